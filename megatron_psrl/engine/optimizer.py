"""Optimizer + data-parallel gradient reduction + clipping, behind one small interface.

On CUDA this is megatron-core's: ``DistributedDataParallel`` (gradient buckets, reduction) and
``get_megatron_optimizer`` (Adam/SGD, fp32 main params for bf16, optional distributed
optimizer, gradient clipping). On CPU megatron's versions need CUDA (``compat``, item 3), so
the same behaviour is provided by ``torch.optim`` plus :mod:`megatron_psrl.distributed.grad_sync`.
Either way: no weight decay on biases and norm weights (megatron's rule), gradients summed
over data-parallel ranks (the loss is normalised over the global batch), clipping by the
global (TP/PP-aware) norm, and megatron's ``OptimizerParamScheduler`` for the learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_psrl.compat import use_megatron_ddp
from megatron_psrl.distributed.grad_sync import (
    allreduce_embedding_gradients,
    allreduce_gradients,
    allreduce_tensor_parallel_partial_gradients,
    clip_gradients_,
    gradient_norm,
)
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
    """Shard optimizer state over data-parallel ranks (megatron, CUDA only)."""

    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``: megatron's DDP reduces gradients in asynchronous buckets (CUDA;
    no effect on CPU, where gloo all-reduces them after the backward pass). With prefix sharing
    the reduce is launched once the step's last backward pass is done, not during it: megatron
    starts a bucket when each of its parameters has had as many gradients as on the first step,
    and a step's count follows its trees (micro-batches, retained prefix graphs), so that
    trigger would fire early on a larger batch."""

    overlap_param_gather: bool = False
    """``--overlap-param-gather``: with the distributed optimizer, the updated parameters are
    all-gathered in the background and each module waits for its bucket before its forward
    pass (megatron's forward pre-hooks; CUDA only). Needs ``use_distributed_optimizer``."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigurationError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigurationError("--lr, --weight-decay and --clip-grad must be >= 0")
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


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim == 1 or name.endswith(".bias")


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


class _TrainingOptimizer:
    """What the training loop uses: ``zero_grad``, ``step`` (returns a :class:`StepOutcome`),
    the current learning rate, and state for checkpoints. Subclasses set ``optimizer`` and
    ``scheduler``.

    ``step(skip=...)`` is the non-finite guard: the caller passes ``skip=True`` when the global
    loss is not finite, and the step also skips itself when the global gradient norm is not.
    Both are the same on every rank (the loss is reduced over data-parallel ranks, the norm
    over the model-parallel group after the data-parallel gradient sum, and a NaN or inf
    anywhere reaches every rank), so all ranks skip alike and issue the same collectives."""

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _into_main_grad(master: torch.nn.Parameter):
    """A post-accumulate-grad hook: add a bf16 parameter's fresh gradient to its fp32 master's
    ``.grad`` and free it (megatron's ``main_grad`` accumulation, on CPU)."""
    def hook(param: torch.nn.Parameter) -> None:
        grad = param.grad.float()
        master.grad = grad if master.grad is None else master.grad.add_(grad)
        param.grad = None

    return hook


class CPUTrainingOptimizer(_TrainingOptimizer):
    """torch.optim + gloo all-reduce + TP-aware clipping (megatron's behaviour on CPU).

    Like megatron's Float16OptimizerWithFloat16Params, a model in bf16 is stepped through fp32
    master copies of its parameters (small updates would round away in bf16), copied back
    after every step. And like megatron's ``main_grad``, its gradients accumulate in fp32: a
    hook moves every backward's bf16 gradient into the master copy's fp32 ``.grad`` (summed
    over micro-batches and calls), where they are reduced over ranks, clipped and applied.
    """

    def __init__(self, model: torch.nn.Module, settings: OptimizerSettings):
        self.model = model
        self.settings = settings
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params: List[torch.nn.Parameter] = [p for _, p in named]
        if any(p.dtype == torch.float16 for p in self.params):
            raise ConfigurationError("--fp16 needs dynamic loss scaling (megatron's optimizer on CUDA); use --bf16 on CPU")
        self.masters: List[torch.nn.Parameter] = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone()) for p in self.params
        ]
        master_of = dict(zip(map(id, self.params), self.masters))
        self._master_of = master_of
        for p, master in zip(self.params, self.masters):
            if master is not p:
                p.register_post_accumulate_grad_hook(_into_main_grad(master))
        groups = [
            {"params": [master_of[id(p)] for n, p in named if not _no_decay(n, p)], "wd_mult": 1.0,
             "weight_decay": settings.weight_decay},
            {"params": [master_of[id(p)] for n, p in named if _no_decay(n, p)], "wd_mult": 0.0, "weight_decay": 0.0},
        ]
        if settings.optimizer == "adam":
            self.optimizer = torch.optim.AdamW(
                groups, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps
            )
        else:
            self.optimizer = torch.optim.SGD(groups, lr=settings.lr, momentum=settings.sgd_momentum)
        self.scheduler = _scheduler(self.optimizer, settings)

    loss_scale = 1.0
    """No loss scaling on CPU (fp32 or bf16)."""

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for master in self.masters:
            master.grad = None

    def main_grad(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """The tensor whose ``.grad`` holds ``p``'s accumulated gradient: ``p`` itself in fp32,
        its fp32 master copy for a bf16 parameter."""
        return self._master_of[id(p)]

    def reduce_gradients(self) -> None:
        """What megatron's finalize_model_grads does: TP-partial sums, the DP sum, then the
        tied word embeddings' sum over the first and last pipeline stages (all in fp32)."""
        allreduce_tensor_parallel_partial_gradients(self.model, self.main_grad)
        allreduce_gradients(self.masters)
        allreduce_embedding_gradients(self.model, self.main_grad)

    def step(self, skip: bool = False) -> StepOutcome:
        """Reduce, clip and apply the gradients (unless skipped, see the class docstring)."""
        self.reduce_gradients()
        norm = gradient_norm(self.params, self.main_grad)
        if skip or not math.isfinite(norm):
            self.zero_grad()
            return StepOutcome(norm, skipped=True)
        if self.settings.clip_grad > 0:
            clip_gradients_(self.masters, self.settings.clip_grad, norm)
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master is not p:
                    p.copy_(master)
        self.scheduler.step(1)
        return StepOutcome(norm, skipped=False)

    def reload_model_params(self) -> None:
        """After weights were loaded into the model: refresh the fp32 master copies (a bf16
        model), or the next step would write the old weights back (megatron's method name)."""
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                if master is not p:
                    master.copy_(p.float())

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        if any(m is not p for p, m in zip(self.params, self.masters)):
            state["fp32_params"] = [m.detach() for m in self.masters]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        for master, saved in zip(self.masters, state.get("fp32_params", [])):
            with torch.no_grad():
                master.copy_(saved)

    # ---------------------------------------------------------------- torch_dist checkpoints
    def _optimizer_order(self) -> List[torch.nn.Parameter]:
        """The model parameter of each optimizer state id (torch numbers them over the groups)."""
        model_param = {id(m): p for p, m in zip(self.params, self.masters)}
        return [model_param[id(m)] for group in self.optimizer.param_groups for m in group["params"]]

    def sharded_state_dict(self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False,
                           saved: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The optimizer state as megatron's sharded tensors: every per-parameter tensor (Adam's
        ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``, the fp32 master copy of a bf16
        parameter) has its parameter's shape, so it gets the parameter's sharding under the key
        ``optimizer.state.<name>.<parameter key>`` (megatron's ``make_sharded_optimizer_tensor``)
        and reshards across TP/PP like the weights. The step count, the same for every
        parameter, and the groups' hyper-parameters are common state (megatron's FP32Optimizer
        saves the step the same way). ``is_loading``: destinations for the keys ``saved`` (the
        checkpoint's common optimizer state) lists."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        order = self._optimizer_order()
        sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, order)
        if len(sharded) != len(order):
            raise ConfigurationError(f"{len(order) - len(sharded)} trained parameters have no sharded checkpoint entry")
        masters = [m for group in self.optimizer.param_groups for m in group["params"]]
        if is_loading:
            keys = list(saved.get("state_keys", [])) if saved else []
            per_param = {i: {k: torch.empty_like(m) for k in keys} for i, m in enumerate(masters)}
            fp32 = bool(saved and saved.get("fp32_params")) and any(m is not p for p, m in zip(order, masters))
            step = None
        else:
            states = [self.optimizer.state.get(m, {}) for m in masters]
            keys = sorted({k for st in states for k, v in st.items() if k != "step" and torch.is_tensor(v)})
            if any(states) and not all(all(torch.is_tensor(st.get(k)) for k in keys) for st in states):
                # Only a parameter that never had a gradient lacks state; it gets what torch
                # would start it with, so that every parameter has the same entries.
                for st, m in zip(states, masters):
                    for k in keys:
                        if not torch.is_tensor(st.get(k)):
                            st[k] = torch.zeros_like(m)
            per_param = {i: {k: st[k] for k in keys} for i, st in enumerate(states)}
            steps = {float(st["step"]) for st in states if "step" in st}
            step = max(steps) if steps else None
            fp32 = any(m is not p for p, m in zip(order, masters))
        state: Dict[str, Any] = {
            "state": {i: {k: make_sharded_optimizer_tensor(sharded[i], t, prefix=f"optimizer.state.{k}")
                          for k, t in tensors.items()} for i, tensors in per_param.items()},
            "state_keys": keys, "step": step, "fp32_params": fp32,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }
        if fp32:
            state["fp32_param"] = {i: make_sharded_optimizer_tensor(sharded[i], m if is_loading is False
                                                                    else torch.empty_like(m),
                                                                    prefix="optimizer.state.fp32_param")
                                   for i, m in enumerate(masters) if m is not order[i]}
        return state

    def load_sharded_state_dict(self, loaded: Dict[str, Any]) -> None:
        """Install what :meth:`sharded_state_dict` (``is_loading=True``) loaded."""
        masters = [m for group in self.optimizer.param_groups for m in group["params"]]
        for group, saved in zip(self.optimizer.param_groups, loaded.get("param_groups", [])):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.state.clear()
        step = loaded.get("step")
        for i, m in enumerate(masters):
            tensors = loaded["state"].get(i, {})
            if not tensors:
                continue
            entry = {k: t.to(m.device) for k, t in tensors.items()}
            if step is not None and isinstance(self.optimizer, torch.optim.AdamW):
                entry["step"] = torch.tensor(float(step), dtype=torch.float32)
            self.optimizer.state[m] = entry
        saved_masters = loaded.get("fp32_param") or {}
        with torch.no_grad():
            for i, m in enumerate(masters):
                if i in saved_masters:
                    m.copy_(saved_masters[i])
            if not saved_masters:
                self.reload_model_params()
            else:  # the model's bf16 weights follow the saved masters (as after a step)
                for p, master in zip(self.params, self.masters):
                    if master is not p:
                        p.copy_(master)


class MegatronTrainingOptimizer(_TrainingOptimizer):  # pragma: no cover - needs CUDA
    """megatron-core DistributedDataParallel + MegatronOptimizer (CUDA)."""

    def __init__(self, model: torch.nn.Module, settings: OptimizerSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron_psrl.model.gpt import model_chunks

        self.settings = settings
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=settings.overlap_grad_reduce,
            overlap_param_gather=settings.overlap_param_gather,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        # One DDP per model chunk (virtual pipeline stages), buckets only for the first, as
        # Megatron-LM wraps them.
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
        self.scheduler = _scheduler(self.optimizer, settings)

    def zero_grad(self) -> None:
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
            if self.settings.overlap_grad_reduce:
                # The whole step accumulates as megatron's no_sync() does (no bucket starts on a
                # per-parameter gradient count, see OptimizerSettings.overlap_grad_reduce);
                # finalize_model_grads then launches every bucket asynchronously and waits.
                for group in ddp.bucket_groups + getattr(ddp, "expert_parallel_bucket_groups", []):
                    group.is_last_microbatch = False
        self.optimizer.zero_grad()

    def sync_params(self) -> None:
        """Finish an in-flight parameter all-gather (``overlap_param_gather``) before the
        parameters are read outside a forward pass (a checkpoint, a weight export)."""
        if self.settings.overlap_param_gather:
            for ddp in self.ddps:
                ddp.start_param_sync(force_sync=True)

    def sharded_state_dict(self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False,
                           saved: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """megatron's own optimizer sharded state dict (torch_dist checkpoints); the distributed
        optimizer's state in its ``fully_reshardable`` form, so it loads under any TP/PP/DP."""
        metadata = ({"distrib_optim_sharding_type": "fully_reshardable"} if self.settings.use_distributed_optimizer
                    else None)
        return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def load_sharded_state_dict(self, loaded: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(loaded)

    def reload_model_params(self) -> None:
        """After weights were loaded into the model: refresh megatron's fp32 main params."""
        self.optimizer.reload_model_params()

    @property
    def loss_scale(self) -> float:
        """megatron's current loss scale (dynamic for fp16, 1 otherwise)."""
        scale = self.optimizer.get_loss_scale()
        return float(scale.item() if torch.is_tensor(scale) else scale)

    def step(self, skip: bool = False) -> StepOutcome:
        from megatron.core.distributed import finalize_model_grads

        # DP reduction (sum: config.calculate_per_token_loss) + TP-partial q/k-norm sums.
        finalize_model_grads(self.ddps)
        # megatron's MegatronOptimizer.step, split open so that a non-finite norm skips the
        # step for bf16/fp32 too (megatron skips only on fp16 overflow).
        found_inf = self.optimizer.prepare_grads()
        norm = float("inf") if found_inf else float(self.optimizer.get_grad_norm())
        if skip or found_inf or not math.isfinite(norm):
            self.zero_grad()
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
        self.scheduler.step(1)
        return StepOutcome(norm, skipped=False)



def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings, device: torch.device):
    """megatron's DDP + optimizer on CUDA, the CPU equivalent elsewhere."""
    if use_megatron_ddp(device):
        return MegatronTrainingOptimizer(model, settings)
    if settings.use_distributed_optimizer:
        raise ConfigurationError("--use-distributed-optimizer needs CUDA: megatron's distributed optimizer shards "
                                 "its state in CUDA buffers, and on CPU the optimizer is torch.optim on every rank; "
                                 "drop the flag on CPU")
    return CPUTrainingOptimizer(model, settings)
