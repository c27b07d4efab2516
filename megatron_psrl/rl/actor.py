"""PolicyActor: the update phase of an RL loop, in memory, for RL frameworks.

An RL framework (verl, slime, OpenRLHF, NeMo-RL, or a hand-written loop) owns rollouts and
rewards; it hands batches of samples to a ``PolicyActor`` and gets back log-probs, gradient
steps and weights, with prefix sharing, on any TP / DP / CP / PP layout (under torchrun every
rank builds the same actor and passes the same batch)::

    from megatron_psrl import ActorConfig, PolicyActor

    actor = PolicyActor("Qwen/Qwen2.5-7B-local-folder", ActorConfig(micro_batch_tokens=8192))
    old = actor.compute_logprobs(batch)                 # list of per-sample float32 arrays
    metrics = actor.train_step(batch)                   # one optimizer step; metrics["logprobs"] too
    weights = actor.state_dict_hf()                     # HF names, to sync an inference engine
    for name, tensor in actor.iter_hf_weights():        # or streamed, one tensor at a time
        inference_engine.load_weights([(name, tensor)])

A batch is a list of samples, each a dict with the fields of docs/data-format.md (``tokens``,
``loss_mask``, ``advantage``, ``old_logprobs``, ``ref_logprobs``, ``weight``, ``id``) as Python
lists, numpy arrays or torch tensors, or a ``SampleBatch``. Every call validates it with the
same one-line errors as the command line.

The actor is a thin layer over the engine (:mod:`megatron_psrl.engine`): it validates batches
and calls, chooses the loss, keeps the caller's RNG state, and moves weights and checkpoints
in and out. Creating an actor never changes the caller's global RNG state.
``pretrain_agent_rl.py`` and ``tools/compute_logprobs.py`` are thin command lines over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.checkpoint.layout import has_checkpoint, read_checkpoint_info
from megatron_psrl.checkpoint.loading import ModelSource, hf_memory_state_dict
from megatron_psrl.checkpoint.sharding import shard_state_dict
from megatron_psrl.checkpoint.state_dict import load_state_into
from megatron_psrl.data.loader import samples_from_dicts
from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.data.validation import check_max_sample_length, check_routed_experts
from megatron_psrl.distributed.setup import ParallelLayout, gradient_group
from megatron_psrl.engine.builder import build_engine
from megatron_psrl.engine.calibration import drain
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.engine.engine import Engine, StepResult
from megatron_psrl.engine.memory import PeakMemory
from megatron_psrl.engine.optimizer import StepOutcome
from megatron_psrl.engine.weights import DEFAULT_BUCKET_BYTES, iter_hf_weights, iter_mcore_weights, streams_one_copy
from megatron_psrl.errors import ConfigurationError, UnsupportedFeatureError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.options import HYBRID_MODEL_NAMES, MOE_MODEL_NAMES, TINY_MODEL_NAMES
from megatron_psrl.rl.loss import ClaimLoss, PerClaimLoss, SequenceLoss
from megatron_psrl.rl.sharing_check import SharingCheckError, check_sharing, choose_samples

Batch = Union[SampleBatch, Sequence[Mapping[str, Any]]]


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block without changing the caller's global RNG state (torch CPU and CUDA)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _debug_model_names() -> Tuple[str, ...]:
    """The named debug configs an actor builds with random weights: the dense tiny ones, the
    mixture-of-experts and the hybrid (linear-attention) ones, as ``--model`` takes them."""
    return TINY_MODEL_NAMES + MOE_MODEL_NAMES + HYBRID_MODEL_NAMES


def model_source(model: Any) -> ModelSource:
    """A :class:`ModelSource` from what a caller has: a folder (Hugging Face or checkpoint), a
    tiny config name, a transformers model object, or ``(hf_config_dict, hf_state_dict)``."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if has_checkpoint(path):
            return ModelSource(checkpoint=path)
        if os.path.isdir(path):
            return ModelSource(hf_dir=path)
        if path in _debug_model_names():
            return ModelSource(tiny=path)
        raise ConfigurationError(f"{path}: no such folder (a Hugging Face save_pretrained folder or a checkpoint; "
                                 f"or a tiny config name: {', '.join(_debug_model_names())})")
    if isinstance(model, tuple) and len(model) == 2:
        return ModelSource(hf_config=dict(model[0]), hf_state_dict=dict(model[1]))
    if hasattr(model, "config") and hasattr(model, "state_dict"):  # a transformers PreTrainedModel
        return ModelSource(hf_config=model.config.to_dict(), hf_state_dict=model.state_dict())
    raise ConfigurationError(f"cannot build a policy from {type(model).__name__}: give a Hugging Face folder, a "
                             "checkpoint folder, a tiny config name, a transformers model or (config, state_dict)")


def _engine_attribute(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.engine, name), doc=doc)


class PolicyActor:
    """The policy of an RL loop on megatron-core with prefix sharing (see the module docstring)."""

    def __init__(self, model: Any = "tiny-llama", config: Optional[ActorConfig] = None, *,
                 load_optimizer: bool = True, for_training: bool = True, log: Optional[Callable[[str], None]] = None,
                 layout: Optional[ParallelLayout] = None):
        """``layout``: process groups the caller opened already (the command line does)."""
        self.config = config or ActorConfig()
        with preserved_rng():
            self.engine: Engine = build_engine(model_source(model), self.config, layout=layout,
                                               load_optimizer=load_optimizer, for_training=for_training, log=log)

    # The engine's parts, read-only here (the engine is the one place that holds them).
    layout = _engine_attribute("layout", "Ranks, parallel sizes, device, collective-timeout monitor.")
    arch = _engine_attribute("arch", "The model's architecture.")
    model = _engine_attribute("model", "This rank's model (chunks).")
    optimizer = _engine_attribute("optimizer", "Optimizer and schedule (None for a log-prob-only actor).")
    kv_cache = _engine_attribute("kv_cache", "The block KV cache of mechanism 2.")
    runner = _engine_attribute("runner", "The step runner.")
    cost_model = _engine_attribute("cost_model", "The planner's cost model (measured, else FLOPs).")
    measured = _engine_attribute("measured", "Start-up cost measurement, when trees may be split over ranks.")
    placement = _engine_attribute("placement", "Trees over an exchange group.")
    backend_name = _engine_attribute("backend_name", "The attention kernel that runs.")
    transformer_impl = _engine_attribute("transformer_impl", "megatron's layer spec.")
    pipeline_split = _engine_attribute("pipeline_split", "The (virtual) stages' layers or count.")
    virtual_pipeline_size = _engine_attribute("virtual_pipeline_size", "Model chunks per pipeline rank.")

    @property
    def iteration(self) -> int:
        """Optimizer steps taken (a resumed checkpoint's iteration included)."""
        return self.engine.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.engine.iteration = value

    def describe_kernels(self) -> str:
        """One line: layer spec, attention kernel, optional GPU packages installed."""
        from megatron_psrl.model.kernels import describe_kernels

        return describe_kernels(self.layout.device, self.transformer_impl, self.backend_name)

    # ------------------------------------------------------------------ batches and calls
    def as_batch(self, batch: Batch, training: bool = True, needs_advantage: bool = True) -> SampleBatch:
        """Validate a batch (see the module docstring) against this model."""
        from megatron_psrl.model.moe import routing_shape

        routing = routing_shape(self.arch)  # what routed_experts (router replay) must look like
        if not isinstance(batch, SampleBatch):
            batch = samples_from_dicts(list(batch), vocab_size=self.arch.vocab_size,
                                       require_advantage=training and needs_advantage, source="<batch>",
                                       routing=routing)
        elif training and needs_advantage and batch.advantages is None:
            raise ConfigurationError(f"{batch.source}: training needs an 'advantage' for every sample")
        check_routed_experts(batch, routing)
        if batch.routed_experts is not None and (self.virtual_pipeline_size or 1) > 1:
            raise UnsupportedFeatureError("router replay (routed_experts) with virtual pipeline stages is not "
                                          "supported yet (untested; pipeline parallelism without them is exact)")
        if self.arch.sample_length_limit is not None:
            check_max_sample_length(batch, self.arch.sample_length_limit, "the model's sliding window")
        if not self.config.allow_rope_extrapolation:
            check_max_sample_length(batch, self.arch.max_position_embeddings, "the model's max_position_embeddings",
                                    "--allow-rope-extrapolation trains it anyway")
        return batch

    def _check_same_call(self, batch: SampleBatch, what: str, *flags: float) -> None:
        """Every rank must make the same call on the same global batch (the planner splits it);
        a framework that hands each rank its own slice would otherwise get silently wrong
        numbers, or ranks that disagree on a collective would hang. One small all-reduce."""
        if dist.get_world_size() == 1:
            return
        positions = np.arange(batch.num_tokens, dtype=np.float64) % 65521 + 1
        digest = [float(batch.num_samples), float(batch.num_tokens), float(np.dot(batch.tokens, positions)),
                  float(np.count_nonzero(batch.loss_mask)), *map(float, flags)]
        t = host_to_device(digest + [-x for x in digest], self.layout.device, np.float64)
        with self.layout.monitor.phase(f"{what} call check (iteration {self.iteration + 1})"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        high, low = t[:len(digest)], -t[len(digest):]
        if not torch.equal(high, low):
            raise ConfigurationError(
                f"{what}: the ranks passed different batches or options ({int(low[0])}-{int(high[0])} samples, "
                f"{int(low[1])}-{int(high[1])} tokens). Every rank must pass the same global batch (the planner "
                "splits it over the ranks) with the same arguments")

    def plan(self, batch: SampleBatch, times: Optional[Dict[str, float]] = None):
        """``(tree, step plan, this rank's memory plan, sharing mode used)`` of a training step."""
        return self.engine.plan(batch, times)

    def _loss(self, loss_fn, overrides: Dict[str, Any]) -> ClaimLoss:
        """The loss of one call: the configured PPO/GRPO loss (with ``overrides``), or a custom
        one, whose ``view.coef`` implements the configured ``loss_agg`` unless it names its own
        (or the call passes ``loss_agg=``)."""
        if loss_fn is None:
            return dataclasses.replace(self.config.loss, **overrides) if overrides else self.config.loss
        unknown = set(overrides) - {"loss_agg"}
        if unknown:
            raise ConfigurationError(f"loss overrides {sorted(unknown)} apply to the default loss only; a custom "
                                     "loss_fn takes only loss_agg=")
        if isinstance(loss_fn, SequenceLoss) or (hasattr(loss_fn, "needs_entropy")
                                                 and not isinstance(loss_fn, PerClaimLoss)):
            return loss_fn
        if not isinstance(loss_fn, PerClaimLoss):
            loss_fn = PerClaimLoss(loss_fn)
        agg = overrides.get("loss_agg") or loss_fn.loss_agg or self.config.loss.loss_agg
        return dataclasses.replace(loss_fn, loss_agg=agg) if agg != loss_fn.loss_agg else loss_fn

    # ------------------------------------------------------------------ the update
    def forward_backward(self, batch: Batch, loss_fn=None, return_logprobs: bool = True,
                         **loss_overrides) -> StepResult:
        """Forward and backward of the whole global batch; gradients accumulate in the model
        (call :meth:`optimizer_step`; with an optimizer, megatron's DDP keeps them in each parameter's
        ``main_grad``, ``actor.optimizer.main_grad(p)``, not in ``p.grad``).

        ``loss_fn``: None for the configured PPO / GRPO loss (``loss_overrides`` change its
        fields for this call: ``clip_eps``, ``kl_coef``, ``entropy_coef``, ``loss_agg``); a
        function of a :class:`~megatron_psrl.rl.loss.ClaimView` returning per-claim
        losses (summed over the global batch); a ``PerClaimLoss``; or a ``SequenceLoss``."""
        loss = self._loss(loss_fn, loss_overrides)
        batch = self.as_batch(batch, training=True, needs_advantage=loss.needs_advantage)
        self._check_same_call(batch, "forward_backward", return_logprobs, isinstance(loss, SequenceLoss))
        with preserved_rng():
            return self.engine.forward_backward(batch, loss, return_logprobs)

    def optimizer_step(self, skip: bool = False) -> StepOutcome:
        """Reduce the accumulated gradients over data x context parallel ranks, clip and apply
        them; a non-finite gradient norm (or ``skip``) skips the step on every rank."""
        self._require_optimizer("optimizer_step")
        return self.engine.optimizer_step(skip)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def _require_optimizer(self, call: str) -> None:
        if self.optimizer is None:
            raise ConfigurationError(f"{call} needs an optimizer: this actor was built with for_training=False "
                                     "(log-probs only)")

    def train_step(self, batch: Batch, loss_fn=None, return_logprobs: bool = True, **loss_overrides) -> Dict[str, Any]:
        """One optimizer step over the global batch; a dict of metrics (``loss``, ``grad_norm``,
        ``skipped``, ``lr``, loss terms, tokens, plan, KV cache, phase times, and ``logprobs``)."""
        return self.train_step_result(batch, loss_fn, return_logprobs, **loss_overrides).as_dict()

    def train_step_result(self, batch: Batch, loss_fn=None, return_logprobs: bool = True,
                          **loss_overrides) -> StepResult:
        """:meth:`train_step` as a :class:`StepResult`."""
        self._require_optimizer("train_step")
        # every collective of the step runs inside a named phase (inner phases name it closer)
        with self.layout.monitor.phase(f"train step of iteration {self.iteration + 1}"):
            return self._train_step_result(batch, loss_fn, return_logprobs, loss_overrides)

    def _train_step_result(self, batch, loss_fn, return_logprobs, loss_overrides) -> StepResult:
        engine = self.engine
        loss = self._loss(loss_fn, loss_overrides)
        batch = self.as_batch(batch, training=True, needs_advantage=loss.needs_advantage)
        self._check_same_call(batch, "train_step", return_logprobs, isinstance(loss, SequenceLoss))
        check = self._sharing_check(batch, loss)  # (before the step: it leaves the gradients zeroed)
        engine.zero_grad()
        t0 = time.perf_counter()
        with preserved_rng(), PeakMemory(self.layout.device, mode=self.config.memory_tracking) as mem:
            # (the step follows at once: each gradient bucket's reduce starts in the last backward)
            result = engine.forward_backward(batch, loss, return_logprobs, last_of_step=True)
            t1 = time.perf_counter()
            result.outcome = engine.optimizer_step(skip=not np.isfinite(result.loss))
            drain(self.layout.device)  # one wait, at the step's end: its time (and the optimizer's) is the device's
        times = result.metrics.setdefault("times", {})
        times["optimizer"] = time.perf_counter() - t1
        peak, step_time = engine.reduce([float(mem.peak_bytes), time.perf_counter() - t0], op=dist.ReduceOp.MAX)
        result.metrics.update(peak_mem_bytes=int(peak), step_time_s=step_time, lr=self.optimizer.lr)
        if check is not None:
            result.metrics["sharing_check"] = check.as_dict()
        return result

    def check_sharing(self, batch: Batch, loss_fn=None, **loss_overrides):
        """The prefix sharing check (``ActorConfig.check_sharing_every``), for callers that run
        their own steps (``forward_backward``, ``optimizer_step``): call it at the start of a step,
        before its first ``forward_backward`` (it leaves the gradients zeroed). Runs on every
        ``check_sharing_every``-th step only; a :class:`~megatron_psrl.rl.sharing_check.SharingCheck`,
        or None on the other steps. ``train_step`` calls it itself."""
        loss = self._loss(loss_fn, loss_overrides)
        return self._sharing_check(self.as_batch(batch, training=True, needs_advantage=loss.needs_advantage), loss)

    def _sharing_check(self, batch, loss):
        """Every ``check_sharing_every`` steps: a few of the batch's samples computed again
        without sharing and compared (:mod:`megatron_psrl.rl.sharing_check`); None on other steps."""
        every = self.config.check_sharing_every
        if not every or (self.iteration + 1) % every or self.config.prefix_sharing == "none":
            return None
        samples = choose_samples(batch, self.config.check_sharing_samples, self.config.seed + self.iteration)
        with self.layout.monitor.phase(f"prefix sharing check of iteration {self.iteration + 1}"), preserved_rng():
            check = check_sharing(self.engine, batch, loss, samples, gradient_group(),
                                  parallel_state.get_model_parallel_group(), self.config.torch_dtype)
        if not check.passed:
            message = f"iteration {self.iteration + 1}: {check.describe()}"
            if not self.config.check_sharing_warn_only:
                raise SharingCheckError(message)
            self.engine.log(f"warning: {message}")
        return check

    # ------------------------------------------------------------------ log-probs
    def compute_logprobs(self, batch: Batch) -> List[np.ndarray]:
        """log p(tokens[i] | tokens[:i]) of every sample (index 0: 0.0), prefix-shared, with the
        same placement over ranks as training; every rank returns all samples."""
        batch = self.as_batch(batch, training=False)
        self._check_same_call(batch, "compute_logprobs")
        with self.layout.monitor.phase("log-prob forward"), preserved_rng():
            return self.engine.compute_logprobs(batch)

    # ------------------------------------------------------------------ weights
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model in megatron names (tensor-parallel shards gathered): a snapshot on
        CPU, never a view of the live parameters (a later step does not change it). Built
        from :func:`~megatron_psrl.engine.weights.iter_mcore_weights`, one tensor at a time;
        every rank of the model-parallel group calls it and gets all of it."""
        return dict(iter_mcore_weights(self.engine))

    def iter_hf_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        device: Optional[Union[str, torch.device]] = "cpu") -> Iterator[Tuple[str, torch.Tensor]]:
        """Stream the weights as ``(Hugging Face name, tensor)`` pairs, gathered over the
        tensor-, pipeline- and expert-parallel ranks about ``bucket_bytes`` at a time, e.g. to update an
        inference engine tensor by tensor without the whole model in host memory. Every rank
        of the model-parallel group receives every tensor and must consume the whole stream;
        ``device=None`` keeps the tensors on the engine's device. See
        :mod:`megatron_psrl.engine.weights`."""
        return iter_hf_weights(self.engine, bucket_bytes, device)

    def state_dict_hf(self) -> Dict[str, torch.Tensor]:
        """The model's weights with Hugging Face names and layouts (every rank gets all of them,
        on CPU, as a snapshot), e.g. to load into an inference engine after a step. Holds the
        whole model: :meth:`iter_hf_weights` streams it instead."""
        return dict(self.iter_hf_weights())

    def export_hf(self, out_dir: str, template_dir: Optional[str] = None, overwrite: bool = True) -> str:
        """Write a Hugging Face ``save_pretrained`` folder (safetensors + config.json), atomically,
        from the weight stream: safetensors shards are written as the tensors arrive. Every rank
        calls it; rank 0 writes."""
        from megatron_psrl.checkpoint.atomic import atomic_directory
        from megatron_psrl.checkpoint.hf_io import write_hf_checkpoint

        layout = self.layout
        if streams_one_copy(self.engine):  # one replica streams (with its EP ranks): the others hold the same weights
            if layout.rank == 0:
                with atomic_directory(out_dir, overwrite=overwrite) as tmp:
                    write_hf_checkpoint(tmp, self.iter_hf_weights(), self.arch.hf_config, template_dir=template_dir)
            else:
                # the writer's collectives need this rank's part; its own copies are dropped
                for _ in self.iter_hf_weights(device=None):
                    pass
        if dist.get_world_size() > 1:
            dist.barrier()
        return out_dir

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights into this rank's shard: every tensor of the model,
        shapes checked, no unexpected names (a misspelled key is an error, not ignored)."""
        full = hf_memory_state_dict(dict(state_dict), self.arch, strict=True)
        shards = shard_state_dict(full, self.arch, self.layout.tensor_parallel_size, self.pipeline_split)
        for stage, chunk in self.engine.stage_chunks():
            load_state_into(chunk, shards[(self.layout.tp_rank, stage)])
        self.engine.weights_changed()

    # ------------------------------------------------------------------ checkpoints
    def save(self, save_dir: str) -> str:
        """Save model and optimizer (none for a ``for_training=False`` actor) as iteration
        ``self.iteration``; every rank calls it. Atomic, one writer per folder."""
        from megatron_psrl.checkpoint.saving import save_training_checkpoint

        fmt = self.config.ckpt_format
        if self.config.optimizer.use_distributed_optimizer and self.optimizer is not None and fmt == "legacy":
            raise UnsupportedFeatureError("the legacy checkpoint format cannot hold the distributed optimizer's "
                                          "sharded state: save with ckpt_format torch_dist (the default)")
        self.engine.params_ready()
        with self.layout.monitor.phase(f"checkpoint save of iteration {self.iteration}"):
            # the costs it planned with go along: a run resuming it plans alike (ResumePoint)
            costs = None if self.engine.measured is None else self.engine.measured.to_record()
            return save_training_checkpoint(save_dir, self.iteration, self.model, self.optimizer, self.arch,
                                            self.layout, ckpt_format=fmt, cost_record=costs)

    def load(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        """Load weights (any TP/PP layout, either format) and, with ``load_optimizer``, the
        optimizer and learning-rate schedule: a torch_dist checkpoint's under any layout
        (resharded), a legacy one's when the layout matches. The iteration is the checkpoint's
        either way (as Megatron-LM's ``--no-load-optim``: a fresh optimizer restarts the schedule)."""
        from megatron_psrl.checkpoint import dist_format
        from megatron_psrl.checkpoint.layout import checkpoint_format
        from megatron_psrl.checkpoint.legacy_format import check_optimizer_expert_parallel, load_stage_states

        engine, layout = self.engine, self.layout
        if checkpoint_format(ckpt_dir) == "torch_dist":
            it_dir, info = read_checkpoint_info(ckpt_dir)
            with layout.monitor.phase(f"checkpoint load of {it_dir}"):
                dist_format.load_model_weights(it_dir, self.model)
                engine.iteration = info.iteration
                if info.has_optimizer_state and load_optimizer and self.optimizer is not None:
                    dist_format.load_training_state(it_dir, self.model, self.optimizer, engine.same_layout(info))
                else:
                    engine.weights_changed()
            return
        stages, chunks = zip(*engine.stage_chunks())
        info, shards, optimizer_state = load_stage_states(ckpt_dir, layout.tp_rank, layout.tensor_parallel_size, stages,
                                                          self.pipeline_split, self.virtual_pipeline_size)
        if optimizer_state and load_optimizer and self.optimizer is not None:
            check_optimizer_expert_parallel(ckpt_dir, info, self.config.expert_model_parallel_size)
        for chunk, shard in zip(chunks, shards):
            load_state_into(chunk, shard)
        engine.iteration = info.iteration
        if optimizer_state and load_optimizer and self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer_state)
        else:
            engine.weights_changed()

    def close(self) -> None:
        """End the process groups (and the collective-timeout monitor) this process uses; call
        it once at the end of the job, on every rank."""
        from megatron_psrl.distributed.setup import shutdown_parallel

        shutdown_parallel()


__all__ = ["ActorConfig", "PolicyActor", "StepResult", "model_source", "preserved_rng"]
