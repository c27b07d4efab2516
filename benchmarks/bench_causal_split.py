#!/usr/bin/env python
"""What splitting a causal square saves on torch's CPU flash kernel (``attention/partial.py``).

    python benchmarks/bench_causal_split.py [--lengths 256,320,...,1024] [--threads 2] [--repeats 15]
    python benchmarks/bench_causal_split.py --step grpo-512x8x512 [--rounds 5]

For every length and head shape: the median time of one causal square (forward and backward,
``partial_attention_forward`` / ``partial_attention_backward`` on the ``aten`` path) run as one
kernel call and as pieces of ``CAUSAL_CHUNK`` rows, measured side by side in this process, and
their ratio; ``split`` says which the backend runs (``causal_chunks``, ``CAUSAL_SPLIT_ROWS``).
Below 768 rows the kernel masks whole 512-key blocks, so one call costs the full square; the
pieces score 0.75-0.86 of its pairs at 320-767 rows. Also the largest difference between the
two outputs (fp32 rounding). A square of at most ``CAUSAL_CHUNK`` rows is one piece: no
``pieces`` time.

``--step WORKLOAD``: whole training steps instead (``PolicyActor.forward_backward`` on
bench_peers' model and workload, at 512-token micro-batches and at the default budget), with
the backend's rule and with every causal square one call, interleaved round by round in one
process; median wall seconds of each and their ratio.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (bench_peers, for --step)

import torch  # noqa: E402

from megatron_psrl.attention import partial  # noqa: E402

SHAPES = ((8, 4, 32), (16, 2, 64), (4, 4, 128))
"""(query heads, key/value groups, head width)."""


def _median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _step(q, k, v, do, scale):
    o, lse = partial.partial_attention_forward(q, k, v, True, scale, "aten")
    partial.partial_attention_backward(do, q, k, v, o, lse, True, scale, "aten")
    return o


def measure(n: int, heads: int, groups: int, width: int, repeats: int) -> dict:
    """One length and head shape: ``one`` and ``pieces`` ms, their ratio, the outputs' difference."""
    g = torch.Generator().manual_seed(n)
    q, do = (torch.randn(n, heads, width, generator=g) for _ in range(2))
    k, v = (torch.randn(n, groups, width, generator=g) for _ in range(2))
    scale = width ** -0.5
    rule = partial.CAUSAL_SPLIT_ROWS
    out, times = {}, {}
    try:
        for name, rows in (("one", (1, 0)), ("pieces", (1, 1 << 30))):  # (one after the other, same inputs)
            partial.CAUSAL_SPLIT_ROWS = rows
            if name == "pieces" and n <= partial.CAUSAL_CHUNK:
                times[name], out[name] = float("nan"), None
                continue
            out[name] = _step(q, k, v, do, scale)
            times[name] = _median_ms(lambda: _step(q, k, v, do, scale), repeats)
    finally:
        partial.CAUSAL_SPLIT_ROWS = rule
    diff = (out["pieces"] - out["one"]).abs().max().item() if out["pieces"] is not None else 0.0
    return dict(n=n, shape=f"{heads}/{groups}x{width}", one_ms=times["one"], pieces_ms=times["pieces"],
                ratio=times["pieces"] / times["one"], split=partial.causal_chunks(n) is not None, max_diff=diff)


def measure_steps(workload: str, rounds: int) -> list:
    """Median step seconds of ``workload`` with the backend's rule and with one call per causal
    square, at 512-token micro-batches and at the default budget (see the module doc)."""
    from bench_peers import DEFAULT_BUDGET, PEER_MODEL, PeerBench, random_weights, workloads

    hf = dict(PEER_MODEL)
    bench = PeerBench(hf, random_weights(hf, 0), DEFAULT_BUDGET, torch.device("cpu"))
    batch = {**workloads(hf["vocab_size"], quick=True), **workloads(hf["vocab_size"])}[workload]()
    rule, modes = partial.CAUSAL_SPLIT_ROWS, {"pieces": partial.CAUSAL_SPLIT_ROWS, "one call": (1, 0)}
    times = {(b, m): [] for b in (512, DEFAULT_BUDGET) for m in modes}
    try:
        for r in range(rounds + 1):  # (round 0 warms up)
            for (budget, mode) in times:
                partial.CAUSAL_SPLIT_ROWS = modes[mode]
                bench.actor.zero_grad()
                t = time.perf_counter()
                bench.forward_backward(batch, micro_batch_tokens=budget)
                if r:
                    times[(budget, mode)].append(time.perf_counter() - t)
    finally:
        partial.CAUSAL_SPLIT_ROWS = rule
    rows = []
    for budget in (512, DEFAULT_BUDGET):
        split, one = (statistics.median(times[(budget, m)]) for m in modes)
        rows.append(dict(workload=workload, budget=budget, micro_batches=bench.micro_batches(batch, micro_batch_tokens=budget),
                         pieces_s=split, one_s=one, ratio=split / one))
    return rows


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,320,384,448,512,576,640,767,768,1024")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--step", default="", help="a bench_peers workload: whole steps instead of single calls")
    p.add_argument("--rounds", type=int, default=5, help="--step: interleaved timed rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.step:
        rows = measure_steps(args.step, args.rounds)
        print(f"training step, {args.step}, fp32, {args.threads} threads, {args.rounds} interleaved rounds, wall clock")
        print("| micro-batch budget | micro-batches | causal squares split s | one call s | split / one |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['budget']} | {r['micro_batches']} | {r['pieces_s']:.3f} | {r['one_s']:.3f} | {r['ratio']:.3f} |")
        return rows
    rows = []
    print(f"causal square, forward + backward, fp32, {args.threads} threads; pieces of {partial.CAUSAL_CHUNK} rows")
    print("| rows | heads/groups x width | one call ms | pieces ms | pieces / one | the backend splits | max |diff| |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        for shape in SHAPES:
            r = measure(n, *shape, args.repeats)
            rows.append(r)
            print(f"| {r['n']} | {r['shape']} | {r['one_ms']:.2f} | {r['pieces_ms']:.2f} | {r['ratio']:.2f} | "
                  f"{'yes' if r['split'] else 'no'} | {r['max_diff']:.1e} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
