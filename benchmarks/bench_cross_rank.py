#!/usr/bin/env python
"""Cross-rank placement: balance on simulated clusters, a real 2-rank run, and the cost model.

    python benchmarks/bench_cross_rank.py [--ranks 2 8 64 512] [--micro-batch-tokens 2048]
        [--micro-batches-per-rank 4] [--real] [--predict]

1. **Planner on simulated ranks** (no model): for step-wise trajectories of 16-64 turns, search
   trees (one tree per task) and the mixed workload, sized to ``--micro-batches-per-rank``
   micro-batches of unique tokens per rank, the imbalance (max / mean rank cost) of whole-tree
   placement and of cross-rank placement, with one exchange group over all ranks and with
   node-sized groups of 8 (trees balanced whole over the groups), the K/V bytes exchanged per
   step (Llama-3-8B in bf16) and the planning time.
2. **A real run** (``--real``): ``pretrain_agent_rl.py`` under torchrun with 2 CPU ranks on a
   batch that is one large rollout tree, cross-rank vs whole-tree placement, median step time
   and the planner's predicted step time.
3. **Cost model** (``--predict``): predicted (start-up calibration) vs measured time of
   random packs (1-9 causal segments of 16-400 tokens, random logit rows), on the tiny Llama
   in this process.
4. **Exchange overlap** (``--overlap``): under torchrun with 2 and 4 CPU ranks (gloo), one
   training step of one rollout tree placed cross-rank (tiny Llama), the prefix K/V exchange
   synchronous (``--no-overlap-kv-exchange``) and overlapped (the default), interleaved,
   ``--overlap-repeats`` times each: median step time and the exposed exchange time per step
   (time a rank spends blocked in the per-layer exchange, forward and backward: the whole
   synchronous all-to-all, or the overlapped one's wait), averaged over the ranks.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.data.synthetic import make_mixed, make_stepwise, make_tree_rollouts  # noqa: E402
from megatron_psrl.schedule.cost import NAMED_MODEL_DIMS, CostModel
from megatron_psrl.schedule.planner import compare_placements  # noqa: E402
from megatron_psrl.tree import build_prefix_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "stepwise-16-64": lambda n, seed: make_stepwise(num_trajectories=n, turns=(16, 64), obs_len=(50, 400),
                                                   action_len=(10, 100), system_len=500, seed=seed),
    "search-tree": lambda n, seed: make_tree_rollouts(num_roots=n, branching=3, depth=4, seed=seed),
    "mixed": lambda n, seed: make_mixed(num_tokens_target=n * 20_000, seed=seed),
}


def sized_tree(name: str, unique_tokens: int):
    """A batch of ``name`` with about ``unique_tokens`` tree tokens."""
    probe = build_prefix_tree(WORKLOADS[name](4, 0))
    units = max(1, int(round(4 * unique_tokens / probe.num_tree_tokens)))
    return build_prefix_tree(WORKLOADS[name](units, 1))


def simulate(args) -> None:
    dims = NAMED_MODEL_DIMS["llama3-8b"]
    kv_bytes = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * 2  # K and V, bf16
    cost = CostModel.named("llama3-8b")
    print("| workload | ranks | micro-batches / rank | whole-tree | cross-rank, one group | cross-rank, groups of 8 "
          "| exchanged / step | plan ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in WORKLOADS:
        for ranks in args.ranks:
            tree = sized_tree(name, args.micro_batches_per_rank * ranks * args.micro_batch_tokens)
            mb_per_rank = tree.num_tree_tokens / args.micro_batch_tokens / ranks
            one = compare_placements(tree, cost, ranks, args.micro_batch_tokens, None, kv_bytes)
            cells = [f"{one['whole-tree']['imbalance']:.3f}", f"{one['cross-rank']['imbalance']:.3f}"]
            if ranks > 8:
                node = compare_placements(tree, cost, ranks, args.micro_batch_tokens, 8, kv_bytes)
                cells.append(f"{node['cross-rank']['imbalance']:.3f}")
            else:
                cells.append("(one group)")
            print(f"| {name} | {ranks} | {mb_per_rank:.1f} | {' | '.join(cells)} | "
                  f"{one['cross-rank']['exchanged_bytes'] / 2**20:.1f} MiB | "
                  f"{one['cross-rank']['plan_seconds'] * 1e3:.0f} |", flush=True)


def real_run(args) -> None:
    from megatron_psrl.data.loader import write_samples

    batch = make_tree_rollouts(num_roots=1, branching=3, depth=4, seed=3, prompt_len=(1500, 2000))
    tree = build_prefix_tree(batch)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_samples(batch, os.path.join(tmp, "one_tree.jsonl"))
        print(f"\none rollout tree: {batch.num_samples} samples, {batch.num_tokens} tokens, "
              f"{tree.num_tree_tokens} unique; 2 CPU ranks, tiny Llama, micro-batch {args.real_micro_batch} tokens")
        print("| placement | median step s | predicted step s | imbalance | exchanged MiB |")
        print("|---|---|---|---|---|")
        times = {}
        for placement in ("whole-tree", "cross-rank"):
            log = os.path.join(tmp, f"{placement}.jsonl")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   os.path.join(REPO, "pretrain_agent_rl.py"), "--data", str(data), "--micro-batch-tokens",
                   str(args.real_micro_batch), "--train-iters", str(args.real_iters), "--placement", placement,
                   "--log-json", log, "--quiet"]
            subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
            recs = [json.loads(line) for line in open(log)][1:]  # the first step warms up
            times[placement] = float(np.median([r["step_time_s"] for r in recs]))
            predicted = recs[-1].get("predicted_step_s")
            print(f"| {placement} | {times[placement]:.3f} | "
                  f"{predicted if predicted is None else f'{predicted:.3f}'} | {recs[-1]['plan_imbalance']:.2f} | "
                  f"{recs[-1]['exchanged_bytes'] / 2**20:.1f} |", flush=True)
        print(f"cross-rank speedup over whole-tree placement: {times['whole-tree'] / times['cross-rank']:.2f}x")


def predict(args) -> None:
    import torch

    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.engine.calibration import calibrate, median_seconds, pack_step
    from megatron_psrl.model import tiny_config
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.builder import build_model

    initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("tiny-llama"))
    model = build_model(arch)
    measured = calibrate(model, arch.vocab_size, torch.device("cpu"), 2048)
    rng = np.random.default_rng(0)
    print("\n| micro-batch | tokens | key pairs | logit rows | predicted s | measured s | error |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for k in range(8):
        segments = rng.integers(16, 400, size=int(rng.integers(1, 10))).tolist()
        rows = int(rng.integers(0, sum(segments)))
        keys = sum(s * (s + 1) // 2 for s in segments)
        t = median_seconds(pack_step(model, arch.vocab_size, torch.device("cpu"), segments, rows), 3)
        p = measured.predict(sum(segments), keys, rows)
        errors.append(abs(p - t) / t)
        print(f"| {k} | {sum(segments)} | {keys} | {rows} | {p:.4f} | {t:.4f} | {100 * (p - t) / t:+.1f}% |")
    print(f"mean absolute error of the calibrated cost model: {100 * np.mean(errors):.1f}%")


def overlap_worker(args) -> None:
    """One rank of the ``--overlap`` run (started by :func:`overlap_bench` under torchrun)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_psrl.distributed import kv_exchange
    from megatron_psrl.distributed.setup import initialize_parallel
    from megatron_psrl.engine import step as step_module
    from megatron_psrl.engine.calibration import discard_gradients
    from megatron_psrl.engine.step import StepRunner
    from megatron_psrl.kvcache import BlockKVCache, KVGeometry
    from megatron_psrl.model import tiny_config
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.builder import build_model
    from megatron_psrl.rl.loss import LossConfig
    from megatron_psrl.schedule.config import PlannerConfig
    from megatron_psrl.schedule.memory import activation_bytes_per_token, plan_memory_group
    from megatron_psrl.schedule.with_memory import plan_with_memory

    torch.set_num_threads(1)
    layout = initialize_parallel(1, 1, seed=0, device="cpu")
    world = dist.get_world_size()
    group = parallel_state.get_data_parallel_group()
    arch = ModelArchitecture.from_hf_config(tiny_config("tiny-llama"))
    model = build_model(arch)
    batch = make_tree_rollouts(num_roots=1, branching=3, depth=3, seed=3, prompt_len=(800, 1000),
                               segment_len=(32, 160), obs_len=(32, 160), vocab_size=arch.vocab_size)
    tree = build_prefix_tree(batch)
    config = PlannerConfig(micro_batch_tokens=args.overlap_micro_batch, sharing="tree", data_parallel_size=world,
                           exchange_group_size=world, placement="cross-rank", cost_model=CostModel.named("tiny"))
    geom = KVGeometry(arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))
    budget = 1 << 30
    plan, memories, _ = plan_with_memory(tree, config, lambda ranks: plan_memory_group(
        ranks, geom, budget, activation_bytes_per_token(arch, 1, 4)))
    me = layout.placement_rank
    runner = StepRunner(model, arch.vocab_size, torch.device("cpu"), kv_cache=BlockKVCache(geom, budget),
                        exchange_group=group)
    cfg = LossConfig(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.0)

    blocked = {"s": 0.0}  # seconds blocked in the per-layer exchange on this rank

    def timed(fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                blocked["s"] += time.perf_counter() - t0
        return wrapper

    # Synchronous: the whole per-layer all-to-all (ExchangeKV forward and backward). Overlapped:
    # starting the transfers (ExchangeInFlight(), return_grad) and waiting for them (wait,
    # returned_grad). The replica-gradient return (once per deferred backward, synchronous in
    # both) is not counted.
    kv_exchange._all_to_all = timed(kv_exchange._all_to_all)
    for name in ("__init__", "wait", "return_grad", "returned_grad"):
        setattr(kv_exchange.ExchangeInFlight, name, timed(getattr(kv_exchange.ExchangeInFlight, name)))
    replica_return = step_module.return_replica_grads

    def uncounted_replica_return(*a, **kw):
        before = blocked["s"]
        try:
            return replica_return(*a, **kw)
        finally:
            blocked["s"] = before

    step_module.return_replica_grads = uncounted_replica_return

    def one_step(overlap: bool):
        runner.overlap_kv_exchange = overlap
        blocked["s"] = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        runner.train(plan, me, cfg, memories[me])
        dist.barrier()
        elapsed = time.perf_counter() - t0
        discard_gradients(model)
        return elapsed, blocked["s"]

    one_step(True)  # warm-up, both paths
    one_step(False)
    rows = {True: [], False: []}
    for r in range(args.overlap_repeats):
        for overlap in ((True, False) if r % 2 == 0 else (False, True)):  # interleaved, alternating first
            rows[overlap].append(one_step(overlap))
    result = torch.tensor([[np.median([x[i] for x in rows[o]]) for i in (0, 1)] for o in (False, True)],
                          dtype=torch.float64)
    dist.all_reduce(result)
    result /= world
    # One layer's exchange alone, with the ranks aligned by a barrier before every repeat (no
    # skew): the transfer itself, synchronous, and overlapped with one layer's attention
    # forward over a micro-batch's own keys (what the overlapped path hides it behind).
    from megatron_psrl.attention.partial import partial_attention_forward

    ng, hn = arch.num_kv_heads, arch.head_dim
    n = args.overlap_micro_batch
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, arch.num_attention_heads, hn, generator=gen)
    kk, vv = torch.randn(n, ng, hn, generator=gen), torch.randn(n, ng, hn, generator=gen)
    micro = []
    for send_rows in (n // 4, 4 * n):
        send = torch.randn(send_rows * world, 2, ng, hn, generator=gen)
        counts = [send_rows] * world
        runs = {
            "sync": lambda: kv_exchange._all_to_all(send, counts, counts, group),
            "attention": lambda: partial_attention_forward(q, kk, vv, True, hn ** -0.5),
            "overlapped": lambda: (lambda t: (partial_attention_forward(q, kk, vv, True, hn ** -0.5), t.wait()))(
                kv_exchange.ExchangeInFlight(send, counts, counts, group)),
        }
        times = {name: [] for name in runs}
        for r in range(args.overlap_repeats * 4):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
        micro.append([send_rows] + [float(np.median(times[name])) for name in runs])
    micro_t = torch.tensor(micro, dtype=torch.float64)
    dist.all_reduce(micro_t)
    micro_t /= world
    if dist.get_rank() == 0:
        for send_rows, t_sync, t_attention, t_both in micro_t.tolist():
            print(f"MICRO {world} {int(send_rows)} {send_rows * 2 * ng * hn * 4 * (world - 1) / 2**20:.2f} "
                  f"{t_sync:.6f} {t_attention:.6f} {t_both:.6f}", flush=True)
        fragments = plan.ranks[me].micro_batches
        layers = arch.num_layers
        exchanges = sum(1 for mb in fragments if mb.exchange is not None and mb.exchange.forward_collective)
        print(f"RESULT {world} {tree.num_tree_tokens} {len(fragments)} {exchanges * layers} "
              f"{plan.exchanged_tokens()} " + " ".join(f"{x:.6f}" for x in result.flatten().tolist()), flush=True)
    dist.destroy_process_group()


def overlap_bench(args) -> None:
    print("\nprefix K/V exchange, synchronous vs overlapped: one cross-rank training step of one rollout tree, "
          f"tiny Llama (fp32, 4 layers), micro-batch {args.overlap_micro_batch} tokens, gloo, 1 thread per rank, "
          f"medians of {args.overlap_repeats} interleaved repeats, averaged over ranks")
    print("| ranks | tree tokens | lockstep steps | forward all-to-alls / step | exchanged tokens "
          "| exchange | step s | exposed exchange s | exposed share of step |")
    print("|---|---|---|---|---|---|---|---|---|")
    micro = []
    for ranks in args.overlap_ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
               os.path.abspath(__file__), "--overlap-worker", "--overlap-micro-batch", str(args.overlap_micro_batch),
               "--overlap-repeats", str(args.overlap_repeats)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
        if line is None:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"the {ranks}-rank overlap run failed")
        micro += [x.split()[1:] for x in proc.stdout.splitlines() if x.startswith("MICRO")]
        _, world, tokens, steps, exchanges, moved, *values = line.split()
        (sync_step, sync_blocked, over_step, over_blocked) = map(float, values)
        for name, step_s, blocked_s in (("synchronous", sync_step, sync_blocked), ("overlapped", over_step, over_blocked)):
            print(f"| {world} | {tokens} | {steps} | {exchanges} | {moved} | {name} | {step_s:.3f} | {blocked_s:.4f} "
                  f"| {100 * blocked_s / step_s:.1f}% |", flush=True)
    print(f"\none layer's exchange alone, ranks aligned by a barrier (no skew), medians of "
          f"{4 * args.overlap_repeats} interleaved repeats: the synchronous all-to-all, one layer's attention "
          f"forward over {args.overlap_micro_batch} causal keys, and both overlapped (exposed = both - attention)")
    print("| ranks | rows to each rank | MiB sent per rank | sync all-to-all ms | attention ms | overlapped ms "
          "| exposed ms | exposed share |")
    print("|---|---|---|---|---|---|---|---|")
    for world, rows, mib, t_sync, t_attention, t_both in micro:
        t_sync, t_attention, t_both = float(t_sync), float(t_attention), float(t_both)
        exposed = max(0.0, t_both - t_attention)
        print(f"| {world} | {int(float(rows))} | {mib} | {1e3 * t_sync:.2f} | {1e3 * t_attention:.2f} | "
              f"{1e3 * t_both:.2f} | {1e3 * exposed:.2f} | {100 * exposed / t_sync:.0f}% |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 512])
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--micro-batches-per-rank", type=float, default=4.0)
    p.add_argument("--real", action="store_true", help="also time a 2-rank run on one large tree")
    p.add_argument("--real-micro-batch", type=int, default=1024)
    p.add_argument("--real-iters", type=int, default=5)
    p.add_argument("--predict", action="store_true", help="also compare predicted and measured micro-batch times")
    p.add_argument("--overlap", action="store_true",
                   help="only the exchange-overlap section: synchronous vs overlapped exchange under torchrun")
    p.add_argument("--overlap-ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--overlap-repeats", type=int, default=5)
    p.add_argument("--overlap-micro-batch", type=int, default=512)
    p.add_argument("--overlap-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.overlap_worker:
        overlap_worker(args)
        return
    t0 = time.perf_counter()
    if args.overlap:
        overlap_bench(args)
        print(f"\n(total {time.perf_counter() - t0:.0f} s)")
        return
    simulate(args)
    if args.real:
        real_run(args)
    if args.predict:
        predict(args)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
