"""End to end: one SGD step of ``pretrain_agent_rl.py`` with cross-rank placement under torchrun
equals the per-sample Hugging Face reference (every parameter gradient, read back from the
saved weights with lr = 1, and the loss), and ``tools/compute_logprobs.py`` with the same
placement writes the reference log-probs."""

import json
import os

import numpy as np
import pytest
import torch
from helpers.batches import cross_rank_batch
from helpers.cross_rank_reference import cross_rank_reference
from helpers.hf_reference import assert_grads_close
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.checkpoint.loading import hf_full_state_dict, load_full_state_dict
from megatron_psrl.data.loader import write_samples
from megatron_psrl.model import ModelArchitecture

LOSS = ["--clip-eps", "0.2", "--kl-coef", "0.05", "--entropy-coef", "0.01", "--loss-agg", "seq-mean-token-mean"]


CASES = {  # id: (batch, ranks, CP size, placement, how a tree split between groups gets its shared prefix)
    "dp2-one-tree": ("one-tree", 2, 1, "cross-rank", "auto"),
    "cp2-chain": ("chain", 2, 2, "cross-rank", "auto"),
    "cp2xdp2-mixed": ("mixed", 4, 2, "cross-rank", "auto"),
    # one tree over two exchange groups (the CP groups): the shared prefix computed in both...
    "cp2xdp2-one-tree-split": ("one-tree", 4, 2, "cross-rank", "recompute"),
    # ... or computed once and its K/V sent to the other group (dK/dV back)
    "cp2xdp2-one-tree-transfer": ("one-tree", 4, 2, "cross-rank", "transfer"),
    # trees whole on two ranks of one group: the tree split between them, its prefix sent
    "dp2-whole-tree-transfer": ("one-tree", 2, 1, "whole-tree", "transfer"),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory, request):
    """Both runs of every case (the training step, then the log-prob pass) in one torchrun
    launch per world size (2 and 4 ranks); returns the case's folder (``batch.jsonl``,
    ``log.jsonl``, ``ckpt``, ``lp.jsonl``) once they ran."""
    wanted = {f"{i}/{run}" for i in CASES for run in ("train", "logprobs")
              if f"test_one_sgd_step_and_logprobs_match_reference[{i}]" in selected_test_names(request)}
    shared = SharedLaunches(wanted)
    folders = {}
    for case_id, (kind, nproc, cp, placement, prefix) in CASES.items():
        folders[case_id] = root = tmp_path_factory.mktemp(case_id)
        layout = ["--context-parallel-size", str(cp), "--placement", placement, "--cross-group-prefix", prefix]

        def train_args(kind=kind, layout=layout, root=root):
            data = write_samples(cross_rank_batch(kind), root / "batch.jsonl")
            return ["--hf-dir", _hf_dir(kind, tmp_path_factory), "--data", str(data), "--micro-batch-tokens", "64",
                    *layout, "--optimizer", "sgd", "--lr", "1.0", "--clip-grad", "0", "--train-iters", "1", "--save",
                    str(root / "ckpt"), "--log-json", str(root / "log.jsonl"), *LOSS]

        def logprob_args(kind=kind, layout=layout, root=root):
            return ["--hf-dir", _hf_dir(kind, tmp_path_factory), "--data", str(root / "batch.jsonl"), "--out",
                    str(root / "lp.jsonl"), "--micro-batch-tokens", "64", *layout]

        shared.add(f"{case_id}/train", nproc, os.path.join(REPO_ROOT, "pretrain_agent_rl.py"), train_args)
        shared.add(f"{case_id}/logprobs", nproc, os.path.join(REPO_ROOT, "tools", "compute_logprobs.py"), logprob_args)

    def run(case_id):
        shared.check(f"{case_id}/train")
        shared.check(f"{case_id}/logprobs")
        return folders[case_id]

    return run


def _hf_dir(kind, tmp_path_factory):
    """The ``PARALLEL_CONFIGS["llama"]`` checkpoint (seed 1) the cross-rank tests share."""
    return cross_rank_reference("llama", kind, tmp_path_factory)[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind,nproc,cp,placement,prefix", list(CASES.values()), ids=list(CASES))
def test_one_sgd_step_and_logprobs_match_reference(launches, tmp_path_factory, request, kind, nproc, cp, placement,
                                                   prefix):
    hf_dir, ref_loss, ref_grads, ref_logprobs = cross_rank_reference("llama", kind, tmp_path_factory)
    arch = ModelArchitecture.from_hf_dir(hf_dir)
    root = launches(request.node.callspec.id)
    log, ckpt = root / "log.jsonl", root / "ckpt"
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["placement"] == placement and (rec["exchanged_bytes"] > 0) == (placement == "cross-rank")
    # one tree over two groups (the CP groups), or over the two ranks of a group placing trees
    # whole: split between them, the shared prefix computed in both or sent from one
    split = kind == "one-tree" and (1 < cp < nproc or placement == "whole-tree")
    # (a sent prefix is the root chain the parts share; below a branch point it is recomputed)
    assert (rec["tokens_recomputed_across_groups"] > 0) == (split and prefix == "recompute") or prefix == "transfer"
    assert (rec["tokens_transferred_across_groups"] > 0) == (split and prefix == "transfer")
    assert (rec["transferred_bytes"] > 0) == (split and prefix == "transfer")
    assert rec["loss"] == pytest.approx(ref_loss, rel=1e-5)
    before = hf_full_state_dict(hf_dir, arch)
    _, after = load_full_state_dict(str(ckpt))
    grads = {name: before[name] - after[name] for name in before}  # SGD, lr 1: w1 = w0 - g
    assert_grads_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    out = root / "lp.jsonl"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, ref in zip(rows, ref_logprobs):
        np.testing.assert_allclose(row["logprobs"], ref, atol=1e-4)
    assert torch.isfinite(torch.tensor(rec["grad_norm"]))
