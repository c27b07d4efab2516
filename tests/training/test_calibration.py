"""The start-up cost calibration: positive constants that predict a pack they were not fitted
on, stored in a profile and reused (the same numbers every run, no second measurement)."""

import json

import numpy as np
import pytest
import torch

from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine import calibration
from megatron_psrl.engine.calibration import MeasuredCosts, calibrate
from megatron_psrl.model import tiny_config
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.builder import build_model


@pytest.fixture(scope="module")
def model():
    initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
    return arch, build_model(arch)


def test_measured_constants_are_the_planners_units(model):
    """(How well they predict is a benchmark, benchmarks/bench_cross_rank.py --predict, not a test.)"""
    arch, m = model
    costs = calibrate(m, arch.vocab_size, torch.device("cpu"), 512)
    assert costs.seconds_per_token > 0 and costs.seconds_per_key > 0 and costs.seconds_per_micro_batch >= 0
    cm = costs.cost_model()
    assert cm.linear_flops_per_token == costs.seconds_per_token  # the planner's units become seconds
    settings = costs.planner_settings(num_layers=2, kv_bytes_per_token=256)
    assert settings["cost_per_exchange"] == 4 * costs.seconds_per_exchange  # one all-to-all per layer, fwd + bwd


def test_profile_is_written_and_reused(model, tmp_path, monkeypatch):
    arch, m = model
    profile = tmp_path / "costs.json"
    first = calibrate(m, arch.vocab_size, torch.device("cpu"), 256, profile=str(profile), key="debug")
    assert json.loads(profile.read_text())["key"] == "debug"

    def no_measuring(*args, **kwargs):
        raise AssertionError("the stored profile should have been used")

    monkeypatch.setattr(calibration, "measure_compute", no_measuring)
    again = calibrate(m, arch.vocab_size, torch.device("cpu"), 256, profile=str(profile), key="debug")
    assert again == first
    with pytest.raises(AssertionError, match="stored profile"):  # another key measures again
        calibrate(m, arch.vocab_size, torch.device("cpu"), 256, profile=str(profile), key="other")


def test_predict_is_linear_in_its_parts():
    costs = MeasuredCosts(1e-4, 1e-7, 2e-5, 5e-3)
    a = costs.predict(100, 1000, 10)
    assert a == pytest.approx(1e-2 + 1e-4 + 2e-4 + 5e-3)
    assert np.isclose(costs.predict(200, 2000, 20, micro_batches=2), 2 * a)


def test_a_malformed_cost_record_is_one_line_naming_its_file(tmp_path):
    """A checkpoint's (or profile's) record round-trips; a malformed one is refused in one line
    naming the file, before any plan is made with it."""
    from megatron_psrl.errors import CheckpointError

    costs = MeasuredCosts(1e-4, 1e-7, 2e-5, 5e-3, seconds_per_byte=1e-9, key="k")
    assert MeasuredCosts.from_record(json.loads(json.dumps(costs.to_record())), "x.json") == costs
    path = str(tmp_path / "psrl_cost_calibration.json")
    for record, reason in ((["not", "a", "dict"], "expected a JSON object"),
                           (dict(costs.to_record(), seconds_per_tokn=1.0), "unknown field"),
                           ({"key": "k"}, "missing"),
                           (dict(costs.to_record(), seconds_per_key=float("nan")), "finite number")):
        with pytest.raises(CheckpointError, match=f"^{path}: not a cost calibration record: .*{reason}") as info:
            MeasuredCosts.from_record(record, path)
        assert "\n" not in str(info.value)
