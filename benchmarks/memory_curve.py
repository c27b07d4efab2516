"""bench_peers' memory side (issue 35): the step's peak broken down (``--memory-breakdown``) and
the time-memory curve (``--memory-curve``).

The curve: the project at micro-batch budgets 512 .. 32,768 tokens, at the default budget with
the KV budget at its floor (the smallest ``--kv-cache-budget`` its plan accepts), and with full
activation recomputation (every layer), against every peer's settings (AReaL-DTA at whole
sequences and at 4,096, 2,048 and 512-token blocks), in bench_peers' protocol (warm-up and
gradient check, one memory run, interleaved timed rounds). A project point is marked when it
is both faster (median) and leaner (peak) than every peer.

At each peer's memory (issue 46): ``psrl-at-<peer>`` runs the project with ``--memory-budget``
set to the static memory (weights; the bench keeps no optimizer state) plus that peer's
measured step peak, so that the planner picks its fastest plan under the peer's memory; the
table beside the curve says, per peer, whether the project is no slower there and, where no
plan fits, the project's floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Optional

from megatron_psrl.engine.budget import memory_budget_for
from megatron_psrl.engine.calibration import calibrate_for_planning
from megatron_psrl.kvcache import CacheBudgetError
from megatron_psrl.schedule.budget import MemoryBudgetError, size_text

CURVE_BUDGETS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
CURVE_DTA_BLOCKS = "whole,4096,2048,512"
CURVE_PEERS = ("hf-per-sample", "prefix-grouper", "trl-tree")


def kv_floor(bench, batch) -> int:
    """The smallest KV budget (bytes, to 1/1000) under which the default plan of ``batch`` plans;
    0 when it caches nothing."""
    _, plan, memory, _ = bench.actor.plan(batch)
    rank = plan.ranks[0]
    if memory is None or not rank.sources:
        return 0
    settings = bench.engine.memory_settings
    lo, hi = 0, settings.budget_bytes  # lo infeasible, hi feasible
    while hi - lo > max(1 << 16, hi // 1000):
        mid = (lo + hi) // 2
        try:
            dataclasses.replace(settings, budget_bytes=mid)([rank])
            hi = mid
        except CacheBudgetError:
            lo = mid
    return hi


@contextlib.contextmanager
def recomputing(bench):
    """Full activation recomputation (every layer its own unit) on the bench's model for the
    duration (``Engine.set_recompute``: megatron's config fields, the engine's re-read flag and
    the runner's injection of prefix gradients, as ``--recompute-granularity full`` builds them)."""
    engine = bench.engine
    before = engine.recompute_setting
    engine.set_recompute("full", "uniform", 1)
    try:
        yield
    finally:
        engine.set_recompute(*before)


def curve_contenders(bench, psrl_class) -> list:
    """The project's points of the curve (contenders of bench_peers' protocol)."""

    class KvFloor(psrl_class):
        def prepare(self, work):
            self.overrides["kv_cache_budget"] = max(1, kv_floor(bench, work.batch))
            self.kernels = f"budget {bench.budget} tokens, KV budget at its floor {self.overrides['kv_cache_budget']} B"
            return None

    class Recompute(psrl_class):
        def run(self, work):
            with recomputing(bench):
                super().run(work)

    class Budget(psrl_class):
        def prepare(self, work):
            budget = self.overrides["micro_batch_tokens"]
            first_whole = next(b for b in CURVE_BUDGETS if b >= work.tree_tokens or b == CURVE_BUDGETS[-1])
            if budget > first_whole:
                return f"the same single micro-batch as psrl-mb{first_whole} (the tree has {work.tree_tokens} tokens)"
            return super().prepare(work)

    out = [Budget(bench, f"psrl-mb{b}", micro_batch_tokens=b) for b in CURVE_BUDGETS]
    out.append(KvFloor(bench, "psrl-kv-floor"))
    out.append(Recompute(bench, "psrl-recompute"))
    return out


AT_PEER_PREFIX = "psrl-at-"


def budget_costs(bench):
    """The costs a ``--memory-budget`` run of the bench's model measures at start-up
    (``engine.builder.placement_and_costs``), measured once per bench."""
    if getattr(bench, "_budget_costs", None) is None:
        e = bench.engine
        bench._budget_costs, _ = calibrate_for_planning(e.model, e.arch, e.plan_geometry, e.layout.device,
                                                        e.config.micro_batch_tokens, None)
    return bench._budget_costs


def at_peer_contenders(bench, psrl_class, peers: list, measure_peak) -> list:
    """``psrl-at-<peer>`` for every peer: the project under ``--memory-budget`` = the static
    memory + the peer's measured step peak (``measure_peak(peer, work)``: bench_peers' untimed
    memory run, the same measure as every row's). Run after the peers' warm-ups (listed after
    them); skipped, with the peer's reason, when the peer did not run."""

    class AtPeer(psrl_class):
        def __init__(self, peer):
            super().__init__(bench, AT_PEER_PREFIX + peer.name)
            self.peer, self.memory, self.target = peer, None, None

        def prepare(self, work):
            self.memory = None
            if not getattr(self.peer, "ready", False):
                return f"{self.peer.name} did not run"
            self.target = measure_peak(self.peer, work)
            engine = bench.engine
            self.memory = memory_budget_for(engine, 1 << 62)  # (the static memory; the budget set below)
            static = self.memory.static
            self.memory.budget_bytes = static.total + self.target
            try:
                with self.budgeted():
                    engine.plan(work.batch)
            except MemoryBudgetError as e:
                self.memory = None
                return (f"below the project's floor at {self.target / 2**20:.0f} MB (the step allocates the "
                        f"parameters' gradients, {static.weights / 2**20:.1f} MB, beside its graphs): {e}")
            o = self.memory.last
            self.kernels = (f"--memory-budget {size_text(self.memory.budget_bytes)} ({self.peer.name}'s peak "
                            f"{self.target / 2**20:.1f} MB + static {static.total / 2**20:.1f} MB): micro-batches of "
                            f"{o.lever.micro_batch_tokens} tokens, {o.lever.recompute_layers} recomputed layers, "
                            f"{o.details.get('dropped_graphs', 0)} kept graphs recomputed, predicted step peak "
                            f"{o.peak_bytes / 2**20:.1f} MB")
            self.choice = {"micro_batch_tokens": o.lever.micro_batch_tokens,
                           "recompute_layers": o.lever.recompute_layers,
                           "dropped_graphs": o.details.get("dropped_graphs", 0),
                           "predicted_mb": o.peak_bytes / 2**20, "target_mb": self.target / 2**20}
            return None

        @contextlib.contextmanager
        def budgeted(self):
            """The engine plans under this row's budget with the costs a ``--memory-budget`` run
            measures at start-up (and its recomputation choice is undone after)."""
            engine = bench.engine
            before, recompute, measured = engine.memory_budget, engine.recompute_setting, engine.measured
            engine.memory_budget, engine.measured = self.memory, budget_costs(bench)
            try:
                yield
            finally:
                engine.memory_budget, engine.measured = before, measured
                engine.set_recompute(*recompute)

        def run(self, work):
            with self.budgeted():
                super().run(work)

    return [AtPeer(p) for p in peers]


def skip_same_blocks(dta) -> None:
    """An AReaL-DTA contender whose blocks are at least the longest sample runs exactly as
    whole-sequence blocks: skipped as such (one run less per round)."""
    prepare = dta.prepare

    def same_as_whole(work):
        longest = max(len(t) for t in work.seqs)
        if 0 < dta.block_size and dta.block_size >= longest:
            return f"blocks of {dta.block_size} >= the longest sample ({longest}): the same run as areal-dta-whole"
        return prepare(work)
    dta.prepare = same_as_whole


def is_project(name: str) -> bool:
    return name.startswith("psrl")


def curve_rows(summary: dict) -> List[dict]:
    """The curve's points (contenders that ran), each marked ``dominates`` when it is a project
    point both faster and leaner than every peer; ``spread`` is the rounds' range on the clock of
    ``median_s``."""
    rows = [r for r in summary["rows"] if r["median_s"] is not None and r["peak_mb"] is not None]
    peers = [r for r in rows if not is_project(r["contender"]) and not r["contender"].startswith("floor")]
    fastest = min((r["median_s"] for r in peers), default=None)
    leanest = min((r["peak_mb"] for r in peers), default=None)
    out = []
    for r in rows:
        dominates = (is_project(r["contender"]) and fastest is not None and r["median_s"] < fastest
                     and r["peak_mb"] < leanest)
        out.append({"contender": r["contender"], "median_s": r["median_s"], "spread": r["spread_s"],
                    "peak_mb": r["peak_mb"], "micro_batches": r.get("micro_batches"), "dominates": dominates,
                    "peer": r in peers})
    return out


def curve_md(summary: dict, png: Optional[str], clock: str = "wall") -> List[str]:
    rows = curve_rows(summary)
    lines = [f"**{summary['workload']}** (time-memory curve; {summary['tree_tokens']} tree tokens)", "",
             f"| contender | micro-batches | median s ({clock} clock) | min-max s | peak MB | faster and leaner than every peer |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        sp = r["spread"] or {}
        rng = f"{sp['min']:.3f}-{sp['max']:.3f}" if sp.get("min") is not None else "-"
        mbs = "-" if r["micro_batches"] is None else str(r["micro_batches"])
        lines.append(f"| {r['contender']} | {mbs} | {r['median_s']:.3f} | {rng} | {r['peak_mb']:.0f} | "
                     f"{'**yes**' if r['dominates'] else ''} |")
    if png:
        lines += ["", f"![{summary['workload']}]({png})"]
    return lines + [""]


def at_peer_rows(summary: dict) -> List[dict]:
    """Per peer that ran: its median and peak beside the project's row at its memory
    (``psrl-at-<peer>``): the plan chosen, its predicted and measured peak and median, and
    whether the project is no slower there (``ok``), over the budget, or below its floor."""
    by_name = {r["contender"]: r for r in summary["rows"]}
    out = []
    for name, peer in by_name.items():
        ours = by_name.get(AT_PEER_PREFIX + name)
        if ours is None or peer["median_s"] is None or peer["peak_mb"] is None:
            continue
        row = {"peer": name, "peer_s": peer["median_s"], "peer_mb": peer["peak_mb"], "psrl_s": ours["median_s"],
               "psrl_mb": ours["peak_mb"], "status": ours["status"], "reason": ours.get("reason", "")}
        for key in ("micro_batch_tokens", "recompute_layers", "dropped_graphs", "predicted_mb", "micro_batches"):
            row[key] = ours.get(key)
        if ours["median_s"] is not None:
            row["ratio"] = ours["median_s"] / peer["median_s"]
            row["within_budget"] = ours["peak_mb"] is not None and ours["peak_mb"] <= peer["peak_mb"]
            row["no_slower"] = ours["median_s"] <= peer["median_s"]
        out.append(row)
    return out


def at_peer_md(summary: dict, clock: str = "wall") -> List[str]:
    rows = at_peer_rows(summary)
    if not rows:
        return []
    lines = [f"**{summary['workload']}** at each peer's memory (`psrl --memory-budget` = static + the peer's peak)", "",
             f"| peer | peer peak MB | peer median s ({clock}) | psrl plan (micro-batch tokens, recomputed layers, "
             f"kept graphs recomputed; micro-batches) | psrl predicted MB | psrl peak MB | psrl median s | psrl / peer "
             f"| no slower, within the peer's memory |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("ratio") is None:
            lines.append(f"| {r['peer']} | {r['peer_mb']:.0f} | {r['peer_s']:.3f} | {r['status']}: {r['reason']} "
                         f"| - | - | - | - | no |")
            continue
        plan = (f"{r['micro_batch_tokens']}, {r['recompute_layers']}, {r['dropped_graphs']}; {r['micro_batches']}")
        verdict = "**yes**" if r["no_slower"] and r["within_budget"] else (
            "slower" if r["within_budget"] else "over the peer's memory")
        lines.append(f"| {r['peer']} | {r['peer_mb']:.0f} | {r['peer_s']:.3f} | {plan} | {r['predicted_mb']:.1f} "
                     f"| {r['psrl_mb']:.1f} | {r['psrl_s']:.3f} | {r['ratio']:.2f} | {verdict} |")
    return lines + [""]


def plot(summary: dict, path: str, clock: str = "wall") -> Optional[str]:
    """One PNG: peak MB (x) against median seconds (y); the project's budgets as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = curve_rows(summary)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    line = [r for r in rows if r["contender"].startswith("psrl-mb")]
    line.sort(key=lambda r: int(r["contender"][len("psrl-mb"):]))
    ax.plot([r["peak_mb"] for r in line], [r["median_s"] for r in line], "o-", color="tab:blue",
            label="psrl, budget 512 .. 32768")
    for r in line:
        ax.annotate(r["contender"][len("psrl-mb"):], (r["peak_mb"], r["median_s"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    markers = iter("s^vD<>pP*hX")
    for r in rows:
        if r["contender"].startswith("psrl-mb"):
            continue
        colour = "tab:blue" if is_project(r["contender"]) else None
        ax.plot([r["peak_mb"]], [r["median_s"]], next(markers, "x"), color=colour, label=r["contender"],
                markerfacecolor="none" if not is_project(r["contender"]) else colour)
    for r in rows:
        if r["dominates"]:
            ax.plot([r["peak_mb"]], [r["median_s"]], "o", markersize=14, markerfacecolor="none", color="tab:green")
    ax.set_xlabel("peak MB (heap above the step's start)")
    ax.set_ylabel(f"median step s ({clock} clock)")
    ax.set_title(f"{summary['workload']}: time against memory (green ring: faster and leaner than every peer)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- the breakdown
def breakdown(bench, work) -> dict:
    """The step's peak at the defaults broken down (``memory_breakdown.StepBreakdown``) beside
    the memory plan's prediction."""
    from memory_breakdown import StepBreakdown, predicted

    bench.forward_backward(work.batch)  # warm
    bench.actor.zero_grad()
    bench.actor.kv_cache.release_pool()
    pred = predicted(bench.engine, work.batch)
    with StepBreakdown(bench.model, bench.engine.runner, bench.actor.kv_cache) as b:
        bench.forward_backward(work.batch)
    bench.actor.zero_grad()
    return {"workload": work.name, "measured": b.result(), "predicted": pred,
            "act_bytes_per_token": bench.engine.act_bytes, "head_bytes": bench.engine.head_bytes}


def breakdown_md(rows: List[dict]) -> List[str]:
    from memory_breakdown import SAVED_KINDS

    mb = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
    head = ["workload", "peak MB", "at"] + [f"saved: {k}" for k in SAVED_KINDS] + [
        "kept graphs", "KV cache", "param grads", "other", "plan: step peak MB", "plan: micro-batches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        m, p = row["measured"], row["predicted"]
        at = f"{m['phase']} mb {m['micro_batch']}, {m['op'].replace('aten.', '').replace('.default', '')}"
        cells = [row["workload"], mb(m["peak_bytes"]), at] + [mb(m["saved_running"][k]) for k in SAVED_KINDS] + [
            mb(sum(m["saved_kept"].values())), mb(m["kv_cache"]), mb(m["param_grads"]), mb(m["other"]),
            mb(p["step_peak"]), str(p["micro_batches"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]
