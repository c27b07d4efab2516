"""Grouped-GEMM experts (``--moe-grouped-gemm``): the routed experts in megatron's
``GroupedMLP`` layout (``weight1`` / ``weight2``) and ``TEGroupedMLP`` layout
(``linear_fc{1,2}.weight{i}``) map both ways to Hugging Face and to the checkpoints' per-expert
names (megatron_psrl/model/adapters/grouped_experts.py).

State-dict level: HF -> each layout -> HF bit for bit, and each layout's expert i is the
sequential layout's expert i. Model level, on CPU: megatron's own ``GroupedMLP`` is built with
the grouped_gemm package's ``gmm`` replaced by a reference (grouped_gemm is CUDA-only and not
installed here), so its forward reads the mapped weights through its own ``view(E, h, 2f)``;
its logits and gradients match the SequentialMLP model's. ``TEGroupedMLP`` needs Transformer
Engine: its naming is emulated by a stand-in module holding ``weight{i}`` parameters and TE's
``_extra_state``, swapped in where megatron puts the experts."""

import copy
import types
from collections.abc import Mapping

import pytest
import torch
from helpers.tolerance import assert_equal_up_to_rounding

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
from megatron_psrl.checkpoint import ModelSource, canonical_state_dict, load_model, load_state_into
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.adapters.grouped_experts import (
    EXPERT_LAYOUTS,
    expert_layout,
    from_expert_layout,
    to_expert_layout,
)
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.moe import install_moe_runtime
from megatron_psrl.model.tiny import tiny_config

FAMILIES = ["debug-qwen3-moe", "debug-mixtral", "debug-qwen2-moe"]
T = 24


def _hf_state(family: str, seed: int = 0):
    arch = ModelArchitecture.from_hf_config(tiny_config(family))
    g = torch.Generator().manual_seed(seed)
    return arch, {name: torch.randn(shape, generator=g) for name, shape in get_adapter(arch).hf_shapes().items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", EXPERT_LAYOUTS)
def test_hf_round_trip_through_every_expert_layout_is_bit_exact(family, layout):
    arch, hf = _hf_state(family)
    adapter = get_adapter(arch)
    mcore = adapter.hf_to_mcore_layout(hf.__getitem__, layout)
    assert expert_layout(mcore) == layout
    back = dict(adapter.mcore_to_hf(mcore))
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) and back[k].dtype == hf[k].dtype for k in hf)


def test_grouped_layout_holds_each_experts_transpose_as_groupedmlp_reads_it():
    arch, hf = _hf_state("debug-qwen3-moe")
    adapter = get_adapter(arch)
    seq = dict(adapter.hf_to_mcore(hf.__getitem__))
    grouped = to_expert_layout(seq, "grouped")
    te = to_expert_layout(seq, "te_grouped")
    E, f, h = arch.num_experts, arch.moe_ffn_hidden_size, arch.hidden_size
    for layer in range(arch.num_layers):
        p = f"decoder.layers.{layer}.mlp.experts."
        w1, w2 = grouped[p + "weight1"], grouped[p + "weight2"]
        assert w1.shape == (h, E * 2 * f) and w2.shape == (E * f, h)  # megatron's parameter shapes
        for i in range(E):
            fc1, fc2 = seq[f"{p}local_experts.{i}.linear_fc1.weight"], seq[f"{p}local_experts.{i}.linear_fc2.weight"]
            # GroupedMLP.forward: w1 = weight1.view(E, h, -1), w2 = weight2.view(E, -1, h)
            assert torch.equal(w1.view(E, h, -1)[i], fc1.t()) and torch.equal(w2.view(E, -1, h)[i], fc2.t())
            gate, up = torch.chunk(w1.view(E, h, -1)[i], 2, dim=-1)  # its GLU: silu(first half) * second
            assert torch.equal(gate, hf[f"model.layers.{layer}.mlp.experts.{i}.gate_proj.weight"].t())
            assert torch.equal(up, hf[f"model.layers.{layer}.mlp.experts.{i}.up_proj.weight"].t())
            assert torch.equal(te[f"{p}linear_fc1.weight{i}"], fc1) and torch.equal(te[f"{p}linear_fc2.weight{i}"], fc2)
    for layout, state in (("grouped", grouped), ("te_grouped", te)):
        back = from_expert_layout(state, f)
        assert sorted(back) == sorted(seq) and all(torch.equal(back[k], seq[k]) for k in seq), layout


def test_malformed_expert_sets_are_refused():
    arch, hf = _hf_state("debug-qwen3-moe")
    seq = dict(get_adapter(arch).hf_to_mcore(hf.__getitem__))
    seq.pop("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight")
    with pytest.raises(ValueError, match="linear_fc1 and linear_fc2"):
        to_expert_layout(seq, "grouped")
    with pytest.raises(ValueError, match="unknown expert layout"):
        to_expert_layout(seq, "blocked")
    grouped = to_expert_layout(dict(get_adapter(arch).hf_to_mcore(hf.__getitem__)), "grouped")
    with pytest.raises(ValueError, match="not E experts"):
        from_expert_layout(grouped, arch.moe_ffn_hidden_size + 1)


# ---------------------------------------------------------------------- models on CPU
def _reference_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm's ``gmm``: rows of ``a`` grouped by expert, group i times ``b[i]``."""
    assert not trans_b
    return torch.cat([rows @ b[i] for i, rows in enumerate(torch.split(a, batch_sizes.tolist()))])


@pytest.fixture(scope="module")
def models():
    """``(arch, SequentialMLP model, GroupedMLP model)`` of debug-qwen3-moe on CPU, the grouped
    one with the sequential one's weights loaded through :func:`load_state_into`."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from megatron_psrl.model.gpt import PsrlGPTModel, build_transformer_config

    initialize_parallel(1, 1, seed=0, device="cpu")
    install_moe_runtime(torch.device("cpu"))
    arch, seq, _ = load_model(ModelSource(tiny="debug-qwen3-moe"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gg, "assert_grouped_gemm_is_available", lambda: None)
        mp.setattr(gg, "ops", types.SimpleNamespace(gmm=_reference_gmm))
        grouped = PsrlGPTModel(arch, build_transformer_config(arch, moe_grouped_gemm=True))
        for layer in grouped.decoder.layers:
            experts = layer.mlp.experts
            experts.config = copy.copy(experts.config)
            experts.config.bf16 = True  # GroupedMLP.forward asserts it; the model here stays fp32
            # megatron's jit_fuser (torch.compile) around its GLU: eager here, a compile costs
            # tens of seconds on CPU and is not what this test is about
            experts.activation_func_with_probs = experts.activation_func_with_probs._torchdynamo_orig_callable
            experts.activation_func = experts.activation_func._torchdynamo_orig_callable
        load_state_into(grouped, canonical_state_dict(seq))
        yield arch, seq, grouped


def test_grouped_model_loads_and_saves_the_checkpoint_names(models):
    arch, seq, grouped = models
    assert {k for k in grouped.state_dict() if ".mlp.experts." in k} == {
        f"decoder.layers.{i}.mlp.experts.weight{n}" for i in range(arch.num_layers) for n in (1, 2)}
    ours, theirs = canonical_state_dict(grouped), canonical_state_dict(seq)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_grouped_model_forward_and_gradients_match_sequential(models):
    arch, seq, grouped = models
    ids = torch.randint(0, arch.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as mp:
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        mp.setattr(gg, "ops", types.SimpleNamespace(gmm=_reference_gmm))
        outs = []
        for model in (seq, grouped):
            model.zero_grad(set_to_none=True)
            logits = model(ids, torch.arange(T), TreeAttentionMetadata(plan=causal_plan([T])))
            logits.float().square().mean().backward()
            outs.append(logits.detach())
    assert_equal_up_to_rounding(outs[1], outs[0], scale=float(outs[0].abs().max()))
    grads = [from_expert_layout({k: p.grad for k, p in m.named_parameters()}, arch.moe_ffn_hidden_size)
             for m in (seq, grouped)]
    assert sorted(grads[0]) == sorted(grads[1])
    for name, g in grads[0].items():
        other = grads[1][name]
        if g is None:  # unused (an expert no token reached: zeros in GroupedMLP's weight1 / weight2)
            assert other is None or (".local_experts." in name and not other.any()), name
            continue
        assert_equal_up_to_rounding(other, g, scale=float(g.abs().max()))


class _TEGroupedLinear(torch.nn.Module):
    """Transformer Engine's ``GroupedLinear`` as a state dict sees it: ``weight{i}`` per
    expert and an ``_extra_state`` (TE's FP8 metadata; here a tensor of no size)."""

    def __init__(self, weights):
        super().__init__()
        for i, w in enumerate(weights):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros_like(w)))

    def get_extra_state(self):
        return torch.empty(0)

    def set_extra_state(self, state):
        pass


def test_te_grouped_naming_loads_and_saves_the_checkpoint_names(models):
    arch, seq, _ = models
    _, te_model, _ = load_model(ModelSource(tiny="debug-qwen3-moe"))  # its own random weights
    for layer in te_model.decoder.layers:  # what TEGroupedMLP holds, in place of SequentialMLP
        local = layer.mlp.experts.local_experts
        stand_in = torch.nn.Module()
        stand_in.linear_fc1 = _TEGroupedLinear([e.linear_fc1.weight for e in local])
        stand_in.linear_fc2 = _TEGroupedLinear([e.linear_fc2.weight for e in local])
        layer.mlp.experts = stand_in
    assert "decoder.layers.0.mlp.experts.linear_fc1._extra_state" in te_model.state_dict()
    load_state_into(te_model, canonical_state_dict(seq))
    own = te_model.state_dict()
    theirs = canonical_state_dict(seq)
    for i in range(arch.num_experts):
        assert torch.equal(own[f"decoder.layers.1.mlp.experts.linear_fc2.weight{i}"],
                           theirs[f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc2.weight"])
    ours = canonical_state_dict(te_model)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


class _ReadOnce(Mapping):
    """A streamed state (as the weight stream's): names known up front, a tensor read on demand."""

    def __init__(self, state):
        self.state, self.reads = state, []

    def __getitem__(self, name):
        self.reads.append(name)
        return self.state[name]

    def __iter__(self):
        return iter(self.state)

    def __len__(self):
        return len(self.state)


def test_a_streamed_sequential_state_is_converted_lazily():
    """The weight stream hands ``mcore_to_hf`` a mapping that fetches tensors on demand: the
    expert-layout check reads its names only, never the whole model up front."""
    arch, hf = _hf_state("debug-mixtral")
    adapter = get_adapter(arch)
    streamed = _ReadOnce(dict(adapter.hf_to_mcore(hf.__getitem__)))
    out = adapter.mcore_to_hf(streamed)
    name, tensor = next(out)
    assert name == "model.embed_tokens.weight" and streamed.reads == ["embedding.word_embeddings.weight"]
    assert torch.equal(tensor, hf[name])
