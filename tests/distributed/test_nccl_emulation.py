"""NCCL's point-to-point semantics on gloo (``PSRL_EMULATE_NCCL=1``,
megatron_psrl/distributed/nccl_emulation.py): the emulation catches a program that hangs on
NCCL and passes on gloo; head sends are safe under it, both ways between two ranks; and a
representative case of each multi-rank family that sends point to point or exchanges K/V (head
sends, cross-rank exchange, a hybrid model's linear states across ranks, pipeline PP=2 (and with
two virtual stages per rank: the interleaved order's transfers), expert parallelism EP=2) passes with it on, in one
torchrun launch (their own scripts; the full files run the same way by hand: docs/architecture.md,
"NCCL semantics in CI")."""

import json
import os
import re

import pytest
from helpers.batches import random_tree_records
from helpers.cross_rank_reference import cross_rank_reference
from helpers.families import make_family_checkpoint
from helpers.hf_reference import assert_grads_close
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.distributed.nccl_emulation import EMULATE_ENV, TIMEOUT_ENV
from megatron_psrl.model.tiny import tiny_config

SCRIPTS = {
    "head-sends": os.path.join(REPO_ROOT, "tests", "distributed", "scripts", "head_sends_both_ways.py"),
    "cross-rank": os.path.join(REPO_ROOT, "tests", "training", "scripts", "cross_rank_step.py"),
    "cross-rank-hybrid": os.path.join(REPO_ROOT, "tests", "training", "scripts", "cross_rank_step.py"),
    "pipeline": os.path.join(REPO_ROOT, "tests", "training", "scripts", "pipeline_step.py"),
    "pipeline-vpp": os.path.join(REPO_ROOT, "tests", "training", "scripts", "pipeline_step.py"),
    "expert-parallel": os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_expert_parallel.py"),
}


@pytest.mark.slow
def test_the_emulation_catches_receives_queued_ahead_of_sends(distributed_launches):
    """Each rank posts its receive from the other ahead of its own send: gloo passes, the
    emulation ends both ranks with a timeout (3 s) naming the receive; the same operations as one
    group (batch_isend_irecv, a coalescing manager) pass; tags are ignored under it."""
    out = distributed_launches("nccl-p2p")  # tests/distributed/scripts/nccl_p2p_semantics.py
    assert out.count("crossed gloo: received") == 2, out[-3000:]
    for rank, peer in ((0, 1), (1, 0)):
        assert (f"crossed emulated: timeout: NCCL emulation ({EMULATE_ENV}=1): rank {rank}'s irecv from rank {peer} "
                "((2,) float32, posted at distributed/scripts/nccl_p2p_semantics.py") in out, out[-3000:]
    assert out.count("did not complete within 3 s: under NCCL this hangs") == 2
    for program in ("grouped", "coalesced"):
        for mode in ("gloo", "emulated"):
            assert f"{program} {mode}: received [0.0, 0.0]" in out and f"{program} {mode}: received [1.0, 1.0]" in out
    assert "grouped emulated: received [1.0, 1.0] (1 requests)" in out  # one request per group, as on NCCL
    assert "tags gloo: tag-2 receive got 2" in out and "tags emulated: tag-2 receive got 1" in out


@pytest.mark.slow
def test_head_sends_both_ways(distributed_launches):
    """Two ranks each home of a head the other imports, and a home sending two heads to one rank:
    every head and every returned gradient arrives (asserted in the script), on gloo (and under
    the emulation in test_families_pass_under_nccl_emulation)."""
    out = distributed_launches("head-sends-both-ways")
    for case in ("both-ways", "one-way-two-heads"):
        for kind in ("training", "forward-only"):
            assert out.count(f"OK {case} {kind}") == 2, out[-3000:]


CASES = ("head-sends", "cross-rank", "cross-rank-hybrid", "pipeline", "pipeline-vpp", "expert-parallel")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory, request):
    """The six cases in one 2-rank launch with ``PSRL_EMULATE_NCCL=1`` (a hang reported after
    120 s: a loaded machine's waits are long, a hang is forever); each case's output folder."""
    names = selected_test_names(request)
    shared = SharedLaunches({c for c in CASES if f"test_families_pass_under_nccl_emulation[{c}]" in names})
    env = {EMULATE_ENV: "1", TIMEOUT_ENV: "120"}
    roots = {c: tmp_path_factory.mktemp(c) for c in CASES}

    def cross_rank_args():
        hf_dir = cross_rank_reference("llama", "one-tree", tmp_path_factory)[0]
        return ["--hf-dir", hf_dir, "--batch", "one-tree", "--budget", "64", "--out", str(roots["cross-rank"] / "out.pt")]

    def hybrid_args():  # (linear layers: states point to point, peers and replicas)
        hf_dir = cross_rank_reference("qwen3.5", "one-tree", tmp_path_factory)[0]
        return ["--hf-dir", hf_dir, "--batch", "one-tree", "--budget", "48", "--out",
                str(roots["cross-rank-hybrid"] / "out.pt")]

    def pipeline_args():
        ref = _pipeline_reference(roots["pipeline"])
        return ["--records", str(roots["pipeline"] / "records.json"), "--tp", "1", "--pp", "2", "--out",
                str(roots["pipeline"] / "out.pt"), "--hf-dir", f"llama={ref['hf_dir']}", "--modes", "llama:m1,llama:m2"]

    def pipeline_vpp_args():  # (the same 4-layer model: one layer per virtual stage)
        ref = _pipeline_reference(roots["pipeline"])
        return ["--records", str(roots["pipeline"] / "records.json"), "--tp", "1", "--pp", "2", "--vpp-layers", "1",
                "--out", str(roots["pipeline-vpp"] / "out.pt"), "--hf-dir", f"llama={ref['hf_dir']}", "--modes",
                "llama:m1"]

    def expert_args():
        return [make_family_checkpoint(tiny_config("debug-qwen3-moe"), str(roots["expert-parallel"] / "hf")), "16",
                "tree", "3"]

    makers = {"head-sends": lambda: [], "cross-rank": cross_rank_args, "cross-rank-hybrid": hybrid_args,
              "pipeline": pipeline_args, "pipeline-vpp": pipeline_vpp_args, "expert-parallel": expert_args}
    for case in CASES:
        shared.add(case, 2, SCRIPTS[case], makers[case], group="emulated", env=env)

    def run(case):
        return shared.check(case), roots[case]

    return run


_PIPELINE_REFS: dict = {}


def _pipeline_reference(root):
    """The per-sample reference of test_pipeline_exactness's PP=2 case (its batch and model)."""
    from training.test_pipeline_exactness import _reference

    if "ref" not in _PIPELINE_REFS:
        records = random_tree_records(seed=5, num_roots=8, vocab_size=251)
        (root / "records.json").write_text(json.dumps(records))
        data = (root, samples_from_dicts(records, source="records"), {})
        _PIPELINE_REFS["data"] = data
        _PIPELINE_REFS["ref"] = _reference(data, "llama", 4)
    return _PIPELINE_REFS["ref"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_families_pass_under_nccl_emulation(emulated, case, tmp_path_factory):
    import torch

    out, root = emulated(case)
    if case == "head-sends":
        for name in ("both-ways", "one-way-two-heads"):
            assert out.count(f"OK {name} training") == 2 and out.count(f"OK {name} forward-only") == 2, out[-3000:]
    elif case.startswith("cross-rank"):
        family = "qwen3.5" if case == "cross-rank-hybrid" else "llama"
        _, ref_loss, ref_grads, _ = cross_rank_reference(family, "one-tree", tmp_path_factory)
        res = torch.load(root / "out.pt", weights_only=False)
        assert "cross-rank" in res["placements"] and res["peer_reads"] + res["replicas"] > 0
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_close(res["grads"], ref_grads, rtol=1e-5)
    elif case == "pipeline":
        from training.test_pipeline_exactness import _check

        results = torch.load(root / "out.pt", weights_only=False)
        batch = _PIPELINE_REFS["data"][1]
        _check(results[("llama", "m1")], _PIPELINE_REFS["ref"], batch, "m1", "1f1b")  # 1F1B: sends batched with the next receive
        _check(results[("llama", "m2")], _PIPELINE_REFS["ref"], batch, "m2", "plan-order")
    elif case == "pipeline-vpp":
        from training.test_pipeline_exactness import _check

        results = torch.load(root / "out.pt", weights_only=False)
        _check(results[("llama", "m1")], _PIPELINE_REFS["ref"], _PIPELINE_REFS["data"][1], "m1", "interleaved")
    else:  # every rank matches the per-sample reference (asserted in the script)
        reports = re.findall(r"rank (\d) ep_rank \d: ", out)
        assert sorted(reports) == ["0", "1"], out[-3000:]
