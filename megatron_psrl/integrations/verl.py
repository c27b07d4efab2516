"""A verl training engine over this project's engine: verl's PPO / GRPO trainer, rollouts,
advantages and loss unchanged, the update phase prefix-shared.

verl (0.9.x) builds its training backend through ``EngineRegistry.new(model_type, backend=
engine_config.strategy, ...)``; importing this module registers :class:`PsrlEngine` for
``model_type="language_model"`` under the backend name :data:`BACKEND` (``psrl``), on CUDA and
CPU. A verl config selects it with::

    actor_rollout_ref.model.external_lib=megatron_psrl.integrations.verl
    actor_rollout_ref.actor.engine._target_=megatron_psrl.integrations.verl.PsrlEngineConfig
    actor_rollout_ref.actor.engine.strategy=psrl

(docs/integrations.md has a whole config.)

What a call does. verl hands each data-parallel rank its share of a mini-batch, after
``left_right_2_no_padding``: jagged ``input_ids``, the padded ``prompts`` / ``responses`` /
``attention_mask`` / ``response_mask``, ``old_log_probs``, ``advantages``, ... and settings as
non-tensor entries. :meth:`PsrlEngine.forward_backward_batch` first gathers every
data-parallel rank's token sequences (flat token ids and lengths, as tensors:
:mod:`~megatron_psrl.integrations.verl_batch`), so the engine's planner sees the whole
mini-batch: GRPO groups, multi-turn histories and any other shared prefix are computed once,
whichever rank verl sent them to. Then, for training:

- **verl's own** ``ppo_loss`` (``functools.partial(ppo_loss, config=...)``, what verl's worker
  sets), with a policy-loss mode that is a per-token function (``vanilla`` / dual-clip,
  ``dppo_tv``, ``dppo_kl``, ``sapo``, ``gpg``, ``dro``, ``cispo``), any ``loss_agg_mode``,
  entropy and KL terms: **one forward and one backward**. The loss is evaluated claim by claim
  inside the engine's step (:mod:`~megatron_psrl.integrations.verl_loss`), configured from
  verl's actor config; verl gets back its loss, metrics and log-probs per rank as ``ppo_loss``
  computes them.
- **any other loss function** (and ``gspo``, ``geo_mean``, ``clip_cov``, ``kl_cov``,
  ``bypass_mode``, whose terms depend on other tokens): two passes. The prefix-shared log-prob
  pass (forward only) over the whole mini-batch; this rank's log-probs (and entropies when
  ``calculate_entropy``) go to verl's ``loss_function`` unchanged, as the nested tensors verl's
  own engines produce (position t holds log p(token t+1)); the engine differentiates the loss
  with respect to them, ``g[t] = dL/dlogp[t]``, and, since the loss depends on the parameters
  only through them, runs ``sum_t g[t] * logp[t]`` forward and backward over the whole
  mini-batch with prefix sharing, every rank's ``g`` gathered first. This costs one forward
  pass more than the one-pass path.

The engine logs once which path verl's loss takes, and why. Either way the gradient equals
verl's: verl's engines average gradients over data-parallel ranks, so each rank's share is
divided by the data-parallel size before the engine sums over ranks. With pipeline
parallelism, ``ppo_loss`` takes the two-pass path too.

Not supported yet (refused at the call, in one line): a sampling ``temperature`` other than 1,
pipeline parallelism with ``calculate_entropy``, parameter / optimizer offload, LoRA.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

try:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.engine import EngineConfig
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("megatron_psrl.integrations.verl needs verl: pip install -e \".[verl]\" "
                      f"(verl 0.9.x; {exc})") from exc

from megatron_psrl.distributed.setup import gradient_group
from megatron_psrl.dtypes import canonical_dtype_name
from megatron_psrl.engine.config import ActorConfig
from megatron_psrl.engine.optimizer import OptimizerSettings
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.integrations.verl_batch import (
    GatheredSequences,
    VerlSequences,
    from_verl,
    gather_flat,
    gather_sequences,
    sequences_of,
    to_verl,
)
from megatron_psrl.integrations.verl_loss import one_pass_batch, one_pass_config
from megatron_psrl.rl.loss import PerClaimLoss

_LOG = logging.getLogger(__name__)

BACKEND = "psrl"
"""The backend (``engine.strategy``) name this engine registers under."""


@dataclass
class PsrlEngineConfig(EngineConfig):
    """verl's engine config for this backend: verl's common engine fields plus the project's
    parallel sizes, micro-batch token budget and KV cache budget (Megatron-style names)."""

    strategy: str = BACKEND
    """Must be ``psrl`` (verl picks the engine class by it)."""

    tensor_model_parallel_size: int = 1
    """TP size."""

    pipeline_model_parallel_size: int = 1
    """PP size (log-prob entropies need 1)."""

    context_parallel_size: int = 1
    """CP size: the ranks of a CP group share the fragments of the same trees."""

    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch (tree tokens, i.e. after sharing)."""

    kv_cache_budget: int = 1 << 30
    """Bytes for cached prefix K/V, their gradients and retained prefix graphs (mechanism 2)."""

    memory_budget: Optional[int] = None
    """Bytes the step may hold on the device, everything counted (``ActorConfig.memory_budget``:
    the planner fills it for speed each step); None: on CUDA the free memory at start-up less
    10% of the device's total, none on CPU; 0: none."""

    prefix_sharing: str = "tree"
    """``tree`` (mechanisms 1 + 2), ``tree-dup`` or ``none`` (the per-sample baseline)."""

    attention_backend: str = "auto"
    """Prefix-sharing attention kernel: ``torch``, ``flash``, ``te`` or ``auto``."""

    transformer_impl: str = "auto"
    """megatron's layer spec: ``local``, ``transformer_engine`` or ``auto``."""

    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda``."""

    recompute_granularity: Optional[str] = None
    """Megatron-LM's activation recomputation (``full`` / ``selective``)."""

    recompute_method: Optional[str] = None
    """With ``full``: ``uniform`` or ``block``."""

    recompute_num_layers: Optional[int] = None
    """With ``full``: layers per recomputed unit."""

    check_sharing_every: int = 0
    """Every this many optimizer steps, check prefix sharing against the per-sample computation
    on a few samples before the update (``ActorConfig.check_sharing_every``); 0: never."""

    check_sharing_samples: int = 2
    """Samples the check computes again without sharing."""

    check_sharing_warn_only: bool = False
    """A failed check logs a warning instead of raising."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != BACKEND:
            raise ConfigurationError(f"PsrlEngineConfig.strategy must be {BACKEND!r}, got {self.strategy!r}")
        if self.param_offload or self.optimizer_offload:
            raise ConfigurationError("the psrl engine does not offload parameters or optimizer state yet "
                                     "(param_offload / optimizer_offload must be false)")


def _open_process_groups(config: ActorConfig):
    """This process's :class:`~megatron_psrl.distributed.setup.ParallelLayout`: megatron's
    groups over the process group verl's worker opened (or a one-process gloo group when
    there is none, e.g. an engine built outside a worker)."""
    from megatron_psrl.engine.builder import process_groups

    return process_groups(config, None)


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default) if config is not None else default
    return default if value is None else value


def actor_config(engine_config: PsrlEngineConfig, optimizer_config: Any = None) -> ActorConfig:
    """The project's :class:`ActorConfig` of a verl engine config and optimizer config (verl's
    ``OptimizerConfig`` or ``McoreOptimizerConfig``: lr, weight decay, betas, clipping, warmup,
    decay style; megatron's optimizer names ``adam`` / ``sgd``)."""
    try:
        dtype = canonical_dtype_name(engine_config.dtype)
    except ConfigurationError as exc:
        raise ConfigurationError(f"engine.dtype: {exc}") from None
    o = optimizer_config
    name = str(_get(o, "optimizer", "adam")).lower()
    name = {"adamw": "adam", "adam": "adam", "sgd": "sgd"}.get(name, name)
    betas = tuple(_get(o, "betas", (0.9, 0.999)))
    clip = _get(o, "clip_grad", 1.0)
    warmup = int(_get(o, "lr_warmup_steps", 0) or 0)
    total = int(_get(o, "total_training_steps", -1) or -1)
    if warmup < 0:  # verl: -1 means "from lr_warmup_steps_ratio"
        warmup = int(float(_get(o, "lr_warmup_steps_ratio", 0.0)) * max(total, 0))
    decay_steps = _get(o, "lr_decay_steps", None) or (total if total > 0 else None)
    # verl fills total_training_steps in from the trainer; without it there is nothing to decay
    # over, and a decay over one step would drop the rate to min_lr after the first update
    style = str(_get(o, "lr_decay_style", "constant")) if decay_steps else "constant"
    optimizer = OptimizerSettings(
        optimizer=name, lr=float(_get(o, "lr", 1e-6)), min_lr=float(_get(o, "min_lr", 0.0)),
        lr_warmup_iters=warmup, lr_decay_style=style, lr_decay_iters=int(decay_steps or 1),
        weight_decay=float(_get(o, "weight_decay", 0.0)),
        adam_beta1=float(betas[0]), adam_beta2=float(betas[1]), clip_grad=float(clip),
        scheduler_follows_steps=False)  # verl advances the schedule itself (lr_scheduler_step)
    e = engine_config
    return ActorConfig(
        tensor_model_parallel_size=e.tensor_model_parallel_size, pipeline_model_parallel_size=e.pipeline_model_parallel_size,
        context_parallel_size=e.context_parallel_size, micro_batch_tokens=e.micro_batch_tokens,
        kv_cache_budget=e.kv_cache_budget, memory_budget=e.memory_budget, prefix_sharing=e.prefix_sharing,
        attention_backend=e.attention_backend,
        transformer_impl=e.transformer_impl, device=e.device, dtype=dtype, seed=e.seed,
        recompute_granularity=e.recompute_granularity, recompute_method=e.recompute_method,
        recompute_num_layers=e.recompute_num_layers, check_sharing_every=e.check_sharing_every,
        check_sharing_samples=e.check_sharing_samples, check_sharing_warn_only=e.check_sharing_warn_only,
        optimizer=optimizer)


# ---------------------------------------------------------------------- verl's batch layout
def training_batch(samples, advantages: torch.Tensor, old_log_probs: torch.Tensor, *, global_batch_size: int,
                   calculate_entropy: bool = False) -> "TensorDict":
    """The TensorDict verl's PPO trainer hands a training engine, from token sequences (for
    tests, benchmarks and trying a configuration without a rollout): ``samples`` are
    ``(prompt, response, response_mask)`` integer arrays; prompts are left-padded, responses
    right-padded, then made jagged by verl's own ``left_right_2_no_padding``, with the settings
    its trainer adds. ``advantages`` ``[b, 1]`` (GRPO: one per sample) or ``[b, r_max]``, and
    ``old_log_probs`` ``[b, r_max]``, are masked by the response mask."""
    from verl.workers.utils.padding import left_right_2_no_padding

    b = len(samples)
    p_max = max(len(p) for p, _, _ in samples)
    r_max = max(len(r) for _, r, _ in samples)
    prompts = torch.zeros(b, p_max, dtype=torch.int64)
    responses = torch.zeros(b, r_max, dtype=torch.int64)
    response_mask = torch.zeros(b, r_max, dtype=torch.int64)
    attention = torch.zeros(b, p_max + r_max, dtype=torch.int64)
    for i, (p, r, m) in enumerate(samples):
        prompts[i, p_max - len(p):] = torch.as_tensor(p, dtype=torch.int64)
        responses[i, :len(r)] = torch.as_tensor(r, dtype=torch.int64)
        response_mask[i, :len(r)] = torch.as_tensor(m, dtype=torch.int64)
        attention[i, p_max - len(p):p_max + len(r)] = 1
    td = TensorDict({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                     "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention,
                     "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                     "old_log_probs": old_log_probs.float() * response_mask,
                     "advantages": advantages.float() * response_mask}, batch_size=[b])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=calculate_entropy, global_batch_size=global_batch_size,
                         temperature=1.0)
    return td


def _check_temperature(data: TensorDict) -> None:
    temperature = tu.get_non_tensor_data(data, key="temperature", default=None)
    if temperature is None and "temperature" in data.keys():
        temperature = data["temperature"]
    if temperature is None:
        return
    values = temperature.float() if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    if not torch.all(values == 1.0):
        raise ConfigurationError("the psrl engine computes log-probs at temperature 1; this batch asks for "
                                 f"temperature {values.flatten()[:4].tolist()} (set rollout.temperature=1.0)")


def _leaf(values: torch.Tensor, device, requires_grad: bool) -> torch.Tensor:
    """The flat ``[total]`` values of a jagged output, a leaf that verl's loss is differentiated
    against (a nested tensor's ``values()`` is a new view on every call, not the leaf)."""
    values = values.to(device)
    return values.requires_grad_(True) if requires_grad else values


# ---------------------------------------------------------------------- the engine
class _ModeCtx(BaseEngineCtx):
    """verl's train / eval context: the model's mode (no offload to switch)."""

    def __enter__(self):
        super().__enter__()
        self.engine.set_training(self.mode == "train")

    def __exit__(self, exc_type, exc_val, exc_tb):
        super().__exit__(exc_type, exc_val, exc_tb)


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])
class PsrlEngine(BaseEngine):
    """verl's ``BaseEngine`` over :class:`~megatron_psrl.rl.actor.PolicyActor` (see the module
    docstring). Built by verl's ``TrainingWorker`` as ``EngineRegistry.new(...)``."""

    def __init__(self, model_config: Any, engine_config: PsrlEngineConfig, optimizer_config: Any = None,
                 checkpoint_config: Any = None):
        super().__init__()
        if not isinstance(engine_config, PsrlEngineConfig):
            raise ConfigurationError("the psrl engine needs a PsrlEngineConfig (actor_rollout_ref.actor.engine."
                                     "_target_=megatron_psrl.integrations.verl.PsrlEngineConfig)")
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode = None
        self.actor = None
        self.last_sharing_check = None
        """The last prefix sharing check (``check_sharing_every``), its outcome and differences."""
        self.config = actor_config(engine_config, optimizer_config)
        # verl asks for the data-parallel rank, size and output ranks right after building the
        # engine, before initialize(); like verl's own engines, the process groups (megatron's
        # TP / PP / CP / DP over the world verl opened) are set up here, the model later
        self.layout = _open_process_groups(self.config)

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> None:
        """Build the model and optimizer (verl's ``TrainingWorker.reset``); a second call
        rebuilds them from the model path."""
        from megatron_psrl.rl.actor import PolicyActor

        path = getattr(self.model_config, "local_path", None) or getattr(self.model_config, "path", None)
        if path is None:
            raise ConfigurationError("verl's model config names no model path (model.path)")
        if getattr(self.model_config, "lora_rank", 0):
            raise ConfigurationError("the psrl engine does not train LoRA adapters yet (model.lora_rank must be 0)")
        self.actor = None  # a reset drops the old model before building the new one
        self.actor = PolicyActor(os.fspath(path), self.config, for_training=not self.engine_config.forward_only,
                                 layout=self.layout)

    @property
    def engine(self):
        """The project's engine under the actor."""
        return self.actor.engine

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def set_training(self, training: bool) -> None:
        for chunk in self.engine.stage_chunks():
            chunk[1].train(training)

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if model or optimizer:  # verl asks only with offload on, which the config refuses
            raise ConfigurationError("the psrl engine keeps parameters and optimizer state where they are "
                                     "(no offload)")

    # ------------------------------------------------------------------ process groups
    def get_data_parallel_rank(self) -> int:
        return self.layout.dp_rank

    def get_data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    def get_data_parallel_group(self):
        """megatron's data-parallel group, also of one rank: verl's worker gathers metrics over it
        whenever it is not None, and its ``train_mini_batch`` expects them gathered (as verl's
        own engines, which always return their group, give them)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        layout = self.layout
        return layout.tp_rank == 0 and layout.pp_rank == layout.pipeline_parallel_size - 1 and layout.cp_rank == 0

    # ------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self) -> None:
        self.actor.zero_grad()

    def optimizer_step(self) -> float:
        """One optimizer step; the gradient norm before clipping. A non-finite norm skips the
        step on every rank (as Megatron does) and is returned as is."""
        return float(self.actor.optimizer_step().grad_norm)

    def lr_scheduler_step(self) -> float:
        self.actor.optimizer.scheduler.step(1)
        return float(self.actor.optimizer.lr)

    # ------------------------------------------------------------------ the update
    def forward_backward_batch(self, data: TensorDict, loss_function: Optional[Callable], forward_only: bool = False):
        """verl's call (see the module docstring): ``{"model_output": {"log_probs", ["entropy"]},
        "loss": [loss], "metrics": {name: [value]}}`` for this rank's samples."""
        _check_temperature(data)
        seqs = sequences_of(data)
        layout = self.actor.layout
        dp_group, dp = self.get_data_parallel_group(), self.get_data_parallel_size()

        # verl's global normalisers, as its engines set them before the loss
        loss_mask = data["loss_mask"]
        local_tokens = (loss_mask.values() if loss_mask.is_nested else loss_mask).sum().to(torch.float64)
        num_tokens = local_tokens.reshape(1).to(layout.device)
        if dp_group is not None:
            dist.all_reduce(num_tokens, group=dp_group)
        tu.assign_non_tensor(data, batch_num_tokens=int(num_tokens.item()), dp_size=dp)

        entropy_wanted = bool(tu.get_non_tensor_data(data, key="calculate_entropy", default=False))
        if entropy_wanted and layout.pipeline_parallel_size > 1:
            raise ConfigurationError("calculate_entropy with pipeline parallelism is not supported by the psrl "
                                     "engine yet")
        # the whole mini-batch on every rank: the planner shares prefixes across verl's DP split
        every = gather_sequences(seqs, dp_group, dp, self.get_data_parallel_rank(), layout.device)
        trains = not forward_only and loss_function is not None
        if trains:
            self._check_sharing(every)
            config, why = one_pass_config(loss_function, data)
            if config is not None and layout.pipeline_parallel_size > 1:
                config, why = None, "pipeline parallelism (one pass needs the loss on every rank)"
            self._log_path(config is not None, why)
            if config is not None:
                return self._one_pass(data, config, seqs, every, entropy_wanted)
        return self._two_pass(data, loss_function, seqs, every, entropy_wanted, trains)

    def _check_sharing(self, every: GatheredSequences) -> None:
        """The prefix sharing check on its steps (``check_sharing_every``), before the step's
        gradient: verl zeroes the gradients before this call, which makes one per optimizer step.
        Its loss is the sum of the response tokens' log-probs (what every verl loss differentiates
        through), so it checks the log-probs and their gradient whatever verl's loss is."""
        if not self.actor.config.check_sharing_every:
            return
        mask = every.response_mask()
        batch = every.batch(mask, self.actor.arch.vocab_size, advantages=mask.astype(np.float32))
        check = self.actor.check_sharing(batch, loss_fn=_surrogate(False))
        if check is not None:
            self.last_sharing_check = check
            _LOG.info("psrl engine: %s", check.describe())

    def _log_path(self, one_pass: bool, why: str) -> None:
        """Say once per path which one verl's loss takes (one pass, or log-probs then update)."""
        said = self.__dict__.setdefault("_paths_logged", set())
        if one_pass not in said:
            said.add(one_pass)
            how = "one forward and backward" if one_pass else "two passes (log-probs, then the loss's gradient)"
            _LOG.info("psrl engine: verl's loss runs in %s: %s", how, why)

    def _two_pass(self, data: TensorDict, loss_function, seqs: VerlSequences, every: GatheredSequences,
                  entropy_wanted: bool, trains: bool):
        """Any loss function: log-probs for verl's ``loss_function``, then its gradient through the
        engine (the module docstring's steps 2 and 3)."""
        device, dp_group = self.actor.layout.device, self.get_data_parallel_group()
        batch = self.actor.as_batch(every.batch(every.response_mask(), self.actor.arch.vocab_size), training=False)
        result = self.engine.compute_logprobs(batch, with_entropy=entropy_wanted)
        logprobs, entropies = result if entropy_wanted else (result, None)
        mine, starts = every.mine, seqs.starts
        leaves = {"log_probs": _leaf(to_verl(_concat(logprobs[mine]), starts), device, trains)}
        if entropies is not None:
            leaves["entropy"] = _leaf(to_verl(_concat(entropies[mine]), starts), device, trains)
        offsets = seqs.offsets.to(device)
        model_output = {k: torch.nested.nested_tensor_from_jagged(v, offsets=offsets) for k, v in leaves.items()}
        loss_value, metrics = 0.0, {}
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
            loss_value = float(loss.detach())
            if trains:
                self._backward(loss, leaves, seqs, every)
        detached = {k: torch.nested.nested_tensor_from_jagged(v.detach(), offsets=offsets) for k, v in leaves.items()}
        return {"model_output": detached, "loss": [loss_value], "metrics": _as_verl_metrics(metrics)}

    def _backward(self, loss: torch.Tensor, leaves: Dict[str, torch.Tensor], seqs: VerlSequences,
                  every: GatheredSequences) -> None:
        """The gradient of verl's loss through the engine (the module docstring's step 3): the
        per-token coefficients ``dL/dlogp`` (and ``dL/dentropy``) ride in the batch's
        ``advantages`` (and ``ref_logprobs``) columns, read by :func:`_surrogate` only."""
        dp, dp_group, device = self.get_data_parallel_size(), self.get_data_parallel_group(), self.actor.layout.device
        keys = list(leaves)
        grads = torch.autograd.grad(loss, [leaves[k] for k in keys], allow_unused=True)
        columns = {}
        for key, leaf, grad in zip(keys, leaves.values(), grads):
            grad = torch.zeros_like(leaf) if grad is None else grad
            # verl's engines average gradients over data-parallel ranks; the engine sums them
            columns[key] = gather_flat(from_verl(grad / dp, seqs.starts), dp_group, dp, device)
        ent_coef = columns.get("entropy")
        batch = every.batch(every.response_mask(), self.actor.arch.vocab_size, advantages=columns["log_probs"],
                            ref_logprobs=ent_coef)
        self.actor.forward_backward(batch, loss_fn=_surrogate(ent_coef is not None), return_logprobs=False)

    def _one_pass(self, data: TensorDict, config, seqs: VerlSequences, every: GatheredSequences, entropy_wanted: bool):
        """verl's ``ppo_loss`` evaluated claim by claim inside one forward and backward
        (:mod:`megatron_psrl.integrations.verl_loss`): the same loss, metrics and gradient, no
        log-prob pass."""
        dp, dp_group, device = self.get_data_parallel_size(), self.get_data_parallel_group(), self.actor.layout.device
        info = dict(dp_size=data["dp_size"], batch_num_tokens=data["batch_num_tokens"],
                    global_batch_size=data["global_batch_size"], loss_scale_factor=config.loss_scale_factor)
        config.global_batch_info.update(info)  # as ppo_loss leaves it
        batch, loss, shares = one_pass_batch(data, config, seqs, every, dp_group, dp, device,
                                             self.actor.arch.vocab_size, entropy_wanted)
        # the loss records every token's log-prob (entropy), claimed or not, as verl's engines
        # return them: the prompt's and the untrained response tokens' in the same forward
        result = self.actor.forward_backward(batch, loss_fn=loss, return_logprobs=True)
        outputs = {"log_probs": result.logprobs, "entropy": result.entropies}
        if dist.get_world_size(gradient_group()) > 1:  # each claim ran on one rank of the group
            dist.all_reduce(loss.sums, group=gradient_group())
        value, metrics = loss.rank_result(every.rank, shares, info)
        mine, offsets = every.mine, seqs.offsets.to(device)
        model_output = {k: torch.nested.nested_tensor_from_jagged(to_verl(_concat(v[mine]), seqs.starts).to(device),
                                                                  offsets=offsets)
                        for k, v in outputs.items() if v is not None}
        return {"model_output": model_output, "loss": [value], "metrics": _as_verl_metrics(metrics)}

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(self, **kwargs):
        """``(generator of (Hugging Face name, tensor), None)``: the weights for the rollout engine."""
        actor = self.actor
        if hasattr(actor, "iter_hf_weights"):
            return actor.iter_hf_weights(), None
        return iter(actor.state_dict_hf().items()), None

    def save_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, global_step: int = 0,
                        max_ckpt_to_keep: Optional[int] = None, **kwargs) -> None:
        """A torch_dist (or legacy) checkpoint of model, optimizer and schedule in ``local_path``
        (atomic, checksummed). ``hdfs_path`` and ``max_ckpt_to_keep`` are verl's own business."""
        if hdfs_path:
            raise ConfigurationError("the psrl engine writes local checkpoints only (hdfs_path must be empty)")
        self.actor.save(local_path)

    def load_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        self.actor.load(local_path)


def _concat(per_sample: List[np.ndarray]) -> np.ndarray:
    return np.concatenate(per_sample).astype(np.float32, copy=False) if per_sample else np.zeros(0, np.float32)


def _as_verl_metrics(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """A loss function's metrics as verl's engines return them (``append_to_dict`` over the
    micro-batches): a ``Metric`` stays a ``Metric`` (its own list), anything else becomes a
    list; verl's ``train_mini_batch`` aggregates the first with ``Metric.aggregate_dp`` and
    chains the second."""
    from verl.utils.py_functional import append_to_dict

    out: Dict[str, Any] = {}
    append_to_dict(out, metrics)
    return out


def _surrogate(with_entropy: bool) -> PerClaimLoss:
    """The per-token loss whose parameter gradient is verl's: ``sum g * logp (+ g_ent * entropy)``
    with the coefficients that :meth:`PsrlEngine._backward` put into the batch."""

    def per_claim(view):
        terms = view.advantage * view.logp
        if with_entropy:
            terms = terms + view.ref_logprob * view.entropy
        return terms

    return PerClaimLoss(per_claim, needs_entropy=with_entropy, needs_ref=with_entropy, needs_advantage=True)


__all__ = ["BACKEND", "PsrlEngine", "PsrlEngineConfig", "VerlSequences", "actor_config", "sequences_of",
           "training_batch"]
