"""Megatron-core GPT models (Llama / Mistral / Qwen2 / Qwen3) with prefix-sharing attention."""

from megatron_psrl.dtypes import parse_dtype
from megatron_psrl.model.architecture import ModelArchitecture, RopeConfig, UnsupportedModelError
from megatron_psrl.model.builder import build_model
from megatron_psrl.model.gpt import PsrlGPTModel, build_transformer_config
from megatron_psrl.model.logits import vocab_parallel_logprobs
from megatron_psrl.model.tiny import TINY_CONFIGS, tiny_config

__all__ = [
    "ModelArchitecture",
    "PsrlGPTModel",
    "RopeConfig",
    "TINY_CONFIGS",
    "UnsupportedModelError",
    "build_model",
    "build_transformer_config",
    "parse_dtype",
    "tiny_config",
    "vocab_parallel_logprobs",
]
