"""The pieces of mechanism 2 for linear-attention layers on their own: a pack's segments cut
where a cached prefix ends (its state is then a segment's final state, the outputs unchanged),
the engine's tap check, and the refusal of cross-rank transports for fixed-size states."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from helpers.gated_delta import naive_path, random_inputs

from megatron_psrl.attention.plan import tree_plan
from megatron_psrl.engine.prefix_kv import check_prefix_taps
from megatron_psrl.kvcache import KVGeometry
from megatron_psrl.kvcache.prefix_state import PrefixState
from megatron_psrl.model.architecture import UnsupportedModelError
from megatron_psrl.model.linear_attention import (
    GdnHeads,
    SegmentForest,
    SegmentStates,
    build_tree_linear_index,
    tree_gated_delta_rule,
)
from megatron_psrl.schedule.with_memory import FIXED_STATES_REASON, transfer_reasons, whole_tree_reasons

HEADS = GdnHeads(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)


def test_cuts_end_segments_where_a_prefix_ends_and_change_no_output():
    # a root of 8 tokens with two children; cuts after rows 2 (inside the root), 7 (the root's
    # end: nothing to cut) and 10 (inside the first child)
    lengths, parents = [8, 5, 4], [-1, 0, 0]
    ends = np.cumsum(lengths)
    forest = SegmentForest.from_plan(tree_plan(ends - np.asarray(lengths), ends, parents))
    cut = forest.cut_after(np.array([2, 7, 10]))
    assert list(cut.seg_start) == [0, 3, 8, 11, 13] and list(cut.seg_end) == [3, 8, 11, 13, 17]
    assert list(cut.parent) == [-1, 0, 1, 2, 1]
    assert forest.cut_after(np.array([7, 12, 16])) is forest  # (segment ends already)
    inputs = random_inputs(int(ends[-1]), HEADS)
    whole = tree_gated_delta_rule(**inputs, heads=HEADS, index=build_tree_linear_index(forest, 4, "cpu"))
    index = build_tree_linear_index(cut, 4, "cpu")
    pieces = tree_gated_delta_rule(**inputs, heads=HEADS, index=index, return_states=True)
    torch.testing.assert_close(pieces.core, whole.core, rtol=1e-5, atol=1e-6)
    segments = SegmentStates(pieces.states, index.segment_ends)
    for row, path in ((2, [0, 1, 2]), (10, list(range(8)) + [8, 9, 10])):
        g = segments.segment_ending_after(row)
        torch.testing.assert_close(pieces.states.recurrent[g], naive_path(inputs, path, HEADS)[1], rtol=1e-5, atol=1e-6)
        tail = inputs["mixed_qkv"][path[-3:]]
        assert torch.equal(pieces.states.conv_tail[g], tail)
    with pytest.raises(ValueError, match="no segment ends after pack row 4"):
        segments.segment_ending_after(4)


def test_a_cut_inside_a_root_that_continues_a_cached_prefix_keeps_its_source():
    plan = tree_plan([0, 6], [6, 9], [-1, 0], external_blocks=[(0, 9, 0)], external_lengths=[5])
    cut = SegmentForest.from_plan(plan).cut_after(np.array([3]))
    assert list(cut.parent) == [-1, 0, 1] and list(cut.source) == [0, -1, -1]
    assert cut.num_sources == 1


def _geometry(states):
    return KVGeometry(num_layers=len(states), num_groups=2, head_dim=4, dtype=torch.float32,
                      device=torch.device("cpu"), states=tuple(states))


def test_the_engine_accepts_the_recurrent_tap_of_a_tree_gated_delta_net_only():
    softmax = PrefixState.softmax(2, 4)
    recurrent = PrefixState.recurrent(4, 8, 6, 44, 4)
    arch = types.SimpleNamespace(model_type="toy")
    check_prefix_taps(arch, _geometry((recurrent, softmax)))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))  # no TreeGatedDeltaNet in it
    with pytest.raises(UnsupportedModelError, match="layer 1 keeps a recurrent prefix state but its mixer is not"):
        check_prefix_taps(arch, _geometry((recurrent, softmax)), plain)
    check_prefix_taps(arch, _geometry((softmax, softmax)), plain)


def test_fixed_size_states_split_trees_by_request_and_recompute_shared_heads():
    """Head sends move per-token rows only: a model with fixed-size prefix states recomputes
    prefixes shared between groups; it splits trees over ranks with ``cross-rank`` only (its
    states cross ranks in the per-layer exchange), not over pipelines."""
    assert whole_tree_reasons(1, False, "cross-rank", fixed_states=True) == []
    assert whole_tree_reasons(1, False, "auto", fixed_states=True) == [FIXED_STATES_REASON]
    assert whole_tree_reasons(2, False, "cross-rank", fixed_states=True) == [
        f"{FIXED_STATES_REASON} under pipeline parallelism"]
    assert whole_tree_reasons(1, False, "cross-rank") == []
    assert transfer_reasons(1, False, False, fixed_states=True) == [FIXED_STATES_REASON]
    assert transfer_reasons(1, False, False) == []
    geometry = _geometry((PrefixState.recurrent(4, 8, 6, 44, 4), PrefixState.softmax(2, 4)))
    assert geometry.fixed_bytes_per_source == (4 * 8 * 6 + 3 * 44) * 4


def test_the_memory_plan_charges_the_state_copies_readers_keep():
    """Readers keep a copy of every linear layer's state in their graph (the K/V rows may be
    gathered again in backward instead): the memory plan charges it either way."""
    from megatron_psrl.data.loader import samples_from_dicts
    from megatron_psrl.schedule.config import PlannerConfig
    from megatron_psrl.schedule.memory import _byte_tables
    from megatron_psrl.schedule.planner import plan_step
    from megatron_psrl.tree import build_prefix_tree

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 100, 20).tolist()
    batch = samples_from_dicts([{"id": f"s{i}", "tokens": prompt + rng.integers(0, 100, 6).tolist(),
                                 "advantage": 1.0} for i in range(3)], source="group")
    rank = plan_step(build_prefix_tree(batch), PlannerConfig(micro_batch_tokens=12, sharing="tree")).ranks[0]
    softmax, recurrent = PrefixState.softmax(2, 4), PrefixState.recurrent(4, 8, 6, 44, 4)
    hybrid, plain = _geometry((recurrent, recurrent, softmax)), _geometry((softmax,))
    for gathers in (False, True):
        with_states = _byte_tables(rank, hybrid, 0, gathers_in_backward=gathers)
        without = _byte_tables(rank, plain, 0, gathers_in_backward=gathers)
        for i, mb in enumerate(rank.micro_batches):
            extra = len(mb.reads) * hybrid.fixed_bytes_per_source
            assert with_states.held_reads[i] - (0 if gathers else without.held_reads[i]) == extra
    assert any(mb.reads for mb in rank.micro_batches)


def test_the_builder_splits_trees_of_a_hybrid_model_by_request_only():
    """A hybrid model's trees are split over ranks with ``--placement cross-rank`` (fragments cut
    by the FLOP model: the calibration measures no state transfers); ``auto`` keeps them whole
    without a note; pipeline stages keep them whole with one note."""
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.engine.builder import placement_and_costs
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.tiny import tiny_config

    initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3.5-text"))
    geometry = KVGeometry.for_model(arch, 1, 1, torch.float32, torch.device("cpu"))

    def placed(placement, pp=1):
        config = types.SimpleNamespace(placement=placement, expert_model_parallel_size=1, prefix_sharing="tree")
        layout = types.SimpleNamespace(pipeline_parallel_size=pp, context_parallel_size=1, data_parallel_size=2)
        notes = []
        placement, _, measured = placement_and_costs(config, layout, arch, None, geometry, recompute=False,
                                                     log=notes.append)
        assert measured is None
        return placement, notes

    assert placed("cross-rank") == ("cross-rank", [])
    assert placed("auto") == ("whole-tree", [])
    assert placed("cross-rank", pp=2) == ("whole-tree", [
        f"note: --placement cross-rank is not available with {FIXED_STATES_REASON} under pipeline parallelism "
        "yet; trees are placed whole on data-parallel ranks"])
