"""One memory budget for the whole step, filled for speed (``--memory-budget``).

The budget counts everything the step holds on the device: the weights, the gradients'
buffers and the optimizer state as they live there (:class:`StaticMemory`), and the step's own
peak, predicted by the memory plan (``MemoryPlan.step_timeline_bytes``: KV blocks, kept graphs,
the running micro-batch's graph, loss head and gradients). Under it the planner chooses, per
step, the plan of least predicted time (:class:`Pricing`) among its levers (:class:`Lever`):

- the micro-batch token budget: ``--micro-batch-tokens`` and its halves down to
  :data:`MIN_MICRO_BATCH_TOKENS` (smaller micro-batches: smaller graphs, a smaller loss head);
- inside each plan, keep or recompute every producer's graph (the memory plan drops graphs
  until the step fits, each dropped graph's forward priced again);
- megatron's ``full`` activation recomputation of the first ``k`` layers (``block``), each
  recomputed layer's forward priced again; per micro-batch size the smallest ``k`` that fits
  and, where that plan still recomputes producers' graphs, the smallest that fits keeping them
  all, each found by bisection (the peak falls with ``k``; the time need not grow with it,
  since recomputed layers can let the plan keep graphs it would otherwise recompute whole);
- host offload of kept graphs and cached K/V that the running and the next step do not use,
  priced as the bytes moved over :attr:`Pricing.host_bytes_per_s` less the compute they
  overlap (a side stream on a GPU).

A budget no lever fits is refused in one line naming the smallest budget that would fit
(:class:`MemoryBudgetError`). The planning arithmetic lives here (no model, no engine); the
engine evaluates a lever on a batch (``megatron_psrl.engine.budget``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron_psrl.errors import ConfigurationError

MIN_MICRO_BATCH_TOKENS = 256
"""The smallest micro-batch token budget the planner tries (below it a step is many tiny
micro-batches whose per-call overhead the FLOP cost model does not see)."""

MICRO_BATCH_HALVINGS = 4
"""``--micro-batch-tokens`` is tried at its value and this many halvings (at least
:data:`MIN_MICRO_BATCH_TOKENS`)."""

PLAN_MARGIN = 0.05
"""The plan's predicted step peak times ``1 + PLAN_MARGIN`` must fit: measured peaks were within
3.2% of the plan's on the bench workloads (docs/architecture.md, "One memory budget"), above
it by at most 1.9% there and 3.8% on their small versions."""

DEFAULT_HEADROOM_FRACTION = 0.1
"""The CUDA default budget: the device's free memory at start-up less this share of its total
memory, for what the plan does not count (the CUDA context, NCCL's buffers, kernels' workspaces,
the caching allocator's fragmentation)."""


class MemoryBudgetError(ConfigurationError, MemoryError):
    """``--memory-budget`` cannot hold the step under any plan (the message names the smallest
    budget that would)."""


def size_text(num_bytes: int) -> str:
    """``"39222934 bytes (37.4 MiB)"``: exact bytes, and a readable size."""
    scaled = f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes} bytes ({scaled})"


def default_memory_budget(free_bytes: int, total_bytes: int,
                          headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> int:
    """The CUDA default of ``--memory-budget``: free memory at start-up less the headroom."""
    return max(0, int(free_bytes - headroom_fraction * total_bytes))


def optimizer_state_bytes(parameters: int, dtype_bytes: int, optimizer: str, momentum: float = 0.0,
                          shards: int = 1) -> int:
    """Bytes of megatron's optimizer state for ``parameters`` parameters of ``dtype_bytes``:
    Adam's two fp32 moments (SGD's fp32 momentum when it has one) and, for a model below fp32,
    the fp32 master copy of the weights; sharded over ``shards`` data-parallel ranks by the
    distributed optimizer."""
    per_param = {"adam": 8, "sgd": 4 if momentum else 0}.get(optimizer, 8) + (4 if dtype_bytes < 4 else 0)
    return -(-parameters * per_param // max(1, shards))


@dataclass(frozen=True)
class StaticMemory:
    """What lives on the device for the whole run, before and after every step."""

    weights: int
    """The model's parameters (this rank's shards)."""
    gradients: int
    """The gradients' buffers allocated before the step (megatron's DDP; 0 when the step
    allocates them: the step's charge counts them then)."""
    optimizer_state: int
    """The optimizer's state (:func:`optimizer_state_bytes`; it appears at the first optimizer step)."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state


@dataclass(frozen=True)
class Pricing:
    """What turns a plan into predicted seconds: the FLOP cost model's work at
    ``device_flops_per_s`` and host copies at ``host_bytes_per_s``, overlapped with the compute
    of the step they run beside (:func:`exposed_transfer_seconds`)."""

    device_flops_per_s: float
    """Sustained FLOP rate of the step's kernels."""
    host_bytes_per_s: float
    """Host link bandwidth of pinned copies."""
    seconds_per_micro_batch: float = 1e-3
    """The fixed cost of one micro-batch's forward and backward (kernel launches, packing, the
    loss head's set-up), which the FLOP count does not see: more, smaller micro-batches cost it."""

    @classmethod
    def for_device(cls, device_type: str) -> "Pricing":
        """Stated defaults: on CUDA an H100's bf16 GEMMs at about 40% of their peak (4e14 FLOP/s)
        over PCIe 4.0 x16 pinned copies (25 GB/s); on CPU a few cores' fp32 GEMMs (5e10 FLOP/s)
        and memory copies (1e10 B/s; the CPU's offload moves nothing, the plan still prices it);
        1 ms per micro-batch on both."""
        if device_type == "cuda":
            return cls(device_flops_per_s=4e14, host_bytes_per_s=2.5e10)
        return cls(device_flops_per_s=5e10, host_bytes_per_s=1e10)


def exposed_transfer_seconds(moved_bytes: Sequence[int], compute_seconds: Sequence[float],
                             host_bytes_per_s: float) -> float:
    """Seconds the step waits for host copies: per schedule step, the copies it runs (graphs and
    K/V leaving, the next step's coming back) less that step's compute, which they overlap."""
    return float(sum(max(0.0, m / host_bytes_per_s - c) for m, c in zip(moved_bytes, compute_seconds)))


@dataclass(frozen=True)
class Lever:
    """One setting of the planner's levers for a step."""

    micro_batch_tokens: int
    """Token budget of one micro-batch."""
    recompute_layers: int = 0
    """Layers (the first ones) whose forward is recomputed in the backward pass (megatron's ``full``, ``block``)."""
    offload: bool = False
    """Kept graphs and cached K/V live in host memory between their uses."""


@dataclass
class Outcome:
    """A lever evaluated on a step's batch."""

    lever: Lever
    fits: bool
    """The predicted step peak, with :data:`PLAN_MARGIN`, fits the budget left by the static memory."""
    peak_bytes: int
    """The predicted step peak (above the static memory); when it does not fit, the least this lever reaches."""
    seconds: float = float("inf")
    """Predicted step time (when it fits)."""
    details: Dict[str, Any] = field(default_factory=dict)
    """What the engine keeps of the plan (the plan itself, the dropped graphs, the sharing mode)."""


Evaluate = Callable[[Lever, int], Outcome]
"""``evaluate(lever, step budget bytes)``: plan the step's batch with ``lever`` and the step's own
budget (the memory budget less the static memory, over ``1 + PLAN_MARGIN``)."""


def micro_batch_ladder(max_tokens: int, floor: int = MIN_MICRO_BATCH_TOKENS,
                       halvings: int = MICRO_BATCH_HALVINGS) -> List[int]:
    """``max_tokens`` and its halvings down to ``floor`` (never below it, never above ``max_tokens``)."""
    out = [int(max_tokens)]
    while len(out) <= halvings and out[-1] // 2 >= min(floor, max_tokens):
        out.append(out[-1] // 2)
    return out


def _ratio(margin: float) -> Fraction:
    return 1 + Fraction(margin).limit_denominator(10000)


def step_budget(budget_bytes: int, static: StaticMemory, margin: float = PLAN_MARGIN) -> int:
    """What the step's predicted peak may reach under ``budget_bytes``: ``(budget - static) / (1 + margin)``,
    rounded down (exactly: the smallest budget that fits a peak is :func:`budget_for`'s)."""
    r = _ratio(margin)
    return (budget_bytes - static.total) * r.denominator // r.numerator


def budget_for(peak_bytes: int, static: StaticMemory, margin: float = PLAN_MARGIN) -> int:
    """The smallest budget whose :func:`step_budget` holds ``peak_bytes``."""
    r = _ratio(margin)
    return static.total + -(-peak_bytes * r.numerator // r.denominator)


def _least(run: Callable[[int], Outcome], lo: int, hi: int, ok: Callable[[Outcome], bool]) -> Optional[Outcome]:
    """The outcome of the least ``k`` in ``[lo, hi]`` with ``ok(run(k))``, or None (bisection:
    ``ok`` holds from some ``k`` on, as the peak falls with every recomputed layer)."""
    first = run(lo)
    if ok(first) or lo >= hi:
        return first if ok(first) else None
    last = run(hi)
    if not ok(last):
        return None
    best = last  # lo is not ok, hi is
    while hi - lo > 1:
        mid = (lo + hi) // 2
        out = run(mid)
        lo, hi, best = (lo, mid, out) if ok(out) else (mid, hi, best)
    return best


def _recompute_candidates(evaluate: Evaluate, base: Lever, max_layers: int, room: int, seen: List[Outcome],
                          clean: Callable[[Outcome], bool]) -> List[Outcome]:
    """The fitting outcomes of ``base``'s micro-batches worth comparing: the fewest recomputed
    layers that fit and, when that plan still recomputes producers' graphs (``clean`` false),
    the fewest that fit with none recomputed (a few layers recomputed may cost less than the
    graphs they let the plan keep: the time is not monotone in the layers), and every other
    fitting layer count the two bisections evaluated on the way. Every evaluation is appended
    to ``seen``; each layer count is evaluated once."""
    done: Dict[int, Outcome] = {}

    def run(k: int) -> Outcome:
        if k not in done:
            done[k] = evaluate(Lever(base.micro_batch_tokens, k, base.offload), room)
            seen.append(done[k])
        return done[k]

    fit = _least(run, 0, max_layers, lambda o: o.fits)
    if fit is not None and not clean(fit) and fit.lever.recompute_layers < max_layers:
        _least(run, fit.lever.recompute_layers + 1, max_layers, lambda o: o.fits and clean(o))
    return [o for o in done.values() if o.fits]


def _no_dropped_graphs(outcome: Outcome) -> bool:
    return not outcome.details.get("dropped_graphs")


def choose(evaluate: Evaluate, budget_bytes: int, static: StaticMemory, micro_batch_tokens: Sequence[int],
           max_recompute_layers: int = 0, offload: bool = False, margin: float = PLAN_MARGIN,
           unbeatable: Optional[Callable[[Outcome], bool]] = None,
           clean: Callable[[Outcome], bool] = _no_dropped_graphs) -> Outcome:
    """The fitting lever of least predicted time (ties: the larger micro-batches, no offload, the
    lower peak), or :class:`MemoryBudgetError` naming the smallest budget that fits.

    The grid is (micro-batch size, recomputed layers, offload); per micro-batch size and offload
    setting it evaluates the fewest recomputed layers that fit and, where that plan recomputes
    producers' graphs (not ``clean``), the fewest that fit keeping them all
    (:func:`_recompute_candidates`: two bisections, not every layer count), and compares them
    all: a larger micro-batch with a few layers recomputed can beat a smaller one with none.
    ``unbeatable(outcome)``: the first lever (the largest micro-batches, nothing recomputed, no
    offload) fits with nothing recomputed or duplicated either, so no other lever can be faster
    (each does as much work in at least as many micro-batches): chosen without the others."""
    room = step_budget(budget_bytes, static, margin)
    seen: List[Outcome] = []
    fitting: List[Outcome] = []
    if room > 0 and unbeatable is not None:
        first = evaluate(Lever(micro_batch_tokens[0]), room)
        if first.fits and unbeatable(first):
            return first
    if room > 0:
        for tokens in micro_batch_tokens:
            for off in ((False, True) if offload else (False,)):
                fitting += _recompute_candidates(evaluate, Lever(tokens, 0, off), max_recompute_layers, room, seen,
                                                 clean)
    if fitting:
        return min(fitting, key=lambda o: (o.seconds, -o.lever.micro_batch_tokens, o.lever.offload, o.peak_bytes))
    raise MemoryBudgetError(_refusal(evaluate, budget_bytes, static, micro_batch_tokens, max_recompute_layers,
                                     offload, margin, seen))


def _refusal(evaluate: Evaluate, budget_bytes: int, static: StaticMemory, micro_batch_tokens: Sequence[int],
             max_recompute_layers: int, offload: bool, margin: float, seen: List[Outcome]) -> str:
    """The one line of a budget no lever fits: the smallest budget that would."""
    if not seen:  # (the static memory alone fills the budget: the leanest lever's least peak)
        seen = [evaluate(Lever(min(micro_batch_tokens), max_recompute_layers, offload), 0)]
    lean = min(seen, key=lambda o: (o.peak_bytes, o.lever.recompute_layers, o.lever.offload, -o.lever.micro_batch_tokens))
    for _ in range(4):  # (a least peak is the plans' own estimate: check it plans, else take the next)
        smallest = budget_for(lean.peak_bytes, static, margin)
        check = evaluate(lean.lever, step_budget(smallest, static, margin))
        if check.fits:
            break
        lean = Outcome(lean.lever, False, max(check.peak_bytes, lean.peak_bytes + 1))
    lever = lean.lever
    how = (f"micro-batches of {lever.micro_batch_tokens} tokens, {lever.recompute_layers} recomputed layers"
           + (", host offload" if lever.offload else ""))
    return (f"--memory-budget {size_text(budget_bytes)} cannot hold this step: the weights, gradients and optimizer "
            f"state take {size_text(static.total)} and the leanest plan ({how}) peaks at {size_text(lean.peak_bytes)} "
            f"(plus {margin:.0%} margin); the smallest budget that fits is {size_text(smallest)}")


def describe(outcome: Outcome, budget_bytes: int, static: StaticMemory, num_layers: int) -> str:
    """The log's line of a step's choice."""
    lever, d = outcome.lever, outcome.details
    gib = lambda b: size_text(b).split("(")[1].rstrip(")")  # noqa: E731
    config = d["plan"].config if "plan" in d else None
    cuts = [why for why, on in (("at branch switches", getattr(config, "cut_at_branch_switches", False)),
                                ("after shared prefixes", getattr(config, "cut_after_shared_prefixes", False))) if on]
    parts = [f"micro-batches of {lever.micro_batch_tokens} tokens" + (f" (cut {' and '.join(cuts)})" if cuts else ""),
             f"recompute {lever.recompute_layers} of {num_layers} layers" if lever.recompute_layers else
             "no activation recomputation",
             f"{d.get('dropped_graphs', 0)} producer graph(s) recomputed",
             "host offload" if lever.offload else "no host offload"]
    if d.get("sharing") not in (None, "tree"):
        parts.append(f"sharing {d['sharing']}")
    return (f"memory budget {gib(budget_bytes)}: {', '.join(parts)}; predicted peak "
            f"{gib(static.total + outcome.peak_bytes)} (weights, gradients and optimizer state {gib(static.total)}), "
            f"predicted step {outcome.seconds:.3g} s")


__all__ = ["DEFAULT_HEADROOM_FRACTION", "Evaluate", "Lever", "MIN_MICRO_BATCH_TOKENS", "MemoryBudgetError", "Outcome",
           "PLAN_MARGIN", "Pricing", "StaticMemory", "budget_for", "choose", "default_memory_budget", "describe",
           "exposed_transfer_seconds", "micro_batch_ladder", "optimizer_state_bytes", "size_text", "step_budget"]
