"""Gated DeltaNet (linear attention) on tree-packed micro-batches, exact per root-to-leaf path.

Qwen3-Next and Qwen3.5 run three of every four layers as Gated DeltaNet. Softmax attention
shares a prefix through its K/V (the tree plan lets every token read its ancestors' keys); a
linear-attention layer has no keys to read: what a token sees of its past is the recurrent
state ``S`` (``[h_v, d_k, d_v]`` per sequence) and the last ``K - 1`` inputs of its short causal
convolution. In a prefix tree those are the *shared prefix*: a segment starts from its parent
segment's final state and conv tail, as if every sample ran alone, and the prefix's tokens are
computed once. Nothing of megatron's ``GatedDeltaNet`` (sequences in a batch, a zero state
for each) can express that, so :class:`TreeGatedDeltaNet` keeps megatron's parameters and
constructor and replaces its forward:

* the conv mixes every token with its ``K - 1`` predecessors on its own path (across segment
  boundaries, several ancestors up when segments are short; zeros before a root), a gather of
  precomputed predecessor rows per tap that keeps only its input for the backward;
* the chunked gated delta rule runs per segment from its parent's final state, all segments of
  one tree depth in one padded kernel call (the number of calls is the depth of the tree, not
  the number of segments). Padding at a segment's end (``k = v = beta = 0``, ``g = 0``) leaves
  its final state unchanged, so a branch's state is exact. Autograd sums a state's gradient
  over its children: the prefix gets the gradient of every sample that continues it.

The index structures (predecessor rows, per-depth segment rows, state slots) are built on the
host from the attention plan, once per micro-batch, and copied with
:func:`~megatron_psrl.host_copy.host_to_device`. Mechanism 2 (a prefix cached across
micro-batches) goes through :func:`tree_gated_delta_rule`: roots may start from an external
:class:`LinearState` (a cached prefix) and every segment's final :class:`LinearState` is
returned to be cached; the layer exchanges them with the engine's hook
(:class:`LinearPrefixHook`), segments cut where a produced prefix ends. fla's ``chunk_gated_delta_rule`` runs on CUDA when installed, megatron's
``torch_chunk_gated_delta_rule`` elsewhere; both are optional extras for speed only.

The output norm is Hugging Face's gated RMSNorm (``weight * rmsnorm(x)``, weight init ones,
then ``* silu(gate)``) whatever ``layernorm_zero_centered_gamma`` says for the model's other
norms (Qwen3-Next's are zero-centred, this one is not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, torch_chunk_gated_delta_rule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import deprecate_inference_params

from megatron_psrl.attention.metadata import TreeAttentionMetadata
from megatron_psrl.attention.plan import AttentionPlan, causal_plan
from megatron_psrl.compat import gated_delta_net_construction
from megatron_psrl.host_copy import host_to_device

Tensor = torch.Tensor

try:  # optional: Triton kernels for CUDA
    from fla.modules.l2norm import l2norm as fla_l2norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:
    fla_l2norm = None
    fla_chunk_gated_delta_rule = None

L2NORM_EPS = 1e-6
"""fla's and Hugging Face's ``l2norm`` epsilon (``x * rsqrt(sum(x^2) + eps)``)."""


# ----------------------------------------------------------------------------- states and layout
@dataclass(frozen=True)
class LinearState:
    """What a linear-attention layer carries from a prefix to its continuations (per sequence).

    The prefix cache of mechanism 2 keeps one per cached prefix; :func:`tree_gated_delta_rule`
    takes them for root segments and returns one per segment."""

    recurrent: Tensor
    """fp32 ``[n, h_v, d_k, d_v]``: the delta rule's state after the prefix's last token."""

    conv_tail: Tensor
    """``[n, K - 1, conv_dim]``: the prefix's last ``K - 1`` conv inputs (pre-conv q|k|v), oldest
    first; zero rows where the path has fewer tokens."""


@dataclass(frozen=True)
class GdnHeads:
    """Head layout of this tensor-parallel rank's share of a Gated DeltaNet layer."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    use_qk_l2norm: bool = True
    deterministic: bool = False
    """Use the torch kernel also where fla is installed (fla's backward is not deterministic)."""

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class SegmentForest:
    """The segments of a pack as a forest (host arrays, int64 ``[G]``, depth-first order)."""

    seg_start: np.ndarray
    seg_end: np.ndarray
    parent: np.ndarray
    """Parent segment, -1 for a root."""
    source: np.ndarray
    """For a root: the external source (a cached prefix) it continues, -1 for none."""
    num_sources: int = 0

    @classmethod
    def from_plan(cls, plan: AttentionPlan) -> "SegmentForest":
        """The forest of a pack's attention plan: a segment's parent is the segment holding its
        last ancestor key (ancestor blocks cover whole segments and end where a parent ends)."""
        if plan.is_query_subset:
            raise ValueError("linear attention needs the pack's plan, not a query subset (select_queries)")
        starts, ends = plan.seg_start, plan.seg_end
        g = plan.num_segments
        parent_end = np.zeros(g, np.int64)
        source = np.full(g, -1, np.int64)
        for qa, qb, kb, src in zip(plan.block_q_start, plan.block_q_end, plan.block_k_end, plan.block_source):
            first, last = np.searchsorted(starts, [qa, qb])
            if first >= g or starts[first] != qa or (last < g and starts[last] != qb):
                raise ValueError(f"ancestor block over queries {int(qa)}:{int(qb)} does not cover whole segments")
            if src < 0:
                parent_end[first:last] = np.maximum(parent_end[first:last], kb)
            else:
                if kb != plan.external_lengths[int(src)]:
                    raise ValueError("a segment continues part of an external prefix: its state is not cached")
                source[first:last] = src
        parent = np.where(parent_end > 0, np.searchsorted(ends, parent_end - 1, side="right"), -1)
        if np.any(ends[np.maximum(parent, 0)][parent >= 0] != parent_end[parent >= 0]):
            raise ValueError("a segment branches off inside its parent segment")
        source = np.where(parent < 0, source, -1)
        return cls(starts, ends, parent.astype(np.int64), source, len(plan.external_lengths))

    def cut_after(self, rows: np.ndarray) -> "SegmentForest":
        """The forest with a segment ending after every pack row of ``rows`` (a cached source's
        last token inside a segment: its state is then a segment's final state). The piece
        after a cut is the child of the piece before; the segment's children follow its last
        piece. Exact: a child starts from its parent's final state and conv tail."""
        t = int(self.seg_end[-1]) if len(self.seg_end) else 0
        cuts = np.unique(np.asarray(rows, np.int64) + 1)
        cuts = cuts[(cuts > 0) & (cuts < t) & ~np.isin(cuts, self.seg_start)]
        if not len(cuts):
            return self
        starts = np.sort(np.concatenate([self.seg_start, cuts]))
        orig = np.searchsorted(self.seg_start, starts, side="right") - 1  # the segment each piece is of
        ends = np.minimum(np.append(starts[1:], t), self.seg_end[orig])
        first = np.isin(starts, self.seg_start)
        last_piece = np.searchsorted(starts, self.seg_end, side="left") - 1  # of every original segment
        orig_parent = self.parent[orig]
        parent = np.where(first, np.where(orig_parent >= 0, last_piece[np.maximum(orig_parent, 0)], -1),
                          np.arange(len(starts)) - 1)
        source = np.where(first, self.source[orig], -1)
        return SegmentForest(starts, ends, parent.astype(np.int64), source.astype(np.int64), self.num_sources)


@dataclass(frozen=True)
class DepthLevel:
    """Segments of one tree depth of similar lengths, padded to the longest: one kernel call
    (device tensors). A depth whose segments differ much in length is cut into several
    (:data:`PADDING_LIMIT`)."""

    rows: Tensor
    """int64 ``[B, L]``: pack row of every (segment, position); padding reads the zero row ``t``."""
    init_slot: Tensor
    """int64 ``[B]``: initial state of every segment, a row of ``[zero; external states]`` at
    depth 0, else a row of the previous depth's final states (all its levels', in order)."""
    depth: int = 0
    """The tree depth of its segments."""


PADDING_LIMIT = 1.25
"""A depth's segments go into one kernel call while its padded size stays within this factor of
their tokens; longer ones start another call (sorted by length: a GRPO group's responses of
64-384 tokens would otherwise compute about twice their tokens)."""


def _length_buckets(lengths: np.ndarray) -> list:
    """Indices into ``lengths`` grouped for kernel calls: longest first, a group closed when
    adding the next would pad it beyond :data:`PADDING_LIMIT` times its tokens."""
    order = np.argsort(-lengths, kind="stable")
    buckets, current, tokens = [], [], 0
    for i in order:
        if current and lengths[current[0]] * (len(current) + 1) > PADDING_LIMIT * (tokens + lengths[i]):
            buckets.append(np.array(current, np.int64))
            current, tokens = [], 0
        current.append(i)
        tokens += int(lengths[i])
    if current:
        buckets.append(np.array(current, np.int64))
    return buckets


@dataclass(frozen=True)
class TreeLinearIndex:
    """Everything :func:`tree_gated_delta_rule` gathers by, for one pack (device tensors)."""

    num_tokens: int
    conv_rows: Tensor
    """int64 ``[t, K]``: the conv window of every token, rows of ``[x; zero; external tails]``,
    oldest first, the token itself last."""
    levels: Tuple[DepthLevel, ...]
    out_rows: Tensor
    """int64 ``[t]``: every token's row in the concatenated padded outputs of all levels."""
    state_rows: Tensor
    """int64 ``[G]``: every segment's row in the concatenated final states of all levels."""
    tail_rows: Tensor
    """int64 ``[G, K - 1]``: every segment's final conv tail, rows of ``[x; zero; tails]``."""
    num_sources: int
    segment_ends: np.ndarray = None
    """Host int64 ``[G]``: every segment's end row (exclusive), segment order: which segment's
    final state is a cached source's (:class:`SegmentStates`)."""


def _segment_depths(forest: SegmentForest) -> np.ndarray:
    depth = np.zeros(len(forest.parent), np.int64)
    for s, p in enumerate(forest.parent):  # parents precede children (depth-first order)
        if p >= 0:
            depth[s] = depth[p] + 1
    return depth


def _predecessor_rows(forest: SegmentForest, kernel_size: int) -> np.ndarray:
    """int64 ``[t, K]``: the conv window rows of every token (see ``TreeLinearIndex.conv_rows``)."""
    t = int(forest.seg_end[-1]) if len(forest.seg_end) else 0
    tail = kernel_size - 1
    zero = t
    # prev over the rows [pack tokens, zero row, tail rows of every source (oldest first)]
    prev = np.arange(-1, t + 1 + forest.num_sources * tail, dtype=np.int64)
    prev[zero] = zero
    first = forest.seg_start
    parent_last = forest.seg_end[np.maximum(forest.parent, 0)] - 1
    newest_tail = zero + forest.source * tail + tail  # the source's last tail row
    prev[first] = np.where(forest.parent >= 0, parent_last, np.where(forest.source >= 0, newest_tail, zero))
    for src in range(forest.num_sources):
        if tail:
            prev[zero + 1 + src * tail] = zero  # the oldest tail row follows the zero row
    cur = np.arange(t, dtype=np.int64)
    window = [cur]
    for _ in range(tail):
        cur = prev[cur]
        window.append(cur)
    return np.stack(window[::-1], axis=1)


def build_tree_linear_index(forest: SegmentForest, kernel_size: int, device: torch.device) -> TreeLinearIndex:
    """Host-side index of a pack (numpy from the plan), copied to ``device`` once."""
    t = int(forest.seg_end[-1]) if len(forest.seg_end) else 0
    conv_rows = _predecessor_rows(forest, kernel_size)
    depth = _segment_depths(forest)
    g = len(depth)
    slot = np.zeros(g, np.int64)  # row of a segment's state within its level
    state_rows = np.zeros(g, np.int64)
    out_rows = np.zeros(t, np.int64)
    levels, out_base, state_base = [], 0, 0
    for d in range(int(depth.max()) + 1 if g else 0):
        at_depth = np.flatnonzero(depth == d)
        buckets = _length_buckets(forest.seg_end[at_depth] - forest.seg_start[at_depth])
        ordered = np.concatenate([at_depth[b] for b in buckets])  # the depth's final states, in this order
        slot_of = {int(s): i for i, s in enumerate(ordered)}
        for bucket in buckets:
            segs = at_depth[bucket]
            lengths = forest.seg_end[segs] - forest.seg_start[segs]
            width = int(lengths.max())
            pos = np.arange(width, dtype=np.int64)
            rows = np.where(pos[None, :] < lengths[:, None], forest.seg_start[segs][:, None] + pos[None, :], t)
            init = forest.source[segs] + 1 if d == 0 else slot[forest.parent[segs]]
            for b, s in enumerate(segs):
                out_rows[forest.seg_start[s]:forest.seg_end[s]] = out_base + b * width + np.arange(lengths[b])
            state_rows[segs] = state_base + np.arange(len(segs))
            levels.append(DepthLevel(rows=host_to_device(rows, device, np.int64),
                                     init_slot=host_to_device(init, device, np.int64), depth=d))
            out_base += len(segs) * width
            state_base += len(segs)
        slot[ordered] = [slot_of[int(s)] for s in ordered]
    tail_rows = conv_rows[forest.seg_end - 1, 1:] if g else np.zeros((0, kernel_size - 1), np.int64)
    return TreeLinearIndex(num_tokens=t, conv_rows=host_to_device(conv_rows, device, np.int64),
                           levels=tuple(levels), out_rows=host_to_device(out_rows, device, np.int64),
                           state_rows=host_to_device(state_rows, device, np.int64),
                           tail_rows=host_to_device(tail_rows, device, np.int64), num_sources=forest.num_sources,
                           segment_ends=np.asarray(forest.seg_end, np.int64))


# ------------------------------------------------------------------------------------- the math
@dataclass(frozen=True)
class TreeGatedDeltaOutput:
    """What :func:`tree_gated_delta_rule` returns."""

    core: Tensor
    """``[t, h_v, d_v]``: the delta rule's output of every token (before the gated norm)."""
    states: Optional[LinearState] = None
    """Every segment's final state and conv tail (``[G, ...]``, segment order), if asked for."""


@dataclass(frozen=True)
class SegmentStates:
    """Every segment's final state of one pack in one layer, as the layer hands it to its
    prefix hook (:class:`LinearPrefixHook`)."""

    states: LinearState
    """``[G, ...]`` in segment order, in the graph."""
    segment_ends: np.ndarray
    """Host int64 ``[G]``: every segment's end row (exclusive)."""

    def segment_ending_after(self, row: int) -> int:
        """The segment whose last row is ``row`` (a cached source's last token)."""
        g = int(np.searchsorted(self.segment_ends, row + 1))
        if g >= len(self.segment_ends) or self.segment_ends[g] != row + 1:
            raise ValueError(f"no segment ends after pack row {row}: its state is no segment's final state "
                             "(the layer cuts segments at LinearPrefixHook.linear_cuts)")
        return g


@runtime_checkable
class LinearPrefixHook(Protocol):
    """How mechanism 2 plugs into a linear-attention layer (``packed_seq_params.kv_hook``; the
    engine's :class:`~megatron_psrl.engine.prefix_kv.PrefixKV`): the cached state of every
    prefix the pack continues in, the final states of the prefixes it produces out."""

    def linear_cuts(self) -> np.ndarray:
        """Host int64: the last pack row of every prefix this pack produces (a segment ends
        there: its final state is the prefix's)."""

    def external_linear_state(self, layer_number: int) -> LinearState:
        """The :class:`LinearState` of every external source of the plan (``[E, ...]``, in
        ``plan.external_lengths`` order), gradients flowing to the cache."""

    def on_linear_states(self, layer_number: int, segments: SegmentStates) -> Optional[Tensor]:
        """Called with every segment's final state: stores (and captures) those of the produced
        prefixes. May return a zero scalar to add to the layer's output, which keeps
        gradient-injecting functions of the states in the graph (activation recomputation)."""


def l2norm(x: Tensor) -> Tensor:
    """fla's / Hugging Face's ``x * rsqrt(sum(x^2) + eps)`` over the last dimension."""
    if fla_l2norm is not None and x.is_cuda:
        return fla_l2norm(x)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state: Tensor, deterministic: bool = False):
    """``[B, L, h, d]`` inputs from ``initial_state`` ``[B, h_v, d_k, d_v]`` -> (out
    ``[B, L, h_v, d_v]``, final state fp32): fla's kernel on CUDA when installed, else megatron's
    torch one (the same chunked algorithm)."""
    if fla_chunk_gated_delta_rule is not None and q.is_cuda and not deterministic:
        return fla_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=False)
    return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                        output_final_state=True, use_qk_l2norm_in_kernel=False)


class _PathConv(torch.autograd.Function):
    """The depthwise conv over gathered windows, saving only its input rows: a window tensor
    ``[t, K, C]`` (or ``K`` gathered copies) kept for the backward would be ``K`` times the
    layer's widest activation. Taps accumulate in fp32, as a conv kernel does; the backward
    gathers again."""

    @staticmethod
    def forward(ctx, rows: Tensor, conv_rows: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(rows, conv_rows, weight)
        acc = torch.promote_types(rows.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        taps = weight[:, 0, :].to(acc)  # [C, K]
        out = None
        for j in range(conv_rows.shape[1]):
            term = rows.index_select(0, conv_rows[:, j]).to(acc) * taps[:, j]  # [t, C]
            out = term if out is None else out + term
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        rows, conv_rows, weight = ctx.saved_tensors
        acc = torch.promote_types(rows.dtype, torch.float32)
        taps = weight[:, 0, :].to(acc)
        grad32 = grad_out.to(acc)  # [t, C]
        grad_rows = torch.zeros(rows.shape, dtype=acc, device=rows.device)
        grad_taps = torch.empty_like(taps)  # [C, K]
        for j in range(conv_rows.shape[1]):
            grad_rows.index_add_(0, conv_rows[:, j], grad32 * taps[:, j])
            grad_taps[:, j] = (grad32 * rows.index_select(0, conv_rows[:, j]).to(acc)).sum(0)
        return grad_rows.to(rows.dtype), None, grad_taps.unsqueeze(1).to(weight.dtype)


def conv_along_paths(rows: Tensor, conv_rows: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The depthwise causal conv over every token's own path: ``rows`` ``[r, C]`` (pack tokens,
    the zero row, external tails), ``conv_rows`` ``[t, K]``, ``weight`` ``[C, 1, K]`` -> ``[t, C]``
    (before the activation)."""
    out = _PathConv.apply(rows, conv_rows, weight)
    return out if bias is None else out + bias


def _heads(mixed: Tensor, heads: GdnHeads) -> Tuple[Tensor, Tensor, Tensor]:
    """Post-conv ``[t, C]`` -> q, k ``[t, h_v, d_k]`` (l2-normed, repeated per value head), v ``[t, h_v, d_v]``."""
    t = mixed.shape[0]
    q, k, v = torch.split(mixed, [heads.qk_dim, heads.qk_dim, heads.v_dim], dim=-1)
    q = q.reshape(t, heads.num_key_heads, heads.key_head_dim)
    k = k.reshape(t, heads.num_key_heads, heads.key_head_dim)
    v = v.reshape(t, heads.num_value_heads, heads.value_head_dim)
    if heads.use_qk_l2norm:
        q, k = l2norm(q.contiguous()), l2norm(k.contiguous())
    ratio = heads.num_value_heads // heads.num_key_heads
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return q, k, v


def _with_zero_row(x: Tensor) -> Tensor:
    return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], dim=0)


def _delta_rule_by_depth(q, k, v, g, beta, index: TreeLinearIndex, first_states: Tensor,
                         deterministic: bool) -> Tuple[Tensor, Tensor]:
    """One kernel call per level (a tree depth, or a length bucket of one). ``first_states``
    ``[1 + E, h_v, d_k, d_v]`` (zero, then external). Returns the outputs ``[t, h_v, d_v]`` and
    the final states ``[G, h_v, d_k, d_v]``."""
    q, k, v, g, beta = (_with_zero_row(x) for x in (q, k, v, g, beta))  # row t: padding
    outs, finals, states, depth, at_depth = [], [], first_states, 0, []
    for level in index.levels:
        if level.depth != depth:  # the previous depth's final states, all its levels', in order
            states, depth, at_depth = torch.cat(at_depth), level.depth, []
        b, width = level.rows.shape
        flat = level.rows.reshape(-1)
        take = lambda x: x.index_select(0, flat).reshape((b, width) + tuple(x.shape[1:]))  # noqa: E731
        out, final = chunk_gated_delta_rule(take(q), take(k), take(v), take(g), take(beta),
                                            initial_state=states.index_select(0, level.init_slot),
                                            deterministic=deterministic)
        outs.append(out.reshape((b * width,) + tuple(out.shape[2:])))
        finals.append(final)
        at_depth.append(final)
    core = torch.cat(outs).index_select(0, index.out_rows)
    return core, torch.cat(finals).index_select(0, index.state_rows)


def tree_gated_delta_rule(mixed_qkv: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                          conv_bias: Optional[Tensor], heads: GdnHeads, index: TreeLinearIndex,
                          initial: Optional[LinearState] = None, return_states: bool = False,
                          activation=F.silu) -> TreeGatedDeltaOutput:
    """The conv and the gated delta rule of a tree-packed micro-batch, every token on its own path.

    Args:
        mixed_qkv: ``[t, conv_dim]`` pre-conv q|k|v of every pack token.
        g: fp32 ``[t, h_v]`` log decay (``-exp(A_log) * softplus(alpha + dt_bias)``).
        beta: ``[t, h_v]`` write strength (``sigmoid(b)``).
        conv_weight, conv_bias: the depthwise conv's ``[conv_dim, 1, K]`` weight and bias.
        index: the pack's :class:`TreeLinearIndex`.
        initial: one :class:`LinearState` per external source (``index.num_sources``), the
            states root segments continuing that source start from; other roots start from zero.
        return_states: also return every segment's final :class:`LinearState`.
    """
    if index.num_sources and (initial is None or initial.recurrent.shape[0] != index.num_sources):
        raise ValueError(f"the pack continues {index.num_sources} external prefixes: pass their LinearState")
    tail = conv_weight.shape[-1] - 1
    h_v, d_k, d_v = heads.num_value_heads, heads.key_head_dim, heads.value_head_dim
    rows = [mixed_qkv, mixed_qkv.new_zeros(1, mixed_qkv.shape[1])]  # [t + 1 (+ E * tail), C]
    first_states = [mixed_qkv.new_zeros(1, h_v, d_k, d_v, dtype=torch.float32)]
    if index.num_sources:
        rows.append(initial.conv_tail.reshape(-1, mixed_qkv.shape[1]).to(mixed_qkv.dtype))
        first_states.append(initial.recurrent.float())
    rows = torch.cat(rows)
    mixed = activation(conv_along_paths(rows, index.conv_rows, conv_weight, conv_bias))  # [t, C]
    q, k, v = _heads(mixed, heads)
    core, finals = _delta_rule_by_depth(q, k, v, g, beta, index, torch.cat(first_states), heads.deterministic)
    states = None
    if return_states:
        g_count = index.tail_rows.shape[0]
        conv_tail = rows.index_select(0, index.tail_rows.reshape(-1)).reshape(g_count, tail, -1)
        states = LinearState(recurrent=finals, conv_tail=conv_tail)
    return TreeGatedDeltaOutput(core=core, states=states)


# ------------------------------------------------------------------------------------ the layer
class GatedRMSNorm(torch.nn.Module):
    """Hugging Face's ``Qwen3NextRMSNormGated`` norm part: ``weight * rmsnorm(x)``, weight init
    ones, never zero-centred (the gate is applied by the layer). The norm is per value head and
    heads are split over tensor-parallel ranks, so its weight's gradient is summed over them in
    the backward (megatron's ``copy_to_tensor_model_parallel_region``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.eps = eps
        self.tp_group = kwargs.get("tp_group")

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        return weight * normed.to(dtype)


class TreeGatedDeltaNet(GatedDeltaNet):
    """megatron's ``GatedDeltaNet`` (its parameters, constructor and checkpoint layout) whose
    forward runs a tree-packed micro-batch (:class:`TreeAttentionMetadata`) exactly per path, or
    a plain ``[s, b, h]`` batch of independent sequences without metadata."""

    computes_every_row = True
    """The last layer cannot skip rows: every row's output feeds the states of its descendants."""

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, *args, **kwargs):
        with gated_delta_net_construction(config):
            super().__init__(config, submodules, *args, **kwargs)
        if isinstance(self.out_norm, GatedRMSNorm):
            self.out_norm.tp_group = self.pg_collection.tp
        self._plain_index = None

    def reset_parameters(self):
        with gated_delta_net_construction(self.config):
            super().reset_parameters()

    @property
    def heads(self) -> GdnHeads:
        tp = self.tp_size
        return GdnHeads(self.num_key_heads // tp, self.num_value_heads // tp, self.key_head_dim,
                        self.value_head_dim, self.use_qk_l2norm, bool(self.config.deterministic_mode))

    def tree_index(self, meta: Optional[TreeAttentionMetadata], t: int, b: int, device,
                   cuts: Optional[np.ndarray] = None) -> TreeLinearIndex:
        """The pack's index (built once per micro-batch and kernel size, shared by all layers),
        or that of ``b`` independent sequences of ``t`` tokens without metadata; ``cuts``: pack
        rows after which a segment must end (:meth:`LinearPrefixHook.linear_cuts`)."""
        k = self.conv_kernel_dim
        if meta is None:
            key = (t, b, str(device), k)
            if self._plain_index is None or self._plain_index[0] != key:
                forest = SegmentForest.from_plan(causal_plan([t] * b))
                self._plain_index = (key, build_tree_linear_index(forest, k, device))
            return self._plain_index[1]
        if not isinstance(meta, TreeAttentionMetadata):
            raise NotImplementedError("TreeGatedDeltaNet takes TreeAttentionMetadata or no packed_seq_params")
        if b != 1 or meta.plan.num_tokens > t:
            raise ValueError(f"a tree pack is [t, 1, h] with t = {meta.plan.num_tokens}, got [{t}, {b}, .]")
        cache = meta.__dict__.setdefault("_linear_attention_index", {})
        cuts = np.zeros(0, np.int64) if cuts is None else np.asarray(cuts, np.int64)
        key = (str(device), k, cuts.tobytes())
        if key not in cache:
            forest = SegmentForest.from_plan(meta.plan).cut_after(cuts)
            cache[key] = build_tree_linear_index(forest, k, device)
        return cache[key]

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None, key_value_states=None,
                inference_context=None, attention_bias=None, packed_seq_params=None, sequence_len_offset=None,
                *, inference_params=None, **kwargs):
        """``[t, b, h]`` (``[t / tp, b, h]`` under sequence parallelism) -> (``[t, b, h]``, bias).
        With :class:`TreeAttentionMetadata` ``b`` is 1 and every token sees its own path."""
        if deprecate_inference_params(inference_context, inference_params) is not None:
            raise NotImplementedError("TreeGatedDeltaNet does not run inference contexts")
        qkvzba, _ = self.in_proj(hidden_states)  # [t, b, in_proj_dim / tp] (the whole sequence)
        t, b, _ = qkvzba.shape
        hook = getattr(packed_seq_params, "kv_hook", None)
        if hook is not None and not isinstance(hook, LinearPrefixHook):
            raise NotImplementedError(f"a prefix hook of a linear-attention layer implements LinearPrefixHook; "
                                      f"{type(hook).__name__} does not")
        cuts = hook.linear_cuts() if hook is not None else None
        index = self.tree_index(packed_seq_params, t, b, qkvzba.device, cuts)
        initial = None
        if index.num_sources:
            if hook is None:
                raise ValueError("a pack continuing cached prefixes needs a kv_hook to supply their linear states")
            initial = hook.external_linear_state(self.layer_number)
        produces = cuts is not None and len(cuts) > 0
        heads = self.heads
        # [n, in_proj_dim / tp], sequence-major; a tree pack's rows past its plan's n tokens are
        # sequence-parallel padding (a multiple of TP): their outputs are zero.
        n = index.num_tokens
        rows = qkvzba.transpose(0, 1).reshape(b * t, -1)[:n]
        qkv, gate, beta, alpha = torch.split(
            rows, [2 * heads.qk_dim + heads.v_dim, heads.v_dim, heads.num_value_heads, heads.num_value_heads], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)  # [b * t, h_v] fp32
        result = tree_gated_delta_rule(qkv, g, beta.sigmoid(), self.conv1d.weight, self.conv1d.bias, heads,
                                       index, initial=initial, return_states=produces, activation=self.act_fn)
        core = result.core
        if produces:  # the states of the prefixes this pack produces: into the cache (and the graph)
            anchor = hook.on_linear_states(self.layer_number, SegmentStates(result.states, index.segment_ends))
            if anchor is not None:
                core = core + anchor.to(core.dtype)
        norm_out = self._apply_gated_norm(core, gate)  # [n, v_dim / tp]
        if n < b * t:
            norm_out = F.pad(norm_out, (0, 0, 0, b * t - n))  # [b * t, v_dim / tp]
        norm_out = norm_out.reshape(b, t, -1).transpose(0, 1).contiguous()  # [t, b, v_dim / tp]
        return self.out_proj(norm_out)

    def _apply_gated_norm(self, x: Tensor, gate: Tensor) -> Tensor:
        """Hugging Face's gated norm: ``(norm(x) * silu(gate.float())).to(x.dtype)`` per value head."""
        dtype = x.dtype
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        y = y * F.silu(gate.reshape(-1, x.shape[-1]).float())  # [t * h_v, d_v]
        return y.to(dtype).reshape(x.shape[0], -1)


def tree_gated_delta_net_spec(config, transformer_impl: str = "local") -> ModuleSpec:
    """megatron's ``get_gated_delta_net_module_spec`` with :class:`TreeGatedDeltaNet` and the
    Hugging Face gated norm. With a backend that fuses the input norm into the projection
    (Transformer Engine) the spec says so (``fuse_input_layernorm``), as megatron's; the local
    backend keeps the layer's own input norm and a plain column-parallel ``in_proj``."""
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        from megatron.core.models.backends import LocalSpecProvider

        backend = LocalSpecProvider()
    fused = backend.fuse_layernorm_and_linear()
    in_proj = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    return ModuleSpec(
        module=TreeGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=in_proj, out_norm=GatedRMSNorm,
                                           out_proj=backend.row_parallel_linear()),
        metainfo={"fuse_input_layernorm": fused},
    )
