"""Run a Python script under ``torchrun`` (gloo on CPU) from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, args: Sequence[str] = (), nproc: int = 2, timeout: int = 600,
                 env: Optional[Dict[str, str]] = None) -> str:
    """Run ``script`` with ``nproc`` ranks; returns combined output; raises with it on failure.
    ``env``: variables set for the launch on top of this process's environment."""
    cmd: List[str] = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", script, *args,
    ]
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.path.join(REPO_ROOT, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
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


CASES_DRIVER = os.path.join(REPO_ROOT, "tests", "helpers", "torchrun_cases.py")


def run_torchrun_cases(cases: Sequence[tuple], nproc: int = 2, timeout: int = 600,
                       env: Optional[Dict[str, str]] = None) -> Dict[str, tuple]:
    """Run ``cases`` (``(id, script, args)``) one after another in ONE ``torchrun`` launch of
    ``nproc`` ranks (tests/helpers/torchrun_cases.py): the imports and the start of the job are
    paid once. Returns ``{id: (failure, output)}``: ``output``, what every rank of the case
    wrote (stdout and stderr, rank by rank); ``failure``, None for a case that ran to its end,
    else the reason with the launch's output (for the case that failed, and for the cases
    after it, which did not run). ``timeout`` is per case; ``env`` as for :func:`run_torchrun`."""
    import json
    import shutil
    import tempfile

    logs = tempfile.mkdtemp(prefix="torchrun-cases-")
    spec = os.path.join(logs, "cases.json")
    with open(spec, "w") as f:
        json.dump([{"id": i, "script": s, "args": [str(a) for a in args], "log": os.path.join(logs, f"case{n}")}
                   for n, (i, s, args) in enumerate(cases)], f)
    try:
        try:
            output = run_torchrun(CASES_DRIVER, [spec], nproc=nproc, timeout=timeout * len(cases), env=env)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            output = str(e)
        outcomes, failed = {}, None
        for n, (case_id, _, _) in enumerate(cases):
            case_output = ""
            for r in range(nproc):
                path = os.path.join(logs, f"case{n}.rank{r}")
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        case_output += f.read()
            if all(os.path.exists(os.path.join(logs, f"case{n}.done.rank{r}")) for r in range(nproc)):
                failure = None
            elif failed is None:
                failed = case_id
                failure = (f"case {case_id} failed in its shared torchrun launch; its output:\n{case_output[-6000:]}\n"
                           f"the launch's output (end):\n{output[-3000:]}")
            else:
                failure = f"case {case_id} did not run: case {failed} failed before it in the same launch"
            outcomes[case_id] = failure, case_output
        return outcomes
    finally:
        shutil.rmtree(logs, ignore_errors=True)


class SharedLaunches:
    """Test cases that share torchrun launches: ``add(id, nproc, script, make_args)`` registers
    a case (``make_args()`` builds its arguments just before the launch); ``check(id)`` runs,
    the first time any case of a group is asked for, every case of that group (the cases with
    the same ``nproc``, or the same ``group`` name) that ``wanted`` holds in one launch, in the
    order they were added (a case may use what an earlier one saved), raises the case's failure,
    if it had one, and returns its output (as ``run_torchrun`` does, for that case alone).

    ``wanted``: the ids of the cases this pytest session will ask for (see
    :func:`selected_test_names`); the others are not run."""

    def __init__(self, wanted=None):
        self.wanted = wanted
        self._cases: Dict[str, tuple] = {}
        self._outcomes: Dict[str, tuple] = {}

    def add(self, case_id: str, nproc: int, script: str, make_args, group=None, env=None) -> None:
        """``env``: variables the launch sets (the cases of one launch must agree on them)."""
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
