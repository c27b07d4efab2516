"""The loss head in chunks of claimed rows: the same log-probs, entropies and gradients as one
call, and a peak bounded by a chunk (a 152k vocabulary with a thousand claims)."""

import pytest
import torch
from helpers.tolerance import rounding_tolerance

from megatron_psrl.engine.memory import PeakMemory, heap_bytes_in_use
from megatron_psrl.model.logits import chunk_rows, chunked_logprobs


def _setup(n, h, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(vocab, h, generator=gen) * 0.5)
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    return weight, hidden, targets


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_chunks_give_the_numbers_and_gradients_of_one_call(rows):
    weight, hidden, targets = _setup(200, 32, 1000)
    results = []
    for per_chunk in (None, rows):
        weight.grad = hidden.grad = None
        logp, ent = chunked_logprobs(lambda x: x @ weight.t(), hidden, targets, 1000, with_entropy=True,
                                     rows_per_chunk=per_chunk)
        (logp.sum() - 0.1 * ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
    # different matmul shapes may block the sums differently: a few float32 roundings apart
    for one, chunked in zip(*results):
        tol = rounding_tolerance(torch.float32, float(one.abs().max()) * 32)
        torch.testing.assert_close(chunked, one, rtol=0, atol=tol)


def test_chunk_rows_follow_the_byte_budget():
    assert chunk_rows(152064, 256 * 2**20) == 441
    assert chunk_rows(1000, 1) == 1  # never zero rows
    assert chunk_rows(1000, 10**12) > 10**6


@pytest.mark.fresh_process
def test_peak_of_a_152k_vocabulary_step_is_bounded_by_the_chunk():
    """1024 claims x 152,064 vocabulary: one call would hold several 623 MB fp32 tensors; in
    chunks of 16 MB the forward + backward peak stays under 8 chunks plus the weight and its
    gradient.

    Why 8 chunks: at most 6 chunk-sized tensors are alive at once (a chunk's logits, its
    log-softmax and exp in the forward; their gradients in the backward); the other 2 cover
    allocator rounding (at most a 4 KiB page per tensor) and what the BLAS library allocates
    inside a GEMM call. Its per-process buffer pool (which grows with the largest GEMM seen and
    differs between processors) is filled by a warm-up step before the measurement, so it is
    not counted; the heap figure is process-wide, hence a fresh process."""
    if heap_bytes_in_use() is None:
        pytest.skip("needs glibc's mallinfo2 to measure the heap")
    vocab, chunk = 152064, 16 * 2**20
    weight, hidden, targets = _setup(1024, 16, vocab)
    rows = chunk_rows(vocab, chunk)

    def step():
        logp, ent = chunked_logprobs(lambda x: x @ weight.t(), hidden, targets, vocab, with_entropy=True,
                                     rows_per_chunk=rows)
        (logp.sum() - 0.1 * ent.sum()).backward()

    step()  # warm-up: the BLAS buffer pool
    weight.grad = hidden.grad = None
    with PeakMemory(torch.device("cpu"), mode="ops") as mem:
        step()
    weight_bytes = weight.numel() * 4
    bound = 8 * chunk + 2 * weight_bytes
    assert mem.peak_bytes - mem.start_bytes < bound, (mem.peak_bytes - mem.start_bytes, bound)
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
