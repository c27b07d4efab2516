#!/usr/bin/env python
"""Pipeline parallelism on CPU: the update step with PP=2, prefix sharing vs none, side by side.

    python benchmarks/bench_pipeline.py [--iters 4] [--workloads grpo stepwise]

For each workload, ``pretrain_agent_rl.py`` runs under torchrun with 2 CPU ranks as two
pipeline stages of the tiny Llama (4 layers, 2 per stage), once with prefix sharing and once
with ``--no-prefix-sharing``, on the same batches. Printed per run: the median step time (the
first step warms up), tokens computed, the executor (``1f1b`` for mechanism-1-only
steps, ``plan-order`` with cached prefixes), the measured bubble (p2p wait / step time, mean
over stages), and the speedup of sharing next to the ideal (a FLOP ratio, the same for any
layout). A 1-rank run with PP=1 gives the no-pipeline reference of each mode.

On 2 CPU cores the two stages share the cores with nothing else; on GPUs each stage has its
own device and the bubble is the idle time of that device.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKLOADS = {  # --data and its micro-batch budget: grpo fits a group per micro-batch (1F1B),
    # stepwise trajectories exceed it (cached prefixes, plan order)
    "grpo": ["--data", "grpo", "--micro-batch-tokens", "4096"],
    "stepwise": ["--data", "stepwise", "--micro-batch-tokens", "1024"],
}


def run(name: str, sharing: bool, pp: int, iters: int, tmp: str) -> dict:
    data_args = WORKLOADS[name]
    # one log per run: --log-json appends, so a log shared by two workloads would mix their steps
    log = os.path.join(tmp, f"{name}-{'s' if sharing else 'n'}{pp}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={pp}", "--standalone",
           os.path.join(REPO, "pretrain_agent_rl.py"), "--model", "tiny-llama", *data_args,
           "--train-iters", str(iters), "--pipeline-model-parallel-size", str(pp), "--log-json", log, "--quiet"]
    if not sharing:
        cmd.append("--no-prefix-sharing")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // pp)))
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=env)
    recs = [json.loads(line) for line in open(log)][1:]  # the first step warms up
    return dict(step=float(np.median([r["step_time_s"] for r in recs])),
                computed=int(np.mean([r["tokens_computed"] for r in recs])),
                total=int(np.mean([r["tokens_total"] for r in recs])),
                ideal=float(np.mean([r["ideal_speedup"] for r in recs])),
                bubble=float(np.mean([r.get("pipeline_bubble", 0.0) for r in recs])),
                schedule=recs[-1].get("pipeline_schedule", "-"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = p.parse_args()
    print("| workload | PP | mode | median step s | tokens computed / total | executor | bubble | "
          "speedup of sharing | ideal |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            for pp in (2, 1):
                res = {sharing: run(name, sharing, pp, args.iters, tmp) for sharing in (True, False)}
                speedup = res[False]["step"] / res[True]["step"]
                for sharing in (True, False):
                    r = res[sharing]
                    print(f"| {name} | {pp} | {'sharing' if sharing else 'no sharing'} | {r['step']:.3f} | "
                          f"{r['computed']} / {r['total']} | {r['schedule'] if pp > 1 else '-'} | "
                          f"{r['bubble']:.2f} | {f'{speedup:.2f}x' if sharing else ''} | " +
                          (f"{r['ideal']:.2f}x" if sharing else "") + " |",
                          flush=True)


if __name__ == "__main__":
    main()
