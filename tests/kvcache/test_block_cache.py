"""The block KV cache: budget, block tables, gather/scatter through them, metrics, memory plan."""

import numpy as np
import pytest
import torch

from megatron_psrl.data import make_workload
from megatron_psrl.kvcache import (
    ALL_ROLES,
    GRADS,
    VALUES,
    BlockKVCache,
    CacheBudgetError,
    KVGeometry,
    choose_block_size,
)
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import plan_memory, simulated_peak_bytes
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

GEOM = KVGeometry(num_layers=3, num_groups=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def test_block_size_follows_the_lengths():
    assert choose_block_size([16] * 10) == 16
    assert choose_block_size([512, 1024, 2048]) in (256, 512)
    assert choose_block_size([17, 33, 65]) == 16  # padding dominates for short odd lengths
    assert choose_block_size([]) == 16


def test_budget_below_one_block_is_refused_with_the_numbers():
    with pytest.raises(CacheBudgetError, match=r"cannot hold one KV block.*needs 1536 bytes"):
        BlockKVCache(GEOM, 1000)


def test_write_read_accumulate_through_block_tables():
    cache = BlockKVCache(GEOM, 1 << 20)
    cache.begin_step(block_size=16, pool_blocks=40)
    data = {}
    for sid, n in [(0, 5), (1, 37), (2, 16)]:
        cache.allocate(sid, n)
        for layer in (1, 2, 3):
            k, v = torch.randn(n, 2, 4), torch.randn(n, 2, 4)
            cache.write(sid, layer, k, v)
            data[(sid, layer)] = (k, v)
    # blocks are disjoint
    tables = np.concatenate([cache.block_table(s, kind) for s in range(3) for kind in ("k", "v", "gk", "gv")])
    assert len(tables) == len(set(tables.tolist()))
    for (sid, layer), (k, v) in data.items():
        rk, rv = cache.read(sid, layer)
        assert torch.equal(rk, k) and torch.equal(rv, v)
        g1, g2 = torch.randn_like(k), torch.randn_like(k)
        cache.accumulate_grad(sid, layer, g1, None)
        cache.accumulate_grad(sid, layer, g2, g1)
        gk, gv = cache.read_grad(sid, layer)
        torch.testing.assert_close(gk, g1 + g2)
        torch.testing.assert_close(gv, g1)
    used = cache.blocks_in_use
    cache.free(1, (VALUES,))  # K and V
    assert cache.blocks_in_use == used - 2 * 3
    cache.free(1, (GRADS,))  # dK and dV
    for s in (0, 2):
        cache.free(s, ALL_ROLES)
    cache.end_step()
    m = cache.metrics.to_dict()
    assert m["kv_peak_utilisation"] == pytest.approx(used / 40)
    assert 0.0 < m["kv_fragmentation"] < 1.0  # 5 and 37 tokens waste part of their blocks


def test_pool_never_exceeds_budget():
    cache = BlockKVCache(GEOM, GEOM.block_bytes(16) * 8)
    with pytest.raises(CacheBudgetError, match="needs 9 KV blocks"):
        cache.begin_step(16, 9)
    cache.begin_step(16, 8)
    cache.allocate(0, 16)  # 4 blocks (K, V, dK, dV)
    with pytest.raises(CacheBudgetError, match="KV cache full"):
        cache.allocate(1, 32)  # would need 8 more


def _stream_plan(budget_tokens=64):
    tree = build_prefix_tree(make_workload("stepwise", vocab_size=512, seed=2))
    return plan_step(tree, PlannerConfig(micro_batch_tokens=budget_tokens, sharing="tree")).ranks[0]


def test_memory_plan_keeps_graphs_when_they_fit_and_recomputes_when_not():
    rank = _stream_plan()
    roomy = plan_memory(rank, GEOM, 1 << 40, act_bytes_per_token=100)
    assert all(roomy.keep_graph.values()) and roomy.recompute_tokens == 0
    drop_all = {p: False for p in roomy.keep_graph}
    floor = simulated_peak_bytes(rank, GEOM, drop_all, 100)
    tight = plan_memory(rank, GEOM, floor, act_bytes_per_token=100)
    assert tight.recompute_tokens > 0 and not all(tight.keep_graph.values())
    assert tight.peak_bytes <= floor
    mid_budget = (floor + roomy.peak_bytes) // 2
    mid = plan_memory(rank, GEOM, mid_budget, act_bytes_per_token=100)
    assert mid.peak_bytes <= mid_budget
    assert tight.recompute_tokens >= mid.recompute_tokens >= roomy.recompute_tokens
    too_small = min(floor, simulated_peak_bytes(rank, GEOM, roomy.keep_graph, 0)) - 1
    with pytest.raises(CacheBudgetError, match=r"need at least \d+ bytes at their peak .*\d+ with every graph kept") as err:
        plan_memory(rank, GEOM, too_small, 0)
    # the refusal names a budget that works (the smallest peak the planner reaches), not the
    # keep-everything figure
    named = int(str(err.value).split("need at least ")[1].split(" ")[0])
    assert plan_memory(rank, GEOM, named, 0).peak_bytes <= named


def test_memory_plan_pool_matches_the_simulated_peak():
    rank = _stream_plan()
    mem = plan_memory(rank, GEOM, 1 << 40, act_bytes_per_token=0)
    pool_bytes = mem.pool_blocks * GEOM.block_bytes(mem.block_size)
    # the peak adds the K/V copies a reader gathers from the blocks while it runs
    assert 0 < pool_bytes <= mem.peak_bytes
    # without retained graphs, only the running micro-batch's gathered K/V copies come on top
    reads = max(2 * GEOM.bytes_per_token * sum(rank.sources[s].length for s in mb.reads) for mb in rank.micro_batches)
    no_graphs = simulated_peak_bytes(rank, GEOM, {p: False for p in mem.keep_graph}, 10**9)
    recompute = plan_memory(rank, GEOM, no_graphs, act_bytes_per_token=10**9)
    assert not any(recompute.keep_graph.values())
    rc_pool = recompute.pool_blocks * GEOM.block_bytes(recompute.block_size)
    assert rc_pool <= recompute.peak_bytes <= rc_pool + reads
    # every source's K/V are released after its last reader's forward
    for sid, step in mem.kv_release_step.items():
        readers = rank.sources[sid].consumers
        fwd = [t for t, (op, i) in enumerate(rank.schedule) if i in readers and op != "backward"]
        assert step == max(fwd)


@pytest.mark.parametrize("gathers", [False, True], ids=["copies", "regather"])
def test_memory_plan_charges_the_loss_head_at_every_step(gathers):
    """The loss head's chunk is transient memory of every running micro-batch: the peak grows by
    exactly its bytes, and a budget that held the rest without it now drops graphs or refuses."""
    from megatron_psrl.model.logits import loss_head_peak_bytes

    rank = _stream_plan()
    head = loss_head_peak_bytes(local_vocab=152064, max_rows=64, chunk_bytes=16 << 20)
    assert head == 6 * 27 * 152064 * 4  # 16 MiB holds 27 fp32 rows of a 152k vocabulary
    without = plan_memory(rank, GEOM, 1 << 40, 100, gathers_in_backward=gathers)
    with_head = plan_memory(rank, GEOM, 1 << 40, 100, gathers_in_backward=gathers, head_bytes=head)
    assert with_head.peak_bytes == without.peak_bytes + head
    assert [b - head for b in with_head.timeline_bytes] == without.timeline_bytes
    with pytest.raises(CacheBudgetError):
        plan_memory(rank, GEOM, head, 100, gathers_in_backward=gathers, head_bytes=head)


def test_regathering_in_backward_holds_no_copies_in_kept_graphs():
    """Readers that gather again in backward: kept graphs hold only activations, and every K/V
    block stays until the last backward that re-reads it."""
    rank = _stream_plan()
    copies = plan_memory(rank, GEOM, 1 << 40, 0)
    regather = plan_memory(rank, GEOM, 1 << 40, 0, gathers_in_backward=True)
    assert regather.gathers_in_backward and not copies.gathers_in_backward
    assert all(regather.keep_graph.values())
    assert regather.peak_bytes < copies.peak_bytes
    backward_at = {i: t for t, (op, i) in enumerate(rank.schedule) if op == "backward"}
    for sid, step in regather.kv_release_step.items():
        for reader in rank.sources[sid].consumers:
            assert step >= backward_at.get(reader, -1)


def test_an_offloaded_source_gives_its_blocks_back_and_returns_exactly():
    """Host offload (CPU link: synchronous copies into memory outside the C heap): a source's
    blocks, values and gradients, go to host memory and back to the pool; another source may
    use the freed blocks meanwhile; the source comes back in other blocks, bit for bit."""
    from megatron_psrl.host_copy import HostLink

    cache, link = BlockKVCache(GEOM, 1 << 20), HostLink(torch.device("cpu"))
    cache.begin_step(block_size=16, pool_blocks=16)
    cache.allocate(0, 37)  # 3 blocks of each of K, V, dK, dV
    table = cache.block_table(0, "k")
    k, v, g = torch.randn(37, 2, 4), torch.randn(37, 2, 4), torch.randn(37, 2, 4)
    for layer in (1, 2, 3):
        cache.write(0, layer, k * layer, v)
        cache.accumulate_grad(0, layer, g, None)
    moved = cache.offload(0, link)
    assert moved == 12 * 3 * 16 * 2 * 4 * 4 and cache.blocks_in_use == 0
    assert cache.on_host() == {0} and not cache.on_device()
    cache.allocate(1, 64)  # the whole pool (16 blocks of 4 kinds), then back
    cache.free(1, ALL_ROLES)
    cache.allocate(2, 5)
    assert cache.restore(0, link) == moved and cache.on_device() == {0, 2} and not cache.on_host()
    assert not np.array_equal(cache.block_table(0, "k"), table)  # (back in other blocks)
    for layer in (1, 2, 3):
        rk, rv = cache.read(0, layer)
        assert torch.equal(rk, k * layer) and torch.equal(rv, v)
        gk, gv = cache.read_grad(0, layer)
        assert torch.equal(gk, g) and not gv.any()
    cache.offload(2, link)
    cache.free(2, ALL_ROLES)  # (freed while in host memory: its host copy goes)
    cache.free(0, ALL_ROLES)
    cache.end_step()
    with pytest.raises(CacheBudgetError, match="needs 12 blocks back"):
        cache.allocate(3, 37)
        cache.offload(3, link)
        cache.allocate(4, 64)
        cache.restore(3, link)


def test_the_cpu_host_link_keeps_offloaded_bytes_off_the_heap_and_their_layout():
    """What the CPU link offloads lives outside the C heap (the CPU's "device" memory that
    PeakMemory reads), and comes back with its strides and values."""
    from megatron_psrl.engine.memory import heap_bytes_in_use
    from megatron_psrl.host_copy import HostLink, layout_of

    link = HostLink(torch.device("cpu"))
    t = torch.randn(512, 1024).t()  # [1024, 512], 2 MiB, transposed strides
    layout = layout_of(t)
    before = heap_bytes_in_use()
    host = link.to_host(t)
    if before is not None:
        assert heap_bytes_in_use() - before < t.numel() * t.element_size() // 8
    back = link.to_device(host, layout)
    assert back.stride() == t.stride() and torch.equal(back, t)
    assert link.moved_bytes == 2 * t.numel() * t.element_size()
