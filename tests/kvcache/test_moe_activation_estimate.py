"""The activation estimate of an MoE model's kept graph: the router, the dispatcher's permuted
copies and the top-k experts (and Qwen2-MoE's shared expert) instead of a dense MLP.

The count is checked in this process against what autograd saves (every MoE family, both
dispatchers, fp32 and bf16, a tree pack); the heap bytes a kept graph holds are measured in a
fresh process per config (tests/kvcache/scripts/measure_moe_activations.py; slow).
"""

import copy
import json
import os
import weakref

import pytest
import torch
from helpers.launch_pool import run_python
from helpers.torchrun import script_env

from megatron_psrl.attention import TreeAttentionMetadata, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.moe import install_moe_runtime
from megatron_psrl.model.tiny import MOE_CONFIGS, tiny_config
from megatron_psrl.schedule.memory import (
    ALLOCATOR_MARGIN,
    activation_bytes_per_token,
    moe_saved_bytes_per_token,
    saved_activation_bytes_per_token,
)

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "measure_moe_activations.py")
PROMPT, RESPONSES, RESPONSE = 96, 2, 16  # a 128-token tree pack: two responses share a prompt
N = PROMPT + RESPONSES * RESPONSE

# Qwen3-30B-A3B's published config.json (the fields the estimate reads).
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", torch_dtype="bfloat16")


def _pack():
    starts = [0] + [PROMPT + j * RESPONSE for j in range(RESPONSES)]
    ends = starts[1:] + [N]
    positions = torch.cat([torch.arange(PROMPT)] + [torch.arange(PROMPT, PROMPT + RESPONSE)] * RESPONSES)
    return positions, TreeAttentionMetadata(plan=tree_plan(starts, ends, [-1] + [0] * RESPONSES))


def _saved_bytes(model, ids, positions, metadata) -> int:
    """Bytes of the storages autograd saves and the kept graph holds (parameters excluded; a
    storage once however many views of it are saved: the experts' inputs are slices of one
    permuted copy)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}  # storage address -> (bytes, a saved tensor of it)

    def pack(t):
        storage = t.untyped_storage()
        held = seen.get(storage.data_ptr())
        if storage.data_ptr() not in params and (held is None or held[1]() is None):
            seen[storage.data_ptr()] = (storage.nbytes(), weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(ids, positions, metadata)
    # what the graph holds: a tensor saved by a node that the forward dropped again (a discarded
    # branch, e.g. the sigmoid router's selection on biased scores) is freed, and its address
    # may be another storage's since
    total = sum(nbytes for nbytes, ref in seen.values() if ref() is not None)
    del hidden
    return total


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_moe_count_is_what_autograd_saves(name, dispatcher):
    """A count, not a measurement: exact, the same on every machine (fp32 and bf16)."""
    initialize_parallel(1, 1, seed=0, device="cpu")
    install_moe_runtime(torch.device("cpu"))
    positions, metadata = _pack()
    for dtype in (torch.float32, torch.bfloat16):
        arch, model, _ = load_model(ModelSource(tiny=name), dtype=dtype,
                                    config_overrides={"moe_token_dispatcher_type": dispatcher})
        ids = torch.randint(0, arch.vocab_size, (N,), generator=torch.Generator().manual_seed(0))
        saved = _saved_bytes(model, ids, positions, metadata)
        assert saved == N * saved_activation_bytes_per_token(arch, 1, dtype.itemsize), (dtype, saved / N)


def test_moe_layer_counts_top_k_experts_not_a_dense_mlp():
    """Qwen3-30B-A3B in bf16, by hand: the router's top-8 ids and scores (8*8 + 4*8), the
    dispatcher's permutation ids and [128, tokens] map and weights (8*8 + 128 + 2*128), and per
    routed copy the permuted hidden state, its weight and the fused weighted SwiGLU's input and
    output: 8 * (2048 + 1 + 3*768) * 2. The dense MLP of ``intermediate_size`` 6144 it replaces
    would count 3 * 6144 * 2 = 36,864: less, though the top-8 experts' width is the same 6144,
    because every routed copy keeps the hidden state too."""
    arch = ModelArchitecture.from_hf_config(copy.deepcopy(QWEN3_30B_A3B))
    assert moe_saved_bytes_per_token(arch, 2) == 96 + 448 + 69_648
    dense = ModelArchitecture.from_hf_config(dict(QWEN3_30B_A3B, model_type="qwen3", num_experts=None,
                                                  moe_intermediate_size=None, num_experts_per_tok=None))
    per_layer = (saved_activation_bytes_per_token(arch, 1, 2) - saved_activation_bytes_per_token(dense, 1, 2)) // 48
    assert per_layer == 96 + 448 + 69_648 - 36_864


@pytest.fixture(scope="module", params=[(n, "allgather") for n in sorted(MOE_CONFIGS)]
                + [("debug-qwen3-moe", "alltoall")], ids=lambda p: "-".join(p))
def measured(request):
    name, dispatcher = request.param
    proc = run_python(SCRIPT, [name, dispatcher], env=script_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ModelArchitecture.from_hf_config(tiny_config(name)), json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow  # measurements in fresh processes
def test_moe_estimate_bounds_the_heap_a_kept_graph_holds(measured):
    """Held heap bytes per token of one more kept graph (1,024 tokens) are at most the
    estimate, and the estimate is no looser than the allocator margin plus 15%; the count is
    exact in the fresh process too (a 1,024-token pack)."""
    arch, rows = measured
    estimate = activation_bytes_per_token(arch, 1, 4)
    for key, row in rows.items():
        assert row["saved"] == saved_activation_bytes_per_token(arch, 1, 4 if key.endswith("float32") else 2), key
        if "held" in row:
            assert row["held"] <= estimate <= (ALLOCATOR_MARGIN + 0.15) * row["held"], (key, row, estimate)
