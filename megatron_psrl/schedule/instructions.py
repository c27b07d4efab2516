"""One rank's step as a stream of typed instructions, the form the engine executes.

The plan (:class:`~megatron_psrl.schedule.plan.RankPlan`) orders micro-batches as forward /
backward / forward-backward steps; its memory plan decides which producers keep their graph
and when cached K/V may go. Lowering both gives the rank's instructions, each a small frozen
dataclass that names one thing to do:

====================  ==========================================================================
instruction           what the engine does (``megatron_psrl.engine.step.StepRunner``)
====================  ==========================================================================
AllocateKV            blocks for the sources a micro-batch is about to produce or receive
ForwardBackward       forward with a graph, loss, backward at once (nobody reads it)
ForwardKeep           forward of a producer, its sources' K/V stored, its graph kept
ForwardDrop           forward of a producer without a graph (recomputed at its backward)
Forward               forward only (log-prob and sequence-sum passes), K/V stored
SendHeads             a micro-batch's exported prefix heads go to the ranks that import them
ImportHead            an import micro-batch receives prefix heads into its sources (no model)
ReturnReplicaGrads    cross-rank: the dK/dV of prefix replicas go back to their owners
CollectHeadGrads      the dK/dV importers returned for a head, added before its backward
Backward              a producer's backward (its readers are done), recomputing if dropped
ReturnHeadGrads       an import micro-batch's heads' dK/dV go back to their home rank
ReleaseKV             cached K/V (or every kind, gradients too) of sources nobody needs now
====================  ==========================================================================

Instructions that run the model carry :attr:`Instruction.pass_kind`, the pass the expert
lockstep of an MoE model counts (:data:`megatron_psrl.model.moe.Pass`): ``P`` forward +
backward, ``K`` a kept graph's forward, ``B`` its backward, ``N`` a forward whose graph is
dropped (or a forward-only pass). Lowering is deterministic and local (no communication), so
every rank of a group derives its stream from the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

from megatron_psrl.kvcache.prefix_state import RELEASE_ALL, VALUES_ONLY
from megatron_psrl.schedule.memory import MemoryPlan
from megatron_psrl.schedule.plan import RankPlan

ALL_KINDS = RELEASE_ALL
"""Every block a source holds (its gradients, then its values: the roles of
:mod:`megatron_psrl.kvcache.prefix_state`)."""

KV_KINDS = VALUES_ONLY
"""A source's values (K/V rows, a latent, a recurrent state)."""


@dataclass(frozen=True)
class Instruction:
    """One thing a rank does in a step."""

    pass_kind: ClassVar[Optional[str]] = None
    """The pass the expert lockstep counts for this instruction (None: it runs no model)."""


@dataclass(frozen=True)
class MicroBatchInstruction(Instruction):
    """An instruction about one micro-batch of the rank's plan."""

    micro_batch: int
    """Index into ``RankPlan.micro_batches``."""


@dataclass(frozen=True)
class ForwardBackward(MicroBatchInstruction):
    pass_kind: ClassVar[Optional[str]] = "P"


@dataclass(frozen=True)
class ForwardKeep(MicroBatchInstruction):
    pass_kind: ClassVar[Optional[str]] = "K"


@dataclass(frozen=True)
class ForwardDrop(MicroBatchInstruction):
    pass_kind: ClassVar[Optional[str]] = "N"


@dataclass(frozen=True)
class Forward(MicroBatchInstruction):
    pass_kind: ClassVar[Optional[str]] = "N"


@dataclass(frozen=True)
class Backward(MicroBatchInstruction):
    recompute: bool = False
    """The forward dropped its graph: run it again (with a graph) before the backward."""

    @property
    def pass_kind(self) -> str:  # type: ignore[override]
        """A recomputing backward is one whole pass (its forward and backward) for the lockstep."""
        return "P" if self.recompute else "B"


@dataclass(frozen=True)
class SendHeads(MicroBatchInstruction):
    pass


@dataclass(frozen=True)
class ImportHead(MicroBatchInstruction):
    pass


@dataclass(frozen=True)
class ReturnReplicaGrads(MicroBatchInstruction):
    pass


@dataclass(frozen=True)
class CollectHeadGrads(MicroBatchInstruction):
    pass


@dataclass(frozen=True)
class ReturnHeadGrads(MicroBatchInstruction):
    pass


@dataclass(frozen=True)
class AllocateKV(Instruction):
    sources: Tuple[int, ...]
    """Cached sources to allocate, in the plan's order."""

    kinds: Optional[Tuple[str, ...]] = None
    """Block roles of every source (None: each source's own ``CachedSource.kinds``)."""


@dataclass(frozen=True)
class ReleaseKV(Instruction):
    sources: Tuple[int, ...]
    """Cached sources whose blocks go."""

    kinds: Tuple[str, ...] = KV_KINDS
    """Which of their blocks (``KV_KINDS``: the values only; ``ALL_KINDS``: everything)."""


def lockstep_passes(instructions: List[Instruction]) -> List[Tuple[str, int]]:
    """``(pass, micro-batch)`` of every model run, in order: the expert lockstep's plan."""
    return [(x.pass_kind, x.micro_batch) for x in instructions if x.pass_kind is not None]


LOCAL_INSTRUCTIONS = (AllocateKV, ReleaseKV)
"""Instructions that neither run the model nor communicate."""


def last_backward(instructions: List[Instruction],
                  empty: Callable[[ForwardBackward], bool] = lambda x: False) -> Optional[int]:
    """Index of the step's last backward pass (the last :class:`ForwardBackward` or
    :class:`Backward`; ``empty(x)``: that forward-backward certainly runs no backward, e.g. a
    micro-batch without a claimed token, and is passed over): no gradient changes after it,
    so a parameter's gradient of the step is complete once that pass has produced it. None
    when the stream has no backward, or when an instruction after it communicates (a head's
    dK/dV returned to its home rank): a gradient reduce started during the backward would
    queue ahead of that message on a rank whose peer waits for the message before its own
    reduce (NCCL runs one communicator's operations in the order they were posted)."""
    for k in range(len(instructions) - 1, -1, -1):  # from the end: ``empty`` asked of the tail only
        x = instructions[k]
        if isinstance(x, LOCAL_INSTRUCTIONS) or (isinstance(x, ForwardBackward) and empty(x)):
            continue
        return k if isinstance(x, (ForwardBackward, Backward)) else None
    return None


def _exports(rank_plan: RankPlan) -> Dict[int, Tuple[int, ...]]:
    """Micro-batch -> the sources it produces whose heads other ranks import."""
    out: Dict[int, Tuple[int, ...]] = {}
    for s, src in rank_plan.sources.items():
        if src.exported is not None:
            out[src.producer] = out.get(src.producer, ()) + (s,)
    return out


def _allocate(sources: Tuple[int, ...], kinds: Optional[Tuple[str, ...]] = None) -> List[Instruction]:
    return [AllocateKV(sources, kinds)] if sources else []


def _release(sources: Tuple[int, ...], kinds: Tuple[str, ...] = KV_KINDS) -> List[Instruction]:
    return [ReleaseKV(sources, kinds)] if sources else []


def _send_heads(i: int, exports: Dict[int, Tuple[int, ...]], held=None) -> List[Instruction]:
    """Micro-batch ``i``'s exported heads sent, then their K/V released (the sends hold a copy;
    the home's gradients arrive in blocks of their own). ``held``: the sources allocated here."""
    if i not in exports:
        return []
    release = tuple(s for s in exports[i] if held is None or s in held)
    return [SendHeads(i)] + _release(release)


def training_instructions(rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
    """The rank's training step: its schedule with the memory plan's decisions (kept or dropped
    graphs, when cached K/V go) and the step's communication made explicit."""
    out: List[Instruction] = []
    exports = _exports(rank_plan)
    release_after: Dict[int, List[int]] = {}  # schedule step -> sources whose K/V go then
    for s, last in (memory.kv_release_step.items() if rank_plan.sources else ()):
        release_after.setdefault(last, []).append(s)
    for step, (op, i) in enumerate(rank_plan.schedule):
        mb = rank_plan.micro_batches[i]
        produces = tuple(mb.produces)
        keep = memory.keep_graph.get(i, True) if memory is not None else True
        if not mb.computes:  # an import receives heads and returns their gradients; idle: nothing
            if mb.role == "import" and op == "forward":
                out += _allocate(produces) + [ImportHead(i)]
            elif mb.role == "import":
                out += [ReturnHeadGrads(i)] + _release(produces, ALL_KINDS)
        elif op == "forward_backward":
            out.append(ForwardBackward(i))
        elif op == "forward":
            out += _allocate(produces) + [ForwardKeep(i) if keep else ForwardDrop(i)]
            out += _send_heads(i, exports)
        else:
            out += [CollectHeadGrads(i)] if i in exports else []
            ex = mb.exchange
            out += [ReturnReplicaGrads(i)] if ex is not None and ex.backward_collective else []
            out += [Backward(i, recompute=not keep)] + _release(produces, ALL_KINDS)
        out += _release(tuple(release_after.get(step, ())))
    return out


def forward_instructions(rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
    """The rank's forward-only pass: every micro-batch in order, a cached source's K/V
    allocated only if this rank reads it later and freed after its last reader."""
    out: List[Instruction] = []
    exports = _exports(rank_plan)
    last_reader = memory.kv_release_step if rank_plan.sources else {}
    for i, mb in enumerate(rank_plan.micro_batches):
        # (an owner read only elsewhere holds nothing)
        out += _allocate(tuple(s for s in mb.produces if s in last_reader), KV_KINDS)
        if not mb.computes:
            out += [ImportHead(i)] if mb.role == "import" else []
            continue
        out.append(Forward(i))
        out += _send_heads(i, exports, last_reader)
        out += _release(tuple(s for s in mb.reads if last_reader[s] == i))
    return out
