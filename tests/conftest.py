"""Shared pytest setup: helpers importable as ``helpers.*``, quiet megatron import warnings,
every step plan checked, the ``fresh_process`` marker (tests/helpers/fresh_process.py), and no
launch (torchrun, a launch pool) from a test not marked slow."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every step plan the suite makes (here and in the torchrun scripts it starts, which inherit
# the environment) is checked against the plan's invariants when it is made
# (megatron_psrl/schedule/check.py, ``check_plan``).
os.environ.setdefault("PSRL_CHECK_PLANS", "1")

from helpers import launch_pool  # noqa: E402
from helpers.fresh_process import is_fresh_child, run_in_fresh_process  # noqa: E402
from helpers.launch_pool import starts_summary  # noqa: E402
from helpers.reference_cache import CACHE_ENV  # noqa: E402

# Per-sample references are computed once per session (helpers/reference_cache.py): every rank
# of a torchrun job and every case of a shared launch on the same model and batch share one.
if CACHE_ENV not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="psrl-references-")
    atexit.register(shutil.rmtree, os.environ[CACHE_ENV], True)

from megatron_psrl.compat import quiet_expected_import_warnings  # noqa: E402

quiet_expected_import_warnings()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects: a fresh-process test counts as slow
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("fresh_process"):
            continue
        item.add_marker(pytest.mark.slow)  # a process of its own: seconds of imports
        if not is_fresh_child(item):
            # It runs, fixtures included, in its child process; here it only waits on it.
            item.setup = lambda: None
            item.runtest = lambda item=item: run_in_fresh_process(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Set before the test's fixtures: a fixture that launches counts as the test launching.
    launch_pool.FAST_TEST = None if item.get_closest_marker("slow") else item.nodeid
    try:
        yield
    finally:
        launch_pool.FAST_TEST = None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # pytest-randomly names its seed in the header, which -q hides: name it at the end too,
    # so that any run's order can be replayed (README, "Testing").
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"test order: random, replay with --randomly-seed={seed}")
    pools = starts_summary()
    if pools:
        terminalreporter.write_line(pools)
