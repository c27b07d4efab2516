"""``@pytest.mark.fresh_process``: run a test in a Python process of its own.

Tests that measure memory read process-wide figures (the C heap's bytes in use, the resident
set, the BLAS library's buffer pool): whatever earlier tests left in the process, and threads
they left running, move those figures, so such a test is only meaningful in a fresh process.
The marked test's item runs ``python -m pytest <its node id>`` in a process of its own (the
test's own fixtures are built there) and passes or fails with it; the child's output is shown
on failure. That process is a fork of the session's one-process launch pool
(``helpers/launch_pool.py``): a process that has imported torch, megatron-core and the package
and done nothing else, which is what a fresh interpreter is after its imports.
"""

from __future__ import annotations

import os

import pytest

from helpers.launch_pool import run_python

CHILD_ENV = "PSRL_FRESH_PROCESS_CHILD"
PYTEST_MAIN = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
TIMEOUT_S = 900


def run_in_fresh_process(item: pytest.Item) -> None:
    env = dict(os.environ, **{CHILD_ENV: item.nodeid})
    args = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", item.nodeid]
    proc = run_python(None, args, env=env, cwd=str(item.config.rootpath), timeout=TIMEOUT_S, code=PYTEST_MAIN)
    if proc.returncode != 0:
        pytest.fail(f"{item.nodeid} failed in its fresh process (exit {proc.returncode}):\n"
                    f"{(proc.stdout + proc.stderr)[-8000:]}", pytrace=False)


def is_fresh_child(item: pytest.Item) -> bool:
    return os.environ.get(CHILD_ENV) == item.nodeid
