"""The prefix K/V exchange with empty splits over gloo (2 ranks): what arrives, the gradients
that go back, and that no split and no tensor handed to ``all_to_all_single`` is empty (NCCL's
all-to-all hang class, pytorch/pytorch#146468). Prints ``OK <pattern>`` per pattern.

    torchrun --nproc_per_node 2 kv_exchange_splits.py
"""

import torch
import torch.distributed as dist

from megatron_psrl.distributed import kv_exchange
from megatron_psrl.distributed.kv_exchange import exchange_kv, return_replica_grads

dist.init_process_group("gloo")
rank, g = dist.get_rank(), dist.get_world_size()
assert g == 2
NG, HN, N = 2, 3, 5  # groups, head dim, rows of every rank's k / v

calls = []
_real = dist.all_to_all_single


def recording(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
    calls.append((list(input_split_sizes), list(output_split_sizes), input.numel(), output.numel()))
    return _real(output, input, output_split_sizes, input_split_sizes, **kwargs)


kv_exchange.dist.all_to_all_single = recording


def kv_of(r):
    gen = torch.Generator().manual_seed(10 + r)
    return torch.randn(N, NG, HN, generator=gen), torch.randn(N, NG, HN, generator=gen)


# rows[s][d]: the rows of rank s's k/v that go to rank d (every rank knows all of them)
PATTERNS = {
    "one way, nothing kept": [[[], [4, 0, 2]], [[], []]],
    "self and one peer": [[[1, 3], []], [[2], []]],
    "nothing at all on rank 1": [[[0], [1]], [[], []]],
    "every split filled": [[[0, 1], [2]], [[3], [4, 1]]],
}

for name, rows in PATTERNS.items():
    calls.clear()
    send_counts = [len(rows[rank][d]) for d in range(g)]
    recv_counts = [len(rows[s][rank]) for s in range(g)]
    send_rows = torch.tensor([i for d in range(g) for i in rows[rank][d]], dtype=torch.int64)
    k0, v0 = kv_of(rank)
    k, v = k0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
    k_out, v_out, received = exchange_kv(k, v, send_rows, send_counts, recv_counts, dist.group.WORLD,
                                         differentiable=True)
    expected = torch.cat([torch.stack([kv_of(s)[0][rows[s][rank]], kv_of(s)[1][rows[s][rank]]], dim=1)
                          for s in range(g)])
    assert torch.equal(received, expected), (name, received.shape, expected.shape)

    def weights(r):  # d loss / d received on rank r
        n = sum(len(rows[s][r]) for s in range(g))
        return torch.arange(n * 2 * NG * HN, dtype=torch.float32).reshape(n, 2, NG, HN) + 100 * r

    loss = (k_out * 2).sum() + (v_out * 3).sum() + (received * weights(rank)).sum()
    loss.backward()
    want_k, want_v = torch.full((N, NG, HN), 2.0), torch.full((N, NG, HN), 3.0)
    for d in range(g):  # what every receiver d sends back for the rows this rank gave it
        offset = sum(len(rows[s][d]) for s in range(rank))
        for j, i in enumerate(rows[rank][d]):
            want_k[i] += weights(d)[offset + j, 0]
            want_v[i] += weights(d)[offset + j, 1]
    assert torch.equal(k.grad, want_k) and torch.equal(v.grad, want_v), name

    # the same transfer without autograd, and the replica-gradient return (reverse direction)
    _, _, again = exchange_kv(k0, v0, send_rows, send_counts, recv_counts, dist.group.WORLD, differentiable=False)
    assert torch.equal(again, expected), name
    back = return_replica_grads(received.unsqueeze(1), recv_counts, send_counts, dist.group.WORLD)
    mine = torch.stack([k0[send_rows], v0[send_rows]], dim=1).unsqueeze(1)  # what this rank sent, returned
    assert torch.equal(back, mine), name

    assert len(calls) == 4, calls  # forward, backward, no-grad forward, replica return
    for in_splits, out_splits, in_numel, out_numel in calls:
        assert min(in_splits) > 0 and min(out_splits) > 0 and in_numel > 0 and out_numel > 0, (name, calls)
    print(f"OK {name}", flush=True)

dist.barrier()
dist.destroy_process_group()
