"""The mixture-of-experts MLP of a family: a top-k softmax router over SwiGLU experts,
optionally with a gated shared expert, in every layer (docs/moe.md); or, for the families of
:mod:`.grouped_routing`, a grouped sigmoid router with an expert bias and an ungated shared
expert, after dense first layers (``ModelArchitecture.dense_mlp_layers``).

:class:`MoEFamily` goes before the family's attention bundle in the bases
(``class Qwen3MoeFamily(MoEFamily, Qwen3Family)``) and replaces its dense MLP: the MoE
config fields (:meth:`MoEFamily.hf_mlp_fields`, one per family), megatron's ``MoELayer``, the
router's, dispatcher's and experts' saved bytes, and the parameter counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Dict

from megatron_psrl.errors import UnsupportedModelError
from megatron_psrl.model.families.base import FP32_BYTES, LayerSpecChoices, LlamaLikeFamily, NumberReader

if TYPE_CHECKING:
    from megatron_psrl.model.architecture import ModelArchitecture


class MoEFamily(LlamaLikeFamily):
    """A Llama-like decoder whose MLPs are megatron's ``MoELayer`` (but those of
    ``dense_mlp_layers``). Subclasses parse their config's MoE fields (:meth:`hf_mlp_fields`)."""

    is_moe = True

    router_logits_fp32: ClassVar[bool] = False
    """The router computes its logits, scores and routing weights in fp32 whatever the model
    dtype (megatron ``moe_router_dtype="fp32"``; Hugging Face's GLM-4.5 / DeepSeek-V3 routers
    do); else in the model dtype (Qwen-MoE, Mixtral)."""

    def hf_mlp_fields(self, hf: Dict[str, Any], number: NumberReader) -> Dict[str, Any]:
        """``num_experts``, ``moe_ffn_hidden_size``, ``moe_router_topk``, ``moe_norm_topk_prob``
        and the shared expert's fields of a config.json; refuses the variants not implemented."""
        raise NotImplementedError(f"{type(self).__name__} must parse its MoE fields")

    # ------------------------------------------------------------------ megatron model
    def moe_config_fields(self, arch: "ModelArchitecture") -> Dict[str, Any]:
        """The router of every supported family is megatron's softmax top-k router: renormalised
        over the top k (``norm_topk_prob``; always for Mixtral) = softmax over the top-k logits
        (``moe_router_pre_softmax=False``), else the top k of the softmax over all experts
        (``moe_router_pre_softmax=True``). A shared expert is megatron's ``SharedExpertMLP`` of
        width ``moe_shared_expert_intermediate_size``, its sigmoid gate ``moe_shared_expert_gate``
        (no overlap with the dispatcher: that needs CUDA streams). Routing is dropless (no
        capacity factor); the load-balancing loss is off unless ``moe_aux_loss_coeff`` overrides it."""
        fields = dict(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_topk=arch.moe_router_topk,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.0,
            moe_expert_capacity_factor=None,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=arch.moe_shared_expert_gate,
            moe_shared_expert_overlap=False,
            expert_tensor_parallel_size=1,  # whole experts on every rank that holds them (EP splits them)
        )
        if arch.moe_router_score_function == "sigmoid":
            fields.update(self.sigmoid_router_fields(arch))
        if self.router_logits_fp32:
            fields["moe_router_dtype"] = "fp32"
        if arch.dense_mlp_layers:  # megatron's per-layer pattern: 1 an MoE layer, 0 a dense MLP
            dense = set(arch.dense_mlp_layers)
            fields["moe_layer_freq"] = [0 if i in dense else 1 for i in range(arch.num_layers)]
        return fields

    @staticmethod
    def sigmoid_router_fields(arch: "ModelArchitecture") -> Dict[str, Any]:
        """A sigmoid router (grouped routing, :mod:`.grouped_routing`): each expert's score
        ``sigmoid(logit)``, the top k renormalised when k > 1 (megatron always does), times
        ``moe_router_topk_scaling_factor``; group-limited top-k; the expert bias as megatron's
        ``expert_bias`` buffer, selection only. Its update (``moe_router_bias_update_rate``) is
        off here: the trainer turns it on (``--moe-router-enable-expert-bias``) with per-sample
        token counts (:mod:`megatron_psrl.model.moe_losses`)."""
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_num_groups=arch.moe_router_num_groups,
            moe_router_group_topk=arch.moe_router_group_topk,
            moe_router_topk_scaling_factor=arch.moe_router_topk_scaling_factor,
            moe_router_enable_expert_bias=arch.moe_router_expert_bias,
            moe_router_bias_update_rate=0.0,
        )

    def layer_spec_choices(self, arch: "ModelArchitecture") -> LayerSpecChoices:
        # megatron's MoE spec always carries a SharedExpertMLP submodule; the MoELayer builds it
        # only when the config sets moe_shared_expert_intermediate_size
        return LayerSpecChoices(num_experts=arch.num_experts, qk_layernorm=arch.qk_norm,
                                dense_mlp_layers=tuple(arch.dense_mlp_layers))

    # ------------------------------------------------------------------ memory plan
    def saved_activation_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                         dtype_bytes: int) -> int:
        """The decoder's count with an MoE MLP in every layer, less the difference of a dense
        layer's SwiGLU (``dense_mlp_layers``: ``3 f / tp``) and an MoE layer's."""
        every_layer_moe = super().saved_activation_bytes_per_token(arch, tensor_parallel_size, dtype_bytes)
        return every_layer_moe - self.dense_layers_saved_bytes_difference(arch, tensor_parallel_size, dtype_bytes)

    def dense_layers_saved_bytes_difference(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                            dtype_bytes: int) -> int:
        """What the dense layers (``dense_mlp_layers``) save less than MoE layers would, per token:
        each an MoE layer's MLP bytes less a dense SwiGLU's (``3 f / tp``)."""
        if not arch.dense_mlp_layers:
            return 0
        moe = self.mlp_saved_bytes_per_token(arch, tensor_parallel_size, dtype_bytes)
        dense = LlamaLikeFamily.mlp_saved_bytes_per_token(self, arch, tensor_parallel_size, dtype_bytes)
        return len(arch.dense_mlp_layers) * (moe - dense)

    def mlp_saved_bytes_per_token(self, arch: "ModelArchitecture", tensor_parallel_size: int,
                                  dtype_bytes: int) -> int:
        # experts are whole on every rank (expert_tensor_parallel_size 1): no division by TP
        return self.moe_saved_bytes_per_token(arch, dtype_bytes)

    def moe_saved_bytes_per_token(self, arch: "ModelArchitecture", dtype_bytes: int) -> int:
        """Bytes per token that one MoE layer's router, token dispatcher and experts save for
        backward (megatron's ``MoELayer``; the pre-MLP norm is counted with the layer's norms: its
        output is the router's and the shared expert's input), in place of a dense MLP's ``3 f``.
        Counted from megatron-core 0.16's ``TopKRouter``, the ``allgather`` and ``alltoall``
        dispatchers and the ``SequentialMLP`` experts (a test compares it with what
        ``saved_tensors_hooks`` sees, every MoE family, fp32 and bf16). Per token, with ``E``
        experts, top ``k``, expert width ``f``:

        - the router: its top-k ids (int64, ``8k``) and fp32 scores: the softmax over the top-k
          logits (``4k``; renormalised routing, ``norm_topk_prob``) or over all experts (``4E``);
        - the dispatcher: the permutation's source rows (int64, ``8k``) and the routing map and
          weights as ``[E, tokens]`` (bool ``E``, model dtype ``E b``; fp32 ``4E`` with
          :attr:`router_logits_fp32`, as every routing weight below);
        - the experts, per routed copy of the token (``k`` of them, dropless: exactly ``k`` per
          token however they spread): the permuted hidden state (``h``, the first fc1's input),
          its routing weight (``1``) and megatron's fused weighted SwiGLU: its input, the fc1
          output (``2f``), and its output, the fc2 input (``f``; it scales the activation by the
          routing weight); unfused (``fused_glu`` False): SwiGLU as in a dense MLP (``5f``) and
          the weighted activation (``f``);
        - a shared expert of width ``S``: a dense SwiGLU (``3S`` fused); with a gate (Qwen2-MoE) its
          output (``h``, kept for the gate's product) and the sigmoid gate (``1``);
        - a sigmoid router instead (grouped routing): :meth:`sigmoid_router_saved_bytes`.

        Expert parallelism: these are the bytes of this rank's tokens; the experts' part lives on
        the ranks their experts are on (balanced routing: as many as this rank's experts receive)."""
        b, h, k, e = dtype_bytes, arch.hidden_size, arch.moe_router_topk, arch.num_experts
        if arch.moe_router_score_function == "sigmoid":
            router = self.sigmoid_router_saved_bytes(arch)
        else:
            router = 8 * k + FP32_BYTES * (k if arch.moe_norm_topk_prob else e)
        weight = FP32_BYTES if self.router_logits_fp32 else b  # a routing weight's bytes
        dispatcher = 8 * k + e + e * weight
        widths = 3 if self.fused_glu else 6  # (fused: the weighted SwiGLU's input and output)
        experts = k * ((h + widths * arch.moe_ffn_hidden_size) * b + weight)
        shared = arch.moe_shared_expert_ffn_hidden_size
        gate = (h + 1) if arch.moe_shared_expert_gate else 0
        shared_bytes = (self.glu_saved_widths() * shared + gate) * b if shared else 0
        return router + dispatcher + experts + shared_bytes

    @staticmethod
    def sigmoid_router_saved_bytes(arch: "ModelArchitecture") -> int:
        """What megatron's sigmoid router keeps per token (fp32 scores, whatever the model dtype:
        the grouped-routing families compute router logits in fp32): the top-k ids (``8k``, the
        scatter's and the gather's index), the sigmoid's output (``4E``) and, when k > 1, the
        top-k scores and their sum that renormalise them (``4k + 4``); without an expert bias
        also the group mask of group-limited routing (bool ``E``; with a bias the selection runs
        on the biased scores, whose graph is dropped)."""
        k, e = arch.moe_router_topk, arch.num_experts
        renormalise = FP32_BYTES * (k + 1) if k > 1 else 0
        group_mask = e if arch.moe_router_num_groups and not arch.moe_router_expert_bias else 0
        return 8 * k + FP32_BYTES * e + renormalise + group_mask

    # ------------------------------------------------------------------ parameters
    def mlp_parameters(self, arch: "ModelArchitecture") -> int:
        """The experts (each with its router row), and the shared expert with its gate."""
        h = arch.hidden_size
        return arch.num_experts * (3 * h * arch.moe_ffn_hidden_size + h) + self._shared_expert_parameters(arch)

    def active_mlp_parameters(self, arch: "ModelArchitecture") -> int:
        """The token's top-k experts, the whole router and the shared expert."""
        h = arch.hidden_size
        return (arch.moe_router_topk * 3 * h * arch.moe_ffn_hidden_size + arch.num_experts * h
                + self._shared_expert_parameters(arch))

    @staticmethod
    def _shared_expert_parameters(arch: "ModelArchitecture") -> int:
        """Parameters of one layer's shared expert and its gate (0 without one)."""
        if arch.moe_shared_expert_ffn_hidden_size is None:
            return 0
        h = arch.hidden_size
        return 3 * h * arch.moe_shared_expert_ffn_hidden_size + (h if arch.moe_shared_expert_gate else 0)


# ---------------------------------------------------------------------- config readers
def refuse_dense_layers(hf: Dict[str, Any], number: NumberReader, family: str) -> None:
    """Qwen-MoE configs may make some layers dense (``mlp_only_layers``, ``decoder_sparse_step``
    > 1); refused: every layer must be an MoE layer."""
    num_layers = number("num_hidden_layers")
    dense = sorted(set(hf.get("mlp_only_layers") or []))
    step = number("decoder_sparse_step", default=1)
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step}")
    dense += [i for i in range(num_layers) if (i + 1) % step and i not in dense]
    if dense:
        raise UnsupportedModelError(f"{family} with dense MLP layers {sorted(dense)[:8]} (mlp_only_layers / "
                                    "decoder_sparse_step) is not supported: every layer must be an MoE layer")


def num_experts(hf: Dict[str, Any], key: str) -> int:
    """The routed-expert count, under ``key`` or the other of ``num_experts`` /
    ``num_local_experts`` (transformers >= 5 maps one onto the other for some families)."""
    other = "num_local_experts" if key == "num_experts" else "num_experts"
    experts = hf.get(key) if hf.get(key) is not None else hf.get(other)
    if experts is None:
        raise KeyError(key)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise UnsupportedModelError(f"field {key!r} must be a positive integer, got {experts!r}")
    return experts
