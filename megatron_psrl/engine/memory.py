"""Peak memory of a block of work, measured (not estimated).

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
- CPU: torch's CPU allocator takes its memory from the C heap, so the bytes the heap has handed
  out (glibc ``mallinfo2``: ``uordblks + hblkhd``) are the process's live allocations, tensors
  included. Two ways to watch that figure:

  - ``ops`` (exact): a ``TorchDispatchMode`` reads it after every torch operation (forward and
    backward), which is where new peaks happen; costs a few microseconds per operation (used
    by tests and benchmarks);
  - ``sampled`` (cheap, the training default): a background thread reads it every millisecond;
    it can miss a peak shorter than that.

  Without glibc it falls back to the peak resident set size of the process (``ru_maxrss``),
  which never decreases.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import threading
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import MEMORY_TRACKING


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _load_mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _load_mallinfo2()


def heap_bytes_in_use() -> Optional[int]:
    """Bytes currently allocated from the C heap (None where mallinfo2 is unavailable)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class _HeapPeakMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.peak = heap_bytes_in_use() or 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        used = _MALLINFO2()
        used = used.uordblks + used.hblkhd
        if used > self.peak:
            self.peak = used
        return out


class _HeapSampler:
    """Reads the heap figure every ``interval`` seconds on a daemon thread."""

    def __init__(self, interval: float = 1e-3):
        self.interval = interval
        self.peak = heap_bytes_in_use() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, heap_bytes_in_use())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, heap_bytes_in_use())




class PeakMemory:
    """``with PeakMemory(device) as m: ...; m.peak_bytes``: the peak during the block.

    ``mode`` (CPU only): ``ops`` (exact, default), ``sampled`` or ``off`` (see module doc).
    """

    def __init__(self, device: torch.device, enabled: bool = True, mode: str = "ops"):
        if mode not in MEMORY_TRACKING:
            raise ConfigurationError(f"memory tracking mode must be one of {MEMORY_TRACKING}, got {mode!r}")
        self.device = torch.device(device)
        self.enabled = enabled and mode != "off"
        self.mode = mode
        self.peak_bytes = 0
        self.start_bytes = 0
        self._mode = None

    @property
    def method(self) -> str:
        if self.device.type == "cuda":
            return "cuda_max_memory_allocated"
        return "heap_mallinfo2" if _MALLINFO2 is not None else "ru_maxrss"

    def __enter__(self) -> "PeakMemory":
        if not self.enabled:
            return self
        if self.device.type == "cuda":
            # (no synchronize: the caching allocator counts a tensor when the host enqueues its
            # allocation and its free, so its statistics need no wait for the device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        elif _MALLINFO2 is not None:
            self.start_bytes = heap_bytes_in_use()
            self._mode = _HeapPeakMode() if self.mode == "ops" else _HeapSampler()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        elif self._mode is not None:
            self._mode.__exit__(*exc)
            self.peak_bytes = int(self._mode.peak)
        else:
            self.peak_bytes = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
