#!/usr/bin/env python
"""What splitting a causal square saves on torch's CPU flash kernel (``attention/partial.py``).

    python benchmarks/bench_causal_split.py [--lengths 256,320,...,1024] [--threads 2] [--repeats 15]

For every length and head shape: the median time of one causal square (forward and backward,
``partial_attention_forward`` / ``partial_attention_backward`` on the ``aten`` path) run as one
kernel call and as pieces of ``CAUSAL_CHUNK`` rows, measured side by side in this process, and
their ratio; ``split`` says which the backend runs (``causal_chunks``, ``CAUSAL_SPLIT_ROWS``).
Below 768 rows the kernel masks whole 512-key blocks, so one call costs the full square; the
pieces score 0.75-0.86 of its pairs at 320-767 rows. Also the largest difference between the
two outputs (fp32 rounding). A square of at most ``CAUSAL_CHUNK`` rows is one piece: no
``pieces`` time.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,320,384,448,512,576,640,767,768,1024")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
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
