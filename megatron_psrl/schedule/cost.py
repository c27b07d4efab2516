"""Cost model of the update step: a linear term per token and a quadratic term per key.

FLOPs(computed tokens) = linear_flops_per_token * tokens
                         + attention_flops_per_key * (sum over query tokens of the keys seen)

A token at position p (0-based) attends to p + 1 keys (causal, itself included). Without
sharing every sample of length n costs n tokens and n (n + 1) / 2 key pairs; with the prefix
tree every tree token is computed once and sees ``position + 1`` keys (its ancestors' tokens and
the earlier tokens of its node). The ratio of the two costs is the ideal speedup
(docs/prefix-tree.md); the per-node and per-subtree costs are what the planner balances.

Cross-rank steps also pay the prefix K/V exchange (one all-to-all per layer, forward and
backward; the planner charges it per step from ``PlannerConfig.cost_per_exchanged_byte`` and
``cost_per_exchange``). With the overlapped exchange (the default, ``--no-overlap-kv-exchange``
turns it off) only its exposed part costs time: per layer, the transfer runs while the
attention computes over the keys the rank has, so the step waits for
:func:`exposed_exchange_cost` ``= max(0, exchange - overlappable)``. The calibration measures
the hidden share once (``MeasuredCosts.exchange_exposed_fraction``) and scales the exchange's
cost by it (kept simple: one fraction for every step, measured at a micro-batch's size).

Both coefficients count forward + backward (backward = 2x forward, so 3x forward FLOPs) and a
multiply-add as 2 FLOPs. Norms, activations, softmax, RoPE and biases are left out: they are
linear in tokens and well under 1% of the GEMMs for the named models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Dict, Optional, Union

import numpy as np

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.tree.key_pairs import (
    batch_key_pairs,
    claimed_tokens,
    claimed_tokens_per_node,
    node_key_pairs,
    tree_key_pairs,
    unshared_key_pairs,
)
from megatron_psrl.tree.prefix_tree import PrefixTree

if TYPE_CHECKING:  # the planner does not load model code
    from megatron_psrl.model.architecture import ModelArchitecture

FORWARD_BACKWARD_FACTOR = 3.0
"""Backward costs about twice the forward (gradients w.r.t. inputs and weights)."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a decoder-only transformer that the FLOP count depends on."""

    hidden_size: int
    """Model width."""
    num_layers: int
    """Transformer layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA groups); equal to num_heads for plain multi-head attention."""
    head_dim: int
    """Width of one head (q/k/v projections are num_heads * head_dim wide)."""
    ffn_hidden_size: int
    """Intermediate width of the MLP."""
    vocab_size: int
    """Output vocabulary (the LM head is hidden_size x vocab_size)."""
    gated: bool = True
    """SwiGLU-style MLP (gate + up + down projections) instead of two projections."""
    attention_layers: Optional[int] = None
    """Layers whose attention cost follows the key pairs (None: every layer). The others are
    sliding-window layers (gpt-oss), charged ``window_keys`` keys per token."""
    window_keys: int = 0
    """Keys per token a sliding-window layer is charged: its window (what a token deeper than
    the window sees; shallower tokens see fewer, so this is an upper bound)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.attention_layers is not None and not 0 <= self.attention_layers <= self.num_layers:
            raise ValueError(f"attention_layers must be in [0, num_layers], got {self.attention_layers}")


TINY_MODEL_DIMS = ModelDims(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
    ffn_hidden_size=512, vocab_size=1024,
)
"""The tiny debug Llama used for CPU runs and tests (h256/L4, GQA 4:2, SwiGLU 512, vocab 1024)."""

NAMED_MODEL_DIMS: Dict[str, ModelDims] = {
    "tiny": TINY_MODEL_DIMS,
    # Values of the public Hugging Face config.json of each model.
    "llama3-8b": ModelDims(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                           head_dim=128, ffn_hidden_size=14336, vocab_size=128256),
    "qwen2.5-7b": ModelDims(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                            head_dim=128, ffn_hidden_size=18944, vocab_size=152064),
    "qwen3-32b": ModelDims(hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8,
                           head_dim=128, ffn_hidden_size=25600, vocab_size=151936),
    "llama3-70b": ModelDims(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                            head_dim=128, ffn_hidden_size=28672, vocab_size=128256),
}
"""Model sizes known to :meth:`CostModel.named`."""


# ---------------------------------------------------------------------- exchange overlap
def exposed_exchange_cost(exchange: Union[float, np.ndarray], overlappable: Union[float, np.ndarray]
                          ) -> Union[float, np.ndarray]:
    """The part of an exchange (one layer's all-to-all, in any unit) that overlapping it with
    ``overlappable`` work (the attention over the keys the rank already has, running while the
    rows travel) leaves exposed: ``max(0, exchange - overlappable)``."""
    if np.ndim(exchange) == 0 and np.ndim(overlappable) == 0:
        return max(0.0, float(exchange) - float(overlappable))
    return np.maximum(0.0, np.asarray(exchange, np.float64) - np.asarray(overlappable, np.float64))


def exposed_exchange_fraction(exchange: float, overlappable: float) -> float:
    """:func:`exposed_exchange_cost` as a share of the exchange, in ``[0, 1]`` (1 for an empty
    exchange: nothing to hide)."""
    if not exchange > 0:
        return 1.0
    return min(1.0, exposed_exchange_cost(exchange, overlappable) / float(exchange))


# ---------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CostModel:
    """FLOPs of forward + backward as ``linear * tokens + attention * key_pairs``."""

    linear_flops_per_token: float
    """FLOPs per computed token of the transformer layers' GEMMs (QKV, output projection, MLP)."""

    attention_flops_per_key: float
    """FLOPs per (query token, key) pair over all layers (QK^T and attention x V)."""

    head_flops_per_row: float = 0.0
    """FLOPs per logit row (the output layer), charged only for tokens whose log-prob is
    computed: tokens with a loss claim (the log-prob pass computes every row, see
    ``all_rows``)."""

    read_flops_per_token: float = 0.0
    """FLOPs per cached prefix token a micro-batch reads (from the KV cache or a peer rank),
    over all layers: what a reader derives from the cached rows (latent attention: the K/V
    up-projection of the latent, ``ModelFamily.read_flops_per_token``); charged per read by
    :meth:`read_cost` in every rank's planned cost."""

    name: Optional[str] = field(default=None, compare=False)
    """The model size this was derived from, for reports (None if built by hand)."""

    def __post_init__(self) -> None:
        for name in ("linear_flops_per_token", "attention_flops_per_key", "head_flops_per_row",
                     "read_flops_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.linear_flops_per_token == 0 and self.attention_flops_per_key == 0:
            raise ValueError("a cost model needs a non-zero term")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dims(
        cls,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ffn_hidden_size: int,
        vocab_size: int,
        gated: bool = True,
        name: Optional[str] = None,
    ) -> "CostModel":
        """Forward + backward FLOPs of a decoder-only transformer (see the module docstring)."""
        dims = ModelDims(hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                         ffn_hidden_size, vocab_size, gated)
        return cls.from_model_dims(dims, name=name)

    @classmethod
    def from_model_dims(cls, dims: ModelDims, name: Optional[str] = None) -> "CostModel":
        q_width = dims.num_heads * dims.head_dim
        kv_width = dims.num_kv_heads * dims.head_dim
        mlp_matrices = 3 if dims.gated else 2
        weights_per_layer = (
            dims.hidden_size * q_width              # Q projection
            + 2 * dims.hidden_size * kv_width       # K and V projections
            + q_width * dims.hidden_size            # output projection
            + mlp_matrices * dims.hidden_size * dims.ffn_hidden_size
        )
        # A multiply-add per weight and token; QK^T and PV are head_dim multiply-adds per head.
        linear = FORWARD_BACKWARD_FACTOR * 2.0 * dims.num_layers * weights_per_layer
        head = FORWARD_BACKWARD_FACTOR * 2.0 * dims.hidden_size * dims.vocab_size
        per_key = FORWARD_BACKWARD_FACTOR * 2.0 * 2.0 * q_width  # one layer's
        full = dims.num_layers if dims.attention_layers is None else dims.attention_layers
        linear += (dims.num_layers - full) * per_key * dims.window_keys  # sliding-window layers: per token
        return cls(float(linear), float(full * per_key), float(head), name=name)

    @classmethod
    def for_architecture(cls, arch: "ModelArchitecture") -> "CostModel":
        """The cost model of a :class:`~megatron_psrl.model.architecture.ModelArchitecture`: the
        dense transformer its family charges per token (``ModelFamily.cost_dims``: for MoE, the
        experts a token is routed to and the router, not all of them), named by ``model_type``."""
        model = cls.from_model_dims(arch.family.cost_dims(arch), name=arch.model_type)
        return replace(model, read_flops_per_token=float(arch.family.read_flops_per_token(arch)))

    @classmethod
    def named(cls, name: str) -> "CostModel":
        """The cost model of a model size in :data:`NAMED_MODEL_DIMS`."""
        if name not in NAMED_MODEL_DIMS:
            raise ConfigurationError(f"unknown model size {name!r}; choose from {sorted(NAMED_MODEL_DIMS)}")
        return cls.from_model_dims(NAMED_MODEL_DIMS[name], name=name)

    # ------------------------------------------------------------------ costs
    def cost(
        self, num_tokens: Union[int, np.ndarray], key_pairs: Union[int, np.ndarray],
        logit_rows: Union[int, np.ndarray] = 0,
    ) -> Union[float, np.ndarray]:
        """FLOPs of computing ``num_tokens`` tokens that together see ``key_pairs`` keys and
        produce ``logit_rows`` log-probs (scalars give a float, arrays an element-wise float64
        array)."""
        if np.ndim(num_tokens) == 0 and np.ndim(key_pairs) == 0 and np.ndim(logit_rows) == 0:
            return (self.linear_flops_per_token * float(num_tokens)
                    + self.attention_flops_per_key * float(key_pairs)
                    + self.head_flops_per_row * float(logit_rows))
        return (self.linear_flops_per_token * np.asarray(num_tokens, dtype=np.float64)
                + self.attention_flops_per_key * np.asarray(key_pairs, dtype=np.float64)
                + self.head_flops_per_row * np.asarray(logit_rows, dtype=np.float64))

    def read_cost(self, tokens: int) -> float:
        """FLOPs of deriving K/V from ``tokens`` cached prefix rows read (0 where readers attend
        to the rows themselves)."""
        return self.read_flops_per_token * float(tokens)

    def sample_costs(self, batch: SampleBatch) -> np.ndarray:
        """float64 ``[S]``: cost of every sample computed on its own (the baseline): logits
        for its trained tokens."""
        lengths = batch.lengths
        trained = np.add.reduceat(batch.loss_mask.astype(np.int64), batch.offsets[:-1]) if lengths.size else lengths
        return self.cost(lengths, unshared_key_pairs(lengths), trained)

    def baseline_cost(self, batch: SampleBatch) -> float:
        """Cost of the batch without sharing (every sample separately / packed)."""
        return self.cost(batch.num_tokens, batch_key_pairs(batch), int(batch.loss_mask.sum()))

    def node_costs(self, tree: PrefixTree) -> np.ndarray:
        """float64 ``[M]``: cost of computing every node's tokens once (linear + attention
        onto its ancestors and the earlier tokens of the node + logits of its claimed tokens)."""
        return self.cost(tree.node_len, node_key_pairs(tree), claimed_tokens_per_node(tree))

    def subtree_costs(self, tree: PrefixTree) -> np.ndarray:
        """float64 ``[M]``: cost of every node's subtree (itself included), from prefix sums
        over the preorder: subtree m is the node range ``m:node_subtree_end[m]``."""
        cumulative = np.zeros(tree.num_nodes + 1, dtype=np.float64)
        np.cumsum(self.node_costs(tree), out=cumulative[1:])
        return cumulative[tree.node_subtree_end] - cumulative[:-1]

    def tree_cost(self, tree: PrefixTree) -> float:
        """Cost of the batch with the prefix tree (every tree token computed once, the logits
        of a token claimed by several samples once)."""
        return self.cost(tree.num_tree_tokens, tree_key_pairs(tree), int(claimed_tokens(tree).sum()))

    def ideal_speedup(self, tree: PrefixTree) -> float:
        """baseline cost / tree cost: the ideal speedup of this batch and model (docs/prefix-tree.md)."""
        shared = self.tree_cost(tree)
        if shared == 0:
            return 1.0
        return self.baseline_cost(tree.batch) / shared

    def to_dict(self) -> dict:
        return {"name": self.name, "linear_flops_per_token": self.linear_flops_per_token,
                "attention_flops_per_key": self.attention_flops_per_key,
                "head_flops_per_row": self.head_flops_per_row, "read_flops_per_token": self.read_flops_per_token}
