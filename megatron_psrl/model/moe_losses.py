"""The MoE router's z-loss and load-balancing loss, exact with prefix sharing (docs/moe.md
"Router losses").

The definition is the per-sample batch's: the whole global batch of samples (every sample's
tokens; a token shared by ``w`` samples counted ``w`` times; all data-parallel ranks) is one
batch, and per MoE layer ``l``, with ``W = sum_t w_t`` (the batch's tokens)::

    z_l   = z_coeff * sum_t w_t * logsumexp(logits_t)^2 / W
    aux_l = aux_coeff * E / (k * W^2) * sum_e (sum_t w_t p_{t,e}) * C_{l,e},
            C_{l,e} = sum_t w_t [e in routes_l(t)]

``p`` the scores megatron's aux loss uses (softmax over all experts), ``routes_l(t)`` the k
experts the token is routed to: its replayed route (router replay: a token without one is
routed to experts ``0..k-1``, as :class:`~megatron_psrl.model.moe.RouterReplayer` routes it)
or the router's own top-k. Every token of every sample counts in every layer: with these
losses the last layer computes every row (the last-layer row skip would hide the rows
whose output no log-prob reads from its router).

Each tree token is computed (owned) in exactly one micro-batch on one rank, so the sum of
per-micro-batch terms over its owned rows, each weighted by ``w_t`` (``PrefixTree``: the
samples through the token), is the batch's statistic. ``C`` is not differentiable and its
gradient w.r.t. ``p`` is linear in the global ``C``: known before the step, every
micro-batch adds its own linear term and the terms add up to the batch's loss exactly. ``C`` is
known up front from the replayed routes; without them a forward-only pre-pass over the step
(:meth:`RouterLosses.count_routes`) counts them. With pipeline parallelism each stage's routers
add the terms of their own layers (megatron's layer numbers are global): the pre-pass's counts
and the reported sums are summed over the pipeline's stages as well; with sequence parallelism
each tensor-parallel rank adds the terms of its share of the rows (padding rows weigh 0), and
they are summed over the tensor-parallel group too.

megatron's own computation (unweighted, per micro-batch, its aux loss's routing map the
router's own top-k even under replay) is off (its coefficients are 0): the routers'
``routing`` method is wrapped, their routing itself (megatron's ``TopKRouter``) is untouched.

The same per-row weights count the tokens megatron's aux-loss-free balancing updates a sigmoid
router's expert bias from (``moe_router_enable_expert_bias``; grouped routing, GLM-4.5 /
DeepSeek-V3): not a loss, no gradient, but a step's update ``bias += rate * sign(mean_e C_e -
C_e)`` whose counts ``C_{l,e} = sum_t w_t [e in routes_l(t)]`` (the replayed or the router's own
routes, as the forward routed) must be the per-sample batch's. megatron counts every row of
every grad-enabled forward once (``TopKRouter._apply_expert_bias``): a shared token once, not
once per sample. With ``expert_bias_counts`` its counting is switched off and each router's
``local_tokens_per_expert`` gets the weighted counts instead; megatron's
``finalize_model_grads`` then sums them over the tensor x data x context parallel ranks and
updates the bias as it would (every stage its own layers).

Rows are indexed per MoE layer (:func:`~megatron_psrl.model.moe.moe_layer_index`): a model with
dense layers (``dense_mlp_layers``) has no row for those.
The terms are attached to the router's logits as megatron does (an identity whose backward
adds the loss's gradient, scaled like the policy loss), so activation recomputation's graph-less
first forward adds nothing and its recomputation adds the term once.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.host_copy import host_to_device
from megatron_psrl.model.sequence_parallel import sequence_parallel_group, shard_rows, tensor_parallel_rank_and_size

Tensor = torch.Tensor

def check_router_loss_settings(aux_coeff: float, z_coeff: float, load_balancing_type: str,
                               pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                               virtual_pipeline: bool = False) -> None:
    """Refuse the router-loss settings that are not exact (one line each)."""
    if aux_coeff > 0 and load_balancing_type == "seq_aux_loss":
        raise ConfigurationError("--moe-router-load-balancing-type seq_aux_loss with --moe-aux-loss-coeff > 0 is "
                                 "not supported: its statistics are per sequence of megatron's micro-batch, which the "
                                 "tree packing decides (use aux_loss: over the whole global batch)")
    if aux_coeff > 0 and load_balancing_type == "global_aux_loss":
        raise ConfigurationError("--moe-router-load-balancing-type global_aux_loss with --moe-aux-loss-coeff > 0 is "
                                 "not supported: it averages expert counts over the micro-batches seen so far, which "
                                 "follow the packing; aux_loss here already uses the whole global batch's counts")
    if aux_coeff > 0 or z_coeff > 0:
        if virtual_pipeline:
            raise ConfigurationError("--moe-aux-loss-coeff / --moe-z-loss-coeff > 0 with virtual pipeline stages is "
                                     "not supported yet (untested; pipeline parallelism without them is exact)")
        if context_parallel_size > 1:
            raise ConfigurationError("--moe-aux-loss-coeff / --moe-z-loss-coeff > 0 with --context-parallel-size > 1 "
                                     "is not supported yet (untested)")


def token_multiplicity(tree) -> np.ndarray:
    """float64 ``[T]``: samples through every tree token (``node_num_samples`` of its node)."""
    return np.bincount(tree.sample_token_index, minlength=tree.num_tree_tokens).astype(np.float64)


def replayed_counts(batch, num_layers: int, num_experts: int) -> np.ndarray:
    """float64 ``[L, E]``: tokens of the batch routed to every expert of every MoE layer by the
    samples' routes (``routed_experts`` ``[N, L, k]``; a token without a route: experts
    ``0..k-1``, as the replay routes it)."""
    routes = np.asarray(batch.routed_experts).astype(np.int64)
    missing = routes[:, 0, 0] < 0
    if missing.any():
        routes = routes.copy()
        routes[missing] = np.arange(routes.shape[2], dtype=np.int64)
    return np.stack([np.bincount(routes[:, layer].ravel(), minlength=num_experts)[:num_experts]
                     for layer in range(num_layers)]).astype(np.float64)


def _pipeline_group():
    """megatron's pipeline group of this rank when it has more than one stage, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_pipeline_model_parallel_group()


class _AddLoss(torch.autograd.Function):
    """Identity on the router's logits whose backward also seeds ``loss``'s gradient with
    ``scale`` (megatron's ``MoEAuxLossAutoScaler``, with the scale of this step's losses)."""

    @staticmethod
    def forward(ctx, logits: Tensor, loss: Tensor, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class RouterLosses:
    """The weighted router z-loss and load-balancing loss of one model's MoE routers.

    The step runner calls :meth:`begin_step` (the step's tree and loss scale), :meth:`set_pack`
    before every forward of a micro-batch (its rows' weights), :meth:`select` before a backward
    that recomputes a kept forward, and :meth:`end_step` (the sums of this rank's terms)."""

    def __init__(self, model: torch.nn.Module, aux_coeff: float, z_coeff: float, expert_bias_counts: bool = False):
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_psrl.model.gpt import model_chunks
        from megatron_psrl.model.moe import moe_layer_index, moe_layer_pattern

        self.aux_coeff, self.z_coeff = float(aux_coeff), float(z_coeff)
        self.expert_bias_counts = bool(expert_bias_counts)
        """Count the tokens of megatron's expert-bias update weighted per sample (module doc)."""
        self.routers = [m for chunk in model_chunks(model) for m in chunk.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ConfigurationError("--moe-aux-loss-coeff / --moe-z-loss-coeff > 0 need a mixture-of-experts model")
        config = self.routers[0].config
        self.num_layers = sum(moe_layer_pattern(config))  # MoE layers: the rows of the counts
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        for router in self.routers:
            if router.config.moe_aux_loss_coeff or router.config.moe_z_loss_coeff:
                raise ConfigurationError("megatron's own router losses must be off (0): megatron_psrl computes them")
            if self.expert_bias_counts and getattr(router, "expert_bias", None) is None:
                raise ConfigurationError("--moe-router-enable-expert-bias: the model's routers have no expert bias")
            if self.expert_bias_counts:
                router.enable_expert_bias = False  # megatron's own (unweighted) count: off; the bias stays in use
            layer = moe_layer_index(router.config, router.layer_number)
            router.routing = self._routing(router, router.routing, layer)
            router.register_forward_hook(self._count_hook(layer))
        self._active = False
        self._counting: Optional[Tensor] = None  # [L, E] float64: a pre-pass's weighted route counts
        self._route_counts: Optional[Tensor] = None  # the pre-pass's global counts, for the next step
        self._tree = None
        self._multiplicity: Optional[np.ndarray] = None
        self._weights: Optional[Tensor] = None  # [t] float32 weights of the current pack's rows
        self._packs: Dict[int, Tensor] = {}
        self._scale = 1.0
        self._z_factor = 0.0
        self._aux_factor: Optional[Tensor] = None  # [L, E] float32: aux_coeff * E / (k W^2) * C
        self._z_sum: Optional[Tensor] = None
        self._aux_sum: Optional[Tensor] = None
        self.pipeline_group = _pipeline_group()
        """With pipeline parallelism: the stages of this rank's pipeline, each holding the routers
        of its own layers (the route counts and the losses are summed over it), else None."""
        self.sequence_group = sequence_parallel_group(config)
        """With sequence parallelism: the tensor-parallel group, whose ranks each route their own
        share of a pack's rows (the route counts and the losses are summed over it), else None."""

    # ------------------------------------------------------------------ the step
    def needs_route_counts(self, tree) -> bool:
        """The step's load-balancing loss needs a pre-pass to count the routes (no replay)."""
        return self.aux_coeff > 0 and tree.batch.routed_experts is None

    def count_routes(self, tree, forward: Callable[[], object], group=None) -> Tensor:
        """The global weighted route counts ``[L, E]`` of the step of ``tree``: ``forward()``
        runs this rank's micro-batches forward only (the step runner's log-prob pass); the
        counts are summed over ``group`` (the data x context parallel ranks) and kept for the
        next :meth:`begin_step`."""
        import torch.distributed as dist

        device = self.routers[0].weight.device
        self._counting = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=device)
        self._use_tree(tree)
        try:
            forward()
            counts = self._counting
        finally:
            self._counting = None
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        for partial in (self.pipeline_group, self.sequence_group):  # each stage its layers, each TP rank its rows
            if partial is not None:
                dist.all_reduce(counts, group=partial)
        self._route_counts = counts
        return counts

    def begin_step(self, tree, loss_scale: float = 1.0) -> None:
        """A training step over ``tree``'s batch starts; its losses' gradients are scaled by
        ``loss_scale`` (the policy loss's)."""
        device = self.routers[0].weight.device
        self._use_tree(tree)
        total = float(tree.batch.num_tokens)  # W: every sample's tokens
        self._z_factor = self.z_coeff / total
        self._aux_factor = None
        if self.aux_coeff > 0:
            if tree.batch.routed_experts is not None:
                counts = host_to_device(replayed_counts(tree.batch, self.num_layers, self.num_experts), device)
            elif self._route_counts is not None:
                counts = self._route_counts
            else:
                raise RuntimeError("the load-balancing loss needs the step's route counts: RouterLosses.count_routes "
                                   "before the training step (or samples with routed_experts)")
            self._aux_factor = (counts * (self.aux_coeff * self.num_experts / (self.topk * total * total))).float()
        self._route_counts = None
        self._scale = float(loss_scale)
        self._packs.clear()
        self._z_sum = self._aux_sum = None
        self._active = True

    def set_pack(self, i: int, pack) -> None:
        """Micro-batch ``i``'s pack runs forward next: its rows' weights (samples through the
        token where this micro-batch owns it, else 0)."""
        if not (self._active or self._counting is not None):
            return
        w = self._multiplicity[pack.tree_tokens] * pack.owned
        self._weights = host_to_device(w, self.routers[0].weight.device, np.float32)
        if self.sequence_group is not None:  # this TP rank's share of the padded rows (padding: 0)
            rank, tp = tensor_parallel_rank_and_size()
            self._weights = shard_rows(self._weights, rank, tp)
        if self._active:
            self._packs[i] = self._weights

    def select(self, i: int) -> None:
        """Before a backward that recomputes micro-batch ``i``'s forward: its weights again."""
        if self._active and i in self._packs:
            self._weights = self._packs[i]

    def zero_expert_bias_counts(self) -> None:
        """A new step's gradients start from zero: so do the expert bias's token counts (megatron
        zeroes them after it updates the bias; a sharing check's passes, which run before the
        step, must not count)."""
        if self.expert_bias_counts:
            for router in self.routers:
                router.local_tokens_per_expert.zero_()

    def end_step(self) -> Dict[str, Tensor]:
        """This rank's sums of the step's terms (``moe_z_loss``, ``moe_aux_loss``, with their
        coefficients, over every MoE layer: with pipeline parallelism, summed over the stages
        of the pipeline, a collective every stage calls), as 0-d tensors on the device."""
        zero = torch.zeros((), device=self.routers[0].weight.device)
        out = {}
        if self.z_coeff > 0:
            out["moe_z_loss"] = self._z_sum if self._z_sum is not None else zero
        if self.aux_coeff > 0:
            out["moe_aux_loss"] = self._aux_sum if self._aux_sum is not None else zero
        groups = [g for g in (self.pipeline_group, self.sequence_group) if g is not None]
        if groups and out:
            import torch.distributed as dist

            stacked = torch.stack([v.float() for v in out.values()])
            for group in groups:
                dist.all_reduce(stacked, group=group)
            out = dict(zip(out, stacked.unbind()))
        self._active = False
        self._packs.clear()
        self._weights = None
        self._z_sum = self._aux_sum = None
        return out

    # ------------------------------------------------------------------ the routers
    def _use_tree(self, tree) -> None:
        if self._tree is not tree:
            self._tree, self._multiplicity = tree, token_multiplicity(tree)

    @staticmethod
    def _skipped() -> bool:
        from megatron_psrl.model.moe import ExpertLoad

        return ExpertLoad._uncounted_depth > 0  # the expert-parallel lockstep's empty passes

    def _rows(self, n: int) -> Tensor:
        w = self._weights
        if w is None or w.shape[0] != n:
            raise RuntimeError(f"router losses: weights of {None if w is None else w.shape[0]} pack rows, the "
                               f"router sees {n} (the last layer must compute every row)")
        return w

    def _scores(self, logits: Tensor) -> Tensor:
        if self.score_function == "softmax":
            return torch.softmax(logits, dim=-1, dtype=torch.float32)
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)

    def _routing(self, router, routing, layer: int):
        def weighted_routing(logits: Tensor, *args, **kwargs):
            counted = self._active and torch.is_grad_enabled() and not self._skipped()
            if counted:
                flat = logits.reshape(-1, self.num_experts).float()
                w = self._rows(flat.shape[0])
                loss = None
                if self.z_coeff > 0:
                    z = (w * torch.logsumexp(flat, dim=-1).square()).sum() * self._z_factor
                    self._z_sum = z.detach() if self._z_sum is None else self._z_sum + z.detach()
                    loss = z
                if self._aux_factor is not None:
                    p = (self._scores(flat) * w[:, None]).sum(dim=0)  # [E]: sum_t w_t p_{t,e}
                    aux = (p * self._aux_factor[layer]).sum()
                    self._aux_sum = aux.detach() if self._aux_sum is None else self._aux_sum + aux.detach()
                    loss = aux if loss is None else loss + aux
                if loss is not None:
                    logits = _AddLoss.apply(logits, loss, self._scale)
            probs, routing_map = routing(logits, *args, **kwargs)
            if counted and self.expert_bias_counts:  # [t, E] bool: the k experts each row was routed to
                with torch.no_grad():
                    w = self._rows(routing_map.shape[0])
                    router.local_tokens_per_expert += (routing_map.float() * w[:, None]).sum(dim=0)
            return probs, routing_map

        return weighted_routing

    def _count_hook(self, layer: int):
        def count(module, args, output) -> None:
            if self._counting is None or self._skipped():
                return
            routing_map = output[1]  # [t, E] bool: every row's k experts
            w = self._rows(routing_map.shape[0]).double()
            self._counting[layer] += (routing_map.double() * w[:, None]).sum(dim=0)

        return count


__all__: List[str] = ["RouterLosses", "check_router_loss_settings", "replayed_counts", "token_multiplicity"]
