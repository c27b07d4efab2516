"""End to end: one SGD step of ``pretrain_agent_rl.py`` with cross-rank placement under torchrun
equals the per-sample Hugging Face reference (every parameter gradient, read back from the
saved weights with lr = 1, and the loss), and ``tools/compute_logprobs.py`` with the same
placement writes the reference log-probs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.batches import cross_rank_batch
from helpers.families import PARALLEL_CONFIGS
from helpers.hf_reference import (
    assert_grads_close,
    hf_grads_to_mcore,
    load_hf_model,
    make_hf_checkpoint,
    per_sample_logprobs,
    per_sample_loss_and_grads,
)
from helpers.torchrun import REPO_ROOT, free_port, script_env

from megatron_psrl.checkpoint.loading import hf_full_state_dict, load_full_state_dict
from megatron_psrl.data.loader import write_samples
from megatron_psrl.model import ModelArchitecture

CONFIG = PARALLEL_CONFIGS["llama"]
LOSS = ["--clip-eps", "0.2", "--kl-coef", "0.05", "--entropy-coef", "0.01", "--loss-agg", "seq-mean-token-mean"]


def _torchrun(nproc, script, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.join(REPO_ROOT, script), *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_checkpoint(CONFIG, seed=1, directory=str(tmp_path_factory.mktemp("hf")))


@pytest.mark.slow
@pytest.mark.parametrize("kind,nproc,cp", [("one-tree", 2, 1), ("chain", 2, 2), ("mixed", 4, 2), ("one-tree", 4, 2)],
                         ids=["dp2-one-tree", "cp2-chain", "cp2xdp2-mixed", "cp2xdp2-one-tree-split"])
def test_one_sgd_step_and_logprobs_match_reference(hf_dir, tmp_path, kind, nproc, cp):
    batch = cross_rank_batch(kind)
    data = write_samples(batch, tmp_path / "batch.jsonl")
    hf = load_hf_model(hf_dir)
    ref_loss, ref_grads = per_sample_loss_and_grads(hf, batch, 0.2, 0.05, 0.01, "seq-mean-token-mean")
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    ref_grads = hf_grads_to_mcore(ref_grads, arch)
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    _torchrun(nproc, "pretrain_agent_rl.py", [
        "--hf-dir", hf_dir, "--data", str(data), "--micro-batch-tokens", "64", "--context-parallel-size", str(cp),
        "--placement", "cross-rank", "--optimizer", "sgd", "--lr", "1.0", "--clip-grad", "0", "--train-iters", "1",
        "--save", str(ckpt), "--log-json", str(log), *LOSS])
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["placement"] == "cross-rank" and rec["exchanged_bytes"] > 0
    # one tree, two exchange groups (the CP groups): split between them, the shared prefix computed in both
    assert (rec["tokens_recomputed_across_groups"] > 0) == (kind == "one-tree" and 1 < cp < nproc)
    assert rec["loss"] == pytest.approx(ref_loss, rel=1e-5)
    before = hf_full_state_dict(hf_dir, arch)
    _, after = load_full_state_dict(str(ckpt))
    grads = {name: before[name] - after[name] for name in before}  # SGD, lr 1: w1 = w0 - g
    assert_grads_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    out = tmp_path / "lp.jsonl"
    _torchrun(nproc, "tools/compute_logprobs.py", ["--hf-dir", hf_dir, "--data", str(data), "--out", str(out),
                                                   "--micro-batch-tokens", "64", "--context-parallel-size", str(cp),
                                                   "--placement", "cross-rank"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, ref in zip(rows, per_sample_logprobs(hf, batch)):
        np.testing.assert_allclose(row["logprobs"], ref, atol=1e-4)
    assert torch.isfinite(torch.tensor(rec["grad_norm"]))
