"""Cached-prefix gradients accumulate in fp32 whatever the model dtype: in a bf16 pool a dK/dV
row spans two slots read as fp32, so the sum over hundreds of readers is as accurate as one
fp32 addition chain (rel ~1e-7), not bf16's (~1e-2 at 512 readers), and the error does not
grow with the number of readers. K/V themselves stay in the model dtype (copies, exact)."""

import pytest
import torch

from megatron_psrl.kvcache import BlockKVCache, KVGeometry

CPU = torch.device("cpu")


def _cache(dtype, blocks=16):
    geom = KVGeometry(num_layers=2, num_groups=2, head_dim=16, dtype=dtype, device=CPU)
    cache = BlockKVCache(geom, 1 << 24)
    cache.begin_step(16, blocks)
    return geom, cache


@pytest.mark.parametrize("readers", [8, 64, 512])
def test_bf16_gradient_sums_are_fp32_accurate_for_any_number_of_readers(readers):
    geom, cache = _cache(torch.bfloat16)
    assert geom.grad_slots_per_token == 2
    cache.allocate(0, 10)
    gen = torch.Generator().manual_seed(readers)
    grads = [torch.randn(10, 2, 16, generator=gen).bfloat16() for _ in range(readers)]
    for g in grads:
        cache.accumulate_grad(0, 2, g, -0.5 * g)
    gk, gv = cache.read_grad(0, 2)
    exact = torch.stack([g.double() for g in grads]).sum(0)
    assert gk.dtype == gv.dtype == torch.float32 and gk.shape == (10, 2, 16)
    scale = float(exact.abs().max())
    # fp32 accumulation: a few fp32 roundings of the running sum, whatever the count
    assert float((gk.double() - exact).abs().max()) < 1e-6 * scale
    assert float((gv.double() + 0.5 * exact).abs().max()) < 1e-6 * scale
    # layer 1 untouched; K/V blocks are separate and unchanged by gradient writes
    assert float(cache.read_grad(0, 1)[0].abs().max()) == 0.0


def test_kv_rows_stay_in_the_model_dtype_and_read_back_exactly():
    _, cache = _cache(torch.bfloat16)
    cache.allocate(3, 21)
    k = torch.randn(21, 2, 16).bfloat16()
    cache.write(3, 1, k, -k)
    cache.accumulate_grad(3, 1, torch.ones(21, 2, 16), None)  # gradients do not overwrite K/V
    rk, rv = cache.read(3, 1)
    assert rk.dtype == torch.bfloat16 and torch.equal(rk, k) and torch.equal(rv, -k)  # a copy: exact


def test_gradient_blocks_take_twice_the_slots_in_bf16_and_once_in_fp32():
    for dtype, grad_blocks in ((torch.bfloat16, 2), (torch.float32, 1)):
        _, cache = _cache(dtype)
        cache.allocate(0, 10)  # 10 tokens: one 16-slot block per K / V, 20 or 10 slots per gradient
        assert [len(cache.block_table(0, k)) for k in ("k", "v", "gk", "gv")] == [1, 1, grad_blocks, grad_blocks]
