"""Cross-rank prefix sharing with the overlapped prefix K/V exchange (the default) and with the
synchronous one (``--no-overlap-kv-exchange``) under torchrun (gloo): both equal the per-sample
Hugging Face reference (loss, every parameter gradient, log-probs; fp32, rel 1e-5), and equal
each other; the overlapped run's exchanges are all asynchronous, the synchronous run's none.
Layouts: data parallelism (2 ranks), CP=2 x DP=2 (4 ranks), and a tight KV budget (the
recomputed forward runs its exchanges inside the backward pass)."""

import os

import numpy as np
import pytest
import torch
from helpers.cross_rank_reference import cross_rank_reference
from helpers.hf_reference import assert_grads_close
from helpers.torchrun import SharedLaunches, selected_test_names

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "cross_rank_overlap_step.py")
CASES = [  # (id, batch, nproc, cp, kv budget)
    ("dp2-one-tree", "one-tree", 2, 1, 1 << 30),
    ("cp2xdp2-mixed", "mixed", 4, 2, 1 << 30),
    ("cp2-one-tree-tight-kv", "one-tree", 2, 2, 256 * 1024),
]


@pytest.fixture(scope="module")
def launches(tmp_path_factory, request):
    """Both runs (overlap on and off) of every case in one torchrun launch per world size (2 and
    4 ranks); rank 0 of each run saves its results to the run's ``out`` file."""
    wanted = {f"{c[0]}/{overlap}" for c in CASES for overlap in ("on", "off")
              if f"test_overlapped_and_synchronous_exchange_match_reference[{c[0]}]" in selected_test_names(request)}
    shared = SharedLaunches(wanted)
    outs = {}
    for name, kind, nproc, cp, kv_budget in CASES:
        for overlap in ("on", "off"):
            outs[name, overlap] = out = tmp_path_factory.mktemp(name) / f"result-{overlap}.pt"
            shared.add(f"{name}/{overlap}", nproc, SCRIPT, lambda overlap=overlap, kind=kind, cp=cp,
                       kv_budget=kv_budget, out=out: [
                "--overlap", overlap, "--hf-dir", cross_rank_reference("llama", kind, tmp_path_factory)[0],
                "--batch", kind, "--cp", str(cp), "--budget", "64", "--kv-budget", str(kv_budget), "--out", str(out)])

    def result(name, overlap):
        shared.check(f"{name}/{overlap}")
        return torch.load(outs[name, overlap], weights_only=False)

    return result


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_overlapped_and_synchronous_exchange_match_reference(case, launches, tmp_path_factory):
    name, kind, nproc, cp, kv_budget = case
    hf_dir, ref_loss, ref_grads, ref_logprobs = cross_rank_reference("llama", kind, tmp_path_factory)
    results = {}
    for overlap in ("on", "off"):
        res = results[overlap] = launches(name, overlap)
        assert "cross-rank" in res["placements"], res
        assert res["peer_reads"] > 0, "received prefix K/V must be attended to"
        if "tight" in name:
            assert res["recomputed"] > 0, "the tight KV budget must force recomputation"
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_close(res["grads"], ref_grads, rtol=1e-5)
        for a, b in zip(res["logprobs"], ref_logprobs):
            np.testing.assert_allclose(a, b, atol=1e-4)
    on, off = results["on"]["all_to_all"], results["off"]["all_to_all"]
    assert on["async"] > 0 and off["async"] == 0, (on, off)
    # the same collectives otherwise: every exchange of the synchronous run is asynchronous here
    assert on["async"] + on["sync"] == off["sync"], (on, off)
    # overlap on and off: the same numbers (the received chains' blocks come last in every plan)
    assert results["on"]["loss"] == pytest.approx(results["off"]["loss"], rel=1e-6)
    assert_grads_close(results["on"]["grads"], results["off"]["grads"], rtol=1e-6)
    for a, b in zip(results["on"]["logprobs"], results["off"]["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_command_line_switch_reaches_the_config():
    from megatron_psrl.training.arguments import parse_args
    from megatron_psrl.training.trainer import actor_config_from_args

    base = ["--model", "debug-llama", "--data", "stepwise"]
    assert actor_config_from_args(parse_args(base), "float32").overlap_kv_exchange is True
    assert actor_config_from_args(parse_args(base + ["--no-overlap-kv-exchange"]), "float32").overlap_kv_exchange is False
