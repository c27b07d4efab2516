"""Name the collective that timed out and the rank it was waiting on.

Every collective gets ``--distributed-timeout-minutes`` (``init_process_group(timeout=...)``;
gloo raises on the waiting rank when it expires). A bare gloo timeout says only "Timed out
waiting 600000ms for recv operation", so every rank also publishes, in the job's c10d store:

- a heartbeat (a timestamp, refreshed by a daemon thread a few times per timeout), which
  stops when the process is stopped, dead or wedged;
- the phase it is in (``"gradient all-reduce (iteration 7)"``), set by :meth:`phase`.

When a collective fails inside :meth:`phase`, the failing rank reads every rank's heartbeat
and phase and raises :class:`~megatron_psrl.errors.CollectiveTimeoutError` naming the phase it
was in and the rank(s) it was waiting on: those whose heartbeat went stale (stopped or dead),
else those in another phase (still computing, or stuck elsewhere). Every rank that waits on
the stuck one ends the same way within the timeout; torchrun then stops the rest.

NCCL has its own watchdog (it aborts the process on a timeout); the phase names are still
published and appear in the heartbeat keys for post-mortem reading.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist

from megatron_psrl.errors import CollectiveTimeoutError
from megatron_psrl.options import DEFAULT_TIMEOUT_MINUTES

_KEY = "psrl_monitor/{kind}/{rank}"
_FAILURE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer")


def timeout_delta(minutes: float) -> timedelta:
    """``--distributed-timeout-minutes`` (fractions allowed) as a timedelta."""
    return timedelta(seconds=max(1.0, float(minutes) * 60.0))


def _is_collective_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _FAILURE_WORDS)


class CollectiveMonitor:
    """Heartbeat + phase publisher of one rank (see the module docstring)."""

    def __init__(self, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES):
        self.timeout_s = timeout_delta(timeout_minutes).total_seconds()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._store = None
        self._phase = "start-up"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self.world_size > 1:
            try:  # the store every rank of the job shares (torchrun's, or the init_method's)
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # pragma: no cover - private API moved: timeouts stay unnamed
                self._store = None
        if self._store is not None:
            self.interval_s = min(10.0, max(0.2, self.timeout_s / 8.0))
            self._publish("phase", self._phase)
            self._beat()
            self._thread = threading.Thread(target=self._run, name="psrl-heartbeat", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ publishing
    def _publish(self, kind: str, value: str) -> None:
        try:
            self._store.set(_KEY.format(kind=kind, rank=self.rank), value)
        except Exception:  # the store is gone (job ending): nothing left to tell
            pass

    def _beat(self) -> None:
        self._publish("heartbeat", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def close(self) -> None:
        """Stop the heartbeat (before the process group is destroyed and the store goes away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run a block of collectives under ``name``; a timeout inside names the peer."""
        previous = self._phase
        self._phase = name
        if self._store is not None:
            self._publish("phase", name)
        try:
            yield
        except CollectiveTimeoutError:
            raise  # named already by an inner phase
        except RuntimeError as exc:
            if self.world_size > 1 and _is_collective_failure(exc):
                raise CollectiveTimeoutError(self.describe_failure(name, exc)) from exc
            raise
        finally:
            self._phase = previous
            if self._store is not None:
                self._publish("phase", previous)

    # ------------------------------------------------------------------ diagnosis
    def _read_peers(self) -> Dict[int, Tuple[Optional[float], Optional[str]]]:
        """Every peer's last heartbeat and phase: one store round trip, bounded in time (the
        store host may be the one in trouble)."""
        peers: Dict[int, Tuple[Optional[float], Optional[str]]] = {
            r: (None, None) for r in range(self.world_size) if r != self.rank}
        if self._store is None:
            return peers
        keys = [_KEY.format(kind=kind, rank=r) for r in peers for kind in ("heartbeat", "phase")]
        try:
            self._store.set_timeout(timedelta(seconds=10))
            if not self._store.check(keys):  # a peer that died before publishing: ask one by one
                raise KeyError
            values = [v.decode() for v in self._store.multi_get(keys)]
            for i, r in enumerate(peers):
                peers[r] = (float(values[2 * i]), values[2 * i + 1])
        except Exception:
            for r in peers:
                try:
                    hb, ph = _KEY.format(kind="heartbeat", rank=r), _KEY.format(kind="phase", rank=r)
                    beat = float(self._store.get(hb).decode()) if self._store.check([hb]) else None
                    phase = self._store.get(ph).decode() if self._store.check([ph]) else None
                    peers[r] = (beat, phase)
                except Exception:
                    break  # the store does not answer: report what is known
        return peers

    def describe_failure(self, phase: str, exc: BaseException) -> str:
        """One line: which collective failed here, and which rank(s) it was waiting on."""
        stale_after = max(3.0 * getattr(self, "interval_s", 1.0), 2.0)
        if "time" not in str(exc).lower():
            # A peer closed the connection: it is dying now; give its heartbeat time to go stale.
            time.sleep(stale_after)
        now = time.time()
        peers = self._read_peers()
        stale: List[str] = []
        elsewhere: List[str] = []
        for r, (beat, peer_phase) in sorted(peers.items()):
            if beat is None or now - beat > stale_after:
                age = "never" if beat is None else f"{now - beat:.0f} s ago"
                stale.append(f"rank {r} (not responding: last heartbeat {age}, last phase {peer_phase!r})")
            elif peer_phase != phase:
                elsewhere.append(f"rank {r} (still in {peer_phase!r})")
        minutes = self.timeout_s / 60.0
        what = "timed out" if "time" in str(exc).lower() else "failed"
        head = f"collective in {phase!r} {what} on rank {self.rank} (--distributed-timeout-minutes {minutes:g})"
        if stale:
            return f"{head}; waiting on {', '.join(stale)}"
        if elsewhere:
            return f"{head}; waiting on {', '.join(elsewhere)}"
        detail = " ".join(str(exc).split())[:200]
        return f"{head}; every rank answers its heartbeat, so a peer may have failed first ({detail})"
