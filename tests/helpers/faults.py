"""Fault-injection helpers: run an entry point in a subprocess and check that it failed the way
an operator needs (exit status, one line naming the file, nothing left behind)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List

from helpers.torchrun import REPO_ROOT, script_env

TRAIN = os.path.join(REPO_ROOT, "pretrain_agent_rl.py")
TOOLS = os.path.join(REPO_ROOT, "tools")
SMALL = ["--model", "debug-llama", "--data", "grpo", "--micro-batch-tokens", "512", "--kv-cache-budget", "64MiB"]


def run(script: str, args: List[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=str(cwd), env=script_env(), capture_output=True,
                          text=True, timeout=timeout)


def train(args: List[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    return run(TRAIN, args, cwd, timeout)


def tool(name: str, args: List[str], cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    return run(os.path.join(TOOLS, name), args, cwd, timeout)


def concurrently(calls: Dict[str, Callable[[], subprocess.CompletedProcess]]) -> Dict[str, subprocess.CompletedProcess]:
    """``{name: call()}`` for independent calls of :func:`train` / :func:`tool` (each starts a
    process of its own), run at the same time: their seconds of imports overlap."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def error_line(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    """The one ``error:`` line of a user-facing failure (no traceback)."""
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    return lines[0]


def leftovers(directory) -> List[str]:
    """Temporaries of a save or a conversion left in ``directory`` (recursively)."""
    found = []
    for root, dirs, files in os.walk(directory):
        found += [os.path.join(root, n) for n in dirs + files if ".tmp-" in n or ".old-" in n]
    return found


def without_checksums(it_dir) -> None:
    """Remove an iteration folder's ``checksums.sha256``, as in a checkpoint written before
    checksums were recorded: the readers' own checks of a file's content then run (with the
    list in place, any edit is a checksum mismatch first)."""
    os.remove(os.path.join(str(it_dir), "checksums.sha256"))


def flip_bytes(path) -> None:
    """Invert 64 bytes in the middle of a file (silent corruption: size and name unchanged)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(64)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def truncate_half(path) -> None:
    """Cut a file to half its size (an interrupted copy)."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def empty_file(path) -> None:
    """Leave a file with 0 bytes."""
    open(path, "wb").close()
