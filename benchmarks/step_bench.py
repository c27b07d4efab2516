"""One update step of the project (tree build + planning + forward + backward), timed and with
its measured peak memory: what bench_update_step.py, bench_peers.py and bench_kv_reuse.py measure."""

from __future__ import annotations

import time

import torch

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.kvcache import BlockKVCache, KVGeometry, activation_bytes_per_token, plan_memory
from megatron_psrl.training.actor import cost_model_for
from megatron_psrl.training.loss import LossConfig
from megatron_psrl.training.memory import PeakMemory
from megatron_psrl.training.step import StepRunner
from megatron_psrl.tree import build_prefix_tree
from megatron_psrl.tree.planner import PlannerConfig, plan_step


class Bench:
    """One update step of the project on one model, timed, with its measured peak memory."""

    def __init__(self, model, micro_batch_tokens: int, device: torch.device):
        """``model``: a tiny config's name or a :class:`ModelSource`."""
        initialize_parallel(1, 1, seed=0, device=device.type)
        source = model if isinstance(model, ModelSource) else ModelSource(tiny=model)
        self.arch, self.model, _ = load_model(source, dtype=torch.float32, device=device)
        self.device = device
        self.cost = cost_model_for(self.arch)
        self.loss = LossConfig(loss_agg="token-mean")
        self.budget = micro_batch_tokens
        self.geometry = KVGeometry.for_model(self.arch, 1, 1, torch.float32, device)
        self.cache = BlockKVCache(self.geometry, 4 << 30)

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
            plan = plan_step(tree, PlannerConfig(micro_batch_tokens=self.budget, sharing=mode, cost_model=self.cost,
                                                 max_trees_per_micro_batch=per_tree))
            rank = plan.ranks[0]
            memory = plan_memory(rank, self.geometry, kv_budget, activation_bytes_per_token(self.arch, 1, 4)) \
                if rank.sources else None
            out = StepRunner(self.model, self.arch.vocab_size, self.device, backend, self.cache).train(
                plan, 0, self.loss, memory)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "peak_bytes": mem.peak_bytes - mem.start_bytes, "loss": out.loss,
                "tokens_computed": out.tokens_computed, "tokens_recomputed": out.tokens_recomputed,
                "key_pairs": out.key_pairs, "micro_batches": out.num_micro_batches,
                "kv": self.cache.metrics.to_dict() if memory is not None else {}}
