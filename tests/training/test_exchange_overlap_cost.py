"""The planner charges only the exposed part of an overlapped prefix K/V exchange:
``max(0, exchange - overlappable)`` (``schedule/cost.py``), as the share the start-up calibration
measures (``MeasuredCosts.exchange_exposed_fraction``), and the whole exchange with
``--no-overlap-kv-exchange``."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine.calibration import MeasuredCosts, measure_exchange_overlap
from megatron_psrl.schedule.cost import exposed_exchange_cost, exposed_exchange_fraction


def test_exposed_exchange_cost_is_what_the_overlap_leaves():
    assert exposed_exchange_cost(3.0, 1.0) == 2.0
    assert exposed_exchange_cost(1.0, 3.0) == 0.0  # fully hidden
    np.testing.assert_array_equal(exposed_exchange_cost(np.array([3.0, 1.0]), np.array([1.0, 3.0])), [2.0, 0.0])
    assert exposed_exchange_fraction(4.0, 1.0) == 0.75
    assert exposed_exchange_fraction(4.0, 9.0) == 0.0
    assert exposed_exchange_fraction(4.0, -1.0) == 1.0  # overlapping can cost, the charge stays at most the exchange
    assert exposed_exchange_fraction(0.0, 1.0) == 1.0


def test_planner_settings_charge_the_exposed_share():
    costs = MeasuredCosts(1e-4, 1e-7, 2e-5, 5e-3, seconds_per_byte=1e-9, seconds_per_exchange=1e-4,
                          exchange_exposed_fraction=0.25)
    over = costs.planner_settings(num_layers=4, kv_bytes_per_token=256)
    sync = costs.planner_settings(num_layers=4, kv_bytes_per_token=256, overlap=False)
    assert sync["cost_per_exchange"] == pytest.approx(8 * 1e-4) and sync["cost_per_exchanged_byte"] == 1e-9
    assert over["cost_per_exchange"] == pytest.approx(0.25 * 8 * 1e-4)
    assert over["cost_per_exchanged_byte"] == pytest.approx(0.25 * 1e-9)
    off = MeasuredCosts(1e-4, 1e-7, 2e-5, 5e-3, seconds_per_byte=1e-9, seconds_per_exchange=1e-4,
                        exchange_exposed_fraction=0.25, overlap_kv_exchange=False)
    assert off.planner_settings(num_layers=4, kv_bytes_per_token=256) == sync
    # a profile stored before the overlap existed: nothing hidden
    assert MeasuredCosts(1e-4, 1e-7, 2e-5, 5e-3, seconds_per_exchange=1e-4).planner_settings(4, 256)[
        "cost_per_exchange"] == pytest.approx(8 * 1e-4)


def test_the_overlap_measurement_is_a_share():
    initialize_parallel(1, 1, seed=0, device="cpu")
    share = measure_exchange_overlap(dist.group.WORLD, 4, 2, 16, torch.float32, torch.device("cpu"), 128, 32,
                                     repeats=1)
    assert 0.0 <= share <= 1.0
