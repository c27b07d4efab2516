"""Host <-> device traffic of a step: index arrays in, a few sums out.

On CUDA, every index array a micro-batch needs (token ids, positions, logit rows, claim
coefficients) is copied from pinned host memory without blocking, so the copy overlaps the
kernels still running, and per-micro-batch sums (loss, loss terms) stay on the device until
the step reads them all at once (one synchronisation per step, not per micro-batch). On CPU
both are plain tensors.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import numpy as np
import torch

Tensor = torch.Tensor


def host_to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """``array`` on ``device``: pinned and non-blocking on CUDA, no copy on CPU."""
    t = torch.from_numpy(np.ascontiguousarray(array))
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
        """Every sum as a float: one device-to-host copy for all of them."""
        names = list(self._sums)
        if not names:
            return {}
        tensors = [v for v in self._sums.values() if isinstance(v, Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                               for v in self._sums.values()])
        return dict(zip(names, stacked.cpu().tolist()))
