"""Faults that only one rank sees still end every rank alike: a non-finite gradient on one
data-parallel rank is skipped by all of them; a save that fails on rank 1 fails on rank 0 too
(and leaves nothing); an unwritable output refused at start-up stops every rank."""

import json
import os

import numpy as np
import pytest
import torch
from helpers.faults import without_checksums
from helpers.hf_reference import make_hf_checkpoint
from helpers.torchrun import REPO_ROOT, free_port, script_env

from megatron_psrl.checkpoint.convert import hf_to_mcore
from megatron_psrl.model import tiny_config

pytestmark = pytest.mark.slow  # torchrun jobs

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
TRAIN = os.path.join(REPO_ROOT, "pretrain_agent_rl.py")


def _torchrun(script, args, timeout=300):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", script, *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)


def _error_lines(proc):
    """Each rank's one error line. Another process's output can precede it on the same line
    (ranks share stderr; each error line is one atomic write, other output need not be)."""
    return [line[line.index("error: "):] for line in proc.stderr.splitlines() if "error: " in line]


def test_a_bad_gradient_on_one_rank_is_skipped_by_every_rank(tmp_path):
    """Two samples, one per data-parallel rank (each its own tree); only one has a huge
    advantage. Its rank's gradients overflow, the other rank's do not; the step must be skipped
    on both, and the ranks must still hold the same weights afterwards."""
    rng = np.random.default_rng(0)
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for i, adv in enumerate([1.0, 3e38, 1.0, 1.0]):
            f.write(json.dumps({"id": i, "tokens": rng.integers(0, 256, 30).tolist(), "advantage": adv}) + "\n")
    out = tmp_path / "ranks.json"
    proc = _torchrun(os.path.join(SCRIPTS, "train_and_compare_ranks.py"),
                     ["--out", str(out), "--", "--model", "debug-llama", "--data", str(data), "--global-batch-size",
                      "2", "--train-iters", "3", "--lr", "1e-3", "--quiet"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = json.loads(out.read_text())
    # iteration 1 holds the bad sample (on one rank), iteration 2 does not, iteration 3 does again
    assert [r["skipped"] for r in reports] == [[True, False, True]] * 2
    assert reports[0]["checksum"] == reports[1]["checksum"] and all(r["finite"] for r in reports)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_save_failing_on_rank_1_fails_on_every_rank_and_leaves_nothing(tmp_path, fmt):
    """A NaN in rank 1's tensor-parallel shard only: the step is skipped, and the final save is
    refused by rank 1's finiteness check; rank 0 learns it, removes the save, and both ranks
    end with the same error naming rank 1's file (torch_dist: the iteration folder and rank 1,
    checked before any rank enters megatron's collective save)."""
    hf = make_hf_checkpoint(tiny_config("debug-llama"), seed=0, directory=str(tmp_path / "hf"))
    ckpt = tmp_path / "ckpt"
    hf_to_mcore(hf, str(ckpt), tp=2, progress=False, ckpt_format="legacy")
    path = ckpt / "release" / "mp_rank_01" / "model_optim_rng.pt"
    blob = torch.load(path, weights_only=True)
    blob["model"]["decoder.layers.0.self_attention.linear_qkv.weight"][0, 0] = float("nan")
    torch.save(blob, path)
    without_checksums(ckpt / "release")  # a consistent checkpoint holding a NaN, not a damaged one
    save = tmp_path / "out"
    proc = _torchrun(TRAIN, ["--load", str(ckpt), "--finetune", "--data", "grpo", "--micro-batch-tokens", "512",
                             "--tensor-model-parallel-size", "2", "--train-iters", "1", "--save", str(save),
                             "--ckpt-format", fmt])
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert len(lines) == 2, proc.stderr[-4000:]  # one line per rank
    for line in lines:
        assert "the save failed and was removed" in line and "holds NaN or inf" in line, line
        assert ("mp_rank_01" if fmt == "legacy" else "of rank 1)") in line and "linear_qkv.weight" in line, line
    assert any(line.startswith("error: [rank 0]") and "rank 1:" in line for line in lines)
    assert "megatron_psrl/" not in proc.stderr  # no traceback from the ranks (torchrun prints its own)
    left = sorted(p.name for p in save.iterdir())
    assert left == [], left  # no iteration, no temporary, lock released


def test_an_output_refused_at_start_up_stops_every_rank(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    proc = _torchrun(TRAIN, ["--model", "debug-llama", "--data", "grpo", "--train-iters", "50", "--save",
                             str(blocker / "ckpt")], timeout=120)
    assert proc.returncode != 0
    lines = _error_lines(proc)
    assert sorted(line.split("]")[0] for line in lines) == ["error: [rank 0", "error: [rank 1"], proc.stderr[-3000:]
    assert all(str(blocker / "ckpt") in line and "--save" in line for line in lines)
    assert "iteration" not in proc.stdout
