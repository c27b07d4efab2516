"""What the flash / te backends keep for backward, against the memory plan's count.

The varlen kernels take every segment's gathered ancestor K/V and save those copies for the
backward pass; kept, a GRPO group's 16 responses would hold 16 copies of their prompt's K/V per
layer, which the plan does not charge. ``varlen_tree_attention`` saves a recipe instead and
gathers again in backward. The kernels need CUDA, the gather is torch code: here it runs on CPU
around a reference kernel with flash-attn's contract (bottom-right causal per segment; saves
q, the gathered K and V, the output and the fp32 log-sum-exp), and the heap bytes a forward
keeps alive are measured against the plan's per-token count plus the cached prefix's K/V.
"""

import gc
import types

import numpy as np
import pytest
import torch
from helpers.varlen_reference import reference_kernel as reference_kernel_with

from megatron_psrl.attention.backends import blockwise_tree_attention
from megatron_psrl.attention.backends.varlen import pad_values, varlen_tree_attention
from megatron_psrl.attention.plan import tree_plan
from megatron_psrl.engine.memory import heap_bytes_in_use
from megatron_psrl.schedule.memory import ALLOCATOR_MARGIN, attention_saved_bytes_per_token

NP, NG, HN, SCALE = 4, 2, 32, 0.125
PROMPT, RESPONSES, RESPONSE, SYSTEM = 512, 16, 16, 128


reference_kernel = reference_kernel_with(SCALE)


def grpo_plan(system=SYSTEM):
    """A prompt read by 16 responses, all under a cached system prompt (an external source)."""
    starts = [0] + [PROMPT + i * RESPONSE for i in range(RESPONSES)]
    ends = [PROMPT] + [PROMPT + (i + 1) * RESPONSE for i in range(RESPONSES)]
    t = ends[-1]
    return tree_plan(starts, ends, [-1] + [0] * RESPONSES, external_blocks=[(0, t, 0)], external_lengths=[system])


def leaves(t, seed=0, system=SYSTEM):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(True)  # noqa: E731
    return make(t, NP, HN), make(t, NG, HN), make(t, NG, HN), make(system, NG, HN), make(system, NG, HN)


class CacheReader:
    """A cached prefix the attention reads itself (``CachedPrefixKV``), over rows the test holds
    as the KV cache would: every read a copy (recorded: the forward's, or ``again`` in the
    backward), gradients summed in fp32 into buffers allocated at the first one."""

    def __init__(self, k, v):
        self.k, self.v, self.reads = k.detach(), v.detach(), []
        self.grad_k = self.grad_v = None

    def read(self, again=False, start=0):
        self.reads.append(again)
        return self.k[start:].clone(), self.v[start:].clone()

    def add_grad(self, grad_key, grad_value, start=0):
        if self.grad_k is None:
            self.grad_k = torch.zeros(self.k.shape, dtype=torch.float32)
            self.grad_v = torch.zeros(self.v.shape, dtype=torch.float32)
        if grad_key is not None:
            self.grad_k[start:] += grad_key.float()
        if grad_value is not None:
            self.grad_v[start:] += grad_value.float()

    def materialize(self, start=0):
        raise AssertionError("the varlen path reads cached prefixes itself")


def test_varlen_path_reads_a_cached_prefix_from_the_cache():
    """A cached prefix handed over as a reader (as the runner does for flash and te): read once
    in the forward and once again in the backward (the recipe of the kernel's saved copies), its
    gradients handed to the cache; outputs and every gradient equal those of the same prefix
    given as tensors."""
    plan = grpo_plan()
    q, k, v, ek, ev = leaves(plan.num_tokens)
    reader = CacheReader(ek, ev)
    out = varlen_tree_attention(q, k, v, plan, [reader], reference_kernel)
    ref = blockwise_tree_attention(q, k, v, plan, [(ek, ev)], SCALE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert reader.reads == [False]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v, ek, ev))
    (out * dout).sum().backward()  # (the whole graph, as the runner's backward: the reader's node too)
    assert reader.reads == [False, True]  # K and V read again together, once
    for a, w in zip((q.grad, k.grad, v.grad, reader.grad_k, reader.grad_v), want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_values_narrower_than_keys_are_padded_on_read():
    """A kernel of one head width (flash-attn 2 under latent attention): a cached reader's V is
    padded where it is read, and its gradient handed back at its own width."""
    plan = grpo_plan()
    hv = HN // 2
    q, k, v, ek, ev = leaves(plan.num_tokens)
    v, ev = v.detach()[..., :hv].requires_grad_(True), ev.detach()[..., :hv]
    reader = CacheReader(ek, ev)
    padded, external = pad_values(v, [reader], HN)
    out = varlen_tree_attention(q, k, padded, plan, external, reference_kernel)[..., :hv]
    ev = ev.clone().requires_grad_(True)
    ref = blockwise_tree_attention(q, k, v, plan, [(ek, ev)], SCALE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(ref.sum(), (q, k, v, ek, ev))
    out.sum().backward()
    assert reader.grad_v.shape == ev.shape
    for a, w in zip((q.grad, k.grad, v.grad, reader.grad_k, reader.grad_v), want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_varlen_path_matches_the_torch_backend():
    """Outputs and gradients (cached prefix included) of the gather + regather path equal the
    blockwise backend's: the K/V gathered again in backward are the forward's."""
    plan = grpo_plan()
    q, k, v, ek, ev = leaves(plan.num_tokens)
    out = varlen_tree_attention(q, k, v, plan, [(ek, ev)], reference_kernel)
    ref = blockwise_tree_attention(q, k, v, plan, [(ek, ev)], SCALE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * dout).sum(), (q, k, v, ek, ev))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v, ek, ev))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def _held_bytes(run):
    """Heap bytes alive after ``run()`` (inputs, output and the graph kept for backward)."""
    gc.collect()
    before = heap_bytes_in_use()
    kept = run()
    gc.collect()
    return heap_bytes_in_use() - before, kept


@pytest.mark.skipif(heap_bytes_in_use() is None, reason="needs glibc's mallinfo2")
@pytest.mark.fresh_process  # heap figures: other tests' threads and garbage must not free or allocate meanwhile
def test_graph_keeps_what_the_plan_counts_not_the_gathered_copies():
    plan = grpo_plan()
    t = plan.num_tokens
    key_index, _, _ = plan.gathered_keys()
    arch = types.SimpleNamespace(head_dim=HN, num_attention_heads=NP, num_kv_heads=NG)
    row = NG * HN * 4  # one token's K (or V), fp32
    # The plan: per token the attention's saved share plus the value (counted with the fused QKV
    # output in a model layer; a leaf here) and q (the layer's input here, saved by the kernel);
    # the cached prefix's K/V copies a flash / te reader holds (``held_reads``).
    per_token = attention_saved_bytes_per_token(arch, 1, 4, "flash") + row
    planned = {b: t * per_token + 2 * SYSTEM * row for b in ("flash", "te")}
    assert planned["flash"] == planned["te"]

    def regathered():
        q, k, v, ek, ev = leaves(t)
        return q, k, v, ek, ev, varlen_tree_attention(q, k, v, plan, [(ek, ev)], reference_kernel)

    def copies_kept():  # what the kernel held before: its gathered inputs saved as they are
        q, k, v, ek, ev = leaves(t)
        idx = torch.from_numpy(key_index)
        kg = torch.cat([k, ek]).index_select(0, idx)
        vg = torch.cat([v, ev]).index_select(0, idx)
        cu_q = torch.from_numpy(np.append(plan.seg_start, t))
        return q, k, v, ek, ev, reference_kernel(q, kg, vg, cu_q, torch.from_numpy(plan.gathered_keys()[2]), 0, 0)

    for run in (regathered, copies_kept):  # warm-up: index caches, allocator, thread pools
        kept = run()
        kept[-1].sum().backward()
        del kept
    held, kept = _held_bytes(regathered)
    gathered = 2 * len(key_index) * row
    # the plan charges its count times the allocator margin: an upper bound, and a tight one
    assert 0.95 * planned["flash"] <= held <= ALLOCATOR_MARGIN * planned["flash"], (held, planned)
    kept[-1].sum().backward()  # the recipe gathers again: the backward still runs
    del kept
    held_copies, kept = _held_bytes(copies_kept)
    del kept
    # the copies cost 16 responses x the prompt's K/V (and the system prompt's, once per segment)
    assert held_copies >= held + 0.95 * gathered > ALLOCATOR_MARGIN * planned["flash"], (held_copies, held, gathered)


@pytest.mark.skipif(heap_bytes_in_use() is None, reason="needs glibc's mallinfo2")
@pytest.mark.fresh_process  # heap figures: other tests' threads and garbage must not free or allocate meanwhile
def test_a_cached_reader_leaves_no_copy_of_the_prefix_in_the_graph():
    """The cut of the copies: a cached prefix read by the attention (a reader, the runner's choice
    under the memory plan's ``gathers_in_backward``) is held by the cache only; the graph keeps
    what the plan counts per token. Materialised as copies (``PrefixCopies``), the graph keeps
    them until its backward: the prefix's K and V over again (2 x 1,024 rows here)."""
    system = 1024
    plan = grpo_plan(system)
    t = plan.num_tokens
    arch = types.SimpleNamespace(head_dim=HN, num_attention_heads=NP, num_kv_heads=NG)
    row = NG * HN * 4  # one token's K (or V), fp32
    planned = t * (attention_saved_bytes_per_token(arch, 1, 4, "flash") + row)
    cache = leaves(t, system=system)[3:]  # the cached rows: there before the step, and after it

    def run(reads: bool):
        q, k, v = leaves(t, seed=1)[:3]
        reader = CacheReader(*cache)
        external = [reader] if reads else [tuple(x.detach().clone().requires_grad_(True) for x in cache)]
        return q, k, v, reader, varlen_tree_attention(q, k, v, plan, external, reference_kernel)

    for reads in (True, False):  # warm-up: index caches, allocator, thread pools
        kept = run(reads)
        kept[-1].sum().backward()
        del kept
    held, kept = _held_bytes(lambda: run(True))
    assert 0.95 * planned <= held <= ALLOCATOR_MARGIN * planned, (held, planned)
    kept[-1].sum().backward()  # the backward reads the prefix again from the cache
    assert kept[3].reads == [False, True] and kept[3].grad_k.abs().sum() > 0
    del kept
    held_copies, kept = _held_bytes(lambda: run(False))
    del kept
    assert held_copies - held >= 0.95 * 2 * system * row, (held_copies, held)
