"""Run a Python script under ``torchrun`` (gloo on CPU) from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from helpers.launch_pool import pool_for, pools_enabled, refuse_in_fast_test

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_env(extra: Optional[Dict[str, str]] = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.path.join(REPO_ROOT, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_torchrun(script: str, args: Sequence[str] = (), nproc: int = 2, timeout: int = 600,
                 pooled: bool = True, env: Optional[Dict[str, str]] = None) -> str:
    """Run ``script`` with ``nproc`` ranks; returns combined output; raises with it on failure.
    ``env``: variables set for the case on top of this process's environment (a pool started
    with them runs it).

    By default the case runs in the session's launch pool of ``nproc`` ranks
    (:mod:`helpers.launch_pool`: imports paid once per session, a forked child per case, the
    output rank by rank); ``pooled=False`` (or ``PSRL_TEST_NO_POOL=1``) starts a launch of its
    own, for what tests ``torchrun`` itself."""
    refuse_in_fast_test(f"torchrun ({os.path.basename(script)}, {nproc} ranks)")
    env = _launch_env(env)
    if pooled and pools_enabled():
        outcome = pool_for(nproc, env).run(script, args, env, timeout)
        if outcome.timed_out:
            raise subprocess.TimeoutExpired([script, *map(str, args)], timeout, output=outcome.output)
        if not outcome.ok:
            raise AssertionError(f"torchrun {script} failed ({outcome.reason}):\n{outcome.output[-6000:]}")
        return outcome.output
    cmd: List[str] = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", script, *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({proc.returncode}):\n{output[-6000:]}")
    return output


def script_env() -> dict:
    """Environment for a subprocess that imports the repository and its test helpers (and
    finds this interpreter's ``torchrun`` first, even when its venv is not activated)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.path.join(REPO_ROOT, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def free_port() -> int:
    return _free_port()


def worker_pids(agent_pid: int) -> dict:
    """``{rank: pid}`` of the worker processes a torchrun agent started (read from /proc)."""
    workers = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            workers[int(env[b"RANK"])] = int(entry)
    return workers


def run_torchrun_cases(cases: Sequence[tuple], nproc: int = 2, timeout: int = 600,
                       env: Optional[Dict[str, str]] = None) -> Dict[str, tuple]:
    """Run ``cases`` (``(id, script, args)``) one after another with ``nproc`` ranks (in the
    session's launch pool: each case a fresh fork of pre-imported ranks). Returns
    ``{id: (failure, output)}``: ``output``, what every rank of the case wrote (stdout and
    stderr, rank by rank); ``failure``, None for a case that ran to its end, else the reason
    with the output (for the case that failed; the cases after it do not run, since a case may
    use what an earlier one saved). ``timeout`` is per case."""
    outcomes, failed = {}, None
    for case_id, script, args in cases:
        if failed is not None:
            outcomes[case_id] = f"case {case_id} did not run: case {failed} failed before it", ""
            continue
        try:
            outcomes[case_id] = None, run_torchrun(script, args, nproc=nproc, timeout=timeout, env=env)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            failed = case_id
            output = e.output if isinstance(e, subprocess.TimeoutExpired) else str(e)
            outcomes[case_id] = f"case {case_id} failed:\n{str(output)[-8000:]}", str(output)
    return outcomes


class SharedLaunches:
    """A module's torchrun cases, run as a group: ``add(id, nproc, script, make_args)`` registers
    a case (``make_args()`` builds its arguments just before it runs); ``check(id)`` runs, the
    first time any case of a group is asked for, every case of that group (the cases with the
    same ``nproc``, or the same ``group`` name) that ``wanted`` holds, one after another in the
    session's launch pool, in the order they were added (a case may use what an earlier one
    saved), raises the case's failure, if it had one, and returns its output (as
    ``run_torchrun`` does, for that case alone).

    ``wanted``: the ids of the cases this pytest session will ask for (see
    :func:`selected_test_names`); the others are not run."""

    def __init__(self, wanted=None):
        self.wanted = wanted
        self._cases: Dict[str, tuple] = {}
        self._outcomes: Dict[str, tuple] = {}

    def add(self, case_id: str, nproc: int, script: str, make_args, group=None, env=None) -> None:
        """``env``: variables the case's ranks get (the cases of one group must agree on them)."""
        self._cases[case_id] = (nproc, group if group is not None else nproc, script, make_args, env)

    def check(self, case_id: str) -> str:
        """Raises the case's failure; returns its output (every rank's stdout and stderr)."""
        if case_id not in self._outcomes:
            # a test asked for a case its fixture did not foresee: fix the fixture's ``wanted``
            # (else every such case would start a launch of its own)
            assert self.wanted is None or case_id in self.wanted, f"{case_id!r} is not in wanted: {self.wanted}"
            nproc, group = self._cases[case_id][:2]
            ids = [i for i, c in self._cases.items() if c[1] == group
                   and (i == case_id or self.wanted is None or i in self.wanted)]
            cases = []
            for i in ids:
                try:
                    cases.append((i, self._cases[i][2], self._cases[i][3]()))
                except Exception:  # that case fails, with what went wrong; the others run
                    import traceback

                    self._outcomes[i] = f"preparing case {i} failed:\n{traceback.format_exc()}", ""
            if cases:
                self._outcomes.update(run_torchrun_cases(cases, nproc=nproc, env=self._cases[case_id][4]))
        failure, output = self._outcomes[case_id]
        if failure is not None:
            raise AssertionError(failure)
        return output


def selected_test_names(request) -> set:
    """Names (``test_x[param]``) of the tests of ``request``'s module this session runs."""
    module = request.node.path if hasattr(request.node, "path") else None
    return {item.name for item in request.session.items if getattr(item, "path", None) == module}
