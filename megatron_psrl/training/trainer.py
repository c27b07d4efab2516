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
from typing import Dict, List, Optional

import numpy as np

from megatron_psrl.checkpoint.layout import checkpoint_format, has_checkpoint
from megatron_psrl.checkpoint.loading import ModelSource, source_architecture
from megatron_psrl.cli import apply_checksum_flag
from megatron_psrl.data.loader import load_samples
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.data.synthetic import WORKLOADS, make_workload
from megatron_psrl.data.validation import check_max_sample_length
from megatron_psrl.distributed.setup import ParallelLayout, initialize_parallel
from megatron_psrl.engine.config import DTYPES, ActorConfig
from megatron_psrl.engine.optimizer import OptimizerSettings
from megatron_psrl.errors import ConfigurationError, NonFiniteTrainingError, UnsupportedFeatureError
from megatron_psrl.model.stages import stage_counts
from megatron_psrl.rl.actor import PolicyActor
from megatron_psrl.rl.loss import LossConfig
from megatron_psrl.training.metrics_log import MetricsLog, expert_load_ratios
from megatron_psrl.training.preflight import checkpoint_bytes, prepare_outputs, warn_if_disk_short

logger = logging.getLogger("megatron_psrl")


class BatchSource:
    """The global batch of every iteration: slices of a validated file, or synthetic rollouts."""

    def __init__(self, data: str, vocab_size: int, seed: int, global_batch_size: Optional[int],
                 synthetic_tokens: Optional[int], kl_required: bool, progress: bool,
                 max_sequence_length: Optional[int] = None, max_positions: Optional[int] = None,
                 allow_unknown_fields: bool = False):
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
        if not os.path.exists(data):
            raise ConfigurationError(f"--data {data}: no such file, and not a synthetic workload (one of "
                                     f"{', '.join(WORKLOADS)})")
        self.kind = "file"
        self.samples = load_samples(data, vocab_size=vocab_size, require_advantage=True,
                                    kl_required=kl_required, progress=progress,
                                    allow_unknown_fields=allow_unknown_fields)
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
    """The command line's loop around a :class:`~megatron_psrl.rl.actor.PolicyActor`:
    start-up checks, data, iterations, skipped steps, logs and checkpoints."""

    def __init__(self, args):
        self.args = args
        self.layout: ParallelLayout = initialize_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seed, args.device,
            timeout_minutes=args.distributed_timeout_minutes, context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
        )
        if args.use_distributed_optimizer and _legacy_checkpoint_with_optimizer(args):
            raise UnsupportedFeatureError(
                "the legacy checkpoint format cannot hold the distributed optimizer's sharded state: save with "
                "--ckpt-format torch_dist (the default), or --load a legacy checkpoint with --finetune / "
                "--no-load-optim"
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
        source = self._model_source()
        # Validate all input before anything else happens (the data needs only the vocabulary).
        arch = source_architecture(source)
        self.data = BatchSource(
            args.data, arch.vocab_size, args.seed, args.global_batch_size, args.synthetic_tokens,
            kl_required=args.kl_coef != 0.0, progress=self.layout.is_logging_rank and not args.quiet,
            max_sequence_length=arch.sample_length_limit,
            max_positions=None if args.allow_rope_extrapolation else arch.max_position_embeddings,
            allow_unknown_fields=args.allow_unknown_fields,
        )
        if args.allow_rope_extrapolation and self.data.samples is not None:
            longer = int((self.data.samples.lengths > arch.max_position_embeddings).sum())
            if longer:
                self.log(f"warning: {longer} sample(s) are longer than the model's max_position_embeddings "
                         f"({arch.max_position_embeddings}); RoPE extrapolates (--allow-rope-extrapolation)")
        dtype = args_dtype(args)
        if args.save and self.layout.is_logging_rank:
            warning = warn_if_disk_short(args.save, checkpoint_bytes(arch, DTYPES[dtype], args.optimizer,
                                                                     args.sgd_momentum))
            if warning:
                self.log(warning)
        # The flags become one config; the engine is built on the process groups opened above.
        config = actor_config_from_args(args, dtype)
        self.actor = PolicyActor(source, config, load_optimizer=not (args.finetune or args.no_load_optim),
                                 log=self.log, layout=self.layout)
        self.start_iteration = 0 if args.finetune else self.actor.iteration
        if args.finetune:
            self.actor.iteration = 0
        self.arch = self.actor.arch
        wandb_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        self.metrics_log = MetricsLog(args.tensorboard_dir, args.wandb_project, args.wandb_exp_name,
                                      vars(args), enabled=self.layout.is_logging_rank, wandb_dir=wandb_dir)

    @property
    def model(self):
        """The actor's model chunk on this rank."""
        return self.actor.model

    @property
    def optimizer(self):
        return self.actor.optimizer

    # ------------------------------------------------------------------ loop
    def log(self, msg: str) -> None:
        if self.layout.is_logging_rank and not self.args.quiet:
            print(msg, flush=True)

    def train_iteration(self, iteration: int) -> IterationRecord:
        """One step. A step whose global loss or gradient norm is not finite changes nothing
        (see :class:`~megatron_psrl.engine.optimizer.StepOutcome`) and is counted."""
        batch = self.data.batch(iteration)
        if iteration == self.start_iteration and batch.old_logprobs is None:
            self.log("note: no sample has 'old_logprobs', so the policy ratio is 1 and the policy loss is the same "
                     "function of the advantages every iteration by design (its gradient still trains)")
        result = self.actor.train_step_result(batch, return_logprobs=False)
        outcome, m = result.outcome, result.metrics
        if outcome.skipped:
            self.skipped_iters += 1
            self.consecutive_skipped += 0 if outcome.loss_scale_overflow else 1
        else:
            self.consecutive_skipped = 0
        step_time = m["step_time_s"]
        extra = {k: v for k, v in m.items() if k not in _RECORD_FIELDS and k != "times"}
        extra.update({f"time_{k}_s": v for k, v in m["times"].items()})
        extra.update(skipped=outcome.skipped, skipped_iters=self.skipped_iters)
        tokens_total = m["tokens_total"]
        return IterationRecord(
            iter=iteration + 1, step_time_s=step_time, tokens_total=tokens_total, tokens_computed=m["tokens_computed"],
            ideal_speedup=m["ideal_speedup"], loss=result.loss, grad_norm=float(outcome.grad_norm),
            peak_mem_bytes=m["peak_mem_bytes"], lr=m["lr"], samples=m["samples"], micro_batches=m["micro_batches"],
            tokens_unique=m["tokens_unique"], tokens_recomputed=m["tokens_recomputed"],
            sharing_ratio=tokens_total / max(1.0, m["tokens_computed"]), tokens_per_s=tokens_total / step_time,
            prefix_sharing=m["prefix_sharing"], extra=extra,
        )

    def save(self, iteration: int) -> None:
        t0 = time.perf_counter()
        path = self.actor.save(self.args.save)
        seconds = time.perf_counter() - t0
        self.metrics_log.scalars({"time_checkpoint_s": seconds}, iteration)
        self.log(f"saved checkpoint {path} in {seconds:.2f} s")

    def run(self) -> List[IterationRecord]:
        args = self.args
        a = self.arch
        layout = self.layout
        self.log(f"megatron_psrl: {a.model_type} h{a.hidden_size} L{a.num_layers} heads {a.num_attention_heads}/"
                 f"{a.num_kv_heads} vocab {a.vocab_size} | TP {layout.tensor_parallel_size} DP "
                 f"{layout.data_parallel_size}" + (f" PP {layout.pipeline_parallel_size} ("
                 + (f"{self.actor.virtual_pipeline_size} virtual stages of " if self.actor.virtual_pipeline_size > 1
                    else "") + f"layers {'/'.join(map(str, stage_counts(a, self.actor.pipeline_split)))})"
                 if layout.pipeline_parallel_size > 1 else "") + (f" CP {layout.context_parallel_size}" if layout.context_parallel_size > 1
                                                   else "") + f" | {layout.device} {args_dtype(args)} | "
                 f"prefix sharing: {args.prefix_sharing} | data: {args.data}")
        self.log(self.actor.describe_kernels())
        records = []
        json_file = self.outputs.log_json
        try:
            for it in range(self.start_iteration, args.train_iters):
                rec = self.train_iteration(it)
                records.append(rec)
                if json_file is not None:
                    json_file.write(rec.to_json() + "\n")
                    json_file.flush()
                self.metrics_log.record(rec)
                if (it + 1) % args.log_interval == 0 or it + 1 == args.train_iters or rec.extra["skipped"]:
                    self.log(format_record(rec, args.train_iters))
                check = rec.extra.get("sharing_check")
                if check is not None:
                    self.log(f"iteration {it + 1}: prefix sharing check {'passed' if check['passed'] else 'FAILED'} "
                             f"on samples {check['samples']}: log-probs within {check['logprob_max_abs']:.3g} nats, "
                             f"gradient norm within {check['grad_norm_rel']:.3g}, cosine {check['grad_cosine']:.9f}")
                if self.consecutive_skipped >= args.max_skipped_iters:
                    first = it + 2 - self.consecutive_skipped
                    raise NonFiniteTrainingError(
                        f"iterations {first}-{it + 1}: {self.consecutive_skipped} consecutive steps had a non-finite "
                        f"loss or gradient norm (--max-skipped-iters {args.max_skipped_iters}); they were skipped, "
                        "so no parameter changed and no checkpoint holds them. Check the data for extreme "
                        "'advantage' or 'old_logprobs' values, or lower --lr"
                    )
                self.actor.iteration = it + 1  # checkpoints are named by iteration, skipped ones included
                if args.save and args.save_interval and (it + 1) % args.save_interval == 0 and it + 1 < args.train_iters:
                    self.save(it + 1)
            if args.save:
                self.actor.iteration = max(args.train_iters, self.start_iteration)
                self.save(self.actor.iteration)
        finally:
            self.outputs.close()
            self.metrics_log.close()
        return records


def _legacy_checkpoint_with_optimizer(args) -> bool:
    """The run would save, or resume the optimizer from, a legacy-format checkpoint."""
    if args.save and args.ckpt_format == "legacy":
        return True
    if args.load and not (args.finetune or args.no_load_optim) and has_checkpoint(args.load):
        return checkpoint_format(args.load) == "legacy"
    return False
_RECORD_FIELDS = {f.name for f in dataclasses.fields(IterationRecord)} | {"step_time_s", "peak_mem_bytes", "lr"}


def args_dtype(args) -> str:
    return "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"


def actor_config_from_args(args, dtype: str) -> ActorConfig:
    """The :class:`ActorConfig` of the command line's flags."""
    return ActorConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        loss_head_chunk_mb=args.loss_head_chunk_mb, last_layer_row_skip=args.last_layer_row_skip,
        overlap_kv_exchange=args.overlap_kv_exchange, deterministic=args.deterministic,
        check_sharing_every=args.check_sharing_every,
        check_sharing_samples=args.check_sharing_samples, check_sharing_warn_only=args.check_sharing_warn_only,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        context_parallel_size=args.context_parallel_size, expert_model_parallel_size=args.expert_model_parallel_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff, moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_grouped_gemm=args.moe_grouped_gemm, device=args.device, dtype=dtype,
        transformer_impl=args.transformer_impl, attention_backend=args.attention_backend,
        latent_cache=args.latent_cache, micro_batch_tokens=args.micro_batch_tokens, kv_cache_budget=args.kv_cache_budget,
        memory_budget=args.memory_budget, memory_offload=args.memory_offload,
        prefix_sharing=args.prefix_sharing, placement=args.placement,
        split_trees_across_groups=args.split_trees_across_groups, cross_group_prefix=args.cross_group_prefix,
        cost_profile=args.cost_profile, recalibrate=args.recalibrate,
        optimizer=OptimizerSettings(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
            lr_decay_style=args.lr_decay_style, lr_decay_iters=args.lr_decay_iters, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce, ddp_bucket_size=args.ddp_bucket_size,
            overlap_param_gather=args.overlap_param_gather,
        ),
        loss=LossConfig(clip_eps=args.clip_eps, kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                        loss_agg=args.loss_agg),
        seed=args.seed, memory_tracking=args.memory_tracking, allow_rope_extrapolation=args.allow_rope_extrapolation,
        distributed_timeout_minutes=args.distributed_timeout_minutes, ckpt_format=args.ckpt_format,
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TB"


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
    if "pipeline_bubble" in rec.extra:
        parts.append(f"pipeline {rec.extra['pipeline_schedule']} bubble {rec.extra['pipeline_bubble']:.2f}")
    if "kv_hit_rate" in rec.extra:
        parts.append(f"kv hit {rec.extra['kv_hit_rate']:.2f} util {rec.extra['kv_peak_utilisation']:.2f}")
    if len(rec.extra.get("plan_rank_cost", ())) > 1:
        parts.append(f"plan {rec.extra['placement']} imbalance {rec.extra['plan_imbalance']:.2f}"
                     + (f" exchanged {_fmt_bytes(rec.extra['exchanged_bytes'])}" if rec.extra["exchanged_bytes"] else ""))
    if rec.extra.get("moe_expert_load"):  # the most uneven MoE layer
        parts.append(f"expert load max/mean {max(expert_load_ratios(rec.extra['moe_expert_load'])):.2f}")
    if rec.extra.get("ratio_clamped"):
        parts.append(f"ratio clamped {rec.extra['ratio_clamped']}")
    if rec.extra.get("skipped"):
        parts.append("SKIPPED (non-finite loss or gradient norm)")
    if rec.extra.get("skipped_iters"):
        parts.append(f"skipped iters {rec.extra['skipped_iters']}")
    times = [(name, rec.extra.get(f"time_{key}_s")) for name, key in
             (("tree", "tree"), ("plan", "plan"), ("fwd-bwd", "forward_backward"), ("optimizer", "optimizer"))]
    if all(t is not None for _, t in times):
        parts.append("times " + " ".join(f"{name} {t:.3f}" for name, t in times))
    return " | ".join(parts)


def train(args) -> List[IterationRecord]:
    """Run ``pretrain_agent_rl.py`` with parsed arguments (``arguments.parse_args``)."""
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(levelname)s %(message)s")
    apply_checksum_flag(args)
    return Trainer(args).run()


def main(argv=None) -> List[IterationRecord]:
    from megatron_psrl.training.arguments import parse_args

    return train(parse_args(argv))
