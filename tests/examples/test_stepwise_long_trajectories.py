"""examples/stepwise_long_trajectories.sh as the README runs it: two 2-iteration training runs
of the CLI (1 GiB and 80 MB KV budgets). Its printed figures are its logs', its last line follows
from them, and the README's row quotes them."""

import json
import os
import re
import subprocess

import pytest
from helpers.torchrun import REPO_ROOT, script_env

pytestmark = pytest.mark.slow  # two training runs of the CLI in a subprocess

EXAMPLE = os.path.join(REPO_ROOT, "examples", "stepwise_long_trajectories.sh")
BUDGETS = ("1GiB", "80MB")
LOSS_RTOL = 16 * 1.1920929e-07
"""Relative: 16 float32 roundings (the two budgets run the same tokens through other
micro-batch cuts and a recomputed forward: the losses differ in summation order only)."""


def test_the_printed_claims_follow_from_the_runs_own_figures(tmp_path):
    out = tmp_path / "out"
    env = dict(script_env(), OUT=str(out))
    proc = subprocess.run(["bash", EXAMPLE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    # the small budget must hold mechanism 2: no fallback to duplicated prefixes
    assert "duplicating them" not in text, text[-3000:]
    logs = {b: [json.loads(line) for line in open(out / f"log_{b}.jsonl")] for b in BUDGETS}
    for budget, records in logs.items():
        assert len(records) == 2 and all(r["prefix_sharing"] == "tree" and "kv_hit_rate" in r for r in records)
        last = records[-1]
        line = (f"--kv-cache-budget {budget:>4}: tree, {last['micro_batches']} micro-batches, KV hit rate "
                f"{last['kv_hit_rate']:.2f}, {last['tokens_recomputed']} prefix tokens recomputed")
        assert line in proc.stdout, (line, proc.stdout[-2000:])
    big, small = logs["1GiB"][-1], logs["80MB"][-1]
    # what the last line says: the same losses, the small budget recomputing cached prefixes
    assert big["kv_hit_rate"] == 1.0 and big["tokens_recomputed"] == 0
    assert small["kv_hit_rate"] < 1.0 and small["tokens_recomputed"] > 0
    rel = max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30) for a, b in zip(logs["1GiB"], logs["80MB"]))
    assert rel <= LOSS_RTOL, rel
    last_line = proc.stdout.strip().splitlines()[-1]
    assert last_line == (f"samples longer than a micro-batch train exactly either way: losses equal within {rel:.1e} "
                         "(relative); the small budget recomputes prefixes instead of keeping them"), last_line
    # the README's row quotes these figures
    readme = open(os.path.join(REPO_ROOT, "examples", "README.md")).read()
    row = next(r for r in readme.splitlines() if r.startswith("| `stepwise_long_trajectories.sh`"))
    claim = (f"KV hit rate {big['kv_hit_rate']:.2f} vs {small['kv_hit_rate']:.2f} "
             f"({small['tokens_recomputed']:,} prefix tokens recomputed)")
    assert claim in row and "80 MB" in row, (claim, row)
    assert re.search(r"1 GiB and an 80 MB KV budget", row)
