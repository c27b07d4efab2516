"""The KV cache lifecycle of cross-rank plans, replayed on every rank of a group without a model:
every block a step reads, writes, returns or injects is allocated then, nothing is allocated
twice, and every rank's cache is empty at the end of the step, for the joint keep-or-recompute
decisions of ample and tight budgets."""

import numpy as np
import pytest
import torch
from helpers.batches import cross_rank_batch, random_tree_batch

from megatron_psrl.data import make_workload
from megatron_psrl.kvcache import ALL_ROLES, GRADS, VALUES, CacheBudgetError, KVGeometry
from megatron_psrl.schedule import instructions as ins
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.cross_rank import plan_group_cross_rank
from megatron_psrl.schedule.memory import plan_memory_group
from megatron_psrl.schedule.planner import token_cost_function
from megatron_psrl.tree import build_prefix_tree
from megatron_psrl.tree.index import TreeIndex

# what the memory plan reads of a KVGeometry: 64 bytes per token and kind over 2 layers, fp32
_GEOMETRY = KVGeometry(num_layers=2, num_groups=1, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))


class _Cache:
    def __init__(self):
        self.held = set()

    def allocate(self, s, kinds):
        for k in kinds:
            assert (s, k) not in self.held, ("allocated twice", s, k)
            self.held.add((s, k))

    def need(self, s, kinds, what):
        for k in kinds:
            assert (s, k) in self.held, (what, s, k)

    def free(self, s, kinds):
        self.held -= {(s, k) for k in kinds}


def _replay(plans, memories):
    """What the executor does with the cache on every rank: the rank's training instructions
    (``schedule.instructions``), each checked against the blocks it reads, writes, returns or
    injects, and its cache empty at the end."""
    for plan, memory in zip(plans, memories):
        cache = _Cache()
        for x in ins.training_instructions(plan, memory):
            mb = plan.micro_batches[x.micro_batch] if isinstance(x, ins.MicroBatchInstruction) else None
            if isinstance(x, ins.AllocateKV):
                for s in x.sources:
                    cache.allocate(s, x.kinds or plan.sources[s].kinds)
            elif isinstance(x, ins.ReleaseKV):
                for s in x.sources:
                    cache.free(s, x.kinds)
            elif isinstance(x, ins.ForwardBackward):
                assert not mb.produces
                for s in mb.reads:
                    cache.need(s, ALL_ROLES, "read")
            elif isinstance(x, (ins.ForwardKeep, ins.ForwardDrop)):
                for s in mb.reads:
                    cache.need(s, (VALUES,), "read")
                for s in mb.produces:
                    src = plan.sources[s]
                    if src.replica_of is not None or VALUES in src.kinds:
                        cache.need(s, (VALUES,), "write")
            elif isinstance(x, ins.ReturnReplicaGrads):
                for ids in list(mb.exchange.grad_send.values()) + list(mb.exchange.grad_recv.values()):
                    for s in ids:
                        cache.need(s, (GRADS,), "gradient return")
            elif isinstance(x, ins.Backward):
                if x.recompute:
                    for s in mb.reads:
                        cache.need(s, (VALUES,), "recompute read")
                for s in mb.reads:
                    cache.need(s, (GRADS,), "backward of a reader")
                for s in mb.produces:
                    if plan.sources[s].replica_of is None:
                        cache.need(s, (GRADS,), "inject")
        assert not cache.held, cache.held


def _trees():
    out = [build_prefix_tree(random_tree_batch(seed=s, num_roots=1 + s % 3)) for s in range(4)]
    out += [build_prefix_tree(make_workload(name, seed=1)) for name in ("stepwise", "tree")]
    out += [build_prefix_tree(cross_rank_batch(kind)) for kind in ("one-tree", "chain")]
    return out


@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("budget", [24, 64])
def test_cache_lifecycle_on_every_rank(g, budget):
    dropped = 0
    for tree in _trees():
        index = TreeIndex(tree)
        plans = plan_group_cross_rank(index, np.flatnonzero(tree.node_parent < 0), budget, g,
                                      token_cost_function(index, CostModel.named("tiny")))
        peak = max(m.peak_bytes for m in plan_memory_group(plans, _GEOMETRY, 1 << 40, 100))
        for kv_budget in (1 << 40, int(0.8 * peak), int(0.6 * peak), int(0.4 * peak)):
            try:
                memories = plan_memory_group(plans, _GEOMETRY, kv_budget, 100)
            except CacheBudgetError:
                continue
            assert len({tuple(sorted(m.keep_graph.items())) for m in memories}) == 1  # decided jointly
            dropped += sum(not keep for keep in memories[0].keep_graph.values())
            _replay(plans, memories)
    assert dropped > 0  # the tight budget made some steps recompute
