"""PrefixSharingAttention in megatron's core-attention slot: dispatch on the three input kinds
(plain sbhd, THD PackedSeqParams, TreeAttentionMetadata), backend choice, the mechanism-2 hook,
and clear errors. References are torch SDPA (causal) and the per-query tree reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attn_reference import Forest, make_qkv, per_query_attention
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from megatron_psrl.attention import PrefixSharingAttention, TreeAttentionMetadata, causal_plan
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import build_transformer_config
from megatron_psrl.model.tiny import tiny_config

NP, NG, HN = 4, 2, 16  # debug-llama: 4 query heads, 2 key/value groups, head dim 16
CUDA = torch.cuda.is_available()


def _config(**overrides):
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
    return build_transformer_config(arch, **overrides)


def _attention(backend=None, softmax_scale=None, **kwargs):
    return PrefixSharingAttention(
        _config(), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        softmax_scale=softmax_scale, backend=backend, **kwargs,
    )


def _sdpa_causal(q, k, v, scale):
    """[s, np, hn] causal attention by torch SDPA (is_causal), GQA groups expanded by SDPA."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    )
    return o.transpose(0, 1)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("backend", [None, "torch", "dense"])
def test_sbhd_is_causal_attention(backend):
    s, b = 11, 3
    q = _rand(s, b, NP, HN, seed=1).requires_grad_(True)
    k = _rand(s, b, NG, HN, seed=2).requires_grad_(True)
    v = _rand(s, b, NG, HN, seed=3).requires_grad_(True)
    attn = _attention(backend, softmax_scale=0.3)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (s, b, NP * HN)
    ref = torch.stack([_sdpa_causal(q[:, i], k[:, i], v[:, i], 0.3) for i in range(b)], 1).reshape(s, b, -1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = _rand(*out.shape, seed=4)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_default_softmax_scale_is_inverse_sqrt_head_dim():
    q, k, v = _rand(5, 1, NP, HN, seed=1), _rand(5, 1, NG, HN, seed=2), _rand(5, 1, NG, HN, seed=3)
    out = _attention()(q, k, v, None)
    ref = _sdpa_causal(q[:, 0], k[:, 0], v[:, 0], 1 / math.sqrt(HN)).reshape(5, 1, -1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [None, "dense"])
def test_thd_packed_sequences_are_causal_per_segment(backend):
    lengths = [4, 1, 7, 3]
    t = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q = _rand(t, NP, HN, seed=5).requires_grad_(True)
    k = _rand(t, NG, HN, seed=6).requires_grad_(True)
    v = _rand(t, NG, HN, seed=7).requires_grad_(True)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    out = _attention(backend)(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
    assert out.shape == (t, NP * HN)
    ref = torch.cat(
        [_sdpa_causal(q[a:b], k[a:b], v[a:b], 1 / math.sqrt(HN)) for a, b in zip(cu[:-1], cu[1:])]
    ).reshape(t, -1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = _rand(*out.shape, seed=8)
    for a, w in zip(torch.autograd.grad((out * dout).sum(), (q, k, v)), torch.autograd.grad((ref * dout).sum(), (q, k, v))):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


class RecordingHook:
    """A mechanism-2 hook: supplies fixed external K/V, records what the layer hands it."""

    def __init__(self, external):
        self.external = external
        self.seen = []

    def external_kv(self, layer_number):
        return self.external

    def on_kv(self, layer_number, key, value):
        self.seen.append((layer_number, key, value))


FOREST = Forest(lengths=[4, 3, 2, 5], parents=[-1, 0, 1, 0], ext_lengths=[3, 2], root_sources={0: [0, 1]})


@pytest.mark.parametrize("hv", [HN, 10], ids=["values-as-wide", "narrower-values"])
@pytest.mark.parametrize("meta_backend", [None, "torch", "dense"])
def test_tree_metadata_runs_the_plan(meta_backend, hv):
    """Also with values narrower than the keys (latent attention: megatron's MLA builds its core
    attention with ``k_channels`` / ``v_channels``)."""
    q, k, v, external = make_qkv(FOREST, NP, NG, HN, torch.float64, seed=3, hv=hv)
    hook = RecordingHook(external)
    meta = TreeAttentionMetadata(plan=FOREST.plan(), backend=meta_backend, kv_hook=hook)
    widths = {} if hv == HN else dict(k_channels=HN, v_channels=hv)
    attn = PrefixSharingAttention(
        _config(), layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=0.2,
        **widths,
    )
    assert (attn.head_dim, attn.value_dim) == (HN, hv)
    out = attn(q[:, None], k[:, None], v[:, None], None, packed_seq_params=meta)
    t = FOREST.num_tokens
    assert out.shape == (t, 1, NP * hv)
    ref = per_query_attention(q, k, v, FOREST.key_sets(), external, scale=0.2)
    torch.testing.assert_close(out.reshape(t, NP, hv), ref, atol=1e-10, rtol=1e-10)
    # the hook saw this pack's K/V (as [t, ng, hn] and [t, ng, hv]) for this layer
    (layer, seen_k, seen_v), = hook.seen
    assert layer == 3 and torch.equal(seen_k, k) and torch.equal(seen_v, v)
    leaves = [q, k, v, *external[0], *external[1]]
    dout = torch.randn(t, 1, NP * hv, dtype=torch.float64)
    got = torch.autograd.grad((out * dout).sum(), leaves)
    want = torch.autograd.grad((ref.reshape(t, 1, -1) * dout).sum(), leaves)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10)


def test_tree_metadata_backend_overrides_module_default():
    """meta.backend wins over the module's backend: an unknown name there is an error."""
    q, k, v = _rand(6, 1, NP, HN), _rand(6, 1, NG, HN), _rand(6, 1, NG, HN)
    meta = TreeAttentionMetadata(plan=causal_plan([6]), backend="no-such-kernel")
    with pytest.raises(ValueError, match="no-such-kernel"):
        _attention("dense")(q, k, v, None, packed_seq_params=meta)


def test_tree_metadata_with_causal_plan_equals_thd():
    lengths = [5, 2, 6]
    t = sum(lengths)
    q, k, v = _rand(t, NP, HN, seed=1), _rand(t, NG, HN, seed=2), _rand(t, NG, HN, seed=3)
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    thd = _attention()(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    tree = _attention()(q[:, None], k[:, None], v[:, None], None,
                        packed_seq_params=TreeAttentionMetadata(plan=causal_plan(lengths)))
    # Bit for bit: both paths run the same plan through the same kernels in the same order.
    torch.testing.assert_close(tree[:, 0], thd, atol=0, rtol=0)


# ---------------------------------------------------------------------------- errors
def test_attention_mask_is_refused():
    q, k, v = _rand(4, 1, NP, HN), _rand(4, 1, NG, HN), _rand(4, 1, NG, HN)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        _attention()(q, k, v, mask)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        _attention()(q, k, v, mask, packed_seq_params=TreeAttentionMetadata(plan=causal_plan([4])))


def test_attention_bias_is_refused():
    q, k, v = _rand(4, 1, NP, HN), _rand(4, 1, NG, HN), _rand(4, 1, NG, HN)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        _attention()(q, k, v, None, attention_bias=torch.zeros(1, NP, 4, 4))


def test_dropout_is_refused():
    with pytest.raises(ValueError, match="dropout"):
        PrefixSharingAttention(_config(attention_dropout=0.1), layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self")
    with pytest.raises(ValueError, match="dropout"):
        _attention(attention_dropout=0.2)


def test_unknown_backend_and_attention_type_are_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        _attention("xformers")
    with pytest.raises(ValueError, match="self attention"):
        PrefixSharingAttention(_config(), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="cross")


def test_tree_batch_must_be_one_packed_row():
    q, k, v = _rand(4, 2, NP, HN), _rand(4, 2, NG, HN), _rand(4, 2, NG, HN)
    with pytest.raises(ValueError, match="batch size 1"):
        _attention()(q, k, v, None, packed_seq_params=TreeAttentionMetadata(plan=causal_plan([4])))


def test_tree_metadata_validation():
    with pytest.raises(ValueError, match="qkv_format"):
        TreeAttentionMetadata(plan=causal_plan([3]), qkv_format="thd")
    with pytest.raises(ValueError, match="AttentionPlan"):
        TreeAttentionMetadata()
    with pytest.raises(ValueError, match="kv_hook"):
        TreeAttentionMetadata(plan=FOREST.plan())


@pytest.mark.skipif(CUDA, reason="checks the CPU error message")
@pytest.mark.parametrize("backend", ["flash", "te"])
def test_gpu_backends_without_cuda_say_so(backend):
    q, k, v = _rand(4, 1, NP, HN), _rand(4, 1, NG, HN), _rand(4, 1, NG, HN)
    with pytest.raises(RuntimeError, match="CUDA"):
        _attention(backend)(q, k, v, None)
    with pytest.raises(RuntimeError, match="CUDA"):
        _attention()(q, k, v, None, packed_seq_params=TreeAttentionMetadata(plan=causal_plan([4]), backend=backend))


# ---------------------------------------------------------------------------- GPU kernels
def _gpu_backend_available(backend):
    if not CUDA:
        return False
    try:
        __import__("flash_attn" if backend == "flash" else "transformer_engine.pytorch")
    except ImportError:
        return False
    return True


GPU_FORESTS = {
    # small segments, two roots under one cached prefix, a one-token leaf
    "mixed": dict(lengths=[37, 12, 5, 20, 9, 1], parents=[-1, 0, 1, 0, -1, 4], ext_lengths=[16],
                  root_sources={0: [0], 4: [0]}),
    # a GRPO group: a 1000-token prompt under a cached system prompt, 8 responses
    "grpo": dict(lengths=[1000, 64, 200, 17, 128, 333, 90, 64, 1], parents=[-1] + [0] * 8, ext_lengths=[256],
                 root_sources={0: [0]}),
    # a step-wise chain of turns (observations and actions), the cached prefix its first turns
    "stepwise": dict(lengths=[300, 40, 250, 31, 500, 60], parents=[-1, 0, 1, 2, 3, 4], ext_lengths=[700],
                     root_sources={0: [0]}),
}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "te"])
@pytest.mark.parametrize("workload", sorted(GPU_FORESTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_backend_matches_torch_backend(backend, dtype, workload):
    if not _gpu_backend_available(backend):
        pytest.skip(f"{backend} kernel package not installed")
    forest = Forest(**GPU_FORESTS[workload])
    q, k, v, external = make_qkv(forest, 8, 2, 64, torch.float32, seed=1)
    dev = torch.device("cuda")
    leaves = [x.detach().to(dev, dtype).requires_grad_(True) for x in (q, k, v, *external[0])]
    gq, gk, gv, ek, ev = leaves
    ref_leaves = [x.detach().float().requires_grad_(True) for x in leaves]
    rq, rk, rv, rek, rev = ref_leaves
    plan = forest.plan()

    attn = PrefixSharingAttention(_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self", softmax_scale=0.125)
    out = attn(gq[:, None], gk[:, None], gv[:, None], None, packed_seq_params=TreeAttentionMetadata(
        plan=plan, backend=backend, kv_hook=RecordingHook([(ek, ev)])))
    ref = attn(rq[:, None], rk[:, None], rv[:, None], None, packed_seq_params=TreeAttentionMetadata(
        plan=plan, backend="torch", kv_hook=RecordingHook([(rek, rev)])))
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.float(), ref, **tol)
    dout = torch.randn(ref.shape, device=dev)
    got = torch.autograd.grad((out.float() * dout).sum(), leaves)
    want = torch.autograd.grad((ref * dout).sum(), ref_leaves)
    for a, w in zip(got, want):
        # gradients accumulate over many keys / queries: compare relative to their scale
        err = (a.float() - w).abs().max().item()
        assert err <= 5 * tol["atol"] * max(1.0, w.abs().max().item()), err
