"""One update step of the project (tree build + planning + forward + backward), timed and with
its measured peak memory: what bench_update_step.py, bench_peers.py and bench_kv_reuse.py measure."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch

from megatron_psrl.checkpoint import ModelSource
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.engine.builder import build_engine
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.engine.memory import PeakMemory
from megatron_psrl.engine.runners import make_runner
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.schedule.memory import plan_memory
from megatron_psrl.schedule.planner import plan_step
from megatron_psrl.tree import build_prefix_tree


class Bench:
    """One update step of the project on one model, timed, with its measured peak memory."""

    def __init__(self, model, micro_batch_tokens: int, device: torch.device):
        """``model``: a tiny config's name or a :class:`ModelSource` (its engine is built the way
        every entry point builds one; no optimizer: the bench times forward + backward)."""
        source = model if isinstance(model, ModelSource) else ModelSource(tiny=model)
        self.engine = build_engine(source, ActorConfig(device=device.type, seed=0, micro_batch_tokens=micro_batch_tokens,
                                                       kv_cache_budget=4 << 30, attention_backend="torch"),
                                   for_training=False)
        self.arch, self.model, self.cache = self.engine.arch, self.engine.model, self.engine.kv_cache
        self.device = device
        self.cost = self.engine.flop_model
        self.loss = LossConfig(loss_agg="token-mean")
        self.budget = micro_batch_tokens
        self.geometry = self.engine.geometry
        # The ``dense`` variant runs another attention kernel over the same model and cache.
        self.runners = {"torch": self.engine.runner,
                        "dense": make_runner(self.model, self.arch.vocab_size, device, "dense", self.cache)}

    def step(self, batch: SampleBatch, variant: str, measure_memory: bool = False,
             kv_budget: int = 4 << 30) -> dict:
        """One update step of ``variant`` (``shared``, ``baseline``, ``dense`` or a sharing mode
        ``tree`` / ``tree-dup`` / ``none``); returns time, memory and token counts. Memory is
        measured in separate runs: the per-operation sampling would slow the timed ones."""
        mode = {"shared": "tree", "dense": "tree", "baseline": "none", "per-sample": "none"}.get(variant, variant)
        backend = "dense" if variant == "dense" else "torch"
        per_tree = 1 if variant == "per-sample" else None
        self.model.zero_grad(set_to_none=True)
        with PeakMemory(self.device, enabled=measure_memory) as mem:
            t0 = time.perf_counter()
            tree = build_prefix_tree(batch)
            plan = plan_step(tree, dataclasses.replace(self.engine.planner_config(mode),
                                                       max_trees_per_micro_batch=per_tree))
            rank = plan.ranks[0]
            memory = plan_memory(rank, self.geometry, kv_budget, self.engine.act_bytes) if rank.sources else None
            out = self.runners[backend].train(plan, 0, self.loss, memory)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "peak_bytes": mem.peak_bytes - mem.start_bytes, "loss": out.loss,
                "tokens_computed": out.tokens_computed, "tokens_recomputed": out.tokens_recomputed,
                "key_pairs": out.key_pairs, "micro_batches": out.num_micro_batches,
                "kv": self.cache.metrics.to_dict() if memory is not None else {}}


def write_results(out_dir: str, name: str, payload: dict, markdown: str) -> None:
    """A benchmark's results: ``out_dir/name.json`` (everything measured) and ``out_dir/name.md``
    (the table the docs quote)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(markdown)
