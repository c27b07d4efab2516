"""The gradients readers return for another rank's prefix rows travel and are summed in fp32
(4 ranks over gloo, a bf16 model): rank 0's rows are attended to by ranks 1-3 through the
overlapped exchange and the blockwise tree attention (the default path), and by nobody on rank
0, whose own gradient of them comes from a weighted sum. Rank 0's gradient of those rows must
be the exact sum (every reader's gradient computed again in float64 and gathered) rounded once
to bf16: rounding each reader's gradient to bf16 before it is sent, or summing them in bf16,
misses it on a large share of the elements. (A reader's exact gradient is the fp32 one its
attention computes for the received rows, recorded where the kernel returns it.) Prints
``OK overlapped`` and the mismatch count.

    torchrun --nproc_per_node 4 kv_exchange_fp32_grads.py
"""

import torch
import torch.distributed as dist

from megatron_psrl.attention.backends import blockwise, blockwise_tree_attention
from megatron_psrl.attention.plan import tree_plan
from megatron_psrl.distributed.kv_exchange import ReceivedKV, exchange_kv_start

dist.init_process_group("gloo")
rank, g = dist.get_rank(), dist.get_world_size()
recorded = []  # the gradients of the received rows, as the attention computes them (fp32)
_kernel = blockwise.partial_attention_backward


def recording(dout, q, k, v, out, lse, causal, *args, **kwargs):
    grads = _kernel(dout, q, k, v, out, lse, causal, *args, **kwargs)
    if not causal:  # a block over the received chain (the pack's own segments are causal)
        recorded.append((grads[1].double(), grads[2].double()))
    return grads


blockwise.partial_attention_backward = recording
assert g == 4
T, NP, NG, HN, R = 6, 4, 2, 8, 5  # reader's tokens, query heads, kv heads, head dim, rows read
SCALE = HN ** -0.5
gen = torch.Generator().manual_seed(7 + rank)


def rand(*shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).bfloat16()


k0, v0 = rand(R, NG, HN), rand(R, NG, HN)
k, v = k0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
send_rows = torch.arange(R).repeat(g - 1) if rank == 0 else torch.zeros(0, dtype=torch.int64)
send_counts = [R if rank == 0 and d != 0 else 0 for d in range(g)]
recv_counts = [R if s == 0 and rank != 0 else 0 for s in range(g)]
k_out, v_out, buffer, transfer = exchange_kv_start(k, v, send_rows, send_counts, recv_counts, dist.group.WORLD,
                                                   differentiable=True)
reference = torch.zeros(2, R, NG, HN, dtype=torch.float64)  # this rank's exact gradient of rank 0's rows
if rank == 0:
    wk, wv = rand(R, NG, HN), rand(R, NG, HN)
    loss = (k_out.float() * wk.float()).sum() + (v_out.float() * wv.float()).sum()
    transfer.release()
    reference[0], reference[1] = wk.double(), wv.double()
else:
    q, kq, vq, dout = rand(T, NP, HN), rand(T, NG, HN), rand(T, NG, HN), rand(T, NP, HN)
    # three root segments, each below the received chain: a reader's gradient of a received
    # row sums three blocks' (fp32), which bf16 does not hold
    plan = tree_plan([0, 2, 4], [2, 4, 6], [-1, -1, -1], [(0, 2, 0), (2, 4, 0), (4, 6, 0)], [R])
    received = ReceivedKV(transfer, buffer, transfer.offsets[0], R)
    out = blockwise_tree_attention(q, kq + 0 * k_out.sum(), vq + 0 * v_out.sum(), plan, [received], SCALE)
    transfer.release()
    loss = (out.float() * dout.float()).sum()
loss.backward()
if rank != 0:  # the blocks' sum, as the attention accumulates it (fp32: exact for three bf16 terms)
    reference[0] = sum(rk for rk, _ in recorded)
    reference[1] = sum(rv for _, rv in recorded)
gathered = [torch.zeros_like(reference) for _ in range(g)]
dist.all_gather(gathered, reference)
if rank == 0:
    exact = sum(gathered)  # rank 0's own and every reader's, in float64
    expected = exact.to(torch.bfloat16)
    got = torch.stack([k.grad, v.grad])
    mismatches = int((got != expected).sum())
    ulp = (expected.double().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    worst = float(((got.double() - exact).abs() / ulp).max())
    print(f"rank 0: {mismatches} of {got.numel()} elements differ from the exact sum rounded once "
          f"(worst {worst:.2f} bf16 ulps)", flush=True)
    assert mismatches <= got.numel() // 50 and worst <= 1.0, (mismatches, worst)
print("OK overlapped", flush=True)
dist.barrier()
dist.destroy_process_group()
