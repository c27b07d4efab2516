"""What a cached prefix keeps per layer (``PrefixState``): a softmax, a latent and a recurrent
layer described by the spec alone, stored by the cache, sized by the memory plan, moved as rows.

Nothing here touches the cache, the plan or the transports to add a kind of layer: each test
builds a geometry from states and uses the modules as they are."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from megatron_psrl.data import make_workload
from megatron_psrl.kvcache import ALL_ROLES, GRADS, VALUES, BlockKVCache, KVGeometry, PrefixState, StateField, Storage
from megatron_psrl.kvcache.prefix_state import Combine, Tap, cache_pools
from megatron_psrl.schedule import instructions as ins
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.memory import plan_forward_memory, plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree

CPU = torch.device("cpu")
SOFTMAX = PrefixState.softmax(2, 8)
LATENT = PrefixState.latent(kv_lora_rank=24, rope_dim=8)
RECURRENT = PrefixState.recurrent(num_heads=2, key_dim=4, value_dim=6, conv_channels=16, conv_kernel=4)


def _geometry(states, dtype=torch.float32):
    return KVGeometry(num_layers=len(states), num_groups=2, head_dim=8, dtype=dtype, device=CPU,
                      states=tuple(s if s.dtype == dtype else _with_dtype(s, dtype) for s in states))


def _with_dtype(state, dtype):
    return dataclasses.replace(state, dtype=dtype)


def test_the_three_shapes_say_what_they_keep():
    assert SOFTMAX.kinds(VALUES) == ("k", "v") and SOFTMAX.kinds(GRADS) == ("gk", "gv")
    assert SOFTMAX.per_token and SOFTMAX.tap is Tap.CORE_ATTENTION and SOFTMAX.combine is Combine.CONCAT
    assert SOFTMAX.nbytes(10) == 10 * (2 * 16 * 4 + 2 * 16 * 4)  # K, V, dK, dV in fp32
    assert LATENT.tap is Tap.BEFORE_UP_PROJECTION and LATENT.nbytes(10, (VALUES,)) == 10 * 32 * 4
    # a reader keeps the rows and their up-projection to its 4 heads' keys (24) and values (12)
    read = PrefixState.latent(24, 8, num_heads=4, key_dim=24, value_dim=12)
    assert read.nbytes(10) == LATENT.nbytes(10) and read.reader_nbytes(10) == 10 * (32 + 4 * 36) * 4
    geometry = _geometry((read, read))  # (gathering again in backward: one layer's rows, gradients and dK/dV)
    assert geometry.reader_bytes(10) == 2 * read.reader_nbytes(10) == geometry.derived_read_bytes(10)
    assert geometry.layer_read_bytes(10) == read.nbytes(10) + 10 * 4 * 36 * 4
    assert SOFTMAX.reader_nbytes(10) == SOFTMAX.nbytes(10, (VALUES,)) and RECURRENT.reader_nbytes(7) == RECURRENT.nbytes(1, (VALUES,))
    assert RECURRENT.storage is Storage.FIXED and RECURRENT.combine is Combine.INNERMOST
    assert RECURRENT.tap is Tap.RECURRENT_MIXER
    assert RECURRENT.nbytes(1) == RECURRENT.nbytes(100_000) == 2 * 4 * (2 * 4 * 6 + 3 * 16)  # whatever the length
    bf16 = _with_dtype(SOFTMAX, torch.bfloat16)
    assert bf16.nbytes(1, (VALUES,)) == 2 * 16 * 2 and bf16.nbytes(1, (GRADS,)) == 2 * 16 * 4  # gradients fp32


def test_invalid_states_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        PrefixState((StateField("k", (2,)), StateField("k", (2,))))
    with pytest.raises(ValueError, match="concat"):
        PrefixState((StateField("s", (2,)),), storage=Storage.FIXED, combine=Combine.CONCAT)
    with pytest.raises(ValueError, match="not start with"):
        StateField("gk", (2,))


def test_transport_rows_stack_equal_fields_and_flatten_others():
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    rows = SOFTMAX.pack_rows((k, v))
    assert torch.equal(rows, torch.stack([k, v], dim=1)) and SOFTMAX.row_shape == (2, 2, 8)  # today's layout
    wide = PrefixState.softmax(2, 12, 8)  # DeepSeek-V3-like: K wider than V
    k12 = torch.randn(5, 2, 12)
    rows = wide.pack_rows((k12, v), torch.tensor([4, 0]))
    assert rows.shape == (2, 40) and wide.row_shape == (40,)
    back_k, back_v = wide.unpack_rows(rows)
    assert torch.equal(back_k, k12[[4, 0]]) and torch.equal(back_v, v[[4, 0]])
    # leading dimensions are kept: [n, layers, *row_shape]
    stacked = torch.stack([rows, 2 * rows], dim=1)
    assert torch.equal(wide.unpack_rows(stacked)[1][:, 1], 2 * v[[4, 0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pools_share_one_slot_width_without_padding(dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    (pool,) = cache_pools([_with_dtype(PrefixState.softmax(2, 12, 8), dtype)] * 3, [1, 2, 3])
    assert pool.slot_bytes == math.gcd(24 * size, 16 * size, 24 * 4, 16 * 4)
    assert pool.slots("k", 10) * pool.slot_bytes == 10 * 24 * size  # no padding inside a token
    assert pool.slots("gv", 10) * pool.slot_bytes == 10 * 16 * 4
    softmax = cache_pools([_with_dtype(SOFTMAX, dtype)] * 2, [1, 2])[0]
    assert softmax.slots("gk", 1) == 4 // size  # the gradient's fp32 row spans 1 or 2 slots, as always


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hybrid_cache_gives_rows_blocks_and_states_slots(dtype):
    """A toy hybrid model (one softmax layer, two recurrent ones, one latent): the cache keeps
    each layer's own fields, exactly, and the gradients in fp32."""
    states = (SOFTMAX, RECURRENT, RECURRENT, LATENT)
    geom = _geometry(states, dtype)
    pools = geom.pools
    assert [p.layers for p in pools] == [(1,), (2, 3), (4,)] and [p.state.per_token for p in pools] == [True, False, True]
    cache = BlockKVCache(geom, 1 << 24)
    cache.begin_step(16, 96, pool_sizes=(32, 32, 32))
    cache.allocate(7, 21)
    gen = torch.Generator().manual_seed(0)
    data = {}
    for layer, state in zip(geom.layers, geom.layer_states):
        fields = tuple(torch.randn(((21,) if state.per_token else ()) + f.shape, generator=gen).to(dtype)
                       for f in state.fields)
        cache.write(7, layer, *fields)
        data[layer] = fields
    for layer, fields in data.items():
        assert all(torch.equal(a, b) for a, b in zip(cache.read(7, layer), fields)), layer
        cache.accumulate_grad(7, layer, *fields)
        cache.accumulate_grad(7, layer, *fields)
        grads = cache.read_grad(7, layer)
        assert all(g.dtype == torch.float32 and torch.equal(g, 2 * f.float()) for g, f in zip(grads, fields)), layer
    # the recurrent pool: one slot run per field, whatever the length
    used = cache.pool_blocks_in_use
    cache.allocate(8, 5)
    after = cache.pool_blocks_in_use
    assert after[1] - used[1] == pools[1].source_blocks(5, ALL_ROLES, 16) == pools[1].source_blocks(10**6, ALL_ROLES, 16)
    cache.free(7, ins.ALL_KINDS)
    cache.free(8, ins.ALL_KINDS)
    cache.end_step()
    assert cache.blocks_in_use == 0


def _replay_peaks(plan, memory, geom):
    """The cache's blocks in use per pool, replaying the step's allocations and releases."""
    cache = BlockKVCache(geom, 1 << 40)
    cache.begin_step(memory.block_size, memory.pool_blocks, memory.pool_sizes)
    peak = np.zeros(len(geom.pools), dtype=np.int64)
    for x in ins.training_instructions(plan, memory):
        if isinstance(x, ins.AllocateKV):
            for s in x.sources:
                cache.allocate(s, plan.sources[s].length, x.kinds or plan.sources[s].kinds)
        elif isinstance(x, ins.ReleaseKV):
            for s in x.sources:
                cache.free(s, x.kinds)
        peak = np.maximum(peak, cache.pool_blocks_in_use)
    cache.end_step()
    return tuple(int(p) for p in peak)


def test_the_memory_plan_sizes_every_pool_and_the_cache_holds_it():
    tree = build_prefix_tree(make_workload("stepwise", seed=3))
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=256)).ranks[0]
    assert plan.sources, "the workload must cache prefixes"
    softmax_only = _geometry((SOFTMAX,) * 4)
    hybrid = _geometry((SOFTMAX, RECURRENT, RECURRENT, RECURRENT))
    big_state = PrefixState.recurrent(num_heads=4, key_dim=4, value_dim=6, conv_channels=32, conv_kernel=4)
    hybrid2 = _geometry((SOFTMAX, big_state, big_state, big_state))
    plans = {name: plan_memory(plan, g, 1 << 40, act_bytes_per_token=100)
             for name, g in (("softmax", softmax_only), ("hybrid", hybrid), ("hybrid2", hybrid2))}
    for name, g in (("softmax", softmax_only), ("hybrid", hybrid), ("hybrid2", hybrid2)):
        m = plans[name]
        assert len(m.pool_sizes) == len(g.pools) and m.pool_blocks == sum(m.pool_sizes)
        assert _replay_peaks(plan, m, g) == m.pool_sizes, name  # what the plan sized is what the cache holds
    # the recurrent pool holds a fixed amount per live source: twice the state, twice the bytes
    def state_bytes(name, g):
        return plans[name].pool_sizes[1] * g.pools[1].block_bytes(plans[name].block_size)
    assert state_bytes("hybrid2", hybrid2) == 2 * state_bytes("hybrid", hybrid) > 0
    # the softmax layer's pool is the one-layer share of the softmax-only pool's rows
    assert plans["hybrid"].pool_sizes[0] == plans["softmax"].pool_sizes[0]
    # and the bytes: a recurrent source costs its state whatever its length, a softmax one per token
    fixed = hybrid.pools[1]
    one_state = fixed.source_blocks(1, ALL_ROLES, 16) * fixed.block_bytes(16)
    assert one_state == 3 * RECURRENT.nbytes(1)
    forward = plan_forward_memory(plan, hybrid, 1 << 40)
    assert len(forward.pool_sizes) == 2 and forward.pool_sizes[1] % fixed.source_blocks(1, (VALUES,), 16) == 0


def test_a_budget_below_one_block_of_every_pool_is_refused():
    geom = _geometry((SOFTMAX, RECURRENT))
    need = sum(p.block_bytes(16) for p in geom.pools)
    with pytest.raises(Exception, match=f"needs {need} bytes"):
        BlockKVCache(geom, need - 1)
    BlockKVCache(geom, need)


def test_no_module_outside_the_spec_spells_a_block_kind_or_a_row_layout():
    """The block kinds (``"k"``, ``"gk"``...) and the K-then-V row layout are the spec's: the
    cache, the plan, the lowering, the exchange, head sends and calibration ask it."""
    import pathlib
    import re

    import megatron_psrl

    root = pathlib.Path(megatron_psrl.__file__).parent
    patterns = [r'"g[kv]"', r'\(\s*"k"\s*,\s*"v"', r'"k"\s+in\b', r'startswith\("g"\)',
                r'\b2\s*,\s*(ng|num_groups|geometry\.num_groups)\b', r'\[:,\s*(li|j),\s*[01]\]',
                r'chunk\[:,\s*[01]\]', r'back\[:,\s*[01]\]']
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "prefix_state.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in patterns):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not found, "block kinds or row layouts outside kvcache/prefix_state.py:\n" + "\n".join(found)


def test_the_engine_serves_every_tap_from_its_own_mixer_only():
    """The cache, the plan and the transports take any state; the engine's hook sits in the
    core-attention slot, the linear-attention layer and the latent-attention layer: a layer
    keeping a latent whose mixer is not a ``TreeMLASelfAttention`` is refused before its first
    step, naming the layer (a recurrent state: tests/model/test_linear_prefix_state.py)."""
    import types

    import torch

    from megatron_psrl.engine.prefix_kv import check_prefix_taps
    from megatron_psrl.model.architecture import UnsupportedModelError

    arch = types.SimpleNamespace(model_type="toy")
    for states in ((SOFTMAX, SOFTMAX), (SOFTMAX, RECURRENT), (LATENT, LATENT)):
        check_prefix_taps(arch, _geometry(states))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))  # no latent-attention layer in it
    with pytest.raises(UnsupportedModelError, match="layer 2 keeps a latent prefix state but its mixer is not a "
                                                    "TreeMLASelfAttention"):
        check_prefix_taps(arch, _geometry((SOFTMAX, LATENT)), plain)


@pytest.mark.parametrize("split", [2, (3, 1), (1, 3)], ids=["even", "linear-then-softmax", "linear-then-both"])
def test_pipeline_stages_of_a_hybrid_model_plan_with_every_state_and_size_their_own_pools(split):
    """Stages holding different kinds of layers (linear only, softmax only, both) plan alike,
    with as many layers of every state as the stage with most of them; each stage's cache takes
    its pools' sizes from that plan by state (a stage without softmax layers has no K/V pool)."""
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.tiny import tiny_config

    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3.5-text"))  # linear, linear, linear, full
    plan_geom = KVGeometry.for_pipeline_planning(arch, 1, split, torch.float32, CPU)
    stages = [KVGeometry.for_model(arch, 1, split, torch.float32, CPU, pipeline_rank=p) for p in range(2)]
    counts = {}
    for geom in stages:
        for pool in geom.pools:
            counts[pool.state] = max(counts.get(pool.state, 0), len(pool.layers))
    assert {p.state: len(p.layers) for p in plan_geom.pools} == counts
    assert len({frozenset(p.state for p in g.pools) for g in stages}) == 2  # stages of other pools
    tree = build_prefix_tree(make_workload("grpo", seed=1, vocab_size=arch.vocab_size))
    plan = plan_step(tree, PlannerConfig(micro_batch_tokens=64, sharing="tree")).ranks[0]
    memory = plan_memory(plan, plan_geom, 1 << 40, 0)
    assert memory.pool_states == tuple(p.state for p in plan_geom.pools)
    for geom in stages:
        cache = BlockKVCache(geom, 1 << 40)
        cache.begin_step(memory.block_size, memory.pool_blocks, memory.pool_sizes, memory.pool_states)
        sizes = dict(zip(memory.pool_states, memory.pool_sizes))
        assert [t.shape[1] for t in cache._storage] == [sizes[p.state] for p in geom.pools]
    with pytest.raises(ValueError, match="sizes no pool"):
        BlockKVCache(stages[1], 1 << 40).begin_step(16, 4, (4,), (SOFTMAX,))
