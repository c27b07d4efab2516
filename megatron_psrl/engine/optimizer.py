"""Optimizer + data-parallel gradient reduction + clipping, behind one small interface.

megatron-core's, on CUDA and CPU alike: ``DistributedDataParallel`` (contiguous fp32
``main_grad`` buckets, their reduction, ``--overlap-grad-reduce``) and ``get_megatron_optimizer``
(Adam/SGD, fp32 main params for bf16, the distributed optimizer, ``--overlap-param-gather``,
gradient clipping by the global TP/PP-aware norm). On CPU the same code runs over gloo through
:mod:`megatron_psrl.compat` (item 3), so CPU tests exercise what GPUs run and a checkpoint's
optimizer state has one layout on both. megatron's rules hold: no weight decay on biases and
norm weights, gradients summed over data-parallel ranks (the loss is normalised over the
global batch: ``calculate_per_token_loss``), and ``OptimizerParamScheduler`` for the learning
rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_psrl.compat import install_cpu_optimizer_shims, megatron_optimizer_calls
from megatron_psrl.engine.grad_reduce import BucketLaunches
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import OPTIMIZERS


@dataclass
class OptimizerSettings:
    """Optimizer hyper-parameters (Megatron flag names)."""

    optimizer: str = "adam"
    """``adam`` (AdamW, decoupled weight decay) or ``sgd``."""

    lr: float = 1e-6
    """Peak learning rate (``--lr``)."""

    min_lr: float = 0.0
    """Final learning rate of a decaying schedule (``--min-lr``)."""

    lr_warmup_iters: int = 0
    """Linear warmup iterations (``--lr-warmup-iters``)."""

    lr_decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine`` (``--lr-decay-style``)."""

    lr_decay_iters: int = 1
    """Iterations over which the learning rate decays (default: --train-iters)."""

    weight_decay: float = 0.0
    """Decoupled weight decay (``--weight-decay``), not applied to biases and norms."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    sgd_momentum: float = 0.0
    """SGD momentum."""

    clip_grad: float = 1.0
    """Global gradient-norm clip (``--clip-grad``; 0 disables)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron's distributed optimizer)."""

    overlap_grad_reduce: bool = True
    """``--overlap-grad-reduce`` (on; ``--no-overlap-grad-reduce`` turns it off): megatron's DDP
    reduces gradients in asynchronous buckets, each bucket's reduce started during the step's
    last backward pass as soon as its parameters' gradients are in, while the backward goes on
    (:mod:`megatron_psrl.engine.grad_reduce`); earlier backward passes only accumulate. The same
    sums as reducing after the backward (megatron's operation over the same buckets). Off: one
    bucket, reduced synchronously at the optimizer step."""

    ddp_bucket_size: Optional[int] = None
    """``--ddp-bucket-size``: parameters per gradient bucket with ``overlap_grad_reduce`` (None:
    megatron's default, ``max(40M, 1M x data-parallel size)``). Smaller buckets start earlier
    and overlap more of the backward, at more collectives per step."""

    overlap_param_gather: bool = False
    """``--overlap-param-gather``: with the distributed optimizer, the updated parameters are
    all-gathered in the background, launched right after the optimizer step on every rank, and
    each module waits for its bucket before its forward pass (megatron's forward pre-hooks).
    Needs ``use_distributed_optimizer``."""

    scheduler_follows_steps: bool = True
    """The learning-rate schedule advances with every optimizer step that is taken (Megatron-LM).
    False: the caller advances it (``TrainingOptimizer.scheduler.step``), as verl does with
    its own ``lr_scheduler_step``."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigurationError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigurationError("--lr, --weight-decay and --clip-grad must be >= 0")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ConfigurationError(f"--ddp-bucket-size must be >= 1, got {self.ddp_bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigurationError("--overlap-param-gather needs --use-distributed-optimizer (as in Megatron-LM: "
                                     "the parameters are all-gathered only when the optimizer state is sharded)")


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    grad_norm: float
    """Global gradient norm before clipping (non-finite when the step was skipped for it)."""

    skipped: bool
    """True when nothing changed: the loss or the gradient norm was not finite (as Megatron
    skips a step whose gradients overflowed). Parameters, optimizer state and the learning-rate
    schedule are untouched, the gradients are dropped."""

    loss_scale_overflow: bool = False
    """fp16 only: skipped because the scaled gradients overflowed, which dynamic loss scaling
    expects now and then (the scale was lowered); not a sign of bad data on its own."""


def _scheduler(optimizer, s: OptimizerSettings) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.lr_warmup_iters else s.lr,
        max_lr=s.lr,
        min_lr=s.min_lr,
        lr_warmup_steps=s.lr_warmup_iters,
        lr_decay_steps=max(s.lr_decay_iters, s.lr_warmup_iters + 1),
        lr_decay_style=s.lr_decay_style,
        start_wd=s.weight_decay,
        end_wd=s.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )




class TrainingOptimizer:
    """megatron-core's DistributedDataParallel + MegatronOptimizer, on CUDA and CPU.

    What the training loop uses: ``zero_grad``, ``step`` (returns a :class:`StepOutcome`), the
    current learning rate, and state for checkpoints. One DDP per model chunk (virtual
    pipeline stages), as Megatron-LM wraps them; gradients accumulate in DDP's fp32
    ``main_grad`` buffers over every backward pass of a step.

    ``step(skip=...)`` is the non-finite guard: the caller passes ``skip=True`` when the global
    loss is not finite, and the step also skips itself when the global gradient norm is not.
    Both are the same on every rank (the loss is reduced over data-parallel ranks, the norm
    over the model-parallel group after the data-parallel gradient sum, and a NaN or inf
    anywhere reaches every rank), so all ranks skip alike and issue the same collectives.

    Two of megatron's triggers assume every rank runs the same forward and backward passes,
    which prefix sharing does not (a step's passes follow its trees, and a data-parallel rank
    may get no micro-batch at all), so they are driven from here instead:

    - ``--overlap-grad-reduce``: megatron launches a bucket's reduce once each of its
      parameters had as many gradients as on the first step, on the last micro-batch.
      :class:`~megatron_psrl.engine.grad_reduce.BucketLaunches` takes its place: a bucket
      starts during the backward pass the step runner calls the step's last
      (:meth:`arm_grad_reduce`), once all its parameters' gradients of that pass are in, in one
      order on every rank; the rest start in that order before ``finalize_model_grads`` waits.
    - ``--overlap-param-gather``: megatron launches a bucket's parameter all-gather from the
      forward pre-hook of the bucket before it, which a rank without a forward pass never
      reaches. Here every rank launches all buckets' all-gathers right after the optimizer step
      (and at construction), in the same order (``align_param_gather``: the forward pre-hooks
      only wait), and waits for them locally before the next step or a weight read.
    """

    def __init__(self, model: torch.nn.Module, settings: OptimizerSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron_psrl.model.gpt import model_chunks

        self.model = model
        self.settings = settings
        self.device = next(model.parameters()).device
        install_cpu_optimizer_shims(self.device)
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=settings.overlap_grad_reduce,
            bucket_size=settings.ddp_bucket_size,
            overlap_param_gather=settings.overlap_param_gather,
            # The pre-hooks only wait: the all-gathers are launched by _start_param_gather.
            align_param_gather=settings.overlap_param_gather,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        with megatron_optimizer_calls(self.device):
            # Buckets only for the first chunk, as Megatron-LM wraps them.
            self.ddps = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                                 disable_bucketing=v > 0)
                         for v, chunk in enumerate(model_chunks(model))]
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer=settings.optimizer,
                    lr=settings.lr,
                    min_lr=settings.min_lr,
                    weight_decay=settings.weight_decay,
                    adam_beta1=settings.adam_beta1,
                    adam_beta2=settings.adam_beta2,
                    adam_eps=settings.adam_eps,
                    sgd_momentum=settings.sgd_momentum,
                    clip_grad=settings.clip_grad,
                    bf16=config.bf16,
                    fp16=config.fp16,
                    params_dtype=config.params_dtype,
                    use_distributed_optimizer=settings.use_distributed_optimizer,
                    overlap_param_gather=settings.overlap_param_gather,
                ),
                self.ddps,
            )
        self._give_sgd_a_state_initializer()
        self.scheduler = _scheduler(self.optimizer, settings)
        self.bucket_launches: Optional[BucketLaunches] = (BucketLaunches(self.ddps, self.device)
                                                          if settings.overlap_grad_reduce else None)
        """When each gradient bucket's reduce starts (``overlap_grad_reduce``; None: at the step)."""
        self._start_param_gather()

    # ------------------------------------------------------------------ megatron's triggers
    def _bucket_groups(self):
        return [g for ddp in self.ddps for g in ddp.bucket_groups + getattr(ddp, "expert_parallel_bucket_groups", [])]

    def _start_param_gather(self) -> None:
        """``--overlap-param-gather``: launch every bucket's all-gather, on every rank alike."""
        if self.settings.overlap_param_gather:
            with megatron_optimizer_calls(self.device):
                for ddp in self.ddps:
                    ddp.start_param_sync()

    def _finish_param_gather(self) -> None:
        """Wait for this rank's parameter all-gathers still in flight. Local only: a rank whose
        forward passes waited for them already has nothing left, and megatron's own
        ``start_param_sync(force_sync=True)`` would all-gather again on that rank alone."""
        if self.settings.overlap_param_gather:
            for group in self._bucket_groups():
                if group.param_gather_handle is not None:
                    group.param_gather_handle.wait()
                    group.param_gather_handle = None

    # ------------------------------------------------------------------ the interface
    @property
    def lr(self) -> float:
        """The current learning rate (of the first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def loss_scale(self) -> float:
        """megatron's current loss scale (dynamic for fp16, 1 otherwise)."""
        scale = self.optimizer.get_loss_scale()
        return float(scale.item() if torch.is_tensor(scale) else scale)

    def main_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s accumulated gradient: its fp32 slice of DDP's gradient buffer."""
        return p.main_grad

    def zero_grad(self) -> None:
        """Zero DDP's gradient buffers and the optimizer's main-parameter gradients."""
        with megatron_optimizer_calls(self.device):
            if self.bucket_launches is not None:
                self.bucket_launches.reset()  # (before megatron zeroes a buffer a reduce may still read)
            for ddp in self.ddps:
                ddp.zero_grad_buffer()
            self.optimizer.zero_grad()

    def arm_grad_reduce(self, roots: Optional[Sequence[torch.Tensor]] = None) -> None:
        """The step's last backward pass, from ``roots``, starts (the step runner says so):
        with ``overlap_grad_reduce`` each bucket's reduce starts once its gradients are in."""
        if self.bucket_launches is not None:
            self.bucket_launches.arm(roots)

    def reduce_gradients(self) -> None:
        """megatron's ``finalize_model_grads``: the data x context parallel sum of every bucket
        (``calculate_per_token_loss``: summed, not averaged), the TP-partial sums of q/k norm
        weights, and the tied embeddings' sum over the first and last pipeline stages.
        :meth:`step` calls it; on its own it is for reading reduced gradients."""
        from megatron.core.distributed import finalize_model_grads

        if self.bucket_launches is not None:
            self.bucket_launches.launch_rest()  # (in the one order; finalize then only waits)
        with megatron_optimizer_calls(self.device):
            finalize_model_grads(self.ddps)
        if self.bucket_launches is not None:
            self.bucket_launches.reset()  # (a later backward accumulates, as after any reduce)

    def step(self, skip: bool = False) -> StepOutcome:
        """Reduce, clip and apply the gradients (unless skipped, see the class docstring)."""
        self._finish_param_gather()  # the optimizer writes the parameter buffers
        self.reduce_gradients()
        with megatron_optimizer_calls(self.device):
            # megatron's MegatronOptimizer.step, split open so that a non-finite norm skips the
            # step for bf16/fp32 too (megatron skips only on fp16 overflow).
            found_inf = self.optimizer.prepare_grads()
            norm = float("inf") if found_inf else float(self.optimizer.get_grad_norm())
            if skip or found_inf or not math.isfinite(norm):
                self.zero_grad()
                self._start_param_gather()  # unchanged, but every rank's buckets expect one
                return StepOutcome(norm, skipped=True, loss_scale_overflow=bool(found_inf) and not skip)
            if self.settings.clip_grad > 0:
                # As ChainedOptimizer.step: every sub-optimizer scaled by the one global norm.
                from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    params = opt.get_parameters()
                    if getattr(opt, "is_stub_optimizer", False) or not params:
                        continue
                    clip_grad_by_total_norm_fp32(
                        params, self.settings.clip_grad, norm,
                        use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                    )
            self.optimizer.step_with_ready_grads()
            self._start_param_gather()
        if self.settings.scheduler_follows_steps:
            self.scheduler.step(1)
        return StepOutcome(norm, skipped=False)

    def sync_params(self) -> None:
        """Finish this rank's in-flight parameter all-gathers (``overlap_param_gather``) before
        the parameters are read outside a forward pass (a checkpoint, a weight export)."""
        self._finish_param_gather()

    def reload_model_params(self) -> None:
        """After weights were loaded into the model: refresh megatron's fp32 main params (or
        the next step would write the old weights back)."""
        self._finish_param_gather()
        with megatron_optimizer_calls(self.device):
            self.optimizer.reload_model_params()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """megatron's optimizer state and the scheduler's (the legacy checkpoint format)."""
        with megatron_optimizer_calls(self.device):
            return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Install what :meth:`state_dict` returned."""
        self._finish_param_gather()
        with megatron_optimizer_calls(self.device):
            self.optimizer.load_state_dict(state["optimizer"])
        self._unshare_steps()
        self.scheduler.load_state_dict(state["scheduler"])

    def sharded_state_dict(self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False,
                           saved: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """megatron's own optimizer sharded state dict (torch_dist checkpoints); the distributed
        optimizer's state in its ``fully_reshardable`` form, so it loads under any TP/PP/DP.
        (``saved``, the checkpoint's common optimizer state, is not needed: megatron's layout
        is the same for every run of these settings.)"""
        metadata = ({"distrib_optim_sharding_type": "fully_reshardable"} if self.settings.use_distributed_optimizer
                    else None)
        if is_loading:
            self._state_to_load_into()
        with megatron_optimizer_calls(self.device):
            return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                     metadata=metadata)

    def _give_sgd_a_state_initializer(self) -> None:
        """megatron builds SGD with ``init_state_fn=None`` but calls it unconditionally when a
        torch_dist checkpoint is loaded (``optimizer.py`` ``sharded_state_dict(is_loading=True)``:
        TypeError ``'NoneType' object is not callable``). SGD's state is its momentum buffer
        (none without momentum): the initializer creates zero buffers, which the load then
        overwrites, so the request names the same keys the checkpoint stores."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if getattr(opt, "init_state_fn", False) is None and isinstance(getattr(opt, "optimizer", None),
                                                                            torch.optim.SGD):
                opt.init_state_fn = _init_sgd_state

    def _torch_adam_distributed_optimizers(self):
        """``(megatron DistributedOptimizer, its torch Adam)`` pairs: the distributed optimizer
        where neither apex nor Transformer Engine provides the Adam (always on CPU)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if isinstance(opt, DistributedOptimizer) and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                yield opt, inner

    def _state_to_load_into(self) -> None:
        """Two gaps of megatron's distributed optimizer with torch's Adam (no apex / Transformer
        Engine: always on CPU, on CUDA where neither is installed), closed before a
        ``fully_reshardable`` load:

        - its ``state_dict``, which ``sharded_state_dict`` calls even when loading, reads every
          parameter's ``step`` (``distrib_optimizer.py`` ``state_dict``: ``assert len(steps) ==
          1``), which an Adam that has not stepped yet lacks: it gets its zero state here;
        - its ``load_state_dict`` puts the saved ``step`` into every parameter's state and then
          ``_set_main_param_and_optimizer_states`` copies *every* state key from the loaded
          tensors, which hold ``param``, ``exp_avg`` and ``exp_avg_sq`` only (KeyError
          ``'step'``): the step it just set is handed back for that key.
        The load overwrites all of it with the checkpoint's values (see also
        :meth:`_unshare_steps`)."""
        for opt, inner in self._torch_adam_distributed_optimizers():
            opt.init_state_fn(inner, opt.config)
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))
            if "_set_main_param_and_optimizer_states" in vars(opt):
                continue
            setter = opt._set_main_param_and_optimizer_states

            def set_with_step(model_param, tensors, opt=opt, inner=inner, setter=setter):
                group_index, group_order = opt.model_param_group_index_map[model_param]
                state = inner.state[inner.param_groups[group_index]["params"][group_order]]
                if "step" in state and "step" not in tensors:
                    tensors = dict(tensors, step=state["step"])
                return setter(model_param, tensors)

            opt._set_main_param_and_optimizer_states = set_with_step

    def _unshare_steps(self) -> None:
        """After a load: megatron's distributed optimizer gives every parameter's torch-Adam
        state the *same* ``step`` tensor (``distrib_optimizer.py`` ``load_state_dict``:
        ``s["step"] = step`` for all), which torch's Adam then increments in place once per
        parameter (after one more step, 1 + the parameter count instead of 2: wrong bias
        corrections). Each parameter gets its own copy."""
        for _, inner in self._torch_adam_distributed_optimizers():
            for state in inner.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()

    def load_sharded_state_dict(self, loaded: Dict[str, Any]) -> None:
        """Install what :meth:`sharded_state_dict` (``is_loading=True``) loaded."""
        self._finish_param_gather()
        with megatron_optimizer_calls(self.device):
            self.optimizer.load_state_dict(loaded)
        self._unshare_steps()


def _init_sgd_state(opt: torch.optim.SGD, config=None) -> None:
    """Zero momentum buffers for the parameters of ``opt`` that have none (with momentum)."""
    for group in opt.param_groups:
        if group.get("momentum", 0):
            for p in group["params"]:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))


def saved_optimizer_kind(common_optimizer_state: Any) -> Optional[str]:
    """``adam`` or ``sgd``: the optimizer whose state a checkpoint's common optimizer state
    (its param groups' hyper-parameters) describes; None when it cannot be told."""
    states = common_optimizer_state if isinstance(common_optimizer_state, (list, tuple)) else [common_optimizer_state]
    for state in states:
        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not groups and isinstance(state, dict) and isinstance(state.get("optimizer"), dict):
            groups = state["optimizer"].get("param_groups")
        for group in groups or []:
            if "betas" in group:
                return "adam"
            if "momentum" in group:
                return "sgd"
    return None


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings, device: torch.device) -> TrainingOptimizer:
    """megatron's DDP + optimizer for ``model`` (on ``device``: CUDA, or the CPU through
    :mod:`megatron_psrl.compat`)."""
    return TrainingOptimizer(model, settings)
