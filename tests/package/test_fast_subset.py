"""The fast subset (``-m "not slow"``) starts no torchrun and no launch pool: a test not marked
slow that launches one fails, naming itself (tests/conftest.py, ``helpers.launch_pool``)."""

import pytest
from helpers import launch_pool
from helpers.launch_pool import run_python
from helpers.torchrun import run_torchrun


def test_a_test_not_marked_slow_may_not_launch(request):
    assert launch_pool.FAST_TEST == request.node.nodeid
    with pytest.raises(AssertionError, match=r"test_a_test_not_marked_slow_may_not_launch starts a Python process "
                                             r".* not marked slow"):
        run_python(None, code="pass")
    with pytest.raises(AssertionError, match=r"starts torchrun \(x\.py, 2 ranks\) but is not marked slow"):
        run_torchrun("x.py", nproc=2)
    with pytest.raises(AssertionError, match="starts a launch pool"):
        launch_pool.pool_for(1, {}, torchrun=False)


@pytest.mark.slow  # (instant: it only reads the flag a slow test gets)
def test_a_slow_test_may_launch():
    assert launch_pool.FAST_TEST is None
