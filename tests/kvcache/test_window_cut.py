"""A sliding-window layer's pool keeps only the cached rows some reader's window reaches
(``PrefixState.window``): the memory plan counts what the cache allocates, and a read outside
every planned window is refused. gpt-oss's debug config (an 8-token window on its first layer),
no model."""

import numpy as np
import pytest
import torch

from megatron_psrl.data import samples_from_dicts
from megatron_psrl.kvcache import ALL_ROLES, BlockKVCache, KVGeometry, PrefixState
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.tiny import tiny_config
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import _source_blocks, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

CPU = torch.device("cpu")


def test_a_window_keeps_the_rows_its_readers_reach():
    state = PrefixState.softmax(1, 4, window=8)
    # a source at depths 0..39 read by queries from depth 40 on: depths 33..39, its last 7 rows
    assert state.unread_rows(40, 0, 40) == 33
    assert state.unread_rows(40, 0, 45) == 38  # (a deeper reader: its window starts later)
    assert state.unread_rows(40, 0, 60) == 40  # no window reaches it: nothing kept
    assert state.unread_rows(40, 0, None) == 0  # readers unknown: every row
    assert PrefixState.softmax(1, 4).unread_rows(40, 0, 40) == 0  # a full layer keeps every row
    with pytest.raises(ValueError, match="window"):
        PrefixState.softmax(1, 4, window=0)


def _tree_plan():
    """A 40-token shared prefix, three 20-token branches, each with two 12-token leaves (in
    48-token micro-batches: cached prefixes longer than the window and a block)."""
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 200, 40).tolist()
    recs = []
    for b in range(3):
        branch = trunk + rng.integers(0, 200, 20).tolist()
        for leaf in range(2):
            tokens = branch + rng.integers(0, 200, 12).tolist()
            recs.append({"id": f"b{b}l{leaf}", "tokens": tokens, "loss_mask": [0] * 40 + [1] * 32,
                         "advantage": 1.0})
    tree = build_prefix_tree(samples_from_dicts(recs, source="window-tree"))
    return plan_step(tree, PlannerConfig(micro_batch_tokens=48, sharing="tree")).ranks[0]


def test_the_plan_counts_the_blocks_the_cache_allocates_for_a_window():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-gpt-oss"))
    geom = KVGeometry.for_model(arch, 1, 1, torch.float32, CPU)
    windowed, full = (0, 1) if geom.pools[0].state.window else (1, 0)
    assert geom.pools[windowed].state.window == arch.sliding_window == 8 and geom.pools[full].state.window is None
    rank = _tree_plan()
    assert all(s.reader_depth is not None for s in rank.sources.values())  # (every reader on this rank)
    assert sum(s.length > arch.sliding_window for s in rank.sources.values()) >= 3
    memory = plan_memory(rank, geom, 1 << 30, 0)
    assert 0 < memory.pool_sizes[windowed] < memory.pool_sizes[full]
    # every source at once (a pool large enough): the cache allocates the blocks the plan counts
    cache = BlockKVCache(geom, 1 << 30)
    cache.begin_step(memory.block_size, 0, pool_sizes=(1000, 1000), pool_block_sizes=memory.pool_block_sizes)
    predicted = np.zeros(2, np.int64)
    for s, src in rank.sources.items():
        cache.allocate(s, src.length, ALL_ROLES, reach=src.reach)
        predicted += _source_blocks(geom, src, ALL_ROLES, memory.pool_block_sizes)
    assert cache.pool_blocks_in_use == tuple(predicted)
    assert predicted[windowed] < predicted[full]
    # what is kept: the rows from the first a reader's window reaches, written and read as such
    s, src = next((s, src) for s, src in rank.sources.items() if src.reach[1] - src.first_depth - src.length < 7)
    layer = geom.pools[windowed].layers[0]
    skip = cache.first_kept_row(s, layer)
    assert skip == src.reader_depth - arch.sliding_window + 1 - src.first_depth > 0
    k = torch.arange(src.length, dtype=torch.float32)[:, None, None].expand(-1, geom.num_groups, geom.head_dim)
    cache.write(s, layer, k, -k)
    got_k, got_v = cache.read(s, layer, start=skip)
    assert torch.equal(got_k, k[skip:]) and torch.equal(got_v, -k[skip:])
    with pytest.raises(ValueError, match="no planned window"):
        cache.read(s, layer, start=skip - 1)
    assert cache.first_kept_row(s, geom.pools[full].layers[0]) == 0
