"""Named debug-size model configs (Hugging Face config dicts) for CI and quick runs.

They are real architectures of each supported family at toy sizes; weights are random.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import TINY_MODEL_NAMES

_BASE: Dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
)

TINY_CONFIGS: Dict[str, Dict[str, Any]] = {
    # The default of pretrain_agent_rl.py and the benchmarks (h256 / 4 layers).
    "tiny-llama": dict(_BASE, model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
                       intermediate_size=512, num_hidden_layers=4, head_dim=64),
    "tiny-qwen2": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "tiny-qwen3": dict(_BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=48),
    "tiny-mistral": dict(_BASE, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    # Smallest useful model, for unit tests.
    "debug-llama": dict(_BASE, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256,
                        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16),
}
assert tuple(sorted(TINY_CONFIGS)) == TINY_MODEL_NAMES, "megatron_psrl.options.TINY_MODEL_NAMES lists them"


def tiny_config(name: str) -> Dict[str, Any]:
    """A copy of the named config; raises with the list of names when unknown."""
    try:
        return copy.deepcopy(TINY_CONFIGS[name])
    except KeyError:
        raise ConfigurationError(f"unknown tiny model {name!r}; choose from {', '.join(sorted(TINY_CONFIGS))}") from None
