"""One Hugging Face state-dict adapter per model family (torchtitan style)."""

from megatron_psrl.model.adapters.base import LlamaStyleAdapter
from megatron_psrl.model.adapters.experts import RoutedExpertsMixin, unfuse_experts
from megatron_psrl.model.adapters.mixtral import MixtralAdapter
from megatron_psrl.model.adapters.qwen import Qwen2Adapter, Qwen3Adapter
from megatron_psrl.model.adapters.qwen2_moe import Qwen2MoeAdapter
from megatron_psrl.model.adapters.qwen3_moe import Qwen3MoeAdapter
from megatron_psrl.model.architecture import ModelArchitecture, UnsupportedModelError

_ADAPTERS = {t: cls for cls in (LlamaStyleAdapter, Qwen2Adapter, Qwen3Adapter, Qwen3MoeAdapter, Qwen2MoeAdapter,
                                MixtralAdapter) for t in cls.model_types}


def get_adapter(arch: ModelArchitecture) -> LlamaStyleAdapter:
    """The adapter of ``arch.model_type``."""
    try:
        return _ADAPTERS[arch.model_type](arch)
    except KeyError:
        raise UnsupportedModelError(f"no state-dict adapter for model type {arch.model_type!r}") from None


__all__ = ["LlamaStyleAdapter", "MixtralAdapter", "Qwen2Adapter", "Qwen2MoeAdapter", "Qwen3Adapter", "Qwen3MoeAdapter",
           "RoutedExpertsMixin", "get_adapter", "unfuse_experts"]
