"""Host <-> device traffic of a step: index arrays in, a few sums out.

Every host-to-device copy a step makes goes through :func:`host_to_device`: token ids,
positions, logit rows, claim coefficients, attention gather indices, KV cache slots, router
routes. On CUDA the array is staged in pinned (page-locked) host memory and copied with
``non_blocking=True``: the host goes on queueing kernels while the copy runs, instead of
waiting for the device to drain as a copy from pageable memory makes it (``.to(device)`` of a
plain tensor synchronises). The module sits below ``attention``, ``kvcache``, ``model``, ``rl``
and ``engine`` so all of them can use it (``tests/package/test_host_copies.py`` refuses a
step-path module that copies host data to the device another way). Per-micro-batch sums (loss,
loss terms) stay on the device until the step reads them all at once (:class:`DeviceSums`).
On CPU both are plain tensors.

Host offload (``--memory-offload``) moves kept graphs' saved tensors and cached K/V blocks to
host memory and back through a :class:`HostLink`: on CUDA (:class:`CudaHostLink`) pinned host
buffers and copies on a side stream, fenced by events; on CPU (:class:`HostLink` itself) the
same calls with synchronous copies into buffers outside the C heap (anonymous memory maps), so
the heap that :class:`~megatron_psrl.engine.memory.PeakMemory` reads as the CPU's "device"
memory loses what was offloaded, and the CPU tests exercise the same bookkeeping.

A host sync per step is the design, not yet a measurement: nothing here has run on a GPU.
``benchmarks/gpu_acceptance.py`` counts them under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Dict, Iterator, Optional, Tuple, Union

import numpy as np
import torch

Tensor = torch.Tensor


def host_to_device(array, device: torch.device, dtype: Optional[np.dtype] = None) -> Tensor:
    """``array`` (a numpy array or anything ``np.asarray`` takes, as ``dtype`` if given) on
    ``device``: pinned and non-blocking on CUDA, a plain tensor on CPU.

    The pinned staging buffer comes from torch's caching host allocator, which keeps it until
    the copy has run, so the caller may drop or modify ``array`` at once."""
    t = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceSums:
    """Named running sums kept where their terms live; :meth:`read` returns floats once."""

    def __init__(self) -> None:
        self._sums: Dict[str, Union[Tensor, float]] = {}

    def add(self, name: str, value: Optional[Union[Tensor, float]]) -> None:
        if value is None:
            return
        if isinstance(value, Tensor):
            value = value.detach()
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def read(self) -> Dict[str, float]:
        """Every sum as a float: one device-to-host copy for all the device-held ones (sums of
        plain floats never touch the device: a scalar made a device tensor is a pageable copy)."""
        on_device = {n: v for n, v in self._sums.items() if isinstance(v, Tensor)}
        values = {n: float(v) for n, v in self._sums.items() if not isinstance(v, Tensor)}
        if on_device:
            stacked = torch.stack([v.to(torch.float64).reshape(()) for v in on_device.values()])
            values.update(zip(on_device, stacked.cpu().tolist()))
        return {n: values[n] for n in self._sums}


# ---------------------------------------------------------------------- host offload
Layout = Tuple[torch.Size, Tuple[int, ...], torch.dtype, torch.device]
"""What a tensor copied back must look like: ``(size, stride, dtype, device)``."""


def layout_of(t: Tensor) -> Layout:
    return t.size(), t.stride(), t.dtype, t.device


def _dense(size, stride) -> bool:
    """``size`` / ``stride`` cover their storage exactly once (a permuted contiguous tensor):
    the copy back can take the original strides (a kernel then sees the layout it saw)."""
    expected = 1
    for n, st in sorted(zip(size, stride), key=lambda d: d[1]):
        if n == 1:
            continue
        if st != expected:
            return False
        expected *= n
    return True


class HostLink:
    """Copies between the device and host memory for host offload. This class is the CPU's:
    no streams, every copy done when the call returns, host buffers outside the C heap;
    :class:`CudaHostLink` queues the same copies on a side stream. Use:

    - :meth:`to_host` (a device tensor into a new host buffer; the caller drops the original);
    - inside :meth:`side`, :meth:`to_device` (a host buffer into a new device tensor) and any
      writes of it (into the KV cache's pool), then :meth:`fence`;
    - :meth:`wait` before the device reads what was copied back before the last fence."""

    @staticmethod
    def for_device(device: torch.device) -> "HostLink":
        return CudaHostLink(device) if torch.device(device).type == "cuda" else HostLink(device)

    ARENA_BYTES = 1 << 24
    """The CPU's host buffers are carved from anonymous memory maps of at least this size (one
    map per saved tensor would be thousands of maps a step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.moved_bytes = 0
        """Bytes copied either way so far."""
        self._arena: Optional[Tensor] = None
        self._arena_used = 0

    def _host_buffer(self, like: Tensor) -> Tensor:
        """An empty contiguous host tensor of ``like``'s shape and dtype: on CPU carved from an
        anonymous memory map (outside the C heap: host memory that the heap's figure does not
        count), which goes once every tensor carved from it is gone."""
        nbytes = like.numel() * like.element_size()
        if not nbytes:
            return torch.empty(like.shape, dtype=like.dtype)
        size = -(-nbytes // 64) * 64  # (64-byte aligned: any dtype's view)
        if self._arena is None or self._arena_used + size > self._arena.numel():
            self._arena = torch.frombuffer(mmap.mmap(-1, max(self.ARENA_BYTES, size)), dtype=torch.uint8)
            self._arena_used = 0
        buffer = self._arena[self._arena_used:self._arena_used + nbytes]
        self._arena_used += size
        return buffer.view(like.dtype).view(like.shape)

    def to_host(self, t: Tensor) -> Tensor:
        host = self._host_buffer(t)
        host.copy_(t)
        self.moved_bytes += host.numel() * host.element_size()
        return host

    def _device_tensor(self, layout: Layout) -> Tensor:
        size, stride, dtype, device = layout
        if _dense(size, stride):
            return torch.empty_strided(size, stride, dtype=dtype, device=device)
        return torch.empty(size, dtype=dtype, device=device)

    def to_device(self, host: Tensor, layout: Layout) -> Tensor:
        out = self._device_tensor(layout)
        out.copy_(host.view(out.shape))
        self.moved_bytes += host.numel() * host.element_size()
        return out

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        yield

    def fence(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaHostLink(HostLink):
    """:class:`HostLink` on a CUDA device: pinned host buffers, every copy on a side stream that
    first waits for the work queued on the current stream (what it copies was computed there);
    a copied-out tensor is marked used by the side stream (``record_stream``: the caching
    allocator does not hand its memory out again before the copy ran), a copied-in one by the
    current stream; :meth:`fence` records an event after the side stream's copies, :meth:`wait`
    makes the current stream wait for it. Written for GPUs, not run on one yet."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.event: Optional[torch.cuda.Event] = None
        self._main = torch.cuda.current_stream(self.device)

    def _host_buffer(self, like: Tensor) -> Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def to_host(self, t: Tensor) -> Tensor:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host = self._host_buffer(t)
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        self.moved_bytes += host.numel() * host.element_size()
        return host

    def to_device(self, host: Tensor, layout: Layout) -> Tensor:
        out = self._device_tensor(layout)  # (inside side(): allocated for the side stream)
        out.copy_(host.view(out.shape), non_blocking=True)
        out.record_stream(self._main)  # (read and freed on the main stream)
        self.moved_bytes += host.numel() * host.element_size()
        return out

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        self._main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(self._main)
        with torch.cuda.stream(self.stream):
            yield

    def fence(self) -> None:
        self.event = self.stream.record_event()

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None
