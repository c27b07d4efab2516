"""One rank's step as a stream of typed instructions, the form the engine executes.

The plan (:class:`~megatron_psrl.schedule.plan.RankPlan`) orders micro-batches as forward /
backward / forward-backward steps; its memory plan decides which producers keep their graph
and when cached K/V may go. Lowering both gives the rank's instructions, each a small frozen
dataclass that names one thing to do:

====================  ==========================================================================
instruction           what the engine does (``megatron_psrl.engine.step.StepRunner``)
====================  ==========================================================================
AllocateKV            blocks for the sources a micro-batch is about to produce or receive, or
                      whose gradients the step writes first
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
Residency             host offload: what stays on the device for this step and the next; the
                      rest of the kept graphs and cached K/V goes to host memory
Transfer              pipeline stages: activations and gradients to and from the neighbouring
                      stages, posted as one batch and waited for (virtual stages)
====================  ==========================================================================

A pipeline stage runs the same instructions; a model run receives its input from the stage
before and sends its output on by itself (``engine/stage_links.py``), except with virtual
stages (several model chunks per rank), whose step of independent micro-batches is lowered by
:func:`megatron_psrl.schedule.interleaved.interleaved_1f1b` into model runs of one chunk
(``ForwardKeep`` / ``Backward`` with a ``chunk``) and explicit :class:`Transfer` instructions,
the stream itself saying which sends and receives go together. Stage 1 of 3 with two chunks
and four micro-batches, in its steady state (boundary ``b``: between virtual stages ``b`` and
``b + 1``; this stage's chunk 1 is virtual stage 4)::

    ForwardKeep(2, chunk=1)     # chunk 1 of micro-batch 2, on the activation received for it
    Backward(0, chunk=1)        # chunk 1 of micro-batch 0, from the output gradient received
    Transfer(sends=(StageMessage(0, 3, gradient=True), StageMessage(2, 4)),     # what the two made
             receives=(StageMessage(1, 4, gradient=True), StageMessage(3, 3)))  # what the next two read
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

from megatron_psrl.kvcache.prefix_state import GRADS, GRADS_ONLY, RELEASE_ALL, VALUES, VALUES_ONLY
from megatron_psrl.schedule.plan import MemoryPlan, RankPlan

ALL_KINDS = RELEASE_ALL
"""Every block a source holds (its gradients, then its values: the roles of
:mod:`megatron_psrl.kvcache.prefix_state`)."""

KV_KINDS = VALUES_ONLY
"""A source's values (K/V rows, a latent, a recurrent state)."""


@dataclass(frozen=True)
class ForwardPass:
    """What one model forward of an instruction does besides running the model."""

    graph: bool
    """Builds an autograd graph (a backward follows, now or later)."""

    writes: bool
    """Writes the values of the sources its micro-batch produces into the KV cache."""

    keeps_rows: bool
    """Keeps its sources' rows in the graph, for the gradients readers inject at its backward."""

    loss: bool = True
    """Computes the loss of its claimed rows now (a dropped graph's comes with its recomputation)."""


@dataclass(frozen=True)
class Instruction:
    """One thing a rank does in a step."""

    pass_kind: ClassVar[Optional[str]] = None
    """The pass the expert lockstep counts for this instruction (None: it runs no model)."""

    forward_pass: ClassVar[Optional[ForwardPass]] = None
    """The model forward it runs (None: none)."""


@dataclass(frozen=True)
class MicroBatchInstruction(Instruction):
    """An instruction about one micro-batch of the rank's plan."""

    micro_batch: int
    """Index into ``RankPlan.micro_batches``."""


@dataclass(frozen=True)
class ForwardBackward(MicroBatchInstruction):
    """Forward with a graph, loss, backward at once: nobody reads the micro-batch later.

    Cache: reads its cached prefixes (values) and adds their gradients; holds its gathered
    copies and its graph only while it runs."""

    pass_kind: ClassVar[Optional[str]] = "P"
    forward_pass: ClassVar[Optional[ForwardPass]] = ForwardPass(graph=True, writes=False, keeps_rows=False)


@dataclass(frozen=True)
class ForwardKeep(MicroBatchInstruction):
    """A producer's forward, its graph kept until its :class:`Backward`.

    Cache: writes its sources' values (allocated just before), reads its cached prefixes;
    memory: its graph and the copies it keeps stay until its backward."""

    pass_kind: ClassVar[Optional[str]] = "K"
    forward_pass: ClassVar[Optional[ForwardPass]] = ForwardPass(graph=True, writes=True, keeps_rows=True)

    chunk: Optional[int] = None
    """Virtual pipeline stages: the one model chunk of the rank this forward runs, its input
    received and its output sent by :class:`Transfer` instructions (None: every chunk, in order)."""


@dataclass(frozen=True)
class ForwardDrop(MicroBatchInstruction):
    """A producer's forward without a graph: its :class:`Backward` recomputes it.

    Cache: writes its sources' values, reads its cached prefixes; memory: its gathered copies
    only while it runs (and again in the recomputation)."""

    pass_kind: ClassVar[Optional[str]] = "N"
    forward_pass: ClassVar[Optional[ForwardPass]] = ForwardPass(graph=False, writes=True, keeps_rows=False, loss=False)


@dataclass(frozen=True)
class Forward(MicroBatchInstruction):
    """A forward-only pass (log-probs, sequence sums), no graph.

    Cache: writes the values of the sources read later on this rank, reads its cached prefixes."""

    pass_kind: ClassVar[Optional[str]] = "N"
    forward_pass: ClassVar[Optional[ForwardPass]] = ForwardPass(graph=False, writes=True, keeps_rows=False)


@dataclass(frozen=True)
class Backward(MicroBatchInstruction):
    """A producer's backward, after its readers': the gradients they accumulated injected into
    its sources' rows (recomputing its forward first when the graph was dropped).

    Cache: reads its sources' gradients (a :class:`ReleaseKV` of everything follows), and its
    cached prefixes' values again when it recomputes; memory: its kept graph goes."""

    recompute: bool = False
    """The forward dropped its graph: run it again (with a graph) before the backward."""

    chunk: Optional[int] = None
    """Virtual pipeline stages: the one model chunk of the rank this backward runs (its kept
    :class:`ForwardKeep` of that chunk), its output's gradient received and its input's sent by
    :class:`Transfer` instructions (None: every chunk, last to first)."""

    @property
    def pass_kind(self) -> str:  # type: ignore[override]
        """A recomputing backward is one whole pass (its forward and backward) for the lockstep."""
        return "P" if self.recompute else "B"

    @property
    def forward_pass(self) -> Optional[ForwardPass]:  # type: ignore[override]
        """A recomputing backward runs its producer's forward again, with a graph and its rows
        kept (its values are in the cache already)."""
        return ForwardPass(graph=True, writes=False, keeps_rows=True) if self.recompute else None


@dataclass(frozen=True)
class SendHeads(MicroBatchInstruction):
    """The heads micro-batch ``micro_batch`` exports go to the ranks that import them.

    Cache: reads the exported sources' values (a copy is sent; a :class:`ReleaseKV` of their
    values follows)."""


@dataclass(frozen=True)
class ImportHead(MicroBatchInstruction):
    """An import micro-batch receives prefix heads from their home rank into its sources (no model).

    Cache: writes the received values into sources allocated just before."""


@dataclass(frozen=True)
class ReturnReplicaGrads(MicroBatchInstruction):
    """Cross-rank, before a deferred backward: the gradients readers accumulated in replicas
    of this step's prefixes go to their owners (one collective over the exchange group).

    Cache: reads the replicas' gradients; adds the received ones to the owners' gradients."""


@dataclass(frozen=True)
class CollectHeadGrads(MicroBatchInstruction):
    """Before the backward of a micro-batch that exported heads: the gradients importers
    returned are added to the heads' gradients.

    Cache: adds to the exported sources' gradients."""


@dataclass(frozen=True)
class ReturnHeadGrads(MicroBatchInstruction):
    """The backward of an import micro-batch: its heads' accumulated gradients go back home.

    Cache: reads the imported sources' gradients (a :class:`ReleaseKV` of everything follows)."""


@dataclass(frozen=True)
class AllocateKV(Instruction):
    """Blocks for sources a micro-batch is about to produce or receive (their values), or whose
    gradients the step is about to write first (gradients zeroed).

    Memory: the sources' blocks of the given roles, until a :class:`ReleaseKV`."""

    sources: Tuple[int, ...]
    """Cached sources to allocate, in the plan's order."""

    kinds: Optional[Tuple[str, ...]] = None
    """Block roles of every source (None: each source's own ``CachedSource.kinds``)."""


@dataclass(frozen=True)
class ReleaseKV(Instruction):
    """Blocks of sources nobody needs now go back to their pools.

    Memory: whatever of the given roles the sources still hold."""

    sources: Tuple[int, ...]
    """Cached sources whose blocks go."""

    kinds: Tuple[str, ...] = KV_KINDS
    """Which of their blocks (``KV_KINDS``: the values only; ``ALL_KINDS``: everything)."""


@dataclass(frozen=True)
class Residency(Instruction):
    """Host offload (a memory plan's ``host_offload``), first in every schedule step: the kept
    graphs and cached sources this step and the next use stay on the device (or come back: the
    next step's during this one, on a side stream); every other kept graph and held source goes
    to host memory (:func:`step_residents`).

    Memory: KV blocks and kept graphs on the device only while a step near them uses them."""

    graphs: Tuple[int, ...]
    """Micro-batches whose kept graph this step uses (its own)."""

    sources: Tuple[int, ...]
    """Cached sources this step uses."""

    next_graphs: Tuple[int, ...] = ()
    """Kept graphs only the next step uses: copied back during this step (it does not wait)."""

    next_sources: Tuple[int, ...] = ()
    """Cached sources only the next step uses: likewise."""


def step_residents(rank_plan: RankPlan, order: List[int], t: int) -> Tuple[List[int], set]:
    """``(micro-batches, sources)`` that schedule step ``t`` and the next use (its micro-batch
    and the next step's, and the sources they read or produce): what host offload keeps on the
    device at step ``t`` (the next step's come back during this one). ``order``: the
    micro-batch of every schedule step. The memory plan prices exactly this
    (:func:`megatron_psrl.schedule.memory.count_stream`) and :class:`Residency` enacts it."""
    mbs = list(dict.fromkeys(order[u] for u in (t, t + 1) if u < len(order)))
    sources = {s for i in mbs for s in rank_plan.micro_batches[i].reads + rank_plan.micro_batches[i].produces}
    return mbs, sources


@dataclass(frozen=True, order=True)
class StageMessage:
    """One tensor between two neighbouring pipeline stages. With ``V`` chunks per rank on ``P``
    stages the model is ``V * P`` parts (virtual stages; part ``chunk * P + stage``); boundary
    ``b`` lies between part ``b`` (on stage ``b % P``) and part ``b + 1`` (on stage
    ``(b + 1) % P``). Both ends of a :class:`Transfer` post its messages in one order (the
lowering sorts them alike on both)."""

    micro_batch: int
    """Index into ``RankPlan.micro_batches``."""

    boundary: int
    """The parts ``boundary`` and ``boundary + 1`` it goes between."""

    gradient: bool = False
    """False: part ``boundary``'s forward output, to the next stage (part ``boundary + 1``'s
    input); True: part ``boundary + 1``'s input gradient, back to the previous stage (part
    ``boundary``'s output gradient)."""

    def sender_chunk(self, num_stages: int) -> int:
        """The sending stage's chunk: the part whose output (or input gradient) it is."""
        return (self.boundary + self.gradient) // num_stages

    def receiver_chunk(self, num_stages: int) -> int:
        """The receiving stage's chunk: the part whose input (or output gradient) it is."""
        return (self.boundary + 1 - self.gradient) // num_stages


@dataclass(frozen=True)
class Transfer(Instruction):
    """Sends and receives of a pipeline stage, posted together as one batch
    (``batch_isend_irecv``: none waits for another) and waited for before the next instruction.

    Sends: each a tensor this stage produced earlier (a forward's output, a backward's input
    gradient), handed over and forgotten; receives: each into a buffer of the shape the plan
    gives (``[t, 1, h]`` of the micro-batch's pack), held until the model run that reads it.
    Both ends of a message post it in their instructions of the same round, in
    :class:`StageMessage` order."""

    sends: Tuple[StageMessage, ...]
    """What goes to the neighbours, in order."""

    receives: Tuple[StageMessage, ...]
    """What comes from the neighbours, in order."""


def lockstep_passes(instructions: List[Instruction]) -> List[Tuple[str, int]]:
    """``(pass, micro-batch)`` of every model run, in order: the expert lockstep's plan."""
    return [(x.pass_kind, x.micro_batch) for x in instructions if x.pass_kind is not None]


LOCAL_INSTRUCTIONS = (AllocateKV, ReleaseKV, Residency)
"""Instructions that neither run the model nor communicate."""

TRAILING_TRANSFERS = (Transfer,)
"""Instructions after a stage's last backward that only send on the pipeline group (its input
gradient to the stage before): they do not hold back the gradient reduce (:func:`last_backward`)."""


def last_backward(instructions: List[Instruction],
                  empty: Callable[[ForwardBackward], bool] = lambda x: False) -> Optional[int]:
    """Index of the step's last backward pass (the last :class:`ForwardBackward` or
    :class:`Backward`; ``empty(x)``: that forward-backward certainly runs no backward, e.g. a
    micro-batch without a claimed token, and is passed over): no gradient changes after it,
    so a parameter's gradient of the step is complete once that pass has produced it. None
    when the stream has no backward, or when an instruction after it communicates (a head's
    dK/dV returned to its home rank): a gradient reduce started during the backward would
    queue ahead of that message on a rank whose peer waits for the message before its own
    reduce (NCCL runs one communicator's operations in the order they were posted). A pipeline
    stage's trailing :class:`Transfer` is passed over: its peer, the stage before, reduces
    over another group (of its own stage), whose ranks all receive theirs (as a 1F1B stage's
    last send, which goes at the end of its step)."""
    for k in range(len(instructions) - 1, -1, -1):  # from the end: ``empty`` asked of the tail only
        x = instructions[k]
        if isinstance(x, LOCAL_INSTRUCTIONS + TRAILING_TRANSFERS) or (isinstance(x, ForwardBackward) and empty(x)):
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


@dataclass(frozen=True)
class LoweredStep:
    """One step of the rank's schedule and the instructions that carry it out, in order: the
    unit the memory plan counts (:func:`megatron_psrl.schedule.memory.count_stream`), which
    reads what a step holds after its allocations and model run, before its releases."""

    micro_batch: int
    """The micro-batch the schedule step is about."""

    instructions: Tuple[Instruction, ...]
    """What the rank does in this step."""


def flatten(steps: List[LoweredStep]) -> List[Instruction]:
    """The instruction stream of lowered steps."""
    return [x for step in steps for x in step.instructions]


def last_reads(rank_plan: RankPlan, keep: Dict[int, bool], rereads: bool = False) -> Dict[int, int]:
    """Source -> the schedule step of its last read: the one lifetime rule of cached values.

    A micro-batch reads its cached prefixes in its forward (or forward-backward); a backward
    reads them again when it recomputes the forward: a dropped graph always, any graph when
    ``rereads`` (activation recomputation, or an attention that gathers again in its backward)."""
    out: Dict[int, int] = {}
    for t, (op, i) in enumerate(rank_plan.schedule):
        if op in ("forward", "forward_backward") or (op == "backward" and (rereads or not keep.get(i, True))):
            for s in rank_plan.micro_batches[i].reads:
                out[s] = t
    return out


def first_gradient_writes(rank_plan: RankPlan) -> Dict[int, int]:
    """Source -> the schedule step whose work first writes its gradients, where its gradient
    blocks are allocated: the backward (or forward-backward) of its first reader on this rank
    to run one, else its producer's backward (where the gradients other ranks return are
    added: replicas' readers, a head's importers). Every reader's backward comes before the
    producer's, so a source's fp32 dK/dV live from its first reader's backward to its
    producer's, not from its producer's forward; nothing reads or writes them before."""
    first: Dict[int, int] = {}
    for t, (op, i) in enumerate(rank_plan.schedule):
        if op == "forward":
            continue
        mb = rank_plan.micro_batches[i]
        for s in tuple(mb.reads) + (tuple(mb.produces) if op == "backward" else ()):
            first.setdefault(s, t)
    return {s: t for s, t in first.items() if GRADS in rank_plan.sources[s].kinds}


def _allocate_produced(rank_plan: RankPlan, produces: Tuple[int, ...], grads_later: Dict[int, int]) -> List[Instruction]:
    """Blocks of the sources a forward produces (or an import receives): their values, and
    their gradients only where no later step allocates them (:func:`first_gradient_writes`)."""
    kinds = {s: rank_plan.sources[s].kinds for s in produces}
    values = tuple(s for s in produces if VALUES in kinds[s])
    grads = tuple(s for s in produces if GRADS in kinds[s] and s not in grads_later)
    return _allocate(values, VALUES_ONLY) + _allocate(grads, GRADS_ONLY)


def lower_training(rank_plan: RankPlan, keep: Dict[int, bool], release_step: Dict[int, int]) -> List[LoweredStep]:
    """The rank's training step, a :class:`LoweredStep` per schedule step: its schedule with
    the memory decisions (``keep``: producer -> keep its graph; ``release_step``: source -> the
    step after which its values go, :func:`last_reads`) and the step's communication explicit.

    Per step: the gradient blocks of the sources whose gradients the step writes first
    (:func:`first_gradient_writes`), the value blocks of what a forward produces before it, the
    model run, then releases: an exported head's values once sent, a producer's every block
    after its backward, and the values whose last reader this step was."""
    steps: List[LoweredStep] = []
    exports = _exports(rank_plan)
    release_after: Dict[int, List[int]] = {}  # schedule step -> sources whose values go then
    for s, last in (release_step.items() if rank_plan.sources else ()):
        release_after.setdefault(last, []).append(s)
    grads_later = first_gradient_writes(rank_plan)
    grads_at: Dict[int, List[int]] = {}  # schedule step -> sources whose gradient blocks come then
    for s, t in grads_later.items():
        grads_at.setdefault(t, []).append(s)
    for step, (op, i) in enumerate(rank_plan.schedule):
        out: List[Instruction] = _allocate(tuple(sorted(grads_at.get(step, ()))), GRADS_ONLY)
        mb = rank_plan.micro_batches[i]
        produces = tuple(mb.produces)
        kept = keep.get(i, True)
        if not mb.computes:  # an import receives heads and returns their gradients; idle: nothing
            if mb.role == "import" and op == "forward":
                out += _allocate_produced(rank_plan, produces, grads_later) + [ImportHead(i)]
            elif mb.role == "import":
                out += [ReturnHeadGrads(i)] + _release(produces, ALL_KINDS)
        elif op == "forward_backward":
            out.append(ForwardBackward(i))
        elif op == "forward":
            out += _allocate_produced(rank_plan, produces, grads_later) + [ForwardKeep(i) if kept else ForwardDrop(i)]
            out += _send_heads(i, exports)
        else:
            out += [CollectHeadGrads(i)] if i in exports else []
            ex = mb.exchange
            out += [ReturnReplicaGrads(i)] if ex is not None and ex.backward_collective else []
            out += [Backward(i, recompute=not kept)] + _release(produces, ALL_KINDS)
        out += _release(tuple(release_after.get(step, ())))
        steps.append(LoweredStep(i, tuple(out)))
    return steps


def one_f_one_b(steps: List[LoweredStep], stage: int, num_stages: int) -> List[LoweredStep]:
    """A pipeline stage's share of a mechanism-1 step (every step a :class:`ForwardBackward`:
    micro-batches independent) in the 1F1B order of megatron's and DeepSpeed's pipeline
    schedules: the stage's warm-up forwards (``num_stages - stage - 1``, the stages after it
    still filling), then one forward and one backward in turn, then the remaining backwards.
    Each micro-batch's forward keeps its graph (:class:`ForwardKeep`; a mechanism-1 micro-batch
    writes no cache) until its :class:`Backward`, so a stage holds at most
    ``num_stages - stage`` graphs at once.

    For stage 0 of 2 and micro-batches 0..3: ``F0 F1 B0 F2 B1 F3 B2 B3``; stage 1:
    ``F0 B0 F1 B1 F2 B2 F3 B3``."""
    for step in steps:
        if not all(isinstance(x, ForwardBackward) for x in step.instructions):
            raise ValueError(f"1F1B orders independent micro-batches only, not {step.instructions}")
    order = [step.micro_batch for step in steps]
    warmup = min(num_stages - stage - 1, len(order))
    forward = [LoweredStep(i, (ForwardKeep(i),)) for i in order]
    backward = [LoweredStep(i, (Backward(i),)) for i in order]
    out = forward[:warmup]
    for k in range(len(order) - warmup):
        out += [forward[warmup + k], backward[k]]
    return out + backward[len(order) - warmup:]


def training_instructions(rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
    """The rank's training step as the memory plan lowered and counted it (kept or dropped
    graphs, when cached values go) with the step's communication explicit."""
    if memory is None:
        return flatten(lower_training(rank_plan, {}, {}))
    steps = lower_training(rank_plan, memory.keep_graph, memory.kv_release_step)
    return flatten(with_residency(rank_plan, steps) if memory.host_offload else steps)


def with_residency(rank_plan: RankPlan, steps: List[LoweredStep]) -> List[LoweredStep]:
    """Host offload: a :class:`Residency` first in every step (:func:`step_residents`)."""
    order = [step.micro_batch for step in steps]
    out = []
    for t, step in enumerate(steps):
        mbs, sources = step_residents(rank_plan, order, t)
        now_mbs, now = step_residents(rank_plan, order[t:t + 1], 0)
        residency = Residency(tuple(now_mbs), tuple(sorted(now)), tuple(i for i in mbs if i not in now_mbs),
                              tuple(sorted(sources - now)))
        out.append(LoweredStep(step.micro_batch, (residency,) + step.instructions))
    return out


def forward_release_steps(rank_plan: RankPlan) -> Dict[int, int]:
    """Forward-only: source -> the micro-batch after which its values go: its last reader on
    this rank, or its producer for a head sent to other ranks (an owner read only elsewhere
    holds nothing)."""
    last = {s: max(src.consumers) for s, src in rank_plan.sources.items() if src.consumers}
    last.update({s: src.producer for s, src in rank_plan.sources.items() if src.exported is not None})
    return last


def lower_forward(rank_plan: RankPlan, last_reader: Dict[int, int]) -> List[LoweredStep]:
    """The rank's forward-only pass, a :class:`LoweredStep` per micro-batch in order: a cached
    source's values allocated only if this rank reads it later (``last_reader``,
    :func:`forward_release_steps`) and freed after its last reader."""
    steps: List[LoweredStep] = []
    exports = _exports(rank_plan)
    for i, mb in enumerate(rank_plan.micro_batches):
        # (an owner read only elsewhere holds nothing)
        out = _allocate(tuple(s for s in mb.produces if s in last_reader), KV_KINDS)
        if not mb.computes:
            out += [ImportHead(i)] if mb.role == "import" else []
        else:
            out.append(Forward(i))
            out += _send_heads(i, exports, last_reader)
            out += _release(tuple(s for s in mb.reads if last_reader[s] == i))
        steps.append(LoweredStep(i, tuple(out)))
    return steps


def forward_instructions(rank_plan: RankPlan, memory: Optional[MemoryPlan]) -> List[Instruction]:
    """The rank's forward-only pass as its memory plan lowered and counted it."""
    return flatten(lower_forward(rank_plan, memory.kv_release_step if rank_plan.sources else {}))
