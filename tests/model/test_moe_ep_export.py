"""The Hugging Face export and weight stream of an expert-parallel MoE actor (EP = DP = 2 under
torchrun, tiny Qwen3-MoE): the experts of both ranks gathered and renumbered to their global
index. Bit for bit against the source folder before any step and against every rank's own
parameters after one (asserted in the script); after one SGD step, against the EP = 1 export of
the same step (here, within fp32 rounding: the two runs sum the gradients in another order)."""

import importlib.util
import os
import re

import pytest
from helpers.batches import random_tree_records
from helpers.families import make_family_checkpoint
from helpers.torchrun import REPO_ROOT, run_torchrun

from megatron_psrl import PolicyActor
from megatron_psrl.model.tiny import tiny_config

SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_ep_export.py")


def _script():
    spec = importlib.util.spec_from_file_location("moe_ep_export_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(tiny_config("debug-qwen3-moe"), str(tmp_path_factory.mktemp("hf-qwen3-moe-ep")))


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("tp", [1, 2], ids=["ep2xdp2", "ep2xtp2"])
def test_expert_parallel_export_and_stream_under_torchrun(hf_dir, tmp_path, tp):
    script = _script()
    out = run_torchrun(SCRIPT, [hf_dir, str(tmp_path / "ep2"), str(tp)], nproc=2, timeout=600)
    reports = re.findall(rf"rank (\d) tp {tp} ep_rank (\d): export and stream ok, (\d+) tensors, (\d+) expert tensors",
                         out)
    assert sorted((r, e) for r, e, _, _ in reports) == [("0", "0"), ("1", "1")], out[-3000:]
    assert {(n, x) for _, _, n, x in reports} == {("69", "48")}  # 2 layers x 8 experts x 3 projections

    # the same step at EP = 1 (one process): the same weights, up to the order of the gradient sums
    actor = PolicyActor(hf_dir, script.step_config(1))
    try:
        metrics = actor.train_step(random_tree_records(seed=script.STEP_SEED, num_roots=script.STEP_ROOTS))
        assert not metrics["skipped"]
        ep1 = actor.state_dict_hf()
    finally:
        actor.close()
    ep2, source = script.read_hf_folder(str(tmp_path / "ep2" / "after")), script.read_hf_folder(hf_dir)
    assert set(ep2) == set(ep1) == set(source)
    moved = []
    for name, expected in ep1.items():
        update = float((expected - source[name]).abs().max())
        if update > 0:
            moved.append(name)
        err = float((ep2[name] - expected).abs().max())
        assert err <= 1e-5 * update + 2e-7 * float(source[name].abs().max()) + 1e-9, (name, err, update)
    assert {int(n.split(".")[5]) for n in moved if ".mlp.experts." in n} == set(range(8)), moved  # all experts
