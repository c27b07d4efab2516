"""Prefix heads sent both ways between two ranks (megatron_psrl/engine/head_sends.py), at the
protocol level: each rank is the home of one head and imports the other's (``both-ways``; the
planner puts every home in the lowest group, so no batch makes it do this today, but nothing in
the protocol forbids it), and one rank sends two heads to the other (``one-way-two-heads``, two
trees split between two ranks). Each case runs a training step's calls (start, export forward,
import, gradients back, gradients in) and a forward-only one's, in the order the executor makes
them, on a stand-in KV cache, and checks every received head and every returned gradient.

Under ``PSRL_EMULATE_NCCL=1`` (NCCL's order and rendezvous) a protocol whose two ranks' messages
cross would end with the emulation's timeout (60 s here); each case prints ``OK <case> <pass>``.

    torchrun --nproc_per_node 2 head_sends_both_ways.py
"""

import os
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.distributed import nccl_emulation
from megatron_psrl.distributed.setup import initialize_parallel, shutdown_parallel
from megatron_psrl.engine.head_sends import HeadSends
from megatron_psrl.kvcache import KVGeometry
from megatron_psrl.schedule.plan import HeadImport, HeadSend

os.environ.setdefault(nccl_emulation.TIMEOUT_ENV, "60")  # (a loaded machine: a real hang only)
layout = initialize_parallel(1, 1, seed=0, device="cpu", timeout_minutes=1)
rank = layout.rank
GEOMETRY = KVGeometry(2, 1, 2, torch.float32, torch.device("cpu"))


def kv(transfer: int, layer: int, positions) -> torch.Tensor:
    """``[n, ng, hn]``: the K of an exported head's rows (V is its negative)."""
    rows = torch.as_tensor(positions, dtype=torch.float32)
    return (1000.0 * transfer + 100.0 * layer + rows)[:, None, None].expand(-1, 1, 2).clone()


def grad(importer: int, layer: int, positions) -> torch.Tensor:
    rows = torch.as_tensor(positions, dtype=torch.float32)
    return (10000.0 * (importer + 1) + 100.0 * layer + rows)[:, None, None].expand(-1, 1, 2).clone()


class StandInCache:
    """What HeadSends uses of the block KV cache: K/V and fp32 dK/dV per source and layer."""

    geometry = GEOMETRY

    def __init__(self):
        self.kv, self.grads = {}, {}

    def read(self, s, layer, count=True):
        return self.kv[(s, layer)]

    def write(self, s, layer, k, v):
        self.kv[(s, layer)] = (k.clone(), v.clone())

    def read_grad(self, s, layer):
        return self.grads[(s, layer)]

    def first_kept_row(self, s, layer):  # (no sliding window: every row kept)
        return 0

    def accumulate_grad(self, s, layer, gk, gv):
        k, v = self.grads.get((s, layer), (0.0, 0.0))
        self.grads[(s, layer)] = (gk + k, gv + v)


def source(tokens, producer, exported=None, imported=None):
    return SimpleNamespace(tokens=np.asarray(tokens, np.int64), producer=producer, exported=exported, imported=imported)


# Transfers: (home rank, export start, importing rank, import start, length). A rank is an
# exchange group of its own (groups of one rank); micro-batch 0 exports, micro-batch 1 imports.
CASES = {
    "both-ways": [(0, 0, 1, 10, 3), (1, 20, 0, 30, 2)],
    "one-way-two-heads": [(0, 0, 1, 10, 3), (0, 20, 1, 30, 2)],
}


def plan_of(transfers):
    sends = [HeadSend(home_rank=h, start=a, length=n, imports=[HeadImport(h, a, n), HeadImport(r, b, n)])
             for h, a, r, b, n in transfers]
    ranks = [SimpleNamespace(sources={}) for _ in range(2)]
    exporting = [0, 0]
    for t, (h, a, r, b, n) in enumerate(transfers):
        sources = ranks[h].sources
        sources[len(sources)] = source(range(a, a + n), 0, exported=t)
        sources = ranks[r].sources
        sources[len(sources)] = source(range(b, b + n), 1, imported=(t, 1))
        exporting[h] += 1
    index = SimpleNamespace(position=np.arange(64) % 10)  # heads start at multiples of 10
    return SimpleNamespace(ranks=ranks, head_sends=sends, config=SimpleNamespace(exchange_group_size=1), index=index)


def run(name, transfers, with_grads):
    plan = plan_of(transfers)
    cache = StandInCache()
    group = dist.new_group([0, 1])  # a group of its own per case
    mine = plan.ranks[rank].sources
    for s, src in mine.items():
        if src.exported is not None:
            for layer in GEOMETRY.layers:
                k = kv(src.exported, layer, range(len(src.tokens)))
                cache.write(s, layer, k, -k)
    sends = HeadSends(plan, rank, cache, group, with_grads)
    sends.after_forward(0)
    sends.receive(1)
    for s, src in mine.items():
        if src.imported is not None:
            t = src.imported[0]
            for layer in GEOMETRY.layers:
                k, v = cache.kv[(s, layer)]
                want = kv(t, layer, range(len(src.tokens)))
                assert torch.equal(k, want) and torch.equal(v, -want), (name, s, layer, k)
                cache.grads[(s, layer)] = (grad(rank, layer, range(len(src.tokens))),
                                           -grad(rank, layer, range(len(src.tokens))))
    if with_grads:
        sends.return_grads(1)
        sends.collect_grads(0)
        for s, src in mine.items():
            if src.exported is not None:
                importer = transfers[src.exported][2]
                for layer in GEOMETRY.layers:
                    gk, gv = cache.grads[(s, layer)]
                    want = grad(importer, layer, range(len(src.tokens)))
                    assert torch.equal(gk, want) and torch.equal(gv, -want), (name, s, layer, gk)
    sends.finish()
    print(f"OK {name} {'training' if with_grads else 'forward-only'} on rank {rank}", flush=True)


for name, transfers in CASES.items():
    for with_grads in (True, False):
        run(name, transfers, with_grads)
shutdown_parallel()
