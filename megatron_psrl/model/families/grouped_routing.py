"""DeepSeek-V3-style mixture of experts, for the families that adopt it (GLM-4.5, DeepSeek-V3,
Kimi K2): a sigmoid router with group-limited top-k and an expert bias used for selection only,
shared experts, and dense MLPs in the first layers (docs/moe.md, "Grouped sigmoid routing").

Per token, with ``s = sigmoid(router logits)`` (fp32) and ``b`` the per-expert bias
(``e_score_correction_bias``):

- the experts split into ``n_group`` groups; each group scores the sum of its two best
  ``s + b``; the token keeps its ``topk_group`` best groups;
- it takes the ``num_experts_per_tok`` best ``s + b`` among the kept groups' experts;
- their routing weights are their ``s`` (without ``b``), renormalised to sum to one
  (``norm_topk_prob``), times ``routed_scaling_factor``;
- every token also goes through ``n_shared_experts`` shared experts (one SwiGLU of
  ``n_shared_experts * moe_intermediate_size``, ungated);
- the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP of ``intermediate_size``.

megatron-core runs it as its ``TopKRouter`` with ``moe_router_score_function="sigmoid"``,
``moe_router_num_groups`` / ``moe_router_group_topk`` (its group score sums the top
``k / topk_group`` experts of a group: the same as Hugging Face's top 2 when that is 2, or when
every group is kept), ``moe_router_topk_scaling_factor``, ``moe_router_enable_expert_bias`` (the
bias is its ``expert_bias`` buffer), router logits in fp32 (``moe_router_dtype``, as Hugging Face
computes them), a ``SharedExpertMLP`` without gate, and a per-layer ``moe_layer_freq``.

A family adopts it as a mixin before :class:`~megatron_psrl.model.families.moe.MoEFamily`
(``class Glm4MoeFamily(GroupedRoutingMixin, MoEFamily)``) and names transformers' defaults of
the optional fields (:attr:`GroupedRoutingMixin.hf_mlp_defaults`); its adapter adopts
:class:`~megatron_psrl.model.adapters.grouped_routing.GroupedRoutingAdapterMixin`. The memory
plan, parameter counts and the cost model of mixed dense / MoE layers are
:class:`~megatron_psrl.model.families.moe.MoEFamily`'s (they read ``dense_mlp_layers``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Mapping

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.families.base import NumberReader

ACCEPTED_TOPK_METHODS = ("noaux_tc",)
"""DeepSeek ``topk_method`` values read (absent in GLM configs): ``noaux_tc``, the grouped
sigmoid top-k with the correction bias. DeepSeek-V2's ``greedy`` / ``group_limited_greedy``
(softmax scores, groups scored by their best expert) are refused."""

HF_GROUP_SCORE_EXPERTS = 2
"""Hugging Face scores an expert group by the sum of its best two experts' biased scores."""


def routed_experts(hf: Dict[str, Any]) -> int:
    """``n_routed_experts`` (transformers also maps ``num_local_experts`` onto it)."""
    value = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if value is None:
        raise KeyError("n_routed_experts")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"field 'n_routed_experts' must be a positive integer, got {value!r}")
    return value


def _refuse_other_routers(hf: Dict[str, Any], number: NumberReader, family: str) -> None:
    """DeepSeek-V2's routers and a layer frequency other than 1 are not this routing."""
    method = hf.get("topk_method")
    if method is not None and method not in ACCEPTED_TOPK_METHODS:
        raise UnsupportedModelError(f"{family} with topk_method {method!r} is not supported (only "
                                    f"{', '.join(ACCEPTED_TOPK_METHODS)}: grouped sigmoid top-k)")
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(f"{family} with scoring_func {scoring!r} is not supported (only sigmoid)")
    freq = number("moe_layer_freq", default=1)
    if freq != 1:
        raise UnsupportedModelError(f"{family} with moe_layer_freq {freq} is not supported (every layer after "
                                    "first_k_dense_replace must be a mixture-of-experts layer)")


def _groups(experts: int, topk: int, n_group: int, topk_group: int, family: str):
    """``(moe_router_num_groups, moe_router_group_topk)``: None, None when the group limit keeps
    every expert (one group, or every group kept); refused where megatron's group score (the
    top ``k / topk_group`` experts of a group) is not Hugging Face's (the top 2)."""
    if n_group < 1 or experts % n_group:
        raise UnsupportedModelError(f"n_group {n_group} must divide n_routed_experts {experts}")
    if not 1 <= topk_group <= n_group:
        raise UnsupportedModelError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if topk_group == n_group:
        return None, None
    if experts // n_group < HF_GROUP_SCORE_EXPERTS:
        raise UnsupportedModelError(f"n_group {n_group}: groups of {experts // n_group} expert, Hugging Face scores "
                                    f"a group by its best {HF_GROUP_SCORE_EXPERTS}")
    if topk // topk_group != HF_GROUP_SCORE_EXPERTS:
        raise UnsupportedModelError(
            f"{family} with num_experts_per_tok {topk} and topk_group {topk_group} is not supported: megatron scores "
            f"a group by its best num_experts_per_tok // topk_group = {topk // topk_group} experts, Hugging Face "
            f"by its best {HF_GROUP_SCORE_EXPERTS}")
    return n_group, topk_group


def grouped_routing_fields(hf: Dict[str, Any], number: NumberReader, family: str,
                           defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """The MoE fields of :class:`~megatron_psrl.model.architecture.ModelArchitecture` from a
    DeepSeek-V3-style config.json: ``n_routed_experts``, ``num_experts_per_tok`` and
    ``moe_intermediate_size`` (required), ``n_group``, ``topk_group``, ``norm_topk_prob``,
    ``routed_scaling_factor``, ``n_shared_experts``, ``first_k_dense_replace`` (``defaults``:
    transformers' defaults of the family's config class where absent). Refused: DeepSeek-V2's
    ``topk_method`` / ``scoring_func`` values, ``moe_layer_freq`` other than 1, a group limit
    megatron scores otherwise than Hugging Face (:func:`_groups`), and ``norm_topk_prob`` other
    than ``num_experts_per_tok > 1`` (megatron's sigmoid router renormalises the top k exactly
    when k > 1)."""

    def field(key: str, kind=int):
        return number(key, kind, defaults[key]) if key in defaults else number(key, kind)

    _refuse_other_routers(hf, number, family)
    experts, topk = routed_experts(hf), number("num_experts_per_tok")
    if not 1 <= topk <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok must be in [1, n_routed_experts={experts}], got {topk}")
    renormalised = bool(hf.get("norm_topk_prob", defaults.get("norm_topk_prob", True)))
    if renormalised != (topk > 1):
        raise UnsupportedModelError(
            f"{family} with norm_topk_prob {renormalised} and num_experts_per_tok {topk} is not supported: megatron's "
            "sigmoid router renormalises the top-k weights exactly when num_experts_per_tok > 1")
    groups, group_topk = _groups(experts, topk, field("n_group"), field("topk_group"), family)
    dense = field("first_k_dense_replace")
    layers = number("num_hidden_layers")
    if not 0 <= dense < layers:
        raise UnsupportedModelError(f"first_k_dense_replace must be in [0, num_hidden_layers={layers}), got {dense}")
    shared = field("n_shared_experts")
    if shared < 0:
        raise UnsupportedModelError(f"n_shared_experts must be >= 0, got {shared}")
    width = number("moe_intermediate_size")
    return dict(
        num_experts=experts,
        moe_ffn_hidden_size=width,
        moe_router_topk=topk,
        moe_norm_topk_prob=renormalised,
        moe_shared_expert_ffn_hidden_size=shared * width if shared else None,
        moe_shared_expert_gate=False,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=field("routed_scaling_factor", float),
        moe_router_expert_bias=True,
        dense_mlp_layers=list(range(dense)),
    )


class GroupedRoutingMixin:
    """The MLP of a DeepSeek-V3-style family: listed before
    :class:`~megatron_psrl.model.families.moe.MoEFamily` in the bases."""

    hf_mlp_defaults: ClassVar[Mapping[str, Any]] = {}
    """transformers' defaults (the family's config class) of the optional MoE fields:
    ``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``,
    ``n_shared_experts``, ``first_k_dense_replace``."""

    router_logits_fp32: ClassVar[bool] = True
    """Hugging Face computes the router's logits and scores in fp32 (megatron ``moe_router_dtype``)."""

    hf_mtp_field: ClassVar[str] = "num_nextn_predict_layers"
    """The config field counting the multi-token-prediction layers (stored as decoder layers
    ``num_hidden_layers ...``; carried through conversions unchanged, not trained)."""

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        return grouped_routing_fields(hf, number, self.model_type, self.hf_mlp_defaults)

    def hf_layer_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        fields = dict(super().hf_layer_fields(hf, number))
        mtp = number(self.hf_mtp_field, default=0)
        if mtp < 0:
            raise UnsupportedModelError(f"{self.hf_mtp_field} must be >= 0, got {mtp}")
        fields["mtp_layers"] = mtp
        return fields



__all__ = ["ACCEPTED_TOPK_METHODS", "GroupedRoutingMixin", "grouped_routing_fields", "routed_experts"]
