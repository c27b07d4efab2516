"""Run a Python script under ``torchrun`` (gloo on CPU) from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import List, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, args: Sequence[str] = (), nproc: int = 2, timeout: int = 600) -> str:
    """Run ``script`` with ``nproc`` ranks; returns combined output; raises with it on failure."""
    cmd: List[str] = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", script, *args,
    ]
    env = dict(os.environ)
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
