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


def _calls_in(tree, name):
    """Functions (by name) of ``tree`` that reference ``name`` (an attribute chain like ``time.perf_counter``)."""
    import ast

    found = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and ast.unparse(node) == name:
                    found.add(fn.name)
    return found


def test_the_calibration_has_one_clock_and_one_drain():
    """Every time the calibration takes goes through ``timed_seconds``: the module reads the
    clock there only, and drains the device (``torch.cuda.synchronize``) in ``drain`` only,
    which ``timed_seconds`` calls before starting and before stopping the clock."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(calibration))
    assert _calls_in(tree, "time.perf_counter") == {"timed_seconds"}
    assert _calls_in(tree, "time.time") == set() and _calls_in(tree, "time.monotonic") == set()
    assert _calls_in(tree, "torch.cuda.synchronize") == {"drain"}
    assert [n.func.id for n in ast.walk(ast.parse(inspect.getsource(calibration.timed_seconds)))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)] == ["drain", "fn", "drain"]


def _counting(monkeypatch):
    """Count the calls of ``timed_seconds`` and of ``drain`` (the real ones still run)."""
    counts = {"timed": 0, "drain": 0}
    real_timed, real_drain = calibration.timed_seconds, calibration.drain

    def timed(fn, device=None):
        counts["timed"] += 1
        assert device is not None, "a measurement that does not name its device cannot drain it"
        return real_timed(fn, device)

    def drain(device):
        counts["drain"] += 1
        real_drain(device)

    monkeypatch.setattr(calibration, "timed_seconds", timed)
    monkeypatch.setattr(calibration, "drain", drain)
    return counts


def test_every_measurement_is_timed_by_the_helper(model, monkeypatch):
    """The compute fit and the overlap measurement: every timed call is one ``timed_seconds``
    naming the device, which drains it twice (patched, counted; CPU: draining does nothing)."""
    import torch.distributed as dist

    arch, m = model
    counts = _counting(monkeypatch)
    calibration.measure_compute(m, arch.vocab_size, torch.device("cpu"), 128, repeats=2)
    assert counts == {"timed": 5 * (1 + 2), "drain": 2 * 5 * (1 + 2)}  # 5 packs, a warm-up and 2 repeats each
    counts.update(timed=0, drain=0)
    share = calibration.measure_exchange_overlap(dist.group.WORLD, 4, 2, 16, torch.float32, torch.device("cpu"),
                                                 64, 16, repeats=1)
    assert 0.0 <= share <= 1.0 and counts == {"timed": 3 * 2, "drain": 2 * 3 * 2}  # exchange, attention, both


def test_a_backend_that_does_not_overlap_is_charged_the_whole_exchange(monkeypatch):
    """flash / te / dense wait for the received rows: no overlap is measured for them and the
    planner charges the whole exchange, whatever ``--overlap-kv-exchange`` says; the torch
    backend's measured share stays in force."""
    import types

    import torch.distributed as dist

    counts = _counting(monkeypatch)
    for backend in ("flash", "te", "dense"):
        assert calibration.measure_exchange_overlap(dist.group.WORLD, 4, 2, 16, torch.float32, torch.device("cpu"),
                                                    64, 16, repeats=1, backend=backend) == 1.0
    assert counts["timed"] == 0
    arch = types.SimpleNamespace(model_type="llama", hidden_size=64, num_layers=2, num_attention_heads=4,
                                 num_kv_heads=2)
    geometry = types.SimpleNamespace(dtype="float32", num_groups=2, head_dim=16, num_layers=2, bytes_per_token=256)
    for backend, overlapped in (("torch", True), ("flash", False), ("te", False)):
        key = calibration.planning_key(arch, geometry, torch.device("cpu"), 1, backend)
        recorded = MeasuredCosts(1e-4, 1e-7, 2e-5, 5e-3, seconds_per_byte=1e-9, seconds_per_exchange=1e-4,
                                 exchange_exposed_fraction=0.25, key=key)
        costs, origin = calibration.calibrate_for_planning(None, arch, geometry, torch.device("cpu"), 256, None,
                                                           recorded=recorded, backend=backend)
        assert origin == "checkpoint" and costs.overlap_kv_exchange is overlapped, backend
        settings = costs.planner_settings(num_layers=2, kv_bytes_per_token=256)
        assert settings["cost_per_exchange"] == pytest.approx((0.25 if overlapped else 1.0) * 4 * 1e-4), backend
