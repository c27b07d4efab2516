"""What one micro-batch's autograd graph and loss head hold, by its rows (the step's memory).

A micro-batch of ``t`` tokens whose loss claims ``n`` rows (targets), read from ``o`` distinct
rows of final hidden states, holds while its graph is alive (from its forward to its backward):

- every layer's saved tensors for every row, except that the model's last layer computes its
  queries, attention output, output projection and MLP for the ``o`` output rows only
  (``--no-last-layer-row-skip`` turns that off: ``o = t`` then), and the final norm runs on
  those rows (:class:`ActivationCharge` splits the family's exact per-token count,
  :func:`~megatron_psrl.schedule.memory.saved_activation_bytes_per_token`, that way);
- the loss head's saved tensors: the claimed rows' hidden states ``[n, h]`` (the output
  layer's input) and, when the claimed rows fit one chunk (``--loss-head-chunk-mb``), the
  fp32 log-softmax ``[n, V/tp]``; a chunked head keeps the hidden rows only and recomputes
  each chunk's logits in its backward.

Its backward starts with the loss head: the log-probs' gradient spread into a ``[rows, V/tp]``
fp32 tensor (a zero tensor and the scatter's result) beside the saved log-softmax, so three
chunks of fp32 logits at once, with the whole graph still alive: that is where a step peaks.
As the backward goes on, the graph is freed layer by layer while the parameters' gradients
appear (when they are not allocated before the step, as megatron's DDP buffers are).

With activation recomputation (megatron's ``full`` granularity) a recomputed unit of layers
keeps only its input ``[t, h]``; its backward recomputes its forward, holding the unit's full
saved tensors and the layer's temporaries (:data:`LAYER_BACKWARD_TEMPORARIES`) while (nearly) every
parameter gradient exists. ``selective`` (megatron's core-attention recomputation) keeps the
attention's inputs instead of its output and log-sum-exp.

Measured on CPU (fp32, ``benchmarks/memory_breakdown.py``: the saved tensors by module at the
operation where the heap peaked) these are the bytes exactly, up to well under 1 MB of
autograd's own buffers; docs/architecture.md ("One memory budget") has the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from megatron_psrl.model.architecture import LINEAR_ATTENTION, ModelArchitecture
from megatron_psrl.schedule.plan import RankPlan
from megatron_psrl.tree.index import TreeIndex, chain_structure
from megatron_psrl.tree.key_pairs import claimed_tokens

_FP32 = 4

LOSS_HEAD_BACKWARD_CHUNKS = (3, 5)
"""fp32 ``[rows, V/tp]`` tensors alive at the start of the loss head's backward, without and
with the entropy: the saved log-softmax (or a chunk's recomputed one), the zero tensor the
log-probs' gradient is scattered into and the scatter's result (measured: the heap peaks at
that ``scatter_add``); with the entropy also its saved ``exp`` and the product's gradient."""

LOSS_HEAD_GRAD_CHUNKS = 1
"""fp32 ``[rows, V/tp]`` tensors alive when the output layer's weight gradient is made: the logits' gradient."""

LOSS_HEAD_KEPT_CHUNKS = (1, 2)
"""Of those, what a graph keeps from its forward (an unchunked head): the log-softmax, and
with the entropy its ``exp``."""

LAYER_BACKWARD_TEMPORARIES = (3, 2)
"""Temporaries of a layer's backward beyond its saved tensors, at its MLP activation's gradient
(where a layer's backward peaks): ``f a + h b`` model-dtype values per token for ``(a, b)``: the
fused SwiGLU's gradient ``[t, 2f]``, the incoming gradient and the sigmoid (``f`` each; the
eager kernel on CPU, ``compat.swiglu_back_in_place``; a compiled one holds fewer), the
gradients flowing through the residual stream, less the fc2 input (``f``), freed by fc2's
backward just before (measured: 4.1 f + 1.1 h on CPU beside the layer's saved tensors, h 256,
f 512). A kept layer holds them beside what is left of the graph, a recomputed layer beside
its recomputed saved tensors."""

Rows = Tuple[int, int, int]
"""``(tokens, output rows, claimed rows)`` of a micro-batch (:func:`add_row_counts`)."""


def add_row_counts(index: TreeIndex, plan: RankPlan) -> None:
    """Set ``plan.row_counts``: per micro-batch that runs the model, ``(tokens, output rows,
    claimed rows)``. Claimed rows are the targets with a loss claim that it computes: its owned
    tokens whose predecessor it holds, and its remote targets (the first tokens of the cached
    prefixes' readers); output rows are their distinct predecessors (the rows of final hidden
    states the loss head reads). A loss that records every row's log-prob adds rows the
    forward computes without a graph: not counted."""
    if plan.row_counts is not None:
        return
    claimed = claimed_tokens(index.tree)
    counts = {}
    for i, mb in enumerate(plan.micro_batches):
        tokens = mb.computed_tokens
        if not len(tokens):
            continue
        pred_pack, _ = chain_structure(index, tokens)
        local = mb.owned & (pred_pack >= 0) & claimed[tokens]
        remote = mb.remote_targets[claimed[mb.remote_targets]] if len(mb.remote_targets) else mb.remote_targets
        rows = np.concatenate([index.pred[tokens[local]], index.pred[remote]])
        counts[i] = (len(tokens), len(np.unique(rows)), int(local.sum()) + len(remote))
    plan.row_counts = counts


def recomputed_units(num_layers: int, granularity: Optional[str], method: Optional[str],
                     unit_layers: Optional[int]) -> Tuple[int, int]:
    """``(recomputed layers, layers per unit)`` of megatron's ``full`` recomputation of a stage of
    ``num_layers`` layers: ``uniform`` recomputes every layer in units of ``unit_layers``,
    ``block`` the first ``unit_layers`` layers one by one; ``(0, 1)`` otherwise."""
    if granularity != "full":
        return 0, 1
    if method == "block":
        return min(num_layers, int(unit_layers)), 1
    return num_layers, min(num_layers, int(unit_layers))


@dataclass(frozen=True)
class ActivationCharge:
    """Bytes a micro-batch holds by its rows (see the module docstring); ``of`` builds it."""

    per_layer: int
    """One layer's saved bytes per token (every row)."""
    last_layer_all_rows: int
    """The last layer's saved bytes per token that every row keeps (input norm, K, V, RoPE);
    the rest of :attr:`per_layer` is kept by output rows only (with the row skip)."""
    per_output_row: int
    """The final norm's saved bytes per output row."""
    per_token: int
    """Saved bytes per token outside the layers (the input ids)."""
    num_layers: int
    """Layers of the stage planned for."""
    row_skip: bool
    """The last layer computes the output rows only (``ActorConfig.last_layer_row_skip``)."""
    hidden_row: int
    """Bytes of one row of hidden states ``[h]`` in the model's dtype."""
    logit_row: int
    """Bytes of one fp32 row of logits ``[V/tp]``."""
    chunk_rows: int
    """Claimed rows per loss-head chunk (``--loss-head-chunk-mb``)."""
    grad_bytes: int = 0
    """Parameter gradients the step allocates (0 when they live in buffers allocated before it)."""
    layer_grad_bytes: int = 0
    """Of those, one layer's (the last to appear in a backward are the first layers' and the embedding's)."""
    embedding_grad_bytes: int = 0
    """Of those, the input embedding's."""
    recomputed_layers: int = 0
    """Layers whose forward is recomputed in the backward pass (megatron's ``full``)."""
    unit_layers: int = 1
    """Layers per recomputed unit."""
    selective_saving: int = 0
    """Bytes per token and layer that ``selective`` recomputation does not keep."""
    layer_temporaries: int = 0
    """A layer's backward temporaries per token (:data:`LAYER_BACKWARD_TEMPORARIES`)."""
    entropy: bool = False
    """The loss head computes the entropy too (the step's loss needs it)."""
    output_weight_grad: int = 0
    """The output layer's weight gradient ``[V/tp, h]``, computed at the start of every backward
    with the graph and the loss head's gradient alive: a new tensor, whether it becomes the
    parameter's gradient or is then added into one (``.grad``, megatron's ``main_grad``); 0 where
    the GEMM accumulates into ``main_grad`` itself (``gradient_accumulation_fusion``)."""

    @classmethod
    def of(cls, arch: ModelArchitecture, tensor_parallel_size: int, dtype_bytes: int, local_vocab: int,
           chunk_rows: int, row_skip: bool = True, grad_bytes: Tuple[int, int, int] = (0, 0, 0),
           num_layers: Optional[int] = None,
           recompute: Tuple[Optional[str], Optional[str], Optional[int]] = (None, None, None),
           weight_grad_temporaries: bool = True) -> "ActivationCharge":
        """``recompute``: megatron's ``(granularity, method, num_layers)``; ``num_layers``: the
        stage's layers (default: the model's); ``grad_bytes``: the gradients the step allocates,
        all, one layer's and the embedding's (:attr:`grad_bytes`); ``weight_grad_temporaries``:
        a weight gradient is a tensor of its own before it is accumulated (no
        ``gradient_accumulation_fusion``: :attr:`output_weight_grad`)."""
        h, b, tp = arch.hidden_size, dtype_bytes, tensor_parallel_size
        layers = arch.num_layers if num_layers is None else num_layers
        final_norm = 2 * h * _FP32 + _FP32
        per_layer = (arch.family.saved_activation_bytes_per_token(arch, tp, b) - final_norm - 8) // arch.num_layers
        q, kv = arch.num_attention_heads * arch.head_dim // tp, arch.num_kv_heads * arch.head_dim // tp
        # input norm (fp32 input and normalised input, its output, its statistic), K after RoPE,
        # V (with q/k norms: the fused QKV output and the key norm's fp32 tensors), RoPE's cos/sin
        value = (q + 2 * kv) * b + 2 * kv * _FP32 if arch.qk_norm else kv * b
        all_rows = 2 * h * _FP32 + h * b + _FP32 + kv * b + value + 4 * arch.head_dim * b
        skip = row_skip and _last_layer_skips(arch, layers)
        granularity, method, unit = recompute
        recomputed, unit_layers = recomputed_units(layers, granularity, method, unit)
        selective = (q * b + _FP32 * q // arch.head_dim) if granularity == "selective" else 0
        return cls(per_layer=per_layer, last_layer_all_rows=min(all_rows, per_layer), per_output_row=final_norm,
                   per_token=8, num_layers=layers, row_skip=skip, hidden_row=h * b, logit_row=_FP32 * local_vocab,
                   chunk_rows=max(1, int(chunk_rows)), grad_bytes=int(grad_bytes[0]),
                   layer_grad_bytes=int(grad_bytes[1]), embedding_grad_bytes=int(grad_bytes[2]),
                   recomputed_layers=recomputed, unit_layers=unit_layers, selective_saving=selective,
                   layer_temporaries=(LAYER_BACKWARD_TEMPORARIES[0] * arch.ffn_hidden_size // tp
                                      + LAYER_BACKWARD_TEMPORARIES[1] * h) * b,
                   output_weight_grad=local_vocab * h * b if weight_grad_temporaries else 0)

    def with_recompute(self, granularity: Optional[str], method: Optional[str], unit_layers: Optional[int],
                       arch: ModelArchitecture, tensor_parallel_size: int, dtype_bytes: int) -> "ActivationCharge":
        """This charge under another recomputation setting (megatron's three fields)."""
        other = ActivationCharge.of(arch, tensor_parallel_size, dtype_bytes, self.logit_row // _FP32, self.chunk_rows,
                                    self.row_skip, num_layers=self.num_layers,
                                    recompute=(granularity, method, unit_layers))
        return dataclasses.replace(self, recomputed_layers=other.recomputed_layers, unit_layers=other.unit_layers,
                                   selective_saving=other.selective_saving)

    # -------------------------------------------------------------- per micro-batch
    def _layers_bytes(self, rows: Rows, layers: int, with_last: bool) -> int:
        """Saved bytes of ``layers`` layers (the last one among them when ``with_last``)."""
        t, o, _ = rows
        per_layer = self.per_layer - self.selective_saving
        if not layers:
            return 0
        if not with_last or not self.row_skip:
            return layers * t * per_layer
        out = self.per_layer - self.last_layer_all_rows
        return (layers - 1) * t * per_layer + t * self.last_layer_all_rows + o * max(0, out - self.selective_saving)

    def _head_kept(self, rows: Rows) -> int:
        _, _, n = rows
        kept = LOSS_HEAD_KEPT_CHUNKS[self.entropy] if n <= self.chunk_rows else 0
        return n * self.hidden_row + kept * n * self.logit_row

    def graph(self, rows: Rows) -> int:
        """What the micro-batch's graph holds from its forward to the start of its backward."""
        t, o, _ = rows
        kept_layers = self.num_layers - self.recomputed_layers
        units = -(-self.recomputed_layers // self.unit_layers)
        # (recomputed layers are the first ones: ``block``'s, or all of them)
        layers = self._layers_bytes(rows, kept_layers, with_last=True) if kept_layers else 0
        outputs = o if self.row_skip else t
        return (layers + units * t * self.hidden_row + outputs * self.per_output_row + t * self.per_token
                + self._head_kept(rows))

    def backward_peak(self, rows: Rows, grads_before: int) -> int:
        """The most the micro-batch's own bytes reach during its backward pass (its graph
        included), with ``grads_before`` bytes of parameter gradients already allocated: the
        start (graph and the loss head's backward tensors, :meth:`head_backward`), a kept
        layer's backward (:meth:`_layer_peak`), the end (every gradient), and with
        recomputation each unit's recomputed forward (:meth:`_recompute_peak`)."""
        start = self.graph(rows) + self.head_backward(rows) + grads_before
        end = max(grads_before, self.grad_bytes)
        return max(start, end, self._layer_peak(rows, grads_before), self._recompute_peak(rows, grads_before))

    def head_backward(self, rows: Rows) -> int:
        """Beyond the graph at the start of the backward: the loss head's gradient tensors at
        the scatter, or, when the output layer's weight gradient is made, that gradient and the
        logits' (:attr:`output_weight_grad`)."""
        _, _, n = rows
        chunk = min(n, self.chunk_rows) * self.logit_row
        kept = LOSS_HEAD_KEPT_CHUNKS[self.entropy] if n <= self.chunk_rows else 0
        scatter = (LOSS_HEAD_BACKWARD_CHUNKS[self.entropy] - kept) * chunk
        return max(scatter, LOSS_HEAD_GRAD_CHUNKS * chunk + self.output_weight_grad if n else 0)

    def _layer_peak(self, rows: Rows, grads_before: int) -> int:
        """A kept layer's backward: the graph less the loss head's tensors (freed by then) and
        the layer's temporaries (:attr:`layer_temporaries`, per row it computed): the model's last layer
        first (its output rows, with the row skip), then the one before it, the last one's
        saved tensors freed."""
        t, o, _ = rows
        kept_layers = self.num_layers - self.recomputed_layers
        if not kept_layers:
            return 0
        graph = self.graph(rows) - self._head_kept(rows) + grads_before
        last = graph + (o if self.row_skip else t) * self.layer_temporaries
        if kept_layers == 1:
            return last
        return max(last, graph - self._layers_bytes(rows, 1, with_last=True) + t * self.layer_temporaries)

    def _recompute_peak(self, rows: Rows, grads_before: int) -> int:
        """The most a backward reaches while a recomputed unit's forward runs again: the unit's
        saved tensors and temporaries, the inputs of the units not yet recomputed (the last
        layers' units run first), and the gradients of the layers whose backward ran (every
        gradient when an earlier backward allocated them)."""
        t = rows[0]
        done = max(0, self.grad_bytes - self.embedding_grad_bytes - self.num_layers * self.layer_grad_bytes)
        units = -(-self.recomputed_layers // self.unit_layers)
        peak = 0
        for j in range(units, 0, -1):  # unit j: layers (j - 1) u .. min(j u, recomputed) - 1
            first, end = (j - 1) * self.unit_layers, min(j * self.unit_layers, self.recomputed_layers)
            grads = grads_before or done + (self.num_layers - end) * self.layer_grad_bytes
            unit = self._layers_bytes(rows, end - first, with_last=end == self.num_layers)
            peak = max(peak, grads + j * t * self.hidden_row + unit + t * self.layer_temporaries)
        return peak

    def forward_transient(self, rows: Rows) -> int:
        """Beyond its graph while its forward runs: the loss head's logits (and a chunk's
        log-softmax; with the entropy, the product it sums)."""
        _, _, n = rows
        return (int(self.entropy) + (1 if n <= self.chunk_rows else 2)) * min(n, self.chunk_rows) * self.logit_row


def _last_layer_skips(arch: ModelArchitecture, stage_layers: int) -> bool:
    """The model's last layer can compute its output rows only (``PsrlTransformerLayer``):
    softmax attention without an output gate."""
    kinds = getattr(arch, "layer_kinds", ())
    softmax_last = not kinds or kinds[-1] != LINEAR_ATTENTION
    return softmax_last and not getattr(arch, "attention_output_gate", False) and stage_layers >= 1


__all__ = ["ActivationCharge", "LOSS_HEAD_BACKWARD_CHUNKS", "LOSS_HEAD_KEPT_CHUNKS", "LAYER_BACKWARD_TEMPORARIES", "Rows", "add_row_counts",
           "recomputed_units"]
