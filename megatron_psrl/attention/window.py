"""Sliding windows and learnable sinks in :class:`~megatron_psrl.attention.PrefixSharingAttention`.

- :func:`layer_window`: a layer's window in keys, from megatron's ``window_size`` and
  ``window_attn_skip_freq`` (gpt-oss: every other layer);
- :func:`rows_in_window`: the external K/V a (windowed) plan reads (``AttentionPlan.windowed``
  drops the rows of a cached prefix no query's window reaches: they are not gathered at all);
- :func:`runnable_backend`: the backend that runs a window or a sink (flash-attn takes a window,
  no sink; Transformer Engine's thd kernels are not asked for either here: both fall back to
  the ``torch`` backend, with one logged line per reason).

The window counts positions along a token's own root-to-leaf path (its depth): a query at depth
``p`` sees its ancestors at depths ``p - window + 1 .. p``, never a sibling branch's tokens, as
Hugging Face's per-sample sliding mask (``k > q - sliding_window``).
"""

from __future__ import annotations

import copy
import logging
import re
from typing import List, NamedTuple, Optional, Sequence

from megatron_psrl.attention.metadata import ArrivingPrefixKV, PrefixCopies
from megatron_psrl.errors import ConfigurationError

logger = logging.getLogger("megatron_psrl")

FLASH_WINDOW_MIN_VERSION = (2, 3)
"""flash-attn takes ``window_size`` from 2.3 on."""

_LOGGED: set = set()


def layer_window(config, layer_number: int) -> Optional[int]:
    """Keys a query of layer ``layer_number`` (1-based) sees, itself included (Hugging Face's
    ``sliding_window``), or None (every ancestor). megatron's ``window_size`` is
    ``(left, right)`` keys around the diagonal, so a window of ``W`` keys is ``(W - 1, 0)``;
    ``window_attn_skip_freq`` says which layers have it (megatron's rule)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    left, right = window
    if left < 0:  # megatron's "infinite"
        return None
    if right != 0:
        raise ConfigurationError(f"window_size {tuple(window)}: a decoder's window has no keys to the right (right 0)")
    return int(left) + 1


def rows_in_window(external: Sequence, starts: Optional[Sequence[int]] = None) -> List:
    """``external`` (the hook's K/V sources, in plan order) from row ``starts[j]`` of source
    ``j`` on (None: every row): copies gathered of those rows only (:class:`PrefixCopies`),
    ``(k, v)`` pairs sliced, cached readers reading only those rows (nothing for a source no
    window reaches), arriving rows narrowed to them."""
    out = []
    for source, start in zip(external, [0] * len(external) if starts is None else starts):
        start = int(start)
        if isinstance(source, RowsFrom):  # (only the rows from `first` on are here)
            if start < source.first:
                raise ValueError(f"rows from {start} on read of a source whose rows from {source.first} on are here")
            out += rows_in_window([source.source], [start - source.first])
        elif isinstance(source, PrefixCopies):
            out.append(source.take(start))
        elif not start:
            out.append(source)
        elif isinstance(source, tuple):
            out.append((source[0][start:], source[1][start:]))
        elif isinstance(source, ArrivingPrefixKV):
            narrowed = copy.copy(source)
            narrowed.offset, narrowed.length = source.offset + start, source.length - start
            out.append(narrowed)
        else:
            out.append(_RowsFrom(source, start))
    return out


class RowsFrom(NamedTuple):
    """An external source of which only the rows from ``first`` on are here: a cross-rank
    chain a sliding-window layer's exchange sent from the first row its readers' windows reach
    (``engine/prefix_kv.layer_exchange``). The windowed plan reads it from there on only."""

    source: object
    """The rows that are here: ``(k, v)`` tensors or an :class:`ArrivingPrefixKV`."""
    first: int
    """The source's row the first of them is."""


class _RowsFrom:
    """A cached prefix (``CachedPrefixKV``) as a window reads it: rows ``start:`` only."""

    __slots__ = ("reader", "start")

    def __init__(self, reader, start: int):
        self.reader, self.start = reader, start

    def read(self, again: bool = False, start: int = 0):
        return self.reader.read(again=again, start=self.start + start)

    def add_grad(self, grad_key, grad_value, start: int = 0) -> None:
        self.reader.add_grad(grad_key, grad_value, start=self.start + start)

    def materialize(self, start: int = 0):
        return self.reader.materialize(start=self.start + start)


_FLASH_VERSION: List = []


def _flash_version():
    """The installed flash-attn's ``(major, minor)`` (None without it), looked up once."""
    if not _FLASH_VERSION:
        try:
            import flash_attn

            numbers = re.findall(r"\d+", str(getattr(flash_attn, "__version__", "0")))[:2]
            _FLASH_VERSION.append(tuple(int(n) for n in numbers))
        except ImportError:
            _FLASH_VERSION.append(None)
    return _FLASH_VERSION[0]


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.warning(reason)


def runnable_backend(backend: str, window: Optional[int], sink: bool, flash_version=None) -> str:
    """``backend``, or ``torch`` where it cannot run this layer's window or sink (one logged
    line per reason): flash-attn 2 has no sink (a learnable per-head logit in the denominator)
    and takes a window from 2.3 on; Transformer Engine is not asked for either."""
    if backend not in ("flash", "te") or (window is None and not sink):
        return backend
    if backend == "te":
        _log_once("attention backend 'te': sliding windows and attention sinks run on the 'torch' backend")
        return "torch"
    if sink:
        _log_once("attention backend 'flash': flash-attn has no attention sinks; those layers run on the "
                  "'torch' backend")
        return "torch"
    if flash_version is None:
        flash_version = _flash_version()
    if flash_version is not None and tuple(flash_version) < FLASH_WINDOW_MIN_VERSION:
        _log_once(f"attention backend 'flash': flash-attn {'.'.join(map(str, flash_version))} has no sliding "
                  "window (2.3+); windowed layers run on the 'torch' backend")
        return "torch"
    return backend
