#!/usr/bin/env python
"""How long the command lines take to answer before any work: ``--help`` and a bad flag.

    python benchmarks/bench_cli_startup.py [--repeats 5]

Each command runs in a fresh interpreter (as a user types it); the median wall time is printed
with the target (``--help`` under 2 s: arguments are parsed before megatron-core and torch are
imported). ``import megatron_psrl.rl.actor`` is timed beside it: what a run pays later.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = [
    ("pretrain_agent_rl.py --help", [os.path.join(REPO, "pretrain_agent_rl.py"), "--help"], 2.0),
    ("pretrain_agent_rl.py --micro-batch-tokens 0", [os.path.join(REPO, "pretrain_agent_rl.py"),
                                                     "--micro-batch-tokens", "0"], 2.0),
    ("tools/compute_logprobs.py --help", [os.path.join(REPO, "tools", "compute_logprobs.py"), "--help"], None),
    ("tools/convert_hf_checkpoint.py --help", [os.path.join(REPO, "tools", "convert_hf_checkpoint.py"), "--help"], 2.0),
    ("tools/convert_hf_checkpoint.py, --hf-dir missing",
     [os.path.join(REPO, "tools", "convert_hf_checkpoint.py"), "hf-to-mcore", "--out-dir", "x"], 2.0),
    ("import megatron_psrl.rl.actor (for comparison)", ["-c", "import megatron_psrl.rl.actor"], None),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per command (the median is printed)")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name, cmd, target in COMMANDS:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *cmd], env=env, capture_output=True, cwd=REPO)
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        verdict = "" if target is None else f"  (target < {target:.0f} s: {'met' if median < target else 'MISSED'})"
        print(f"{name:<55} {median:6.2f} s median of {args.repeats}{verdict}")


if __name__ == "__main__":
    main()
