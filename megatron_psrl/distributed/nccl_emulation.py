"""NCCL's point-to-point semantics on gloo, so that CI on CPU catches what would hang on GPUs.

Set ``PSRL_EMULATE_NCCL=1``: :func:`install` (called by
:func:`~megatron_psrl.distributed.setup.initialize_parallel`) then gives every point-to-point
operation on a gloo process group of this process (``isend`` / ``irecv`` / ``send`` /
``recv``, ``batch_isend_irecv``, P2P inside ``_coalescing_manager``; the project's and
megatron-core's pipeline alike) the semantics it has under NCCL. Collectives keep gloo's.

Why: gloo matches a receive with the send of the same source and *tag*, whatever the order the
two sides posted them in, and runs every operation as soon as it is posted. NCCL does neither:

- **tags are ignored**: between two ranks, the n-th message one sends the other is the other's
  n-th receive from it;
- **per pair of ranks, operations run in the order they were posted**, one after the other (a
  pair's operations share one CUDA stream), and a send completes only when the peer's matching
  receive runs (a rendezvous). So a rank whose receive from a peer is queued ahead of its own
  send to that peer, while the peer's receive is likewise queued ahead of its send, hangs;
  on gloo the same program passes;
- **operations posted as one group** (``batch_isend_irecv``, a coalescing manager) run together:
  a group's sends and receives do not wait for each other. The group has one request
  (``batch_isend_irecv`` returns a list of one, as it does on NCCL).

How: every (process group, peer) pair gets a stream, a thread that runs the operations (or
groups) posted to that peer one at a time, in order. A message travels with a gloo tag made from
its sequence number on the pair (the caller's tag is dropped), and every received message is
acknowledged, a send completing only when its acknowledgement arrives. A request whose operation
is still queued after ``PSRL_EMULATE_NCCL_TIMEOUT`` seconds (default: the process group's timeout,
``--distributed-timeout-minutes``) raises :class:`~megatron_psrl.errors.CollectiveTimeoutError`
naming the operation, where it was posted, and what the pair's stream is blocked on: what NCCL
would do is hang there.

- **a group's first operation waits for every member**: NCCL creates a group's communicator
  lazily, at its first operation (unless the process group was bound to a device,
  ``init_process_group(device_id=...)``), and creating it blocks until every member of the group
  reaches a first operation on it. A rank whose first operation on a group is queued behind
  something that waits for a member still busy elsewhere (a collective on another group, a host
  read of a result) hangs. Under the emulation, every rank's first operation on a gloo group,
  point-to-point or collective, waits until all members have reached theirs (counted in the
  default store), and reports a hang past the timeout. ``initialize_parallel`` runs one
  collective on every group at start-up for that reason (``warm_up_groups``).

What it does not model: a real NCCL send of a few bytes may complete into the peer's buffer
before the peer's receive runs (the emulation is stricter: a rendezvous for every message). Host-side waits block (``work.wait()`` on NCCL only makes the compute stream
wait), which is equivalent here because an NCCL operation is ordered after the compute queued
before it was posted.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_psrl.errors import CollectiveTimeoutError

EMULATE_ENV = "PSRL_EMULATE_NCCL"
"""``1``: point-to-point operations on gloo process groups get NCCL's semantics (:func:`install`)."""

TIMEOUT_ENV = "PSRL_EMULATE_NCCL_TIMEOUT"
"""Seconds a request may wait before it is reported as a hang (default: the process group's timeout)."""

_PG = dist.ProcessGroup
_ORIGINAL = {"send": _PG.send, "recv": _PG.recv, "recv_anysource": _PG.recv_anysource,
             "batch_isend_irecv": dist.batch_isend_irecv, "_coalescing_manager": dist._coalescing_manager}
_COLLECTIVES = tuple(name for name in (
    "allreduce", "allreduce_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "allgather",
    "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "gather",
    "scatter", "barrier", "monitored_barrier") if hasattr(_PG, name))
"""The collectives of a process group whose first use the emulation gates (those this torch has)."""
_ORIGINAL.update({name: getattr(_PG, name) for name in _COLLECTIVES})
_FIRST_USE_KEY = "psrl-nccl-emulation-first-use/"
_TAG_SPACE = 1 << 30  # gloo takes 32-bit tags: sequence numbers wrap (far beyond any step)
_THREAD_GRACE_S = 2.0


def enabled() -> bool:
    """``PSRL_EMULATE_NCCL=1`` in the environment (read at every call)."""
    return os.environ.get(EMULATE_ENV) == "1"


class _Op:
    """One point-to-point operation as posted: a send or a receive of ``tensor`` with ``peer``."""

    __slots__ = ("is_send", "tensor", "peer", "where")

    def __init__(self, is_send: bool, tensor: torch.Tensor, peer: int, where: str):
        self.is_send, self.tensor, self.peer, self.where = is_send, tensor, peer, where

    def describe(self, pg) -> str:
        kind, way = ("isend", "to") if self.is_send else ("irecv", "from")
        return (f"{kind} {way} rank {_global(pg, self.peer)} ({tuple(self.tensor.shape)} "
                f"{str(self.tensor.dtype).replace('torch.', '')}, posted at {self.where})")


class EmulatedWork:
    """The request of a posted operation or group: done when all of its parts are done (the
    group's part on every peer's stream)."""

    def __init__(self, pg, ops: List[_Op], timeout_s: float):
        self.pg, self.ops, self.timeout_s = pg, ops, timeout_s
        self._lock = threading.Lock()
        self._left = len({op.peer for op in ops})
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.streams: List["_PairStream"] = []

    def _part_done(self, error: Optional[BaseException]) -> None:
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            if self._left <= 0 or error is not None:
                self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def wait(self, timeout=None) -> bool:
        seconds = self.timeout_s if timeout is None else getattr(timeout, "total_seconds", lambda: timeout)()
        if not self._done.wait(seconds):
            raise CollectiveTimeoutError(self._hang_message(seconds))
        if self._error is not None:
            raise RuntimeError(f"NCCL emulation: rank {dist.get_rank()}'s {self.describe()} failed: "
                               f"{self._error}") from self._error
        return True

    def describe(self) -> str:
        what = "; ".join(op.describe(self.pg) for op in self.ops)
        return f"group [{what}]" if len(self.ops) > 1 else what

    def _hang_message(self, seconds: float) -> str:
        blocked = []
        for stream in self.streams:
            running = stream.running
            if running is not None and running is not self:
                blocked.append(f"the stream of ranks {dist.get_rank()} and {_global(self.pg, stream.peer)} is "
                               f"blocked at {running.describe()}, posted ahead of it")
            elif running is self:
                blocked.append(f"rank {_global(self.pg, stream.peer)} has not run the matching operation: an "
                               "operation it posted ahead of it towards this rank may be waiting for this rank")
        return (f"NCCL emulation ({EMULATE_ENV}=1): rank {dist.get_rank()}'s {self.describe()} did not complete "
                f"within {seconds:g} s: under NCCL this hangs ({'; '.join(blocked) or 'never started'}). Between "
                "two ranks operations run one after the other in the order they were posted, tags do not count, "
                "and a send completes only when the peer's matching receive runs: post both sides' sends and "
                "receives as one group (batch_isend_irecv) or in the same order on both sides.")


class _PairStream:
    """The operations this rank posted to one peer of one process group, run one at a time."""

    def __init__(self, pg, peer: int):
        self.pg, self.peer = pg, peer
        self.sent = 0  # messages sent to the peer so far (the next one's sequence number)
        self.received = 0  # messages received from it
        self.running: Optional[EmulatedWork] = None
        self._items: "queue.SimpleQueue[Optional[EmulatedWork]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"nccl-emulation-peer{peer}", daemon=True)
        self._thread.start()

    def post(self, work: EmulatedWork) -> None:
        work.streams.append(self)
        self._items.put(work)

    def close(self) -> None:
        """End the thread once its queue is done (a hung operation ends a second after its
        request timed out: no thread may sit in gloo while the process exits)."""
        self._items.put(None)
        running = self.running
        self._thread.join(timeout=_THREAD_GRACE_S + (min(running.timeout_s, 10.0) if running is not None else 0.0))

    def _run(self) -> None:
        while True:
            work = self._items.get()
            if work is None:
                return
            self.running = work
            try:
                self._execute([op for op in work.ops if op.peer == self.peer], timedelta(seconds=work.timeout_s + 1.0))
                work._part_done(None)
            except BaseException as exc:  # the request reports it
                work._part_done(exc)
            self.running = None

    def _execute(self, ops: List[_Op], limit: timedelta) -> None:
        """Run one operation or one group's operations with this peer: all messages posted at
        once; a receive acknowledged once its data is here; a send done when acknowledged.
        ``limit``: gloo gives up then (a second after the request reported the hang)."""
        send, recv = _ORIGINAL["send"], _ORIGINAL["recv"]
        pending, received = [], []
        for op in ops:
            if op.is_send:
                seq, self.sent = self.sent, self.sent + 1
                ack = torch.zeros(1, dtype=torch.uint8)
                pending += [send(self.pg, [op.tensor], self.peer, _tag(seq, 0)), recv(self.pg, [ack], self.peer, _tag(seq, 1))]
            else:
                seq, self.received = self.received, self.received + 1
                received.append((seq, recv(self.pg, [op.tensor], self.peer, _tag(seq, 0))))
        for seq, work in received:
            work.wait(limit)
            pending.append(send(self.pg, [torch.ones(1, dtype=torch.uint8)], self.peer, _tag(seq, 1)))
        for work in pending:
            work.wait(limit)


def _tag(seq: int, ack: int) -> int:
    return 2 * (seq % _TAG_SPACE) + ack


def _global(pg, rank: int) -> int:
    try:
        return dist.get_global_rank(pg, rank)
    except (RuntimeError, ValueError):  # a group torch does not know by name: its own numbering
        return rank


def _call_site() -> str:
    """``file:line`` of the first frame outside torch.distributed and this module."""
    frame = sys._getframe(2)
    here = os.path.abspath(__file__)
    while frame is not None:
        name = frame.f_code.co_filename
        if os.path.abspath(name) != here and f"torch{os.sep}distributed" not in name and "contextlib" not in name:
            parts = name.split(os.sep)
            return f"{os.sep.join(parts[-3:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _Emulator:
    """The installed emulation: this process's pair streams and the groups being posted."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.streams: Dict[Tuple[int, int], _PairStream] = {}
        self.groups = threading.local()  # pg id -> the ops of the group being posted on this thread
        self._lock = threading.Lock()
        self.first_used: set = set()
        """Names of the groups this rank has reached a first operation on."""

    @staticmethod
    def is_gloo(pg) -> bool:
        try:
            return isinstance(pg._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
        except (RuntimeError, AttributeError):
            return False

    def first_use(self, pg, what: str) -> None:
        """NCCL's lazy communicator: this rank's first operation on ``pg`` waits until every
        member has reached a first operation on it (module docstring)."""
        name = getattr(pg, "group_name", None)
        if name is None or name in self.first_used or not self.is_gloo(pg):
            return
        self.first_used.add(name)
        store = dist.distributed_c10d._get_default_store()
        key = _FIRST_USE_KEY + name
        members = pg.size()
        store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        while store.add(key, 0) < members:
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"NCCL emulation ({EMULATE_ENV}=1): rank {dist.get_rank()}'s first operation on group "
                    f"{name!r} ({what}, posted at {_call_site()}) waited {self.timeout_s:g} s for the group's "
                    f"{members - store.add(key, 0)} other members to reach a first operation on it: under NCCL "
                    "this hangs (a group's communicator is created at its first operation, by every member "
                    "together). Create communicators eagerly: init_process_group(device_id=...) and one "
                    "collective per group at start-up (initialize_parallel does both).")
            time.sleep(0.005)

    def emulates(self, pg, tensor: torch.Tensor) -> bool:
        try:
            return isinstance(pg._get_backend(tensor.device), dist.ProcessGroupGloo)
        except RuntimeError:
            return False

    def p2p(self, pg, is_send: bool, tensors, peer: int, tag: int, original):
        if len(tensors) != 1 or not self.emulates(pg, tensors[0]):
            return original(pg, tensors, peer, tag)
        self.first_use(pg, "isend" if is_send else "irecv")
        op = _Op(is_send, tensors[0], int(peer), _call_site())
        group = getattr(self.groups, "open", {}).get(id(pg))
        if group is not None:  # posted with its group when the group closes
            group.ops.append(op)
            group.members.append(_GroupMember())
            return group.members[-1]
        return self.post(pg, [op])

    def post(self, pg, ops: List[_Op]) -> EmulatedWork:
        work = EmulatedWork(pg, ops, self.timeout_s)
        for peer in sorted({op.peer for op in ops}):
            with self._lock:
                key = (id(pg), peer)
                if key not in self.streams:
                    self.streams[key] = _PairStream(pg, peer)
                stream = self.streams[key]
            stream.post(work)
        return work

    @contextlib.contextmanager
    def grouped(self, pg):
        """Point-to-point operations on ``pg`` posted inside run as one group, posted at the end;
        yields the group (None when nested in an open group of ``pg``, which takes them)."""
        open_groups = self.groups.__dict__.setdefault("open", {})
        if id(pg) in open_groups:
            yield None
            return
        group = _OpenGroup()
        open_groups[id(pg)] = group
        try:
            yield group
        finally:
            del open_groups[id(pg)]
        if group.ops:
            group.work = self.post(pg, group.ops)
            for member in group.members:
                member.work = group.work

    def close(self) -> None:
        with self._lock:
            for stream in self.streams.values():
                stream.close()
            self.streams.clear()
            self.first_used.clear()  # (a new process group numbers its groups again)


class _OpenGroup:
    """A group being posted: its operations and the requests handed out for them."""

    def __init__(self):
        self.ops: List[_Op] = []
        self.members: List["_GroupMember"] = []
        self.work: Optional[EmulatedWork] = None


class _GroupMember:
    """What an operation posted inside a group returns: waiting on it waits for the group (as on
    NCCL, where the group has one request)."""

    work: Optional[EmulatedWork] = None

    def wait(self, timeout=None) -> bool:
        if self.work is None:
            raise RuntimeError("NCCL emulation: a request of a group was waited on before the group was posted")
        return self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()


_EMULATOR: List[_Emulator] = []


def install(timeout_s: Optional[float] = None) -> bool:
    """With ``PSRL_EMULATE_NCCL=1``, give gloo's point-to-point operations NCCL's semantics (the
    module docstring) in this process, from now on; idempotent. ``timeout_s``: how long a request
    may wait (``PSRL_EMULATE_NCCL_TIMEOUT`` overrides it). Returns whether it is installed."""
    if not enabled():
        return bool(_EMULATOR)
    seconds = float(os.environ.get(TIMEOUT_ENV) or timeout_s or 1800.0)
    if _EMULATOR:
        _EMULATOR[0].timeout_s = seconds
        return True
    emulator = _Emulator(seconds)
    _EMULATOR.append(emulator)

    def send(pg, tensors, dstRank, tag=0):
        return emulator.p2p(pg, True, tensors, dstRank, tag, _ORIGINAL["send"])

    def recv(pg, tensors, srcRank, tag=0):
        return emulator.p2p(pg, False, tensors, srcRank, tag, _ORIGINAL["recv"])

    def recv_anysource(pg, tensors, tag=0):
        if len(tensors) == 1 and emulator.emulates(pg, tensors[0]):
            raise RuntimeError(f"NCCL emulation ({EMULATE_ENV}=1): NCCL has no receive from any source "
                               f"(posted at {_call_site()})")
        return _ORIGINAL["recv_anysource"](pg, tensors, tag)

    def batch_isend_irecv(p2p_op_list):
        pg = p2p_op_list[0].group if p2p_op_list else None
        if pg is None or not emulator.emulates(pg, p2p_op_list[0].tensor):
            return _ORIGINAL["batch_isend_irecv"](p2p_op_list)
        with emulator.grouped(pg) as group:
            members = _ORIGINAL["batch_isend_irecv"](p2p_op_list)
        if group is None:  # inside an open group: it posts them
            return members
        return [group.work] if group.work is not None else []

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        with _ORIGINAL["_coalescing_manager"](group, device, async_ops) as cm:
            with emulator.grouped(pg) as p2p:
                yield cm
            if p2p is not None and p2p.work is not None:
                if async_ops:
                    cm.append(p2p.work)
                else:
                    p2p.work.wait()

    def gated(name):
        original = _ORIGINAL[name]

        def collective(pg, *args, **kwargs):
            emulator.first_use(pg, name)
            return original(pg, *args, **kwargs)

        return collective

    for name in _COLLECTIVES:
        setattr(_PG, name, gated(name))
    _PG.send, _PG.recv, _PG.recv_anysource = send, recv, recv_anysource
    for module in (dist, dist.distributed_c10d):
        module.batch_isend_irecv = batch_isend_irecv
        module._coalescing_manager = coalescing_manager
    return True


def uninstall() -> None:
    """Restore gloo's own point-to-point semantics (tests); the pair streams end."""
    if not _EMULATOR:
        return
    _EMULATOR.pop().close()
    _PG.send, _PG.recv, _PG.recv_anysource = _ORIGINAL["send"], _ORIGINAL["recv"], _ORIGINAL["recv_anysource"]
    for name in _COLLECTIVES:
        setattr(_PG, name, _ORIGINAL[name])
    for module in (dist, dist.distributed_c10d):
        module.batch_isend_irecv = _ORIGINAL["batch_isend_irecv"]
        module._coalescing_manager = _ORIGINAL["_coalescing_manager"]


def close_streams() -> None:
    """End the pair streams (the process groups are going away; the emulation stays installed)."""
    if _EMULATOR:
        _EMULATOR[0].close()
