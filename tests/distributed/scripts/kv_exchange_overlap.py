"""The overlapped prefix K/V exchange equals the synchronous one (2 ranks over gloo): the tree
attention of a pack over its own keys, a cached prefix and a chain received from the other rank,
computed with the synchronous exchange (``exchange_kv``, received rows as ``(k, v)`` pairs) and
with the overlapped one (``exchange_kv_start``, received rows in flight as ``ReceivedKV``):
the same output and the same gradients of q, k, v (the exchange's returned gradients included)
and of the cached prefix, bit for bit where the received chain's blocks come last in the plan
(the packing's order), up to rounding where they do not. Also: no empty split or tensor is
handed to ``all_to_all_single`` (NCCL's hang class), every collective of the overlapped path is
asynchronous, replica rows arrive through ``on_arrival``, a query subset that reads no received
row, the no-grad path and the backends that wait before their kernel (``dense``). Prints
``OK [<case>]`` per case.

    torchrun --nproc_per_node 2 kv_exchange_overlap.py
"""

import torch
import torch.distributed as dist

from megatron_psrl.attention.backends import blockwise_tree_attention, dense_tree_attention
from megatron_psrl.attention.plan import AttentionPlan, tree_plan
from megatron_psrl.distributed import kv_exchange
from megatron_psrl.distributed.kv_exchange import ReceivedKV, exchange_kv, exchange_kv_start

dist.init_process_group("gloo")
rank, g = dist.get_rank(), dist.get_world_size()
assert g == 2
other = 1 - rank
T, NP, NG, HN, CACHED = 12, 4, 2, 8, 4
SCALE = HN ** -0.5

calls = []
_real = dist.all_to_all_single


def recording(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
    calls.append((list(input_split_sizes), list(output_split_sizes), input.numel(), output.numel(),
                  bool(kwargs.get("async_op", False))))
    return _real(output, input, output_split_sizes, input_split_sizes, **kwargs)


kv_exchange.dist.all_to_all_single = recording


def tensors(r, dtype):
    gen = torch.Generator().manual_seed(100 + r)
    q = torch.randn(T, NP, HN, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(T, NG, HN, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(T, NG, HN, generator=gen, dtype=torch.float64).to(dtype)
    ck = torch.randn(CACHED, NG, HN, generator=gen, dtype=torch.float64).to(dtype)
    cv = torch.randn(CACHED, NG, HN, generator=gen, dtype=torch.float64).to(dtype)
    dout = torch.randn(T, NP, HN, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, ck, cv, dout


# sends[s]: rows of rank s's pack that go to the other rank, as (rows, use): "peer" (attended to
# now) or "replica" (stored only)
CASES = {
    "both ways": {0: [([0, 1, 2], "peer")], 1: [([0, 1, 2, 3], "peer")]},
    "one way with a replica": {0: [([0, 1, 2], "peer"), ([5, 6], "replica")], 1: []},
    "replicas only": {0: [([3, 4], "replica")], 1: [([1], "replica")]},
}


def plan_of(chains, late_peers=True, subset=False):
    """Segments [0,5) [5,9) [9,12) (the last two children of the first), all below the cached
    prefix (source 0), the last two below every received peer chain (sources 1..)."""
    ext_blocks = [(0, T, 0)] + [(5, T, 1 + j) for j in range(len(chains))]
    plan = tree_plan([0, 5, 9], [5, 9, 12], [-1, 0, 0], ext_blocks, [CACHED] + list(chains))
    if not late_peers and chains:  # the received chains' blocks first: another merge order
        order = sorted(range(plan.num_blocks), key=lambda b: -int(plan.block_source[b]))
        plan = AttentionPlan(plan.num_tokens, plan.seg_start, plan.seg_end, plan.block_q_start[order],
                             plan.block_q_end[order], plan.block_k_start[order], plan.block_k_end[order],
                             plan.block_source[order], plan.external_lengths)
    if subset:  # rows of the first segment only: they read no received row
        plan = plan.select_queries(torch.arange(0, 4).numpy())
    return plan


def run(case, overlap, dtype, backend="torch", grad=True, late_peers=True, subset=False):
    sends = CASES[case]
    q0, k0, v0, ck0, cv0, dout = tensors(rank, dtype)
    q, k, v = (x.clone().requires_grad_(grad) for x in (q0, k0, v0))
    ck, cv = ck0.clone().requires_grad_(grad), cv0.clone().requires_grad_(grad)
    mine = [rows for rows, _ in sends[rank]]
    send_rows = torch.tensor([i for rows in mine for i in rows], dtype=torch.int64)
    send_counts = [0, 0]
    send_counts[other] = len(send_rows)
    recv_counts = [0, 0]
    recv_counts[other] = sum(len(rows) for rows, _ in sends[other])
    uses, at = [], 0  # (offset in the other rank's split, length, kind)
    for rows, kind in sends[other]:
        uses.append((at, len(rows), kind))
        at += len(rows)
    peers = [(o, n) for o, n, kind in uses if kind == "peer"]
    replicas = [(o, n) for o, n, kind in uses if kind == "replica"]
    plan = plan_of([n for _, n in peers], late_peers, subset)
    if subset:
        q_in, dout = q[0:4], dout[0:4]
    else:
        q_in = q
    stored = {}
    with torch.set_grad_enabled(grad):
        if overlap:
            k2, v2, buffer, transfer = exchange_kv_start(k, v, send_rows, send_counts, recv_counts, dist.group.WORLD,
                                                         differentiable=True)
            base = transfer.offsets[other]
            for o, n in replicas:
                transfer.on_arrival(lambda buf, o=o, n=n: stored.__setitem__(o, buf[base + o:base + o + n].clone()))
            external = [(ck, cv)] + [ReceivedKV(transfer, buffer, base + o, n) for o, n in peers]
        else:
            k2, v2, received = exchange_kv(k, v, send_rows, send_counts, recv_counts, dist.group.WORLD,
                                           differentiable=True)
            for o, n in replicas:
                stored[o] = received[o:o + n].detach().clone()
            external = [(ck, cv)] + [(received[o:o + n, 0].clone(), received[o:o + n, 1].clone()) for o, n in peers]
        if backend == "torch":
            out = blockwise_tree_attention(q_in, k2, v2, plan, external, SCALE)
        else:
            external = [e if isinstance(e, tuple) else e.materialize() for e in external]
            out = dense_tree_attention(q_in, k2, v2, plan, external, SCALE)
        if overlap:
            transfer.release()  # what the hook's after_attention does (waits, lets the rows go)
    grads = ()
    if grad:
        (out * dout).sum().backward()
        grads = (q.grad, k.grad, v.grad, ck.grad, cv.grad)
    return out.detach(), grads, stored


def check(name, **kw):
    calls.clear()
    sync = run(name.split(":")[0], False, **kw)
    n_sync = len(calls)
    calls.clear()
    over = run(name.split(":")[0], True, **kw)
    exact = kw.get("late_peers", True)
    for a, b in zip((sync[0],) + tuple(sync[1]), (over[0],) + tuple(over[1])):
        if exact:
            assert torch.equal(a, b), (name, (a - b).abs().max())
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=64 * torch.finfo(a.dtype).eps)
    assert sync[2].keys() == over[2].keys() and all(torch.equal(sync[2][o], over[2][o]) for o in sync[2]), name
    # One forward (and one backward) collective per exchange, never an empty split or tensor,
    # all asynchronous in the overlapped path.
    assert len(calls) == n_sync == (2 if kw.get("grad", True) else 1), (name, calls, n_sync)
    for in_splits, out_splits, in_numel, out_numel, is_async in calls:
        assert min(in_splits) > 0 and min(out_splits) > 0 and in_numel > 0 and out_numel > 0, (name, calls)
        assert is_async, (name, calls)
    print(f"OK [{name}]", flush=True)


for case in CASES:
    check(case, dtype=torch.float32)
check("both ways:float64", dtype=torch.float64)
check("both ways:bfloat16", dtype=torch.bfloat16)
check("one way with a replica:no grad", dtype=torch.float32, grad=False)
check("both ways:dense", dtype=torch.float32, backend="dense")
check("both ways:received first", dtype=torch.float64, late_peers=False)
check("one way with a replica:query subset", dtype=torch.float32, subset=True)

dist.barrier()
dist.destroy_process_group()
