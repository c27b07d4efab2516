"""The training loop of pretrain_agent_rl.py: data -> prefix tree -> plan -> steps -> optimizer.

Per iteration, on every rank:

1. the global batch (a slice of the samples file, or a fresh synthetic workload) is turned into
   the global prefix tree (every rank builds the same tree);
2. the planner assigns trees to data-parallel ranks and cuts them into micro-batches, and the
   KV cache manager decides block size / keep-or-recompute for mechanism 2 (every rank plans
   all ranks, so fallbacks and errors are identical everywhere);
3. this rank runs its micro-batches (forward/backward, gradient accumulation);
4. gradients are reduced over data-parallel ranks, clipped, applied;
5. metrics are reduced and logged (stdout and ``--log-json``), checkpoints saved.

All input is validated before the first iteration changes any state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.attention.backends import default_backend
from megatron_psrl.checkpoint.loading import ModelSource, load_model, source_architecture
from megatron_psrl.checkpoint.mcore_format import has_checkpoint, read_checkpoint_info
from megatron_psrl.data.loader import load_samples
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.data.synthetic import WORKLOADS, make_workload
from megatron_psrl.data.validation import check_max_sample_length
from megatron_psrl.distributed.setup import ParallelLayout, exchange_group_of, gradient_group, initialize_parallel
from megatron_psrl.errors import ConfigurationError, NonFiniteTrainingError, UnsupportedFeatureError
from megatron_psrl.kvcache import BlockKVCache, KVGeometry, activation_bytes_per_token, plan_memory_group
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.training.calibration import MeasuredCosts, calibrate_for_planning
from megatron_psrl.training.checkpointing import save_training_checkpoint
from megatron_psrl.training.loss import LossConfig
from megatron_psrl.training.memory import PeakMemory
from megatron_psrl.training.optimizer import OptimizerSettings, build_optimizer
from megatron_psrl.training.planning import plan_with_memory
from megatron_psrl.training.preflight import checkpoint_bytes, prepare_outputs, warn_if_disk_short
from megatron_psrl.training.step import StepRunner
from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.cost import CostModel
from megatron_psrl.tree.planner import PlannerConfig, StepPlan

logger = logging.getLogger("megatron_psrl")


def cost_model_for(arch: ModelArchitecture) -> CostModel:
    return CostModel.from_dims(
        hidden_size=arch.hidden_size, num_layers=arch.num_layers, num_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        vocab_size=arch.vocab_size, name=arch.model_type,
    )


class BatchSource:
    """The global batch of every iteration: slices of a validated file, or synthetic rollouts."""

    def __init__(self, data: str, vocab_size: int, seed: int, global_batch_size: Optional[int],
                 synthetic_tokens: Optional[int], kl_required: bool, progress: bool,
                 max_sequence_length: Optional[int] = None, max_positions: Optional[int] = None):
        self.data = data
        self.vocab_size = vocab_size
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.synthetic_tokens = synthetic_tokens
        self.kl_required = kl_required
        # Samples longer than these are refused (a file at start-up, synthetic batches as made).
        self.length_limits = [(n, why, hint) for n, why, hint in (
            (max_sequence_length, "the model's sliding window", None),
            (max_positions, "the model's max_position_embeddings", "--allow-rope-extrapolation trains it anyway"),
        ) if n is not None]
        self.samples: Optional[SampleBatch] = None
        if data in WORKLOADS and not os.path.exists(data):
            self.kind = "synthetic"
            return
        self.kind = "file"
        self.samples = load_samples(data, vocab_size=vocab_size, require_advantage=True,
                                    kl_required=kl_required, progress=progress)
        if self.samples.num_samples == 0:
            raise ConfigurationError(f"{data}: no samples")
        self._check_lengths(self.samples)

    def _check_lengths(self, batch: SampleBatch) -> None:
        for limit, why, hint in self.length_limits:
            check_max_sample_length(batch, limit, why, hint)

    def batch(self, iteration: int) -> SampleBatch:
        if self.kind == "synthetic":
            # Synthetic rollouts carry old/ref log-probs when the KL term needs them.
            batch = make_workload(self.data, num_tokens_target=self.synthetic_tokens, vocab_size=self.vocab_size,
                                  seed=self.seed + iteration, with_logprobs=self.kl_required)
            self._check_lengths(batch)
            return batch
        if self.global_batch_size is None:
            return self.samples
        gbs = self.global_batch_size
        # Consecutive slices of the file, wrapping around (epochs).
        return self.samples.select((np.arange(gbs) + iteration * gbs) % self.samples.num_samples)


@dataclasses.dataclass
class IterationRecord:
    """One line of --log-json."""

    iter: int
    step_time_s: float
    tokens_total: int
    tokens_computed: int
    ideal_speedup: float
    loss: float
    grad_norm: float
    peak_mem_bytes: int
    lr: float
    samples: int
    micro_batches: int
    tokens_unique: int
    tokens_recomputed: int
    sharing_ratio: float
    tokens_per_s: float
    prefix_sharing: str
    extra: Dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """One line of strict JSON: a non-finite value (a skipped step's loss) is written as null."""
        d = dataclasses.asdict(self)
        d.update(d.pop("extra"))
        return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()})


class Trainer:
    """Owns the model, optimizer, KV cache and loop (see module docstring)."""

    def __init__(self, args):
        self.args = args
        self.layout: ParallelLayout = initialize_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed, args.device,
            timeout_minutes=args.distributed_timeout_minutes, context_parallel_size=args.context_parallel_size,
        )
        self.exchange_group, self.exchange_group_size = exchange_group_of(self.layout)
        if args.pipeline_model_parallel_size > 1:
            raise UnsupportedFeatureError(
                "training with --pipeline-model-parallel-size > 1 is not supported yet (the converter and "
                "--load handle PP-sharded checkpoints; train with TP and DP)"
            )
        if args.use_distributed_optimizer and (args.save or (args.load and not (args.finetune or args.no_load_optim))):
            raise UnsupportedFeatureError(
                "checkpoints of the distributed optimizer's sharded state are not implemented yet: use --save/--load "
                "without --use-distributed-optimizer, or --load with --finetune / --no-load-optim"
            )
        # Everything the run will write is checked (and locked) before any compute.
        with self.layout.monitor.phase("start-up checks"):
            self.outputs = prepare_outputs(args.save, args.log_json, self.layout.is_logging_rank)
        try:
            for note in self.outputs.notes:
                self.log(note)
            self._build()
        except BaseException:
            self.outputs.close(abandon=True)
            raise
        self.skipped_iters = 0
        self.consecutive_skipped = 0

    def _model_source(self) -> ModelSource:
        """Megatron's convention: ``--load`` resumes when it holds a checkpoint; otherwise the
        run starts from ``--hf-dir`` / ``--model`` (a first start with ``--load`` = ``--save``)."""
        args = self.args
        if args.load and has_checkpoint(args.load):
            if args.hf_dir or args.model:
                self.log(f"resuming from {args.load} (--hf-dir/--model are used only while it holds no checkpoint)")
            return ModelSource(checkpoint=args.load)
        if args.load and (args.hf_dir or args.model):
            self.log(f"{args.load} holds no checkpoint yet: starting from {args.hf_dir or args.model}")
            return ModelSource(hf_dir=args.hf_dir, tiny=args.model)
        return ModelSource(hf_dir=args.hf_dir, checkpoint=args.load, tiny=args.model)

    def _build(self) -> None:
        args = self.args
        device = self.layout.device
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        impl = args.transformer_impl
        if impl == "auto":
            impl = "local"
            if device.type == "cuda":
                try:
                    import transformer_engine  # noqa: F401

                    impl = "transformer_engine"
                except ImportError:
                    pass
        source = self._model_source()
        self.start_iteration = 0
        if source.checkpoint and not args.finetune:
            _, info = read_checkpoint_info(source.checkpoint)
            self.start_iteration = info.iteration
            layout = (info.tensor_parallel_size, info.pipeline_parallel_size)
            if info.has_optimizer_state and not args.no_load_optim and layout != (
                self.layout.tensor_parallel_size, self.layout.pipeline_parallel_size
            ):
                raise ConfigurationError(
                    f"{args.load} was saved with TP={layout[0]} PP={layout[1]}; its optimizer state cannot be loaded "
                    f"with TP={self.layout.tensor_parallel_size} PP={self.layout.pipeline_parallel_size}. Pass "
                    "--no-load-optim to resume with a fresh optimizer, or --finetune to start a new run"
                )
        # Validate all input before anything else happens (the data needs only the vocabulary).
        arch = source_architecture(source)
        self.data = BatchSource(
            args.data, arch.vocab_size, args.seed, args.global_batch_size, args.synthetic_tokens,
            kl_required=args.kl_coef != 0.0, progress=self.layout.is_logging_rank and not args.quiet,
            max_sequence_length=arch.sliding_window,
            max_positions=None if args.allow_rope_extrapolation else arch.max_position_embeddings,
        )
        if args.allow_rope_extrapolation and self.data.samples is not None:
            longer = int((self.data.samples.lengths > arch.max_position_embeddings).sum())
            if longer:
                self.log(f"warning: {longer} sample(s) are longer than the model's max_position_embeddings "
                         f"({arch.max_position_embeddings}); RoPE extrapolates (--allow-rope-extrapolation)")
        self.arch, self.model, optimizer_state = load_model(source, dtype=dtype, device=device, transformer_impl=impl)
        self.dtype = dtype
        if args.save and self.layout.is_logging_rank:
            warning = warn_if_disk_short(args.save, checkpoint_bytes(self.arch, dtype, args.optimizer, args.sgd_momentum))
            if warning:
                self.log(warning)
        settings = OptimizerSettings(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_style=args.lr_decay_style, lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        self.optimizer = build_optimizer(self.model, settings, device)
        if optimizer_state and not (args.finetune or args.no_load_optim):
            self.optimizer.load_state_dict(optimizer_state)
        self.loss_cfg = LossConfig(clip_eps=args.clip_eps, kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                                   loss_agg=args.loss_agg)
        tp = self.layout.tensor_parallel_size
        self.geometry = KVGeometry.for_model(self.arch, tp, self.layout.pipeline_parallel_size, dtype, device)
        self.cost_model, self.measured = cost_model_for(self.arch), None
        if self.exchange_group_size > 1 and args.placement != "whole-tree" and args.prefix_sharing == "tree":
            # Cross-rank decisions weigh compute against transfers: measure both on this model.
            with self.layout.monitor.phase("cost calibration"):
                self.measured = calibrate_for_planning(self.model, self.arch, self.geometry, device,
                                                       args.micro_batch_tokens, self.exchange_group,
                                                       profile=args.cost_profile)
            self.cost_model = self.measured.cost_model()
            self.log(f"cost calibration: {self.measured.seconds_per_token * 1e6:.1f} us/token, "
                     f"{self.measured.seconds_per_key * 1e9:.2f} ns/key pair, "
                     f"{self.measured.seconds_per_micro_batch * 1e3:.2f} ms/micro-batch, exchange "
                     f"{self.measured.seconds_per_exchange * 1e3:.2f} ms + "
                     f"{1 / max(self.measured.seconds_per_byte, 1e-15) / 1e9:.2f} GB/s")
        self.kv_cache = BlockKVCache(self.geometry, args.kv_cache_budget)
        self.act_bytes = activation_bytes_per_token(self.arch, tp, torch.tensor([], dtype=dtype).element_size())
        backend = None if args.attention_backend == "auto" else args.attention_backend
        self.backend_name = backend or default_backend(device.type, dtype)
        self.runner = StepRunner(self.model, self.arch.vocab_size, device, backend, self.kv_cache,
                                 exchange_group=self.exchange_group)

    # ------------------------------------------------------------------ planning
    def plan(self, tree) -> Tuple[StepPlan, Optional[object], str]:
        """This step's plan, this rank's memory plan, and the sharing mode actually used."""
        args = self.args
        costs = (self.measured.planner_settings(self.geometry.num_layers, 2 * self.geometry.bytes_per_token)
                 if self.measured else dict(cost_model=self.cost_model))
        config = PlannerConfig(
            micro_batch_tokens=args.micro_batch_tokens, data_parallel_size=self.layout.placement_size,
            sharing=args.prefix_sharing, exchange_group_size=self.exchange_group_size, placement=args.placement,
            **costs,
        )
        plan, memories, mode = plan_with_memory(
            tree, config, lambda ranks: plan_memory_group(ranks, self.geometry, args.kv_cache_budget, self.act_bytes))
        if mode != args.prefix_sharing:
            self.log("warning: the cached prefixes do not fit --kv-cache-budget; duplicating them this step")
        return plan, memories[self.layout.placement_rank], mode

    # ------------------------------------------------------------------ loop
    def log(self, msg: str) -> None:
        if self.layout.is_logging_rank and not self.args.quiet:
            print(msg, flush=True)

    def _reduce(self, values: List[float], op=dist.ReduceOp.SUM, group=None) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def train_iteration(self, iteration: int) -> IterationRecord:
        """One step. A step whose global loss or gradient norm is not finite changes nothing
        (see :class:`~megatron_psrl.training.optimizer.StepOutcome`) and is counted."""
        args = self.args
        monitor = self.layout.monitor
        t0 = time.perf_counter()
        batch = self.data.batch(iteration)
        tree = build_prefix_tree(batch)
        plan, memory, mode = self.plan(tree)
        self.optimizer.zero_grad()
        dp_group = gradient_group()  # data x context parallel: every rank with its own share
        keys = ["clip_frac", "pg_loss", "ratio_clamped"]  # the same keys on every rank, even one without claims
        keys += ["kl"] if self.loss_cfg.kl_coef else []
        keys += ["entropy"] if self.loss_cfg.entropy_coef else []
        with PeakMemory(self.layout.device, mode=args.memory_tracking) as mem:
            with monitor.phase(f"forward/backward of iteration {iteration + 1}"):
                out = self.runner.train(plan, self.layout.placement_rank, self.loss_cfg, memory,
                                        loss_scale=self.optimizer.loss_scale)
            with monitor.phase(f"loss all-reduce of iteration {iteration + 1}"):
                sums = self._reduce([out.loss, out.tokens_computed, out.tokens_recomputed, out.num_micro_batches]
                                    + [out.metrics.get(k, 0.0) for k in keys], group=dp_group)
            with monitor.phase(f"gradient all-reduce and optimizer step of iteration {iteration + 1}"):
                outcome = self.optimizer.step(skip=not math.isfinite(sums[0]))
        step_time = time.perf_counter() - t0
        with monitor.phase(f"metrics all-reduce of iteration {iteration + 1}"):
            peak, step_time = self._reduce([float(mem.peak_bytes), step_time], op=dist.ReduceOp.MAX)
            extra = {k: v for k, v in zip(keys, sums[4:])}
            extra.update(self._kv_metrics(bool(plan.ranks[self.layout.placement_rank].sources), dp_group))
        if outcome.skipped:
            self.skipped_iters += 1
            self.consecutive_skipped += 0 if outcome.loss_scale_overflow else 1
        else:
            self.consecutive_skipped = 0
        extra["ratio_clamped"] = int(extra["ratio_clamped"])
        extra["skipped"] = outcome.skipped
        extra["skipped_iters"] = self.skipped_iters
        extra["attention_backend"] = self.backend_name
        extra.update(plan_metrics(plan, self.geometry, self.measured))
        tokens_total = int(batch.num_tokens)
        return IterationRecord(
            iter=iteration + 1, step_time_s=step_time, tokens_total=tokens_total, tokens_computed=int(sums[1]),
            ideal_speedup=float(self.cost_model.ideal_speedup(tree)),
            loss=sums[0], grad_norm=float(outcome.grad_norm), peak_mem_bytes=int(peak), lr=self.optimizer.lr,
            samples=batch.num_samples, micro_batches=int(sums[3]),
            tokens_unique=int(tree.num_tree_tokens), tokens_recomputed=int(sums[2]),
            sharing_ratio=tokens_total / max(1.0, sums[1]),
            tokens_per_s=tokens_total / step_time, prefix_sharing=mode, extra=extra,
        )

    def _kv_metrics(self, used: bool, dp_group) -> Dict[str, float]:
        """KV cache metrics of the step over all data-parallel ranks (same collectives on every
        rank, zeros where a rank ran no mechanism-2 work); empty when no rank used the cache."""
        m = self.kv_cache.metrics
        util = m.utilisation_samples
        local_sum = [m.tokens_read, m.tokens_recomputed, m.allocated_slots, m.used_slots,
                     float(np.mean(util)) if util else 0.0, 1.0] if used else [0.0] * 6
        local_max = [m.peak_blocks_used / m.pool_blocks if m.pool_blocks else 0.0, m.block_size,
                     m.pool_blocks] if used else [0.0] * 3
        read, recomputed, allocated, occupied, util_sum, ranks = self._reduce(local_sum, group=dp_group)
        peak_util, block_size, pool_blocks = self._reduce(local_max, op=dist.ReduceOp.MAX, group=dp_group)
        if ranks == 0:
            return {}
        return {
            "kv_block_size": int(block_size), "kv_pool_blocks": int(pool_blocks), "kv_peak_utilisation": peak_util,
            "kv_mean_utilisation": util_sum / ranks,
            "kv_fragmentation": 1.0 - occupied / allocated if allocated else 0.0,
            "kv_hit_rate": read / (read + recomputed) if read + recomputed else 1.0,
            "kv_tokens_recomputed": int(recomputed),
        }

    def save(self, iteration: int) -> None:
        with self.layout.monitor.phase(f"checkpoint save of iteration {iteration}"):
            path = save_training_checkpoint(self.args.save, iteration, self.model, self.optimizer, self.arch,
                                            self.layout)
        self.log(f"saved checkpoint {path}")

    def run(self) -> List[IterationRecord]:
        args = self.args
        a = self.arch
        self.log(f"megatron_psrl: {a.model_type} h{a.hidden_size} L{a.num_layers} heads {a.num_attention_heads}/"
                 f"{a.num_kv_heads} vocab {a.vocab_size} | TP {self.layout.tensor_parallel_size} DP "
                 f"{self.layout.data_parallel_size}" + (f" CP {self.layout.context_parallel_size}" if self.layout.context_parallel_size > 1
                                                   else "") + f" | {self.layout.device} {str(self.dtype).replace('torch.', '')} | "
                 f"prefix sharing: {args.prefix_sharing} | attention: {self.backend_name} | data: {args.data}")
        records = []
        json_file = self.outputs.log_json
        try:
            for it in range(self.start_iteration, args.train_iters):
                rec = self.train_iteration(it)
                records.append(rec)
                if json_file is not None:
                    json_file.write(rec.to_json() + "\n")
                    json_file.flush()
                if (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters or rec.extra["skipped"]:
                    self.log(format_record(rec, args.train_iters))
                if self.consecutive_skipped >= args.max_skipped_iters:
                    first = it + 2 - self.consecutive_skipped
                    raise NonFiniteTrainingError(
                        f"iterations {first}-{it + 1}: {self.consecutive_skipped} consecutive steps had a non-finite "
                        f"loss or gradient norm (--max-skipped-iters {args.max_skipped_iters}); they were skipped, "
                        "so no parameter changed and no checkpoint holds them. Check the data for extreme "
                        "'advantage' or 'old_logprobs' values, or lower --lr"
                    )
                if args.save and args.save_interval and (it + 1) % args.save_interval == 0 and it + 1 < args.train_iters:
                    self.save(it + 1)
            if args.save:
                self.save(max(args.train_iters, self.start_iteration))
        finally:
            self.outputs.close()
        return records


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TB"


def plan_metrics(plan: StepPlan, geometry: KVGeometry, measured: Optional[MeasuredCosts]) -> Dict[str, object]:
    """What the planner decided, for the iteration line and --log-json."""
    out: Dict[str, object] = {
        "placement": "+".join(sorted(set(plan.placements))),
        "plan_imbalance": plan.imbalance(),
        "plan_rank_cost": [round(float(c), 6) for c in plan.rank_costs()],
        "exchanged_bytes": plan.exchanged_bytes(2 * geometry.bytes_per_token),
        "tokens_duplicated": plan.mechanism_counts()["duplicated_tokens"],
    }
    if measured is not None:
        out["predicted_step_s"] = float(max(plan.predicted_makespan))
        other = max(plan.alternative_makespan)
        if math.isfinite(other):
            out["predicted_other_placement_s"] = float(other)
    return out


def format_record(rec: IterationRecord, total_iters: int) -> str:
    parts = [
        f"iteration {rec.iter:6d}/{total_iters:6d}",
        f"step time {rec.step_time_s:7.3f} s",
        f"tokens {rec.tokens_total} (computed {rec.tokens_computed}, sharing {rec.sharing_ratio:.2f}x, "
        f"ideal speedup {rec.ideal_speedup:.2f}x)",
        f"tokens/s {rec.tokens_per_s:9.1f}",
        f"loss {rec.loss: .6e}",
        f"grad norm {rec.grad_norm:.4e}",
        f"lr {rec.lr:.3e}",
        f"micro-batches {rec.micro_batches}",
        f"peak mem {_fmt_bytes(rec.peak_mem_bytes)}",
    ]
    if "kv_hit_rate" in rec.extra:
        parts.append(f"kv hit {rec.extra['kv_hit_rate']:.2f} util {rec.extra['kv_peak_utilisation']:.2f}")
    if len(rec.extra.get("plan_rank_cost", ())) > 1:
        parts.append(f"plan {rec.extra['placement']} imbalance {rec.extra['plan_imbalance']:.2f}"
                     + (f" exchanged {_fmt_bytes(rec.extra['exchanged_bytes'])}" if rec.extra["exchanged_bytes"] else ""))
    if rec.extra.get("ratio_clamped"):
        parts.append(f"ratio clamped {rec.extra['ratio_clamped']}")
    if rec.extra.get("skipped"):
        parts.append("SKIPPED (non-finite loss or gradient norm)")
    if rec.extra.get("skipped_iters"):
        parts.append(f"skipped iters {rec.extra['skipped_iters']}")
    return " | ".join(parts)


def main(argv=None) -> List[IterationRecord]:
    from megatron_psrl.training.arguments import parse_args

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(message)s")
    trainer = Trainer(args)
    return trainer.run()
