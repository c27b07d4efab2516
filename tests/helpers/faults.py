"""Fault-injection helpers: run an entry point in a subprocess and check that it failed the way
an operator needs (exit status, one line naming the file, nothing left behind)."""

import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List

from helpers.launch_pool import run_python
from helpers.output_capture import output_to
from helpers.torchrun import REPO_ROOT, script_env

TRAIN = os.path.join(REPO_ROOT, "pretrain_agent_rl.py")
TOOLS = os.path.join(REPO_ROOT, "tools")
SMALL = ["--model", "debug-llama", "--data", "grpo", "--micro-batch-tokens", "512", "--kv-cache-budget", "64MiB"]


def run(script: str, args: List[str], cwd, timeout: int = 300, here: bool = False) -> subprocess.CompletedProcess:
    """``python script args`` in ``cwd``: its exit status, stdout and stderr. ``here``: in this
    process instead (:func:`run_here`; ``timeout`` does not apply there)."""
    if here:
        return run_here(script, args, cwd)
    return run_python(script, args, env=script_env(), cwd=str(cwd), timeout=timeout)


def run_here(script: str, args: List[str], cwd) -> subprocess.CompletedProcess:
    """:func:`run` inside this process, without the seconds of imports a new process pays: the
    script runs as ``__main__`` with ``args`` in ``cwd``, everything it writes to stdout and
    stderr (Python's streams and file descriptors 1 and 2) is captured, and its exit status is
    what it passes to ``sys.exit`` (1 with a traceback for an exception it lets escape, as the
    interpreter would). For calls that end by themselves (no signals, no second process), one
    at a time: the entry points' own handler (``megatron_psrl.cli``) prints the error line and
    ends the process groups it started, so nothing is left for the next test."""
    saved = sys.argv, os.getcwd(), list(sys.path)
    environ = dict(os.environ)  # (--no-verify-checksums sets a variable for the processes it starts)
    code = 0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            with output_to(out.fileno(), err.fileno()):
                sys.argv = [script, *args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
                os.chdir(str(cwd))
                try:
                    runpy.run_path(script, run_name="__main__")
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except Exception:
                    traceback.print_exc()
                    code = 1
        finally:
            sys.argv, cwd_before, sys.path[:] = saved
            os.chdir(cwd_before)
            os.environ.clear()
            os.environ.update(environ)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([script, *args], code, out.read().decode("utf-8", "replace"),
                                           err.read().decode("utf-8", "replace"))


def train(args: List[str], cwd, timeout: int = 300, here: bool = False) -> subprocess.CompletedProcess:
    return run(TRAIN, args, cwd, timeout, here)


def tool(name: str, args: List[str], cwd, timeout: int = 300, here: bool = False) -> subprocess.CompletedProcess:
    return run(os.path.join(TOOLS, name), args, cwd, timeout, here)


def one_by_one(calls: Dict[str, Callable[[], subprocess.CompletedProcess]]) -> Dict[str, subprocess.CompletedProcess]:
    """``{name: call()}``, in turn: for calls run in this process (``here=True``)."""
    return {name: call() for name, call in calls.items()}


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
