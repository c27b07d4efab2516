"""Float comparisons that hold on every CPU.

Two computations of the same value that reduce in a different order (a wider tensor, another
chunking, another kernel, another SIMD width) agree only up to rounding, and how far depends
on the machine. Bit-for-bit equality is asserted only where both sides are the same
operations in the same order (a copy, a reshard, a round trip); everything else compares
within a few units of rounding of the dtype, at the magnitude the computation works at.
"""

from __future__ import annotations

import torch

ROUNDING_ULPS = 8
"""Units of rounding allowed between two orders of the same reduction (a handful of
reassociations at the working magnitude; far below any real bug)."""


def rounding_tolerance(dtype: torch.dtype, scale: float, ulps: int = ROUNDING_ULPS) -> float:
    """Absolute tolerance: ``ulps`` units of rounding of ``dtype`` at magnitude ``scale``."""
    return ulps * torch.finfo(dtype).eps * max(1.0, float(scale))


def assert_equal_up_to_rounding(actual: torch.Tensor, expected: torch.Tensor, scale: float,
                                ulps: int = ROUNDING_ULPS) -> None:
    """``actual`` equals ``expected`` up to ``ulps`` roundings at magnitude ``scale``."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=rounding_tolerance(actual.dtype, scale, ulps))
