"""The KV cache manager's per-step decisions: block size, pool size, keep-or-recompute.

Given a rank's plan (micro-batches, cached sources, schedule), the cache geometry and the byte
budget, it simulates the step's timeline and decides, per producer micro-batch, whether its
autograd graph is kept from its forward to its (deferred) backward or dropped and rebuilt by
recomputing its forward when the backward is due. Everything the cache manager holds counts
against the budget:

- K and V blocks of a source, from its producer's forward until its last read (a reader
  that recomputes reads again at its backward);
- dK and dV blocks of a source, from the first step that writes them (its first reader's
  backward, :func:`~megatron_psrl.schedule.instructions.first_gradient_writes`) until the
  producer's backward;
- the retained graph of a producer that keeps it (tokens x activation bytes per token, plus
  the K/V it gathered from the cache, unless the attention gathers them again in its backward
  pass: ``gathers_in_backward``, the ``torch``, ``flash`` and ``te`` backends,
  :data:`~megatron_psrl.attention.backends.READS_CACHED_PREFIXES`);
- the K/V copies gathered from the cache by the micro-batch that is running (all layers' for
  kernels that save them; one layer's at a time when gathered again in backward);
- the running micro-batch's loss head (``head_bytes``: one chunk of claimed rows' logits and
  their gradients, :func:`megatron_psrl.model.logits.loss_head_peak_bytes`);
- with the ``flash`` and ``te`` backends (:class:`VarlenCharge`): one layer's gathered K/V
  copies, in the forward and again in the backward regather, with the kernel's gradients of
  them and their fp32 sum, while a micro-batch runs; and the kernel's softmax statistics
  padded to segments x longest segment, where a kernel pads them, in every kept graph.

Gathering again in backward trades the copies a kept graph held (every reader its whole
prefix chain) for keeping the prefix's K/V blocks until the reader's backward.

Producers keep their graphs unless the simulated peak exceeds the budget; then graphs are
dropped greedily (see :func:`plan_memory`). If no choice fits, the plan is infeasible
(:class:`CacheBudgetError`) and the caller cuts differently (duplication).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron_psrl.attention.core_attention import saved_bytes_per_token
from megatron_psrl.kvcache.manager import CacheBudgetError, KVGeometry, choose_block_size
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.schedule import instructions as ins
from megatron_psrl.schedule.plan import CachedSource, MemoryPlan, RankPlan
from megatron_psrl.schedule.step_charge import ActivationCharge, Rows
from megatron_psrl.tree.index import TreeIndex, chain_structure

# The norms' internals and statistics and the attention's log-sum-exp stay fp32 in any dtype.
_FP32_BYTES = 4

# What the heap holds for a kept graph beyond the count of saved tensors: allocator rounding.
# Every saved tensor is one allocation, rounded up by at most one 4 KiB page (glibc's mmapped
# chunks; its heap chunks by at most 96 B with torch's 64-byte alignment; CUDA's caching
# allocator by at most 512 B). A layer saves 22-28 tensors (tiny configs), so a graph's
# rounding is at most 120 KiB per layer: under 10% of it from 256 tokens on, even for
# debug-llama (11.8 KB per token in 2 layers). Nothing here depends on the processor: the
# count is of the tensors autograd saves. What does vary by processor is the BLAS library's
# own buffer pool (MKL keeps per-thread packing buffers, sized by the largest GEMM it has run,
# for the life of the process: 3 MB for a 1,024-token forward of tiny-llama on an AMD EPYC,
# about 15 MB on an Intel Xeon): a per-process constant like the weights, not part of any
# graph, outside --kv-cache-budget (docs/architecture.md, "Activations of a kept graph").
ALLOCATOR_MARGIN = 1.1


class StepBudgetError(CacheBudgetError):
    """The step's peak (KV blocks, kept graphs and the running micro-batch's graph, loss head and
    gradients) cannot fit the step's budget under any keep / drop decision of this plan."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed
        """The smallest step peak this plan reaches (bytes)."""


MODELLED_BACKENDS = ("torch", "flash", "te")
"""Attention backends whose saved tensors the plan counts (``dense``, the O(t^2) reference,
keeps its t x t mask and probabilities: not a training backend, not modelled)."""


def _check_backend(backend: str) -> None:
    if backend not in MODELLED_BACKENDS:
        raise ValueError(f"the memory plan models the attention backends {MODELLED_BACKENDS}, not {backend!r}")


def attention_saved_bytes_per_token(arch: ModelArchitecture, tensor_parallel_size: int, dtype_bytes: int,
                                    backend: str = "torch") -> int:
    """Bytes per token that one layer's core attention keeps for backward beyond the fused QKV
    output (the value is a view of it): the query and key after RoPE, the output, and the fp32
    log-sum-exp (the family counts them: ``ModelFamily.attention_saved_bytes_per_token``).

    The same for every modelled backend. ``torch`` saves its inputs and merges in place;
    ``flash`` and ``te`` save their per-segment *gathered* K/V, which would cost every segment
    its whole ancestor chain (a GRPO group of 16 responses on one prompt: 16 copies of the
    prompt's K/V per layer), but :func:`~megatron_psrl.attention.backends.varlen.varlen_tree_attention`
    saves them as a recipe over the pack's K/V and gathers again in backward, so what stays is
    the pack's key and value (a test measures it, ``tests/kvcache/test_varlen_saved_bytes.py``).
    Cached prefixes read by the attention are charged per micro-batch, not here (``held_reads``:
    none when the attention reads them again in backward, as torch, flash and te do). What the
    varlen kernels hold beyond this count (their gathered copies while a layer runs, softmax
    statistics padded to segments x longest segment) is :class:`VarlenCharge`'s, per micro-batch."""
    _check_backend(backend)
    family = getattr(arch, "family", None)  # (a bare attention shape has none: the core attention's count)
    if family is not None:
        return family.attention_saved_bytes_per_token(arch, tensor_parallel_size, dtype_bytes)
    return saved_bytes_per_token(arch.num_attention_heads, arch.num_kv_heads, arch.head_dim, tensor_parallel_size,
                                 dtype_bytes)


def saved_activation_bytes_per_token(arch: ModelArchitecture, tensor_parallel_size: int, dtype_bytes: int,
                                     backend: str = "torch") -> int:
    """Bytes of the tensors autograd saves for backward per token (all layers), exactly: the
    family's count (``ModelFamily.saved_activation_bytes_per_token``; for the Llama-like
    families, megatron's local layer with the project's core attention, per tensor in
    :meth:`megatron_psrl.model.families.LlamaLikeFamily.saved_activation_bytes_per_token`; a
    test compares it with the storages ``torch.autograd.graph.saved_tensors_hooks`` sees, fp32
    and bf16). The attention's share is :func:`attention_saved_bytes_per_token` (the same for
    ``torch``, ``flash``, ``te``); an MoE layer's MLP is :func:`moe_saved_bytes_per_token`."""
    _check_backend(backend)
    return arch.family.saved_activation_bytes_per_token(arch, tensor_parallel_size, dtype_bytes)


def moe_saved_bytes_per_token(arch: ModelArchitecture, dtype_bytes: int) -> int:
    """Bytes per token that one MoE layer's router, token dispatcher and experts save for backward
    (megatron's ``MoELayer``), in place of a dense MLP's ``3 f``: the family's count
    (:meth:`megatron_psrl.model.families.MoEFamily.moe_saved_bytes_per_token`, counted from
    megatron-core 0.16's router, dispatchers and experts; a test compares it with what
    ``saved_tensors_hooks`` sees, every MoE family, fp32 and bf16). Expert parallelism: these
    are the bytes of this rank's tokens."""
    family = arch.family
    if not family.is_moe:
        raise ValueError(f"model type {arch.model_type!r} has no mixture-of-experts layers")
    return family.moe_saved_bytes_per_token(arch, dtype_bytes)


def activation_bytes_per_token(arch: ModelArchitecture, tensor_parallel_size: int, dtype_bytes: int,
                               backend: str = "torch") -> int:
    """Upper bound of the memory one token's part of a kept autograd graph holds (all layers):
    the saved tensors (:func:`saved_activation_bytes_per_token`) and the graph's output hidden
    state (the loss head keeps it), times :data:`ALLOCATOR_MARGIN` for allocator rounding.
    The memory plan charges this per token of every graph it keeps."""
    saved = saved_activation_bytes_per_token(arch, tensor_parallel_size, dtype_bytes, backend)
    return int(ALLOCATOR_MARGIN * (saved + arch.hidden_size * dtype_bytes))


def add_segment_shapes(index: TreeIndex, plan: RankPlan) -> None:
    """Set ``plan.segment_shapes``: per micro-batch that runs the model, ``(segments, longest
    segment, gathered keys)``, what a varlen kernel's memory follows. A segment's queries see its
    ancestors (in the pack, cached or received) and its own tokens: as many keys as its last
    token's position plus one (the rows ``AttentionPlan.gathered_keys`` lists for it)."""
    if plan.segment_shapes is not None:
        return
    shapes = {}
    for i, mb in enumerate(plan.micro_batches):
        tokens = mb.computed_tokens
        if not len(tokens):
            continue
        _, continues = chain_structure(index, tokens)
        starts = np.flatnonzero(~continues)
        ends = np.append(starts[1:], len(tokens))
        keys = int((index.position[tokens[ends - 1]] + 1).sum())
        shapes[i] = (len(starts), int((ends - starts).max()), keys)
    plan.segment_shapes = shapes


@dataclass(frozen=True)
class VarlenCharge:
    """What the ``flash`` and ``te`` backends hold beyond the per-token saved tensors
    (:func:`attention_saved_bytes_per_token`), from a micro-batch's segment shape
    (:func:`add_segment_shapes`). ``None`` for the ``torch`` backend, which gathers nothing.

    While a layer's attention runs (forward, or its backward), per gathered key
    (``bytes_per_gathered_key``, one layer): the K and V copies (``2 kv b``; the forward's,
    freed after the kernel, or the backward's regather); in backward the kernel's gradients of
    them (``2 kv b``; flash-attn 2 with fewer K/V heads than query heads first writes them per
    query head, ``2 q b``); the fp32 copy of one of them and the fp32 sum over the source rows
    (at most one per gathered key) that ``GatherRows`` adds them into (``8 kv``). One layer at a
    time: charged once per running micro-batch, not per layer.

    In a kept graph, per layer (``lse_bytes_per_row``): the kernel's fp32 log-sum-exp, counted
    per token already; older flash-attn 2 releases and cuDNN before 9.6 pad it to
    segments x longest segment rows, so the padding rows are charged here."""

    bytes_per_gathered_key: int
    """One layer's transient bytes per gathered K/V row (see the class doc)."""
    lse_bytes_per_row: int
    """fp32 log-sum-exp bytes of one query row, all of this stage's layers."""

    @classmethod
    def of(cls, arch: ModelArchitecture, tensor_parallel_size: int, dtype_bytes: int, backend: str,
           num_layers: Optional[int] = None) -> Optional["VarlenCharge"]:
        if backend not in ("flash", "te"):
            return None
        hd, tp, b = arch.head_dim, tensor_parallel_size, dtype_bytes
        q, kv = arch.num_attention_heads * hd // tp, arch.num_kv_heads * hd // tp
        grads = 2 * (q if backend == "flash" else kv) * b
        layers = arch.num_layers if num_layers is None else num_layers
        return cls(bytes_per_gathered_key=2 * kv * b + grads + 2 * _FP32_BYTES * kv,
                   lse_bytes_per_row=_FP32_BYTES * (q // hd) * layers)

    def transient(self, shape: Tuple[int, int, int]) -> int:
        return shape[2] * self.bytes_per_gathered_key

    def held(self, shape: Tuple[int, int, int], tokens: int) -> int:
        segments, longest, _ = shape
        return max(0, segments * longest - tokens) * self.lse_bytes_per_row


BlockSizes = Tuple[int, ...]
"""Tokens per KV block of each pool of the cache (``KVGeometry.pools`` order)."""


def pool_block_sizes(geometry: KVGeometry, sources) -> BlockSizes:
    """Every pool's block size, from the rows it keeps of ``sources`` (:func:`choose_block_size`):
    the sources' lengths, or in a sliding window's pool the few rows its readers' windows reach
    (``CachePool.kept_rows``), which blocks sized for whole sources would mostly leave empty."""
    sources = list(sources)
    return tuple(choose_block_size([p.kept_rows(s.length, *s.reach) for s in sources]) for p in geometry.pools)


def _source_blocks(geometry: KVGeometry, src: CachedSource, roles, block_sizes: BlockSizes) -> np.ndarray:
    """Blocks a source takes in each pool of the cache, for the given roles: the rows each pool
    keeps (a sliding-window pool those some reader's window reaches, ``CachePool.kept_rows``),
    as ``BlockKVCache.allocate`` allocates them."""
    return np.array([p.source_blocks(p.kept_rows(src.length, *src.reach), roles, bs)
                     for p, bs in zip(geometry.pools, block_sizes)], dtype=np.int64)


def _block_bytes(geometry: KVGeometry, block_sizes: BlockSizes) -> np.ndarray:
    """Bytes of one block of each pool."""
    return np.array([p.block_bytes(bs) for p, bs in zip(geometry.pools, block_sizes)], dtype=np.int64)


def _simulate(plan: RankPlan, keep: Dict[int, bool], block_sizes: BlockSizes, tables: "_ByteTables",
              geometry: KVGeometry, rereads: bool = False) -> Tuple["_Counts", Dict[int, int]]:
    """What the step holds at every schedule step (:class:`_Counts`) and every source's last
    read. The step is lowered (:func:`~megatron_psrl.schedule.instructions.lower_training`, what
    the runner executes) and its instructions counted (:func:`count_stream`)."""
    last_read = ins.last_reads(plan, keep, rereads or tables.gathers_in_backward)
    return _count(plan, ins.lower_training(plan, keep, last_read), block_sizes, tables, geometry), last_read


@dataclass
class _Counts:
    """Per schedule step, what a lowered step stream holds (:func:`count_stream`)."""

    blocks: np.ndarray
    """int64 ``[steps, pools]``: KV blocks allocated."""
    other: np.ndarray
    """int64 ``[steps]``: the KV plan's other bytes: kept graphs (per token) with their copies,
    the running micro-batch's copies and attention temporaries, ``head_bytes``."""
    step_other: np.ndarray
    """int64 ``[steps]``: the step's other bytes on the device: kept graphs (by rows, on the device)
    with their copies, the running micro-batch's copies, attention temporaries and own bytes
    (:meth:`_ByteTables.running`)."""
    device_blocks: np.ndarray
    """int64 ``[steps, pools]``: KV blocks on the device (all of them unless offloaded)."""
    moved_blocks: np.ndarray
    """int64 ``[steps, pools]``: KV blocks copied to or from host memory at the step (offload)."""
    moved_bytes: np.ndarray
    """int64 ``[steps]``: kept graphs' bytes copied to or from host memory at the step (offload)."""


def count_stream(plan: RankPlan, steps, block_sizes: BlockSizes, tables: "_ByteTables", geometry: KVGeometry):
    """What a lowered step stream holds: per schedule step, the blocks of each pool and the
    other bytes (kept graphs with their gathered copies, the running micro-batch's gathered
    copies and attention temporaries, the loss head), read after the step's allocations and
    model run and before its releases. Each instruction's effect:

    - ``AllocateKV``: the sources' blocks of the given roles (their own ``kinds`` by default);
    - ``ReleaseKV``: whatever of those roles the sources still hold;
    - ``ForwardKeep``: its graph and the copies it keeps, until its ``Backward``;
    - ``ForwardBackward``, ``ForwardDrop``, ``Forward``, a recomputing ``Backward`` (and every pass when the
      attention gathers again in backward): the gathered copies while it runs;
    - every step: the micro-batch's attention temporaries and the loss head.

    The step's own view (by rows, with the running micro-batch's graph, loss head and gradients,
    and what host offload moves) is :func:`_count`'s."""
    counts = _count(plan, steps, block_sizes, tables, geometry)
    return counts.blocks, counts.other


class _Stream:
    """:func:`_count`'s state: blocks and graphs alive, and what the step timeline records."""

    def __init__(self, plan: RankPlan, tables: "_ByteTables", geometry: KVGeometry, block_sizes: BlockSizes, order):
        self.plan, self.tables, self.geometry, self.block_sizes = plan, tables, geometry, block_sizes
        self.order = order  # the micro-batch of every schedule step
        self.zero = np.zeros(len(geometry.pools), dtype=np.int64)
        self.held: Dict[int, Dict[str, np.ndarray]] = {}  # source -> role -> its blocks in each pool
        self.blocks, self.graphs, self.grads = self.zero, 0, False
        self.kept: Dict[int, int] = {}  # producer -> its kept graph's bytes (by rows) with its copies
        # (graphs, sources) on the device at the last step; before the first, what it uses: nothing
        # is in host memory yet (a source or graph the first steps make is not a copy)
        self.on_device: Tuple[set, set] = self._touched(0) if order else (set(), set())
        self.rows: Dict[str, list] = {k: [] for k in ("blocks", "other", "step", "device", "moved_blocks", "moved")}

    def allocate(self, s: int, roles) -> None:
        src = self.plan.sources[s]
        for role in (roles or src.kinds):
            self.held.setdefault(s, {})[role] = _source_blocks(self.geometry, src, (role,), self.block_sizes)
            self.blocks = self.blocks + self.held[s][role]

    def release(self, s: int, roles) -> None:
        for role in roles:
            self.blocks = self.blocks - self.held.get(s, {}).pop(role, self.zero)

    def _touched(self, t: int) -> Tuple[set, set]:
        """Graphs and sources the steps ``t`` and ``t + 1`` use (offload keeps those on the device:
        the next step's are copied back during this one; :func:`~megatron_psrl.schedule.instructions.step_residents`,
        which the executor's :class:`~megatron_psrl.schedule.instructions.Residency` enacts)."""
        mbs, sources = ins.step_residents(self.plan, self.order, t)
        return set(mbs), sources

    def record(self, t: int, i: int, kind: Optional[str], runs: bool) -> None:
        tables = self.tables
        copies = (tables.running_reads[i] if runs else 0) + tables.attention.get(i, 0)
        self.rows["blocks"].append(self.blocks)
        self.rows["other"].append(self.graphs + copies + tables.head_bytes)
        own = copies + tables.running(i, kind, self.grads)
        if not tables.offload:  # everything alive is on the device
            self.rows["device"].append(self.blocks)
            self.rows["step"].append(sum(self.kept.values()) + own)
            return
        graphs, sources = self._touched(t)
        device = sum((self.held[s][r] for s in sources & set(self.held) for r in self.held[s]), self.zero)
        moved = (self.on_device[1] ^ sources) & set(self.held)  # (left, or back for the next step)
        self.rows["moved_blocks"].append(sum((self.held[s][r] for s in moved for r in self.held[s]), self.zero))
        self.rows["moved"].append(sum(self.kept[g] for g in (self.on_device[0] ^ graphs) & set(self.kept)))
        self.on_device = (graphs, sources)
        self.rows["device"].append(device)
        self.rows["step"].append(sum(b for g, b in self.kept.items() if g in graphs) + own)


def _count(plan: RankPlan, steps, block_sizes: BlockSizes, tables: "_ByteTables", geometry: KVGeometry) -> _Counts:
    """:func:`count_stream`, and the step's own view of every schedule step (:class:`_Counts`)."""
    steps = list(steps)
    state = _Stream(plan, tables, geometry, block_sizes, [step.micro_batch for step in steps])
    for t, step in enumerate(steps):
        i = step.micro_batch
        runs, frees_graph, recorded, kind = tables.gathers_in_backward, False, False, None
        for x in step.instructions:
            if isinstance(x, ins.ReleaseKV) and not recorded:  # releases come after the step's reading
                state.record(t, i, kind, runs)
                recorded = True
            if isinstance(x, ins.AllocateKV):
                for s in x.sources:
                    state.allocate(s, x.kinds)
            elif isinstance(x, ins.ReleaseKV):
                for s in x.sources:
                    state.release(s, x.kinds)
            elif isinstance(x, ins.ForwardKeep):
                state.graphs += tables.graph[i] + tables.held_reads[i]
                own = tables.step_graph.get(i, 0) if tables.charge is not None else tables.graph[i]
                state.kept[i] = own + tables.held_reads[i]
                kind = "keep"
            elif isinstance(x, (ins.ForwardBackward, ins.ForwardDrop, ins.Forward)):
                runs = True
                kind = "forward_backward" if isinstance(x, ins.ForwardBackward) else "forward"
            elif isinstance(x, ins.Backward):
                runs = runs or x.recompute
                frees_graph = not x.recompute
                kind = "recompute" if x.recompute else "backward"
        if not recorded:
            state.record(t, i, kind, runs)
        if frees_graph:
            state.graphs -= tables.graph[i] + tables.held_reads[i]
            state.kept.pop(i, None)
        state.grads = state.grads or kind in ("forward_backward", "backward", "recompute")
    pools = len(geometry.pools)
    as_blocks = lambda rows: np.asarray(rows, dtype=np.int64).reshape(len(rows), pools)  # noqa: E731
    r = state.rows
    if not tables.offload:  # (nothing moves)
        r["moved_blocks"], r["moved"] = [state.zero] * len(steps), [0] * len(steps)
    return _Counts(as_blocks(r["blocks"]), np.asarray(r["other"], dtype=np.int64), np.asarray(r["step"], dtype=np.int64),
                   as_blocks(r["device"]), as_blocks(r["moved_blocks"]), np.asarray(r["moved"], dtype=np.int64))


@dataclass
class _ByteTables:
    """Per micro-batch bytes the simulation charges."""

    graph: Dict[int, int]
    """Its graph's activations per token (kept from its forward to its backward, or transient):
    the KV plan's charge (``--kv-cache-budget``)."""

    held_reads: Dict[int, int]
    """Prefix K/V copies a kept graph holds until its backward."""

    running_reads: Dict[int, int]
    """Prefix K/V copies held while it runs."""

    gathers_in_backward: bool

    head_bytes: int = 0
    """The loss head's transient peak, charged at every step (a micro-batch is running)."""

    attention: Dict[int, int] = field(default_factory=dict)
    """A varlen backend's transient while the micro-batch runs (:class:`VarlenCharge`)."""

    charge: Optional[ActivationCharge] = None
    """The step's charge by rows (None: the step's timeline charges ``graph`` and ``head_bytes``)."""

    step_graph: Dict[int, int] = field(default_factory=dict)
    """Its graph by rows (``charge``; a varlen kernel's padded statistics and the rows a producer
    captures included): the step timeline's charge."""

    rows: Dict[int, Rows] = field(default_factory=dict)
    """Its ``(tokens, output rows, claimed rows)`` (with a ``charge``)."""

    produced_grads: Dict[int, int] = field(default_factory=dict)
    """What its backward reads for the sources it produces (with a ``charge``): their fp32 dK/dV
    from the cache, and the captured rows' gradients scattered into its K and V."""

    offload: bool = False
    """Kept graphs and K/V blocks that the running and the next step do not use live in host memory."""

    def running(self, i: int, kind: Optional[str], grads: bool) -> int:
        """What micro-batch ``i`` holds while step ``kind`` of it runs beyond the kept graphs
        (``grads``: a backward ran before, the parameters' gradients exist): its own graph
        unless kept, its loss head, the gradients; per token: its graph while it runs and the
        loss head's ``head_bytes``."""
        charge = self.charge
        if charge is None:
            return self.head_bytes + (self.graph.get(i, 0) if kind in ("forward_backward", "recompute") else 0)
        before = charge.grad_bytes if grads else 0
        rows = self.rows.get(i)
        if rows is None or kind is None:
            return before
        if kind in ("keep", "forward"):
            return charge.forward_transient(rows) + before
        held = self.step_graph[i] - charge.graph(rows)  # (padded statistics, captured K/V rows)
        peak = charge.backward_peak(rows, before) + self.produced_grads.get(i, 0)
        return peak - charge.graph(rows) if kind == "backward" else peak + held


def _produced(plan: RankPlan, geometry: KVGeometry, captures: bool) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Per producer micro-batch: the values of the sources it computes (its graph keeps them as
    differentiable rows for the dK/dV its readers inject: ``engine/prefix_kv.py``'s capture; not
    with activation recomputation, which injects them inside the graph), and what its backward
    reads for them (their fp32 gradients from the cache; captured, the rows' gradients
    scattered into its every row's K and V)."""
    values: Dict[int, int] = {}
    grads: Dict[int, int] = {}
    for src in plan.sources.values():
        if src.replica_of is not None or src.imported is not None:
            continue
        i = src.producer
        values[i] = values.get(i, 0) + (geometry.read_bytes(src.length, src.reach) if captures else 0)
        grads[i] = grads.get(i, 0) + geometry.grad_bytes(src.length, src.reach)
    for i in grads:
        grads[i] += geometry.read_bytes(plan.micro_batches[i].num_tokens) if captures else 0
    return values, grads


def _step_tables(plan: RankPlan, geometry: KVGeometry, charge: ActivationCharge, varlen: Optional[VarlenCharge],
                 captures: bool) -> dict:
    """The step timeline's fields of :class:`_ByteTables` (charged by rows)."""
    if plan.row_counts is None:
        raise ValueError("a step charged by rows needs the micro-batches' row counts (schedule.step_charge.add_row_counts)")
    values, grads = _produced(plan, geometry, captures)
    graph = {}
    for i, rows in plan.row_counts.items():
        shape = plan.segment_shapes.get(i) if varlen is not None and plan.segment_shapes else None
        padded = varlen.held(shape, plan.micro_batches[i].num_tokens) if shape is not None else 0
        graph[i] = charge.graph(rows) + padded + values.get(i, 0)
    return dict(charge=charge, step_graph=graph, rows=dict(plan.row_counts), produced_grads=grads)


def _byte_tables(plan: RankPlan, geometry: KVGeometry, act_bytes_per_token: int,
                 gathers_in_backward: bool = False, head_bytes: int = 0,
                 varlen: Optional[VarlenCharge] = None, charge: Optional[ActivationCharge] = None,
                 captures: bool = True, offload: bool = False) -> _ByteTables:
    """Per micro-batch: its graph's activations, and the prefix K/V it holds while it runs (or,
    kept, until its backward): copies gathered from the cache and K/V received from other
    ranks in the same step (cross-rank peers, always kept as copies). Gathered again in
    backward, cached prefixes cost one layer's K/V copies and their fp32 gradients at a time
    (and every linear layer's state, always kept as a copy, and every latent layer's rows with
    their up-projected K/V, :meth:`KVGeometry.reader_bytes`). With a ``charge``, the step's
    timeline charges by rows (:func:`_step_tables`; ``captures``: see :func:`_produced`)."""
    graph = {i: len(mb.computed_tokens) * act_bytes_per_token for i, mb in enumerate(plan.micro_batches)}
    by_rows = _step_tables(plan, geometry, charge, varlen, captures) if charge is not None else {}
    attention = {}
    if varlen is not None:
        if plan.segment_shapes is None:
            raise ValueError("a varlen backend's memory plan needs the micro-batches' segment shapes "
                             "(schedule.memory.add_segment_shapes)")
        for i, shape in plan.segment_shapes.items():
            graph[i] += varlen.held(shape, plan.micro_batches[i].num_tokens)
            attention[i] = varlen.transient(shape)
    read = geometry.reader_bytes  # every layer of this stage (a window's kept rows at most; latent: and their up-projection)
    cached = {i: sum(read(plan.sources[s].length, plan.sources[s].reach) for s in mb.reads)
              for i, mb in enumerate(plan.micro_batches)}
    peers = {i: sum(read(p.length) for p in mb.peer_reads) for i, mb in enumerate(plan.micro_batches)}
    if not gathers_in_backward:
        reads = {i: cached[i] + peers[i] for i in cached}
        return _ByteTables(graph, reads, reads, False, head_bytes, attention, offload=offload, **by_rows)
    one_layer = {i: sum(geometry.layer_read_bytes(plan.sources[s].length, plan.sources[s].reach) for s in mb.reads)
                 for i, mb in enumerate(plan.micro_batches)}
    # (a linear layer's fixed-size state and a latent layer's rows and their up-projection are
    # read as copies its graph keeps, whatever this choice)
    held = {i: peers[i] + sum(geometry.derived_read_bytes(plan.sources[s].length, plan.sources[s].reach) for s in mb.reads)
            for i, mb in enumerate(plan.micro_batches)}
    return _ByteTables(graph, held, {i: one_layer[i] + held[i] for i in cached}, True, head_bytes, attention,
                       offload=offload, **by_rows)


def simulated_peak_bytes(
    plan: RankPlan, geometry: KVGeometry, keep_graph: Dict[int, bool], act_bytes_per_token: int,
    block_size: Optional[int] = None, gathers_in_backward: bool = False, head_bytes: int = 0,
    varlen: Optional[VarlenCharge] = None,
) -> int:
    """Peak bytes (KV blocks + retained graphs) of ``plan`` under the given decisions."""
    sizes = (block_size,) * len(geometry.pools) if block_size else pool_block_sizes(geometry, plan.sources.values())
    tables = _byte_tables(plan, geometry, act_bytes_per_token, gathers_in_backward, head_bytes, varlen)
    counts, _ = _simulate(plan, keep_graph, sizes, tables, geometry)
    return int((counts.blocks @ _block_bytes(geometry, sizes) + counts.other).max(initial=0))


@dataclass(frozen=True)
class StepCharge:
    """What a memory plan needs to predict the step's own peak beside the KV plan's (and to fit
    it to a budget): :func:`plan_memory_group`'s ``step``."""

    charge: ActivationCharge
    """A micro-batch's graph, loss head and the step's gradients by rows (the plans' ``row_counts`` set)."""
    budget_bytes: Optional[int] = None
    """The step's timeline must fit this (None: no limit)."""
    offload: bool = False
    """Kept graphs and K/V blocks live in host memory while the running and the next step do not use them."""


def plan_memory(plan: RankPlan, geometry: KVGeometry, budget_bytes: int, act_bytes_per_token: int,
                rereads: bool = False, gathers_in_backward: bool = False, head_bytes: int = 0,
                varlen: Optional[VarlenCharge] = None, step: Optional[StepCharge] = None) -> MemoryPlan:
    """Decide block size, pool size and keep/recompute for every producer of ``plan``."""
    return plan_memory_group([plan], geometry, budget_bytes, act_bytes_per_token, rereads, gathers_in_backward,
                             head_bytes, varlen, step)[0]


class _Timelines:
    """The group's simulated timelines under keep/drop decisions: per rank, the KV plan's bytes
    (blocks, kept graphs, copies; against ``--kv-cache-budget``) and the step's (on the device,
    the running micro-batch's own bytes added; against the step's budget)."""

    def __init__(self, plans, geometry, tables, block_sizes, rereads, budget, step_budget):
        self.plans, self.geometry, self.tables, self.block_sizes = plans, geometry, tables, block_sizes
        self.rereads, self.budget, self.step_budget = rereads, budget, step_budget
        self.block_bytes = _block_bytes(geometry, block_sizes)

    def counts(self, keep) -> List[Tuple[_Counts, Dict[int, int]]]:
        return [_simulate(p, keep, self.block_sizes, t, self.geometry, self.rereads) for p, t in zip(self.plans, self.tables)]

    def __call__(self, keep) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Per rank: (the KV plan's timeline, the step's timeline). The cache allocates each pool
        at its peak when the step begins and keeps it to the end
        (:meth:`~megatron_psrl.kvcache.BlockKVCache.begin_step`): on the step's timeline the
        pools weigh their peak at every step, not the blocks in use."""
        out = []
        for c, _ in self.counts(keep):
            pools = c.device_blocks.max(axis=0, initial=0) @ self.block_bytes if c.device_blocks.size else 0
            out.append((c.blocks @ self.block_bytes + c.other, pools + c.step_other))
        return out

    def over(self, held) -> List[np.ndarray]:
        """Per rank and step: over a budget."""
        step = self.step_budget if self.step_budget is not None else np.iinfo(np.int64).max
        return [(kv > self.budget) | (total > step) for kv, total in held]

    def fits(self, held) -> bool:
        return not any(o.any() for o in self.over(held))


def _drop_until_fits(timelines: _Timelines, producers, keep, forward_at, backward_at) -> dict:
    """Drop graphs greedily (see :func:`plan_memory_group`) until the timelines fit or no graph
    alive at the first step over a budget is left to drop."""
    held = timelines(keep)
    while not timelines.fits(held):
        over = timelines.over(held)
        t = min(int(np.argmax(o)) for o in over if o.any())
        rank = max(range(len(timelines.plans)), key=lambda r: held[r][1][t] if len(held[r][1]) > t else 0)
        table = timelines.tables[rank]
        alive = [p for p in producers if keep[p] and forward_at[p] <= t < backward_at[p]]
        if not alive:
            break  # only blocks and running micro-batches at that step: no graph to drop
        victim = max(alive, key=lambda p: (table.graph[p] + table.held_reads[p],
                                           -timelines.plans[rank].micro_batches[p].num_tokens, -p))
        keep[victim] = False
        held = timelines(keep)
    if timelines.step_budget is not None and not timelines.fits(held):
        # (greedy drops are not always the least: a recomputing reader re-reads its prefixes later)
        dropped = {p: False for p in producers}
        if timelines.fits(timelines(dropped)):
            return dropped
    return keep


def _budget_error(timelines: _Timelines, producers, keep) -> CacheBudgetError:
    """The smallest peaks this schedule reaches (the planner's decisions, or every producer
    recomputing: dropping is not always a saving, recomputing readers re-read later)."""
    def peaks(decisions, which):
        return max(int(h[which].max(initial=0)) for h in timelines(decisions))

    dropped = {p: False for p in producers}
    kv = min(peaks(keep, 0), peaks(dropped, 0))
    if kv > timelines.budget:
        return CacheBudgetError(
            f"the cached prefixes of this step need at least {kv} bytes at their peak (KV blocks of the "
            f"prefixes alive at once plus the graphs, gathered K/V copies and loss head in use; "
            f"{peaks({p: True for p in producers}, 0)} with every graph kept) but --kv-cache-budget is "
            f"{timelines.budget} bytes")
    step = min(peaks(keep, 1), peaks(dropped, 1))
    return StepBudgetError(f"this step needs at least {step} bytes at its peak (KV blocks, kept graphs, the "
                           f"running micro-batch's graph, loss head and gradients) but the step's budget is "
                           f"{timelines.step_budget} bytes", needed=step)


def plan_memory_group(plans: List[RankPlan], geometry: KVGeometry, budget_bytes: int,
                      act_bytes_per_token: int, rereads: bool = False,
                      gathers_in_backward: bool = False, head_bytes: int = 0,
                      varlen: Optional[VarlenCharge] = None, step: Optional[StepCharge] = None) -> List[MemoryPlan]:
    """:func:`plan_memory` for ranks that run one schedule in lockstep (a cross-rank group;
    or a single rank): a producer step keeps or drops its graph on all of them alike, because
    a recomputation re-runs the step's exchange, in which every rank takes part.

    Starts from keeping every producer's graph. While some rank's simulated timeline exceeds
    the budget, it finds the first schedule step over budget and drops the largest graph
    alive at that step on that rank (fewest tokens on ties), then simulates again: one
    simulation per dropped graph. Dropping is not always a saving: a reader that recomputes
    reads its cached prefixes again later, which keeps their K/V blocks alive longer; the
    simulation accounts for that. ``rereads``: with activation recomputation every backward
    reads its cached prefixes again (their K/V stay until then). ``gathers_in_backward``: the
    attention gathers cached K/V again in its backward pass (``torch``, ``flash``, ``te``) instead of
    keeping copies in the graph; every backward then re-reads too. ``head_bytes``: the loss
    head's transient peak, charged at every step. ``varlen``: the ``flash`` / ``te`` backends'
    gathered K/V and padded statistics (:class:`VarlenCharge`; the plans' ``segment_shapes``).
    ``step``: the step's own timeline by rows (:class:`StepCharge`; ``MemoryPlan.step_timeline_bytes``),
    which must fit its budget too (:class:`StepBudgetError` when no decision does).
    """
    schedule = plans[0].schedule
    block_sizes = pool_block_sizes(geometry, (s for p in plans for s in p.sources.values()))
    forward_at = {i: t for t, (op, i) in enumerate(schedule) if op == "forward"}
    backward_at = {i: t for t, (op, i) in enumerate(schedule) if op == "backward"}
    # (an import holds no graph: it receives K/V; an idle step holds nothing)
    producers = sorted(i for i in forward_at if all(p.micro_batches[i].computes for p in plans))
    charge, offload = (step.charge, step.offload) if step is not None else (None, False)
    tables = [_byte_tables(p, geometry, act_bytes_per_token, gathers_in_backward, head_bytes, varlen, charge,
                           not rereads, offload) for p in plans]
    timelines = _Timelines(plans, geometry, tables, block_sizes, rereads, budget_bytes,
                           step.budget_bytes if step is not None else None)
    keep = _drop_until_fits(timelines, producers, {p: True for p in producers}, forward_at, backward_at)
    if not timelines.fits(timelines(keep)):
        raise _budget_error(timelines, producers, keep)
    memories = []
    for plan, (counts, last_read), (kv, total) in zip(plans, timelines.counts(keep), timelines(keep)):
        # (offloaded, a source's blocks go back to the pool: the pool holds what is on the device)
        pool_sizes = tuple(int(n) for n in (counts.device_blocks if offload else counts.blocks).max(axis=0, initial=0))
        recompute = int(sum(plan.micro_batches[p].num_tokens for p in producers if not keep[p]))
        memories.append(MemoryPlan(
            block_size=_row_block_size(geometry, block_sizes), pool_blocks=sum(pool_sizes), keep_graph=dict(keep),
            kv_release_step=dict(last_read), peak_bytes=int(kv.max(initial=0)), recompute_tokens=recompute,
            timeline_bytes=kv.tolist(), gathers_in_backward=gathers_in_backward, pool_sizes=pool_sizes,
            pool_block_sizes=block_sizes,
            pool_states=tuple(p.state for p in geometry.pools), step_timeline_bytes=total.tolist(),
            offloaded_bytes=(counts.moved_blocks @ timelines.block_bytes + counts.moved_bytes).tolist()
            if offload else [], host_offload=offload,
        ))
    return memories


def _row_block_size(geometry: KVGeometry, block_sizes: BlockSizes) -> int:
    """``MemoryPlan.block_size``: the block size of the pools that keep whole sources (those
    without a sliding window; every pool's when all have one)."""
    whole = [bs for p, bs in zip(geometry.pools, block_sizes) if p.state.window is None]
    return (whole or list(block_sizes))[0]


def step_peak_bytes(plan: RankPlan, memory: Optional[MemoryPlan], act_bytes_per_token: int,
                    head_bytes: int = 0, varlen: Optional[VarlenCharge] = None, in_flight: int = 1,
                    charge: Optional[ActivationCharge] = None) -> int:
    """Predicted peak of one training step above the weights (and above gradients allocated
    before it): the memory plan's step timeline (KV blocks, kept graphs, gathered K/V copies, a
    varlen backend's gathered copies, and at every schedule step what the running micro-batch
    holds: its graph when the plan does not hold it already, its loss head, and by rows the
    parameters' gradients once a backward ran; :meth:`_ByteTables.running`). ``memory`` None: a
    step without cached prefixes (every step a forward+backward; ``varlen``'s charges added
    here, the plans' ``segment_shapes`` set); by rows with ``charge`` (the ``row_counts`` set;
    a memory plan charges as it was planned). ``in_flight``: graphs a pipeline stage holds at
    once in a step without cached prefixes (megatron's 1F1B: up to the pipeline's stages, on
    its first stage; with cached prefixes every stage runs the plan's order)."""
    if memory is not None and memory.step_timeline_bytes:
        return int(max(memory.step_timeline_bytes))
    shapes = plan.segment_shapes if varlen is not None else None
    if varlen is not None and shapes is None:
        raise ValueError("a varlen backend's step peak needs the micro-batches' segment shapes (add_segment_shapes)")
    if memory is None and charge is not None:
        return _independent_step_peak(plan, charge, varlen, in_flight)
    keep = memory.keep_graph if memory is not None else {}
    timeline = memory.timeline_bytes if memory is not None else [head_bytes] * len(plan.schedule)
    peak = 0
    for t, (op, i) in enumerate(plan.schedule):
        mb = plan.micro_batches[i]
        running = op == "forward_backward" or (op == "backward" and not keep.get(i, True))
        extra = mb.num_tokens * act_bytes_per_token if running else 0
        if shapes is not None and i in shapes:
            extra += varlen.held(shapes[i], mb.num_tokens) if running else 0
            extra += varlen.transient(shapes[i]) if memory is None else 0  # (a plan's timeline has it)
        peak = max(peak, timeline[t] + extra)
    return int(peak)


def _independent_step_peak(plan: RankPlan, charge: ActivationCharge, varlen: Optional[VarlenCharge],
                           in_flight: int) -> int:
    """:func:`step_peak_bytes` of a step of independent micro-batches, charged by rows: at every
    backward, the micro-batch's own peak and the graphs of the ``in_flight - 1`` next ones."""
    if plan.row_counts is None:
        raise ValueError("a step peak charged by rows needs the micro-batches' row counts (add_row_counts)")
    order = [i for _, i in plan.schedule]
    shapes = plan.segment_shapes or {}

    def padded(i: int) -> int:
        return varlen.held(shapes[i], plan.micro_batches[i].num_tokens) if varlen is not None and i in shapes else 0

    def graph(i: int) -> int:
        rows = plan.row_counts.get(i)
        return (charge.graph(rows) if rows is not None else 0) + padded(i)

    peak = 0
    for t, i in enumerate(order):
        rows = plan.row_counts.get(i)
        own = charge.backward_peak(rows, charge.grad_bytes if t else 0) if rows is not None else charge.grad_bytes
        own += padded(i) + (varlen.transient(shapes[i]) if varlen is not None and i in shapes else 0)
        ahead = sum(graph(j) for j in order[t + 1:t + max(1, in_flight)])
        peak = max(peak, own + ahead)
    return int(peak)


def plan_forward_memory(plan: RankPlan, geometry: KVGeometry, budget_bytes: int) -> MemoryPlan:
    """The forward-only (log-prob) variant: micro-batches in order, K and V blocks only, freed
    after their last reader; no gradient blocks, no retained graphs."""
    block_sizes = pool_block_sizes(geometry, plan.sources.values())
    block_bytes = _block_bytes(geometry, block_sizes)
    last_read = ins.forward_release_steps(plan)
    tables = _byte_tables(plan, geometry, 0)
    blocks, other = count_stream(plan, ins.lower_forward(plan, last_read), block_sizes, tables, geometry)
    held = (blocks @ block_bytes + other).tolist()
    peak_blocks = blocks.max(axis=0, initial=0)
    peak = max(held, default=0)
    if peak > budget_bytes:
        raise CacheBudgetError(
            f"the cached prefixes need {peak} bytes of KV blocks at their peak but --kv-cache-budget is "
            f"{budget_bytes} bytes"
        )
    pool_sizes = tuple(int(n) for n in peak_blocks)
    return MemoryPlan(block_size=_row_block_size(geometry, block_sizes), pool_blocks=sum(pool_sizes), keep_graph={},
                      kv_release_step=last_read, peak_bytes=peak, timeline_bytes=held, pool_sizes=pool_sizes,
                      pool_states=tuple(p.state for p in geometry.pools), pool_block_sizes=block_sizes)


__all__ = [
    "MemoryPlan",
    "StepBudgetError",
    "StepCharge",
    "ALLOCATOR_MARGIN",
    "MODELLED_BACKENDS",
    "VarlenCharge",
    "add_segment_shapes",
    "activation_bytes_per_token",
    "attention_saved_bytes_per_token",
    "moe_saved_bytes_per_token",
    "plan_forward_memory",
    "plan_memory",
    "plan_memory_group",
    "pool_block_sizes",
    "saved_activation_bytes_per_token",
    "simulated_peak_bytes",
    "step_peak_bytes",
]


@dataclass(frozen=True)
class MemorySettings:
    """What the memory plans of a run need besides the step plan: the K/V geometry every stage
    plans with, the budget and the activation sizes. Called with ranks planned together, it
    returns their training memory plans (:func:`plan_memory_group`);
    :meth:`forward` returns forward-only ones (:func:`plan_forward_memory`)."""

    geometry: KVGeometry
    """K/V geometry the plans assume (every pipeline stage's: ``KVGeometry.for_pipeline_planning``)."""
    budget_bytes: int
    """``--kv-cache-budget``."""
    act_bytes_per_token: int = 0
    """Bytes a kept graph holds per token (:func:`activation_bytes_per_token`): the KV plan's charge."""
    rereads: bool = False
    """Activation recomputation: every backward reads its cached prefixes again."""
    gathers_in_backward: bool = False
    """The attention gathers cached K/V again in its backward (the ``torch`` backend)."""
    head_bytes: int = 0
    """The loss head's transient peak, charged at every step."""
    varlen: Optional[VarlenCharge] = None
    """The ``flash`` / ``te`` backends' gathered K/V and padded statistics (None: ``torch``)."""
    step: Optional[StepCharge] = None
    """The step's own timeline by rows, and its budget (``--memory-budget`` less the weights,
    gradients and optimizer state): :class:`StepCharge` (None: the KV plan only). The plans
    need their ``row_counts`` then (:func:`~megatron_psrl.schedule.step_charge.add_row_counts`)."""

    def __call__(self, plans: List[RankPlan]) -> List[MemoryPlan]:
        return plan_memory_group(plans, self.geometry, self.budget_bytes, self.act_bytes_per_token, self.rereads,
                                 self.gathers_in_backward, self.head_bytes, self.varlen, self.step)

    def forward(self, plans: List[RankPlan]) -> List[MemoryPlan]:
        return [plan_forward_memory(plan, self.geometry, self.budget_bytes) for plan in plans]
