"""Launch pools: the test session's multi-rank (and one-process) jobs share pre-imported ranks.

Every ``torchrun`` launch of a test script used to pay Python's, torch's, megatron-core's and the
package's imports on every rank: 13 s for two ranks, 25 s for four, on this project's 2-core
machine, for about thirty launches a session. A pool is ONE launch of ``nproc`` ranks per world
size for the whole session (``helpers/pool_worker.py``): each rank imports once, then forks a
child per case that runs the case's script as ``__main__``. A forked child starts from the state
right after the imports, so cases are as independent as separate launches were (no process
group, patched class or grown heap carried over), and each case makes its own process group
on a port of its own.

What a pool does not give, and what keeps its own launch (``pooled=False``): the behaviour of
``torchrun``'s agent itself (restarts, a killed or hung worker, the agent's exit code and
messages: tests/reliability). A case runs in a pool started with its own environment (one pool
per distinct environment; the last used are kept, up to ``MAX_POOL_RANKS`` ranks in all), so
what is read at import time is what the case asked for. ``PSRL_TEST_NO_POOL=1`` turns pools off (a launch per case).

A case of several ranks that fails (a rank's non-zero exit, a time-out) ends its pool, so a rank
still waiting in a collective for the failed one cannot hang the next case; the next case
starts a new pool.

A one-process pool (:func:`run_python`) stands in for ``subprocess.run([python, script])``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO_ROOT, "tests", "helpers", "pool_worker.py")
NO_POOL_ENV = "PSRL_TEST_NO_POOL"
# set per test by pytest, or per case by the pool: not a reason to start a pool anew
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "PSRL_FRESH_PROCESS_CHILD")
FAILED_RANK_GRACE_S = 5.0  # after one rank fails, how long the others get to end on their own
POLL_S = 0.02


FAST_TEST: Optional[str] = None
"""The node id of the running test when it is not marked slow (set by tests/conftest.py), else
None: the fast subset (``-m "not slow"``) is meant to start no process that pays the imports,
so a launch from such a test is refused (:func:`refuse_in_fast_test`) instead of quietly
costing its seconds."""


def refuse_in_fast_test(what: str) -> None:
    """Raise if the running test is not marked slow: starting ``what`` belongs to slow tests."""
    if FAST_TEST is not None:
        raise AssertionError(f"{FAST_TEST} starts {what} but is not marked slow: mark it "
                             f"@pytest.mark.slow (the fast subset, -m \"not slow\", starts no launch)")


def pools_enabled() -> bool:
    return os.environ.get(NO_POOL_ENV, "") in ("", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_key(env: Dict[str, str]) -> Tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV))


class CaseOutcome:
    """What one case of a pool did: ``ok``; ``output``, every rank's stdout and stderr, rank by
    rank (``(stdout, stderr)`` when asked for apart); ``reason``, why it failed (None when ok);
    ``returncode``, the first non-zero exit code of a rank (None when none ended)."""

    def __init__(self, ok: bool, output, reason: Optional[str], timed_out: bool = False,
                 returncode: Optional[int] = None):
        self.ok, self.output, self.reason, self.timed_out = ok, output, reason, timed_out
        self.returncode = returncode


class LaunchPool:
    """``nproc`` pre-imported ranks under one ``torchrun`` launch (``torchrun=False``: one plain
    Python process, for scripts run without torchrun)."""

    def __init__(self, nproc: int, env: Dict[str, str], torchrun: bool = True):
        self.nproc, self.torchrun, self.env_key = nproc, torchrun, _env_key(env)
        self.dir = tempfile.mkdtemp(prefix=f"launch-pool-{nproc}-")
        self.cases = 0
        if torchrun:
            cmd: List[str] = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                              "--master_addr=127.0.0.1", f"--master_port={free_port()}", WORKER, self.dir,
                              str(os.getpid())]
        else:
            cmd = [sys.executable, WORKER, self.dir, str(os.getpid())]
        self._log = open(os.path.join(self.dir, "launch.log"), "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, script: Optional[str], args: Sequence[str], env: Dict[str, str], timeout: float,
            cwd: str = REPO_ROOT, code: Optional[str] = None, split: bool = False) -> CaseOutcome:
        """Runs ``script`` (or ``code``, as ``python -c``) with ``args`` on every rank."""
        k, self.cases = self.cases, self.cases + 1
        log = os.path.join(self.dir, f"case{k}")
        request = dict(script=script, code=code, args=[str(a) for a in args], env=env, cwd=str(cwd), log=log,
                       split=split)
        if self.torchrun:
            request["port"] = free_port()
        path = os.path.join(self.dir, f"req{k}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(request, f)
        os.replace(path + ".tmp", path)
        codes = self._wait(k, timeout)
        output = self._output(log)
        if split:
            output = (output, self._output(log + ".err"))
        if len(codes) == self.nproc and not any(codes.values()):
            return CaseOutcome(True, output, None, returncode=0)
        if self._timed_out:
            reason = f"timed out after {timeout:.0f} s"
        elif self._died and not codes:
            reason = f"the pool's launch ended:\n{self._launch_log()[-3000:]}"
        else:
            missing = sorted(set(range(self.nproc)) - set(codes))
            reason = f"exit codes by rank: {codes}" + (f"; ranks {missing} did not end" if missing else "")
        if self.nproc > 1 or self._timed_out or self._died:
            self.close()  # a rank may still wait in a collective for the failed one
        return CaseOutcome(False, output, reason, timed_out=self._timed_out,
                           returncode=next((c for c in codes.values() if c), None))

    def _wait(self, k: int, timeout: float) -> Dict[int, int]:
        codes: Dict[int, int] = {}
        deadline, failed_at = time.monotonic() + timeout, None
        self._timed_out = self._died = False
        while len(codes) < self.nproc:
            for r in range(self.nproc):
                path = os.path.join(self.dir, f"req{k}.exit.rank{r}")
                if r not in codes and os.path.exists(path):
                    with open(path) as f:
                        codes[r] = int(f.read())
            if len(codes) == self.nproc:
                break
            now = time.monotonic()
            if any(codes.values()):
                failed_at = failed_at or now
                if now - failed_at > FAILED_RANK_GRACE_S:
                    break
            if not self.alive():
                self._died = True
                break
            if now > deadline:
                self._timed_out = True
                break
            time.sleep(POLL_S)
        return codes

    def _output(self, log: str) -> str:
        out = ""
        for r in range(self.nproc):
            path = f"{log}.rank{r}"
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out += f.read()
        return out

    def _launch_log(self) -> str:
        self._log.flush()
        with open(os.path.join(self.dir, "launch.log"), errors="replace") as f:
            return f.read()

    def close(self) -> None:
        if self.alive():
            open(os.path.join(self.dir, "stop"), "w").close()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# Ranks kept started at once, over all pools (each holds its imports: ~430 MB resident, much
# of it torch's shared libraries). Enough for every pool a session uses (one- to four-rank
# launches, a few environments): in random order, a smaller limit restarted pools over and over.
MAX_POOL_RANKS = 20
_POOLS: Dict[Tuple, LaunchPool] = {}  # in order of last use
STARTS: List[Tuple[int, bool, str]] = []  # (nproc, torchrun, why) of every pool the session started
_CLOSED: set = set()  # keys of pools closed before the session's end (evicted, failed or died)


def pool_for(nproc: int, env: Dict[str, str], torchrun: bool = True) -> LaunchPool:
    """The session's pool of ``nproc`` ranks for ``env`` (started, or restarted, as needed)."""
    refuse_in_fast_test(f"a launch pool ({nproc} {'ranks' if torchrun else 'process'})")
    key = (nproc, torchrun, _env_key(env))
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
        _CLOSED.add(key)
    if pool is None:
        while _POOLS and sum(p.nproc for p in _POOLS.values()) + nproc > MAX_POOL_RANKS:
            evicted = next(iter(_POOLS))
            _POOLS.pop(evicted).close()
            _CLOSED.add(evicted)
        STARTS.append((nproc, torchrun, "again" if key in _CLOSED else "new"))
        pool = LaunchPool(nproc, env, torchrun)
    _POOLS[key] = pool
    return pool


def starts_summary() -> str:
    """One line on the session's pools: how many started, by size, and how many of them were
    started again after an eviction or a failure (each start costs the ranks' imports)."""
    if not STARTS:
        return ""
    sizes: Dict[str, int] = {}
    for nproc, torchrun, _ in STARTS:
        name = f"{nproc} rank{'s' if nproc > 1 else ''}" if torchrun else "1 process"
        sizes[name] = sizes.get(name, 0) + 1
    again = sum(why == "again" for *_, why in STARTS)
    return (f"launch pools: {len(STARTS)} started ({', '.join(f'{n} x {k}' for k, n in sorted(sizes.items()))}), "
            f"{again} of them started again after an eviction or a failure")


@atexit.register
def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_python(script: Optional[str], args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
               cwd: str = REPO_ROOT, timeout: float = 900, code: Optional[str] = None,
               check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], capture_output=True, text=True)`` (or
    ``python -c code``), in the session's one-process pool: the child is a fork of a process
    that has done the imports and nothing else, so it starts as a fresh interpreter would after
    them (what memory-measuring scripts need), without paying them. Raises
    ``subprocess.TimeoutExpired`` on time-out; with ``check``, ``CalledProcessError``."""
    refuse_in_fast_test(f"a Python process ({script or 'python -c'})")
    env = dict(os.environ if env is None else env)
    argv = [sys.executable] + ([script] if script else ["-c", code]) + [str(a) for a in args]
    if not pools_enabled():
        return subprocess.run(argv, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout,
                              check=check)
    outcome = pool_for(1, env, torchrun=False).run(script, args, env, timeout, cwd=cwd, code=code, split=True)
    stdout, stderr = outcome.output
    if outcome.timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    returncode = 0 if outcome.ok else (outcome.returncode if outcome.returncode is not None else -9)
    if not outcome.ok and outcome.returncode is None:
        stderr += f"\n[launch pool] {outcome.reason}"
    if check and returncode:
        raise subprocess.CalledProcessError(returncode, argv, stdout, stderr)
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
