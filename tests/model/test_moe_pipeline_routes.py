"""MoE router replay and the router losses with pipeline parallelism (docs/moe.md "Router
replay", "Router losses"): PP = 2 over gloo, one torchrun launch; every rank's log-probs, loss,
reported ``moe_z_loss`` / ``moe_aux_loss`` (summed over both stages) and every gradient it
holds equal the per-sample Hugging Face reference with the same routes (asserted inside
tests/model/scripts/moe_pipeline_routes.py), in both pipeline executors and with activation
recomputation; GLM-4.5's grouped sigmoid routing with a dense first layer and the expert bias's
update too."""

import os
import re

import pytest
from helpers.families import make_family_checkpoint
from helpers.torchrun import REPO_ROOT, run_torchrun

from megatron_psrl.model.tiny import tiny_config

SCRIPT = os.path.join(REPO_ROOT, "tests", "model", "scripts", "moe_pipeline_routes.py")
PHASES = ("replay", "losses-replay", "losses-own-routes", "recompute-losses-replay", "grouped-losses-bias")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(tiny_config("debug-qwen3-moe"), str(tmp_path_factory.mktemp("hf-qwen3-moe-pp")))


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    """GLM-4.5 with 4 layers: stage 0 holds the dense layer and an MoE one, stage 1 two MoE layers
    (seed 1: seed 0 nearly cancels this batch's policy loss, tests/model/test_sequence_parallel.py)."""
    return make_family_checkpoint(dict(tiny_config("debug-glm4-moe"), num_hidden_layers=4),
                                  str(tmp_path_factory.mktemp("hf-glm4-moe-pp")), seed=1)


@pytest.mark.slow  # two processes
def test_router_replay_and_router_losses_with_pipeline_parallelism_under_torchrun(hf_dir, glm_dir):
    """PP = 2 (one MoE layer per stage), micro-batches of 16 tokens (cached prefixes: the
    plan order) and of 72 (whole trees, 3 micro-batches: 1F1B), with replay alone, z + aux with
    replay and z + aux with the route-count pre-pass; then z + aux with replay under full
    activation recomputation, whose 1F1B backwards recompute their forwards after later ones
    (each routes and weighs its tokens as its own forward did). Then GLM-4.5 (a dense first
    layer: stage 0 has one router, stage 1 two), z + aux with the pre-pass and
    ``moe_router_enable_expert_bias``: each stage's updated biases are megatron's update of the
    per-sample route counts, bit for bit."""
    out = run_torchrun(SCRIPT, [hf_dir, "16", "72", glm_dir], nproc=2, timeout=600)
    reports = re.findall(r"rank (\d) pp_rank \d (\S+) schedule (\S+) budget (\d+) ok: .*?micro-batches (\d+), "
                         r"cached prefixes (\d+)", out)
    expected = [(r, name, "plan-order" if budget == "16" else "1f1b", budget)
                for r in "01" for name in PHASES for budget in ("16", "72")]
    assert sorted(r[:4] for r in reports) == sorted(expected), out[-3000:]
    for _, _, _, budget, micro_batches, cached in reports:
        if budget == "72":  # whole trees, several micro-batches: a 1F1B backward runs after a later forward
            assert int(micro_batches) >= 2 and int(cached) == 0
        else:
            assert int(cached) > 0
    assert len(re.findall(r"pp_rank 0 grouped-losses-bias .*?MoE layers \[0\] biases updated", out)) == 2, out[-3000:]
    assert len(re.findall(r"pp_rank 1 grouped-losses-bias .*?MoE layers \[1, 2\] biases updated", out)) == 2
