"""The planner's configuration: the layout it plans for, its budgets and its costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import CROSS_GROUP_PREFIX, PLACEMENTS, SHARING_MODES
from megatron_psrl.schedule.cost import CostModel


@dataclass
class PlannerConfig:
    """Knobs of the planner."""

    micro_batch_tokens: int
    """Token budget of one micro-batch (``--micro-batch-tokens``)."""

    data_parallel_size: int = 1
    """Number of data-parallel ranks to spread the trees over."""

    sharing: str = "tree"
    """``tree`` (mechanisms 1 + 2), ``tree-dup`` (mechanism 1, oversized trees split by
    duplicating their prefix) or ``none`` (baseline, no sharing)."""

    cost_model: Optional[CostModel] = None
    """Cost model for balancing and the mechanism choice; None balances by tokens."""

    max_trees_per_micro_batch: Optional[int] = None
    """At most this many small trees packed into one micro-batch (None: as many as fit). With
    ``sharing="none"`` and 1, every sample runs alone (the per-sample reference point)."""

    snap_fraction: float = 0.85
    """Mechanism-2 chunks end at a node boundary instead of mid-node when that keeps them at
    least this full (fewer cached sources)."""

    cut_at_branch_switches: bool = False
    """Mechanism-2 chunks also end wherever the depth-first stream moves on to a sibling
    subtree, so no micro-batch both finishes one branch and starts the next. Such a
    micro-batch reads the first branch's prefixes and produces the second's, so its deferred
    backward would keep the first branch's dK/dV (and K/V) alive while the second runs. Cut
    there, only one chain's prefixes are alive at a time, at the price of more, less full
    micro-batches (small trees fill their free space). The trainer plans with it when the
    default cut does not fit ``--kv-cache-budget``."""

    cut_after_shared_prefixes: bool = False
    """Mechanism-2 chunks also end where a prefix that several branches share ends, so the
    micro-batch that produces it holds no branch after it. Its kept graph (the producer's,
    alive until the last reader's backward) is then the shared prefix's alone, not also that
    of the first branch's tokens packed behind it: one more micro-batch, and a kept graph of
    the prefix's size (a GRPO group's prompt alone, its responses packed two and more per
    micro-batch). The memory budget's planner weighs it against the default cut."""

    exchange_group_size: int = 1
    """Ranks that may split one tree between them and exchange its prefix K/V (consecutive
    blocks of ``data_parallel_size``; 1: every tree stays on one rank). Trees are balanced
    whole over the groups; inside a group the placement is chosen per step."""

    placement: str = "auto"
    """Inside an exchange group: ``whole-tree`` (every tree on one rank), ``cross-rank``
    (equal-cost fragments of the depth-first stream in lockstep steps,
    :mod:`megatron_psrl.schedule.cross_rank`) or ``auto`` (the smaller predicted makespan)."""

    kv_bytes_per_token: float = 0.0
    """Bytes of one token's K and V over all layers of a rank (what an exchange moves)."""

    cost_per_exchanged_byte: float = 0.0
    """Cost-model units of moving one byte between ranks (link bandwidth against compute)."""

    cost_per_exchange: float = 0.0
    """Cost-model units of one exchange step (per-layer collective latency, summed)."""

    cost_per_micro_batch: float = 0.0
    """Cost-model units of the fixed overhead of one micro-batch (or cross-rank step)."""

    local_rank: Optional[int] = None
    """Plan in full only the exchange group that holds this placement rank (what the rank
    runs); every other group gets empty rank plans carrying its cost from the assignment of
    trees to groups. Planning time then stays that of one group at any cluster size. Each
    group's plan is exactly the one full planning makes (groups are planned independently
    once trees are assigned to them). None: every group (simulations, checks)."""

    split_trees_across_groups: bool = True
    """A tree larger than one exchange group's fair share of the step is split between
    groups when the cost model predicts a shorter step (:mod:`megatron_psrl.schedule.group_split`);
    False keeps every tree in one group."""

    cross_group_prefix: str = "auto"
    """How the copies of a tree split between groups get the shared head of their path:
    ``recompute`` (each copy computes it), ``transfer`` (the home rank computes it once and
    sends its K/V; every copy that can imports it) or ``auto`` (per copy, the cheaper by the
    cost model). Only with ``sharing="tree"``; the caller passes ``recompute`` where the step
    runner cannot send heads (pipeline stages, MoE models, activation recomputation)."""

    cost_per_transferred_byte: Optional[float] = None
    """Cost-model units of sending one byte of a head between groups (None: the exchange's,
    ``cost_per_exchanged_byte``)."""

    cost_per_transfer: Optional[float] = None
    """Cost-model units of the fixed cost of one head transfer (None: ``cost_per_exchange``)."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ConfigurationError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.data_parallel_size < 1:
            raise ConfigurationError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.sharing not in SHARING_MODES:
            raise ConfigurationError(f"sharing must be one of {SHARING_MODES}, got {self.sharing!r}")
        if not 0.0 < self.snap_fraction <= 1.0:
            raise ValueError(f"snap_fraction must be in (0, 1], got {self.snap_fraction}")
        if self.exchange_group_size < 1 or self.data_parallel_size % self.exchange_group_size:
            raise ConfigurationError(f"exchange_group_size {self.exchange_group_size} must divide the "
                                     f"{self.data_parallel_size} ranks that share the batch")
        if self.local_rank is not None and not 0 <= self.local_rank < self.data_parallel_size:
            raise ConfigurationError(f"local_rank {self.local_rank} is not one of the {self.data_parallel_size} ranks")
        if self.placement not in PLACEMENTS:
            raise ConfigurationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.cross_group_prefix not in CROSS_GROUP_PREFIX:
            raise ConfigurationError(f"cross_group_prefix must be one of {CROSS_GROUP_PREFIX}, "
                                     f"got {self.cross_group_prefix!r}")

    @property
    def transfer_cost_per_byte(self) -> float:
        """Cost-model units of sending one byte of a head between groups."""
        return self.cost_per_exchanged_byte if self.cost_per_transferred_byte is None else self.cost_per_transferred_byte

    @property
    def transfer_fixed_cost(self) -> float:
        """Cost-model units of the fixed cost of one head transfer."""
        return self.cost_per_exchange if self.cost_per_transfer is None else self.cost_per_transfer


# ====================================================================== entry point
