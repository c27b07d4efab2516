"""Host offload of a step (``--memory-offload``, a memory plan's ``host_offload``): kept graphs'
saved tensors and cached K/V blocks live in host memory while no step near them uses them.

The memory plan decides what is where (``schedule.instructions.step_residents``: at every
schedule step, the graphs and cached sources this step and the next use are on the device)
and prices the copies; the lowering puts a :class:`~megatron_psrl.schedule.instructions.Residency`
first in every step, which :meth:`HostOffload.settle` enacts:

1. the current stream waits for what the previous step copied back (its fence);
2. kept graphs and held sources outside the two steps' sets go to host memory (their device
   memory is free for this step: a source's blocks go back to the KV pool, which the plan
   sized for the blocks on the device only);
3. what this step uses and is still on the host comes back and is waited for (nothing, when
   the previous step prefetched it, as the plan has it);
4. what only the next step uses comes back on the link's side stream, fenced, while this
   step computes.

A kept graph's saved tensors are caught as its forward saves them
(``torch.autograd.graph.saved_tensors_hooks``: pack registers the tensor with the graph's
:class:`SavedTensors`, unpack returns it on the device); the model's parameters and buffers are
never moved (they stay on the device for every step anyway). Copies go through
:class:`~megatron_psrl.host_copy.HostLink`: on CUDA pinned buffers and a side stream with
events (written for GPUs, not run on one yet), on CPU synchronous copies into memory outside
the C heap, so the CPU tests exercise the same bookkeeping and measure what leaves the heap.
Copies are exact: an offloaded step computes bit for bit what the same plan computes without.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_psrl.host_copy import HostLink, Layout, layout_of

Tensor = torch.Tensor


class _Saved:
    """One saved tensor of a kept graph: on the device (``device``) or in host memory (``host``)."""

    __slots__ = ("device", "host", "layout")

    def __init__(self, t: Tensor):
        self.device: Optional[Tensor] = t
        self.host: Optional[Tensor] = None
        self.layout: Layout = layout_of(t)

    @property
    def nbytes(self) -> int:
        t = self.device if self.device is not None else self.host
        return t.numel() * t.element_size()


@dataclass
class SavedTensors:
    """The saved tensors of one kept graph (each once, however many nodes save it)."""

    entries: Dict[tuple, _Saved] = field(default_factory=dict)
    on_host: bool = False

    def pack(self, t: Tensor, kept: set, device: torch.device):
        if t.device != device or not t.numel() or t.untyped_storage().data_ptr() in kept:
            return t  # (a parameter, a buffer, an empty or host tensor: stays where it is)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self.entries:
            self.entries[key] = _Saved(t)
        return self.entries[key]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


@dataclass
class OffloadRecord:
    """What a step moved, per schedule step (for the step's metrics and the tests)."""

    graph_bytes: List[int] = field(default_factory=list)
    """Kept graphs' saved bytes copied either way at each step."""
    kv_bytes: List[int] = field(default_factory=list)
    """Cached sources' block bytes copied either way at each step."""
    graphs_out: List[List[int]] = field(default_factory=list)
    """Kept graphs sent to host memory at each step."""
    sources_out: List[List[int]] = field(default_factory=list)
    """Cached sources sent to host memory at each step."""


class HostOffload:
    """One training step's host offload (module docstring)."""

    def __init__(self, link: HostLink, cache, model: torch.nn.Module):
        self.link, self.cache = link, cache
        self.graphs: Dict[int, SavedTensors] = {}
        # (what every step keeps on the device: never copied)
        self.kept = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
        self.record = OffloadRecord()

    # ------------------------------------------------------------------ a kept graph
    def saving(self, i: int):
        """The context of micro-batch ``i``'s kept forward: its saved tensors are registered."""
        saved = self.graphs.setdefault(i, SavedTensors())
        return torch.autograd.graph.saved_tensors_hooks(lambda t: saved.pack(t, self.kept, self.link.device),
                                                        self._unpack)

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.device is None:  # (not brought back by a Residency: the plan did not foresee this read)
            with self.link.side():
                packed.device = self.link.to_device(packed.host, packed.layout)
            self.link.fence()
            self.link.wait()
        return packed.device

    def release(self, i: int) -> None:
        """Micro-batch ``i``'s backward ran: its graph (and its saved tensors) are gone."""
        self.graphs.pop(i, None)

    def _graph_out(self, saved: SavedTensors) -> int:
        for e in saved.entries.values():
            e.host, e.device = self.link.to_host(e.device), None
        saved.on_host = True
        return saved.nbytes

    def _graph_in(self, saved: SavedTensors) -> int:
        with self.link.side():
            for e in saved.entries.values():
                e.device = self.link.to_device(e.host, e.layout)
        for e in saved.entries.values():
            e.host = None
        saved.on_host = False
        return saved.nbytes

    # ------------------------------------------------------------------ a schedule step
    def settle(self, x) -> None:
        """Enact a :class:`~megatron_psrl.schedule.instructions.Residency` (module docstring)."""
        self.link.wait()  # 1. the previous step's copies back
        graphs, sources = set(x.graphs) | set(x.next_graphs), set(x.sources) | set(x.next_sources)
        out_g = sorted(g for g, s in self.graphs.items() if g not in graphs and not s.on_host)
        out_s = sorted(s for s in self.cache.on_device() if s not in sources) if self.cache is not None else []
        moved_g = sum(self._graph_out(self.graphs[g]) for g in out_g)  # 2. out
        moved_kv = sum(self.cache.offload(s, self.link) for s in out_s)
        host_s = self.cache.on_host() if self.cache is not None else set()
        late_g = [g for g in x.graphs if g in self.graphs and self.graphs[g].on_host]  # 3. this step's
        late_s = [s for s in x.sources if s in host_s]
        moved_g += sum(self._graph_in(self.graphs[g]) for g in late_g)
        moved_kv += sum(self.cache.restore(s, self.link) for s in late_s)
        if late_g or late_s:
            self.link.fence()
            self.link.wait()
        moved_g += sum(self._graph_in(self.graphs[g]) for g in x.next_graphs  # 4. the next step's
                       if g in self.graphs and self.graphs[g].on_host)
        moved_kv += sum(self.cache.restore(s, self.link) for s in x.next_sources if s in host_s)
        self.link.fence()
        r = self.record
        r.graph_bytes.append(moved_g)
        r.kv_bytes.append(moved_kv)
        r.graphs_out.append(out_g)
        r.sources_out.append(out_s)

    def finish(self) -> None:
        """The step's end: every kept graph had its backward, nothing is left in host memory."""
        self.link.wait()
        if self.graphs:
            raise RuntimeError(f"host offload: kept graphs {sorted(self.graphs)} outlived the step")


__all__ = ["HostOffload", "OffloadRecord", "SavedTensors"]
