"""Fixtures of the fault-injection tests."""

import subprocess
import sys

import pytest


@pytest.fixture
def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
