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

A host sync per step is the design, not yet a measurement: nothing here has run on a GPU.
``benchmarks/gpu_acceptance.py`` counts them under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

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
