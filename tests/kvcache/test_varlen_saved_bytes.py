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
from megatron_psrl.attention.backends.varlen import varlen_tree_attention
from megatron_psrl.attention.plan import tree_plan
from megatron_psrl.engine.memory import heap_bytes_in_use
from megatron_psrl.schedule.memory import ALLOCATOR_MARGIN, attention_saved_bytes_per_token

NP, NG, HN, SCALE = 4, 2, 32, 0.125
PROMPT, RESPONSES, RESPONSE, SYSTEM = 512, 16, 16, 128


reference_kernel = reference_kernel_with(SCALE)


def grpo_plan():
    """A prompt read by 16 responses, all under a cached system prompt (an external source)."""
    starts = [0] + [PROMPT + i * RESPONSE for i in range(RESPONSES)]
    ends = [PROMPT] + [PROMPT + (i + 1) * RESPONSE for i in range(RESPONSES)]
    t = ends[-1]
    return tree_plan(starts, ends, [-1] + [0] * RESPONSES, external_blocks=[(0, t, 0)], external_lengths=[SYSTEM])


def leaves(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(True)  # noqa: E731
    return make(t, NP, HN), make(t, NG, HN), make(t, NG, HN), make(SYSTEM, NG, HN), make(SYSTEM, NG, HN)


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
