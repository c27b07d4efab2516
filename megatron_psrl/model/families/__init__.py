"""Model families, one bundle each (torchtitan's ``ModelSpec`` idea), keyed by Hugging Face
``model_type``.

A bundle (:class:`ModelFamily`) holds everything family-specific: config.json parsing and
refusals, megatron's config fields and layer-spec choices, the state-dict adapter class, the
per-layer prefix state of the KV cache, the memory plan's and the cost model's arithmetic, and
its debug-size configs. Adding a family is one module here (build the bundle,
:func:`register_family` it, import the module below) plus its tests; docs/architecture.md,
"Model families".
"""

from megatron_psrl.model.families.base import (
    FP32_BYTES,
    TINY_BASE,
    LayerSpecChoices,
    LlamaLikeFamily,
    ModelFamily,
    NumberReader,
)
from megatron_psrl.model.families.moe import MoEFamily
from megatron_psrl.model.families.registry import (
    family_of,
    get_family,
    moe_model_types,
    register_family,
    registered_families,
    supported_model_types,
    unregister_family,
)

# The built-in families register on import, in the order the supported types are listed (error
# messages name them in it).
from megatron_psrl.model.families import llama, mistral, qwen2, qwen3  # noqa: E402,F401  isort: skip
from megatron_psrl.model.families import qwen3_moe, qwen2_moe, mixtral  # noqa: E402,F401  isort: skip
from megatron_psrl.model.families import qwen3_next, qwen3_5  # noqa: E402,F401  isort: skip
from megatron_psrl.model.families import gpt_oss  # noqa: E402,F401  isort: skip
from megatron_psrl.model.families import deepseek  # noqa: E402,F401  isort: skip
from megatron_psrl.model.families import glm4_moe  # noqa: E402,F401  isort: skip

__all__ = [
    "FP32_BYTES",
    "LayerSpecChoices",
    "LlamaLikeFamily",
    "MoEFamily",
    "ModelFamily",
    "NumberReader",
    "TINY_BASE",
    "family_of",
    "get_family",
    "moe_model_types",
    "register_family",
    "registered_families",
    "supported_model_types",
    "unregister_family",
]
