#!/usr/bin/env python
"""The global planner at cluster scale, and its cost next to the step it plans.

Two modes:

``--mode scale`` (default): simulate the planner on 1,024 / 4,096 / 16,384 ranks (``--ranks``)
for Qwen3-32B- and Qwen3-235B-A22B-sized cost models (``--models``) on step-wise, search-tree,
GRPO and mixed batches of long trajectories (32k-128k tokens). Planner only, no model: for
every (model, workload, ranks) it prints the planned makespan against perfect balance (the
imbalance), the K/V bytes every rank exchanges per step and their time at the link bandwidth,
and the planning time (``plan_step``, both placements of every exchange group)::

    python benchmarks/bench_planner.py --ranks 1024 4096 16384 --nvlink-gbps 450 --ib-gbps 50

``--mode cost``: tree build, plan and packing of ~``--tokens``-token synthetic batches of the
tiny model on ``--dp`` ranks, timed once after a warm-up on one core::

    python benchmarks/bench_planner.py --mode cost --tokens 1000000 --dp 8 --micro-batch-tokens 8192

Scale mode details (also in docs/benchmarks.md, "Planner at scale"):

- Batch size grows with the cluster: ``ranks / 2`` trajectories (root-to-leaf paths, 512 at
  1,024 ranks), so every rank gets 16k-40k unique tokens (1-3 micro-batches of 16k).
- Trees are generated directly at the node level (``synthetic_tree``), never as token lists:
  a 16,384-rank step-wise batch has 8,192 trajectories of ~70k tokens and 2.3 M samples.
- ``--token-unit q``: every length is divided by q (one simulated token stands for q real
  tokens), the micro-batch budget too, and the cost model is scaled to match (linear and
  logit terms x q, attention x q^2, K/V bytes x q). The structure (trees, nodes, micro-batches,
  fragments, steps) is the real one; only per-token array work shrinks. ``--token-unit 1``
  simulates every token (feasible up to ~1k ranks on a small machine).
- Ranks are GPUs; an exchange group (``--group-size``, default 8 = one node) exchanges over
  NVLink when it fits a node (``--gpus-per-node``), over InfiniBand otherwise. Bytes are the
  K/V of all layers in bf16 (a rank keeps whole layers: FSDP/ZeRO sharding, no TP split).
- Seconds are cost-model FLOPs at ``--gpu-tflops`` achieved per GPU; the planner weighs the
  exchange against balance with the same bandwidth (``cost_per_exchanged_byte``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_psrl.schedule.check import check_plan
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import NAMED_MODEL_DIMS, CostModel, ModelDims
from megatron_psrl.schedule.plan import StepPlan
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree.prefix_tree import PrefixTree  # noqa: E402

# ====================================================================== models
BF16_BYTES = 2


@dataclasses.dataclass(frozen=True)
class SimModel:
    """A model for the simulation: its dims, MoE shape (None: dense) and derived costs."""

    name: str
    dims: ModelDims
    num_experts: int = 0
    """Routed experts (0: dense MLP)."""
    top_k: int = 0
    """Experts per token."""
    expert_ffn: int = 0
    """Intermediate width of one expert's (gated) MLP."""

    def cost_model(self) -> CostModel:
        """Forward + backward FLOPs. For a MoE model only the top-k experts' MLPs count (as a
        dense gated MLP of width top_k * expert_ffn), plus the router GEMM (hidden x experts)."""
        if not self.num_experts:
            return CostModel.from_model_dims(self.dims, name=self.name)
        active = dataclasses.replace(self.dims, ffn_hidden_size=self.top_k * self.expert_ffn)
        base = CostModel.from_model_dims(active, name=self.name)
        router = 3.0 * 2.0 * self.dims.num_layers * self.dims.hidden_size * self.num_experts
        return dataclasses.replace(base, linear_flops_per_token=base.linear_flops_per_token + router)

    def kv_bytes_per_token(self) -> float:
        """K and V of one token over all layers, bf16."""
        d = self.dims
        return float(2 * d.num_layers * d.num_kv_heads * d.head_dim * BF16_BYTES)


SIM_MODELS: Dict[str, SimModel] = {
    # Qwen/Qwen3-32B config.json (dense)
    "qwen3-32b": SimModel("qwen3-32b", NAMED_MODEL_DIMS["qwen3-32b"]),
    # Qwen/Qwen3-235B-A22B config.json: 128 experts of moe_intermediate_size 1536, 8 per token,
    # no shared expert, every layer MoE (ffn_hidden_size below is the active width, 8 x 1536)
    "qwen3-235b-a22b": SimModel(
        "qwen3-235b-a22b",
        ModelDims(hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
                  ffn_hidden_size=8 * 1536, vocab_size=151936),
        num_experts=128, top_k=8, expert_ffn=1536),
}


def scaled_cost_model(model: CostModel, q: int) -> CostModel:
    """The cost model of one simulated token standing for ``q`` real tokens."""
    return dataclasses.replace(model, linear_flops_per_token=model.linear_flops_per_token * q,
                               attention_flops_per_key=model.attention_flops_per_key * q * q,
                               head_flops_per_row=model.head_flops_per_row * q)


# ====================================================================== node-level trees
class _Forest:
    """Preorder nodes of a forest under construction: length, parent, claimed token range."""

    def __init__(self) -> None:
        self.length: List[int] = []
        self.parent: List[int] = []
        self.claim: List[Tuple[int, int]] = []  # claimed tokens [a, b) inside the node

    def add(self, parent: int, length: int, claim: Tuple[int, int] = (0, 0)) -> int:
        self.length.append(max(int(length), 1))
        self.parent.append(parent)
        a, b = claim
        self.claim.append((min(a, self.length[-1]), min(b, self.length[-1])))
        return len(self.length) - 1

    def tree(self) -> PrefixTree:
        """A :class:`PrefixTree` (nodes in the order added, which must be preorder) with one
        loss claim per claimed token; no SampleBatch behind it (``batch`` is None: the
        planner's ``tree`` mode does not read the samples)."""
        lens = np.asarray(self.length, dtype=np.int64)
        parent = np.asarray(self.parent, dtype=np.int64)
        m = len(lens)
        offset = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        has = parent >= 0
        # parents precede children: fill depths in one pass over the parent levels
        level_parent = parent.copy()
        depth_acc = np.zeros(m, np.int64)
        active = has.copy()
        while active.any():
            p = level_parent[active]
            depth_acc[active] += lens[p]
            level_parent[active] = parent[p]
            active = level_parent >= 0
        depth = depth_acc
        # subtree end: first later node that is not a descendant (stack over preorder)
        subtree_end = np.full(m, m, dtype=np.int64)
        level = np.zeros(m, np.int64)
        for i in np.flatnonzero(has):  # parents precede children
            level[i] = level[parent[i]] + 1
        stack: List[int] = []
        for i in range(m):
            li = level[i]
            while stack and level[stack[-1]] >= li:
                subtree_end[stack.pop()] = i
            stack.append(i)
        t = int(offset[-1])
        claimed = np.zeros(t + 1, np.int64)
        ca = np.asarray([c[0] for c in self.claim], np.int64) + offset[:-1]
        cb = np.asarray([c[1] for c in self.claim], np.int64) + offset[:-1]
        keep = cb > ca
        np.add.at(claimed, ca[keep], 1)
        np.add.at(claimed, cb[keep], -1)
        claimed = np.cumsum(claimed[:-1]) > 0
        claim_token = np.flatnonzero(claimed).astype(np.int64)
        claim_offsets = np.concatenate([[0], np.cumsum(claimed)]).astype(np.int64)
        children = np.bincount(parent[has], minlength=m)
        leaves = np.flatnonzero(children == 0)
        # one sample per leaf; a claim belongs to the first sample through its node
        claim_node = np.repeat(np.arange(m), lens)[claim_token]
        claim_sample = np.searchsorted(leaves, claim_node).astype(np.int32)
        return PrefixTree(
            batch=None, tokens=np.zeros(t, np.int32), node_offset=offset, node_parent=parent.astype(np.int32),
            node_depth=depth, node_subtree_end=subtree_end, node_num_samples=np.ones(m, np.int64),
            sample_node=leaves.astype(np.int32), sample_token_index=np.zeros(0, np.int64),
            claim_token=claim_token, claim_sample=claim_sample,
            claim_flat=claim_token.copy(), claim_offsets=claim_offsets)


def _logu(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def _stepwise(f: _Forest, rng, q: int, root: int = -1) -> int:
    """One step-wise trajectory of 32k-128k tokens: a task, then 16-64 turns of an action
    (50-500 tokens, trained) and a tool output; sample t is the history up to action t, so
    the trajectory is one chain of nodes [output_t-1 + action_t]. Returns 1 trajectory."""
    total = _logu(rng, 32768, 131072)
    turns = int(rng.integers(16, 65))
    task = _logu(rng, 1000, 4000)
    actions = np.exp(rng.uniform(np.log(50), np.log(500), turns))
    weights = np.exp(rng.uniform(0, np.log(30), turns - 1))
    outputs = np.maximum(total - task - actions.sum(), 0) * weights / weights.sum()
    node = f.add(root, (task + actions[0]) / q, _suffix(task, actions[0], q))
    for t in range(1, turns):
        node = f.add(node, (outputs[t - 1] + actions[t]) / q, _suffix(outputs[t - 1], actions[t], q))
    return 1


def _suffix(head: float, tail: float, q: int) -> Tuple[int, int]:
    """The claimed range of a node [unclaimed head + claimed tail] in simulated tokens."""
    n = max(int(round((head + tail) / q)), 1)
    return n - max(int(round(tail / q)), 1), n


def _grpo(f: _Forest, rng, q: int, root: int = -1, group: int = 16) -> int:
    """One GRPO group: a prompt of 1k-8k tokens and ``group`` responses of 31k-120k (long
    reasoning rollouts), so trajectories of 32k-128k. Returns ``group`` trajectories."""
    prompt = f.add(root, _logu(rng, 1000, 8000) / q)
    for _ in range(group):
        n = _logu(rng, 31000, 120000) / q
        f.add(prompt, n, (0, max(int(round(n)), 1)))
    return group


def _search_tree(f: _Forest, rng, q: int, root: int = -1, branching: int = 2, depth: int = 3) -> int:
    """One search tree: a 2k-8k prompt; every turn branches ``branching`` ways into an action
    (200-2000 tokens, trained) and a tool output (8k-30k, none after the last action), so
    root-to-leaf paths of ~30k-100k. Returns its number of leaves (trajectories)."""
    top = f.add(root, _logu(rng, 2000, 8000) / q)

    def grow(parent: int, level: int) -> int:
        leaves = 0
        for _ in range(branching):
            action = _logu(rng, 200, 2000)
            obs = _logu(rng, 8000, 30000) if level < depth - 1 else 0.0
            n = max(int(round((action + obs) / q)), 1)
            node = f.add(parent, n, (0, max(int(round(action / q)), 1)))
            leaves += grow(node, level + 1) if level < depth - 1 else 1
        return leaves

    return grow(top, 0)


WORKLOADS = ("stepwise", "search-tree", "grpo", "mixed", "stepwise-one-tree")


def synthetic_tree(workload: str, trajectories: int, q: int, seed: int = 0) -> Tuple[PrefixTree, int]:
    """A batch of about ``trajectories`` root-to-leaf paths (see the unit generators above) as
    a node-level prefix tree in units of ``q`` tokens; returns (tree, trajectories).
    ``stepwise-one-tree``: step-wise trajectories under one shared 512-token system prompt,
    so the whole batch is one tree."""
    rng = np.random.default_rng(seed)
    f = _Forest()
    made = 0
    root = -1
    if workload == "stepwise-one-tree":
        root = f.add(-1, 512 / q)
    kinds = {"stepwise": [_stepwise], "stepwise-one-tree": [_stepwise], "grpo": [_grpo],
             "search-tree": [_search_tree], "mixed": [_stepwise, _search_tree, _grpo]}[workload]
    made_by = [0] * len(kinds)
    while made < trajectories:
        k = int(np.argmin(made_by))  # mixed: equal trajectories of each kind
        n = kinds[k](f, rng, q, root)
        made_by[k] += n
        made += n
    return f.tree(), made


# ====================================================================== one simulation
@dataclasses.dataclass
class ScaleResult:
    workload: str
    model: str
    ranks: int
    trajectories: int
    tree_tokens: float  # real tokens
    micro_batches_per_rank: float
    cross_groups: int
    groups: int
    makespan_s: float
    perfect_s: float
    exchanged_mean: float  # bytes per rank per step
    exchanged_max: float
    exchange_s: float  # the busiest rank's bytes at the group's link bandwidth
    plan_s: float
    local_s: float  # planning one rank's group only (PlannerConfig.local_rank), the slowest of three
    recomputed: float  # tokens computed again (trees split across groups) / unique tokens
    transferred: float = 0.0  # tokens of heads sent between groups instead (once per receiving copy) / unique tokens
    transfer_s: float = 0.0  # the busiest home rank's sends (heads to every importing rank) at InfiniBand speed
    plan: Optional[StepPlan] = None

    @property
    def imbalance(self) -> float:
        return self.makespan_s / self.perfect_s


def rank_exchanged_bytes(plan: StepPlan, kv_bytes_per_token: float) -> np.ndarray:
    """Bytes every rank sends in the step: its prefix K/V (forward), the gradients of the
    chains it received (the exchange's backward) and its replicas' gradients."""
    out = np.zeros(len(plan.ranks))
    for i, r in enumerate(plan.ranks):
        tokens = 0
        for mb in r.micro_batches:
            ex = mb.exchange
            if ex is None:
                continue
            tokens += sum(len(c) for chains in ex.send.values() for c in chains)
            tokens += sum(u.length for uses in ex.recv.values() for u in uses)
            tokens += sum(r.sources[s].length for ids in ex.grad_send.values() for s in ids)
        out[i] = tokens * kv_bytes_per_token
    return out


def simulate(tree: PrefixTree, workload: str, trajectories: int, model: SimModel, ranks: int, q: int,
             args: argparse.Namespace, keep_plan: bool = False) -> ScaleResult:
    flops = args.gpu_tflops * 1e12
    group = args.group_size
    link_gbps = args.nvlink_gbps if group <= args.gpus_per_node else args.ib_gbps
    kvb = model.kv_bytes_per_token() * q  # per simulated token
    cost = scaled_cost_model(model.cost_model(), q)
    config = PlannerConfig(
        micro_batch_tokens=max(args.micro_batch_tokens // q, 1), data_parallel_size=ranks, sharing="tree",
        cost_model=cost, exchange_group_size=group, placement=args.placement, kv_bytes_per_token=kvb,
        cost_per_exchanged_byte=flops / (link_gbps * 1e9),
        cost_per_exchange=flops * 2 * model.dims.num_layers * args.exchange_latency_us * 1e-6,
        cost_per_micro_batch=flops * args.micro_batch_overhead_ms * 1e-3,
        split_trees_across_groups=not args.no_split_trees_across_groups,
        # heads of trees split between groups travel between nodes: InfiniBand, one send and receive
        cross_group_prefix=args.cross_group_prefix, cost_per_transferred_byte=flops / (args.ib_gbps * 1e9),
        cost_per_transfer=flops * 2 * args.exchange_latency_us * 1e-6)
    t0 = time.process_time()  # CPU seconds: wall time on a shared machine includes others' work
    plan = plan_step(tree, config)
    plan_s = time.process_time() - t0
    # What a rank of a real job pays: its own group planned (local_rank), the others assigned
    # only; the slowest of the first, middle and last rank's groups.
    local_s = 0.0
    for rank in sorted({0, ranks // 2, ranks - 1}):
        t0 = time.process_time()
        plan_step(tree, dataclasses.replace(config, local_rank=rank))
        local_s = max(local_s, time.process_time() - t0)
    total = float(cost.tree_cost(tree))
    sent = rank_exchanged_bytes(plan, kvb)
    return ScaleResult(
        workload=workload, model=model.name, ranks=ranks, trajectories=trajectories,
        tree_tokens=float(tree.num_tree_tokens) * q,
        micro_batches_per_rank=plan.num_micro_batches() / ranks,
        cross_groups=plan.placements.count("cross-rank"), groups=len(plan.placements),
        makespan_s=float(max(plan.predicted_makespan)) / flops, perfect_s=total / ranks / flops,
        exchanged_mean=float(sent.mean()), exchanged_max=float(sent.max()),
        exchange_s=float(sent.max()) / (link_gbps * 1e9), plan_s=plan_s, local_s=local_s,
        recomputed=plan.split_tokens_recomputed / tree.num_tree_tokens,
        transferred=plan.transferred_tokens() / tree.num_tree_tokens,
        transfer_s=home_send_bytes(plan, kvb) / (args.ib_gbps * 1e9), plan=plan if keep_plan else None)


def home_send_bytes(plan: StepPlan, kv_bytes_per_token: float) -> float:
    """The busiest home rank's bytes sent in a step: every head to every rank that imports it
    (its K/V; their gradients come back as many), counted from the planned ranks' imports."""
    sent: Dict[int, float] = {}
    for r in plan.ranks:
        for t, j in {src.imported for src in r.sources.values() if src.imported is not None}:
            home = plan.head_sends[t].home_rank
            sent[home] = sent.get(home, 0.0) + plan.head_sends[t].imports[j].length * kv_bytes_per_token
    return max(sent.values(), default=0.0)


HEADER = ("| model | workload | ranks | trajectories | unique tokens / rank | micro-batches / rank | "
          "cross-rank groups | planned makespan s | perfect s | imbalance | exchanged GiB / rank (mean, max) | "
          "exchange s (max rank) | recomputed | sent heads (home send s) | plan CPU s (all groups) | "
          "plan CPU s (one rank) |")


def format_row(r: ScaleResult) -> str:
    gib = 2.0 ** 30
    return (f"| {r.model} | {r.workload} | {r.ranks} | {r.trajectories} | {r.tree_tokens / r.ranks / 1e3:.1f}k | "
            f"{r.micro_batches_per_rank:.2f} | {r.cross_groups}/{r.groups} | {r.makespan_s:.2f} | "
            f"{r.perfect_s:.2f} | {r.imbalance:.3f} | {r.exchanged_mean / gib:.2f}, {r.exchanged_max / gib:.2f} | "
            f"{r.exchange_s:.3f} | {100 * r.recomputed:.2f}% | {100 * r.transferred:.2f}% ({r.transfer_s:.3f}) | "
            f"{r.plan_s:.2f} | {r.local_s:.2f} |")


def run_scale(args: argparse.Namespace) -> None:
    link = "NVLink" if args.group_size <= args.gpus_per_node else "InfiniBand"
    print(f"Planner at scale: token unit {args.token_unit}, micro-batch budget {args.micro_batch_tokens} tokens, "
          f"exchange groups of {args.group_size} ({link}; NVLink {args.nvlink_gbps:g} GB/s, InfiniBand "
          f"{args.ib_gbps:g} GB/s per GPU), {args.gpu_tflops:g} TFLOP/s achieved per GPU, "
          f"placement {args.placement}, {args.trajectories_per_rank:g} trajectories per rank, shared heads of "
          f"split trees: {args.cross_group_prefix}.")
    print()
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for workload in args.workloads:
        for ranks in args.ranks:
            trajectories = max(int(round(ranks * args.trajectories_per_rank)), 1)
            tree, made = synthetic_tree(workload, trajectories, args.token_unit, seed=args.seed)
            for name in args.models:
                res = simulate(tree, workload, made, SIM_MODELS[name], ranks, args.token_unit, args,
                               keep_plan=args.check)
                if args.check:
                    check_plan(res.plan)
                    res.plan = None
                print(format_row(res), flush=True)


# ====================================================================== cost mode
def timed(fn):
    fn()  # warm-up
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run_cost(args: argparse.Namespace) -> None:
    from megatron_psrl.data import make_workload
    from megatron_psrl.tree import build_prefix_tree

    print("| workload | samples | tokens | mode | tree build ms | plan ms | pack ms | micro-batches |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("grpo", "stepwise", "tree", "mixed"):
        batch = make_workload(name, vocab_size=1024, seed=0, num_tokens_target=args.tokens)
        tree, t_build = timed(lambda: build_prefix_tree(batch))
        for mode in ("tree", "none"):
            cfg = PlannerConfig(micro_batch_tokens=args.micro_batch_tokens, sharing=mode, data_parallel_size=args.dp)
            plan, t_plan = timed(lambda: plan_step(tree, cfg))
            _, t_pack = timed(lambda: [r.pack(plan.index, i) for r in plan.ranks for i in range(len(r.micro_batches))])
            print(f"| {name} | {batch.num_samples} | {batch.num_tokens} | {mode} | {1e3 * t_build:.0f} | "
                  f"{1e3 * t_plan:.0f} | {1e3 * t_pack:.0f} | {plan.num_micro_batches()} |")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("scale", "cost"), default="scale")
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--models", nargs="+", choices=sorted(SIM_MODELS), default=["qwen3-32b", "qwen3-235b-a22b"])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["stepwise", "search-tree", "grpo", "mixed"])
    p.add_argument("--trajectories-per-rank", type=float, default=0.5)
    p.add_argument("--token-unit", type=int, default=64, help="real tokens per simulated token (1: exact)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="real tokens per micro-batch (scale mode default 16384, cost mode 8192)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="GB/s per GPU inside a node")
    p.add_argument("--ib-gbps", type=float, default=50.0, help="GB/s per GPU between nodes")
    p.add_argument("--gpu-tflops", type=float, default=400.0, help="achieved bf16 TFLOP/s per GPU")
    p.add_argument("--exchange-latency-us", type=float, default=20.0, help="per layer and direction")
    p.add_argument("--micro-batch-overhead-ms", type=float, default=0.0)
    p.add_argument("--placement", choices=("auto", "whole-tree", "cross-rank"), default="auto")
    p.add_argument("--cross-group-prefix", choices=("auto", "transfer", "recompute"), default="auto",
                   help="trees split between groups: send the shared head over InfiniBand or recompute it "
                        "(auto: per copy, the cheaper)")
    p.add_argument("--no-split-trees-across-groups", action="store_true",
                   help="keep every tree inside one exchange group (the planner before hierarchical placement)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="check every plan (check_plan)")
    p.add_argument("--quick", action="store_true",
                   help="small rank counts (16, 64), token unit 512, checked plans: a smoke run")
    p.add_argument("--tokens", type=int, default=1_000_000, help="cost mode: tokens per batch")
    p.add_argument("--dp", type=int, default=8, help="cost mode: data-parallel ranks")
    args = p.parse_args(argv)
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = 16384 if args.mode == "scale" else 8192
    if args.quick:
        args.ranks = [16, 64]
        args.token_unit = max(args.token_unit, 512)
        args.check = True
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "cost":
        run_cost(args)
    else:
        run_scale(args)


if __name__ == "__main__":
    main()
