"""Qwen3-Next and Qwen3.5 (every model type, tiny, fp32 CPU) loaded from a random Hugging Face
checkpoint reproduce transformers on tree-packed micro-batches: one packed forward gives every
sample's log-probs, and the gradient of a per-token weighted loss (a GRPO-like sum of
advantage-weighted log-probs) equals transformers', every parameter, summed over the samples
run one by one. Two packs: a GRPO group (one prompt, four completions) and a branching tree.
Mechanism 1 only: everything in one micro-batch.

Also the torch_dist round trip (it builds the model), bit for bit with the vision tower."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import assert_grads_close, hf_grads_to_mcore
from helpers.hybrid import WRAPPERS, make_hybrid_checkpoint, read_safetensors

from megatron_psrl.attention import TreeAttentionMetadata, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megatron_psrl.model import vocab_parallel_logprobs
from megatron_psrl.model.adapters import unfuse_experts
from megatron_psrl.model.families import registered_families
from megatron_psrl.model.tiny import tiny_config

HYBRID = [name for f in registered_families() if f.has_linear_attention for name in f.tiny_configs]
ATOL = 1e-5


def _tokens(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _pack(vocab, segments, parents):
    """A tree pack of ``segments`` (lengths) with ``parents`` (-1: a root): tokens, positions,
    the plan and every root-to-leaf sample's pack rows."""
    starts = [sum(segments[:i]) for i in range(len(segments))]
    ends = [s + n for s, n in zip(starts, segments)]
    pack = torch.cat([_tokens(n, vocab, seed=20 + i) for i, n in enumerate(segments)])
    depth = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + segments[p])
    positions = torch.cat([d + torch.arange(n) for d, n in zip(depth, segments)])
    rows = {}
    children = {p for p in parents if p >= 0}
    for leaf in (i for i in range(len(segments)) if i not in children):
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        rows["/".join(map(str, path))] = torch.cat([torch.arange(starts[i], ends[i]) for i in path])
    return pack, positions, tree_plan(starts, ends, parents), rows


PACKS = {
    "grpo-group": ([9, 5, 7, 3, 6], [-1, 0, 0, 0, 0]),  # one prompt, four completions
    "branching-tree": ([7, 5, 6, 4, 3], [-1, 0, 0, 2, 2]),  # two levels of branching
}


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    from megatron_psrl.distributed.setup import initialize_parallel

    cache = {}

    def get(name):
        initialize_parallel(1, 1, device="cpu")
        if name not in cache:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

            d = make_hybrid_checkpoint(tiny_config(name), str(tmp_path_factory.mktemp(name)))
            arch, model, _ = load_model(ModelSource(hf_dir=d))
            auto = AutoModelForImageTextToText if arch.model_type in WRAPPERS else AutoModelForCausalLM
            cache[name] = (arch, model, auto.from_pretrained(d, dtype=torch.float32, attn_implementation="eager"), d)
        return cache[name]

    return get


def _weights(rows, seed):
    """Per sample, a weight per predicted token (an advantage times a loss mask)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(len(r) - 1, generator=g) * (torch.arange(len(r) - 1) >= 3) for k, r in rows.items()}


@pytest.mark.parametrize("pack_name", sorted(PACKS))
@pytest.mark.parametrize("name", HYBRID)
def test_tree_pack_logprobs_loss_and_gradients_equal_per_sample_hf(name, pack_name, hybrid_models):
    arch, model, hf, _ = hybrid_models(name)
    pack, positions, plan, rows = _pack(arch.vocab_size, *PACKS[pack_name])
    weights = _weights(rows, seed=len(pack_name))
    model.zero_grad(set_to_none=True)
    hidden = model(pack, positions, TreeAttentionMetadata(plan=plan))[:, 0]
    assert hidden.shape[0] == len(pack)
    loss = 0.0
    hf.train(False)
    hf.zero_grad(set_to_none=True)
    ref_loss = 0.0
    for key, r in rows.items():
        lp, _ = vocab_parallel_logprobs(model.output_logits(hidden[r[:-1]]), pack[r[1:]], arch.vocab_size)
        toks = pack[r]
        ref = torch.log_softmax(hf(toks[None]).logits[0, :-1].float(), -1).gather(1, toks[1:, None])[:, 0]
        assert (lp.detach() - ref.detach()).abs().max().item() <= ATOL, key
        loss = loss - (weights[key] * lp).sum()
        sample_loss = -(weights[key] * ref).sum()
        sample_loss.backward()
        ref_loss += float(sample_loss)
    loss.backward()
    assert abs(float(loss) - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
    ours = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    hf_grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in hf.named_parameters() if not n.startswith("model.visual.")}
    if arch.is_moe:
        hf_grads = unfuse_experts(hf_grads, arch.model_type)
    assert_grads_close(ours, hf_grads_to_mcore(hf_grads, arch), rtol=1e-5, atol=1e-7)
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)




@pytest.mark.parametrize("name", ["debug-qwen3-next", "debug-qwen3.5", "debug-qwen3.5-moe"])
def test_torch_dist_round_trip_is_bit_exact(name, hybrid_models, tmp_path):
    _, _, _, src = hybrid_models(name)
    hf_to_mcore(src, str(tmp_path / "ckpt"), progress=False, ckpt_format="torch_dist")
    mcore_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    a, b = read_safetensors(src), read_safetensors(str(tmp_path / "back"))
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
