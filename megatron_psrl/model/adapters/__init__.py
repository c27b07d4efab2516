"""One Hugging Face state-dict adapter per model family (torchtitan style).

Which adapter a ``model_type`` uses is its family bundle's business
(:attr:`megatron_psrl.model.families.ModelFamily.adapter`); :func:`get_adapter` asks the registry.
"""

from megatron_psrl.model.adapters.base import LlamaStyleAdapter
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin, unfuse_experts
from megatron_psrl.model.adapters.glm4_moe import Glm4MoeAdapter
from megatron_psrl.model.adapters.gpt_oss import GptOssAdapter
from megatron_psrl.model.adapters.grouped_routing import GroupedRoutingAdapterMixin
from megatron_psrl.model.adapters.mixtral import MixtralAdapter
from megatron_psrl.model.adapters.qwen import Qwen2Adapter, Qwen3Adapter
from megatron_psrl.model.adapters.qwen2_moe import Qwen2MoeAdapter
from megatron_psrl.model.adapters.qwen3_moe import Qwen3MoeAdapter
from megatron_psrl.model.architecture import ModelArchitecture, UnsupportedModelError


def get_adapter(arch: ModelArchitecture) -> LlamaStyleAdapter:
    """The adapter of ``arch.model_type`` (its family's, :mod:`megatron_psrl.model.families`)."""
    # imported here: the families refer to the adapter classes of this package
    from megatron_psrl.model.families import registry

    if arch.model_type not in registry.supported_model_types():
        raise UnsupportedModelError(f"no state-dict adapter for model type {arch.model_type!r}")
    return registry.get_family(arch.model_type).adapter(arch)


__all__ = ["Glm4MoeAdapter", "GptOssAdapter", "GroupedRoutingAdapterMixin", "LlamaStyleAdapter", "MixtralAdapter",
           "Qwen2Adapter", "Qwen2MoeAdapter", "Qwen3Adapter", "Qwen3MoeAdapter",
           "RoutedExpertsMixin", "get_adapter", "unfuse_experts"]
