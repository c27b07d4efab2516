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

MOE_CONFIGS: Dict[str, Dict[str, Any]] = {
    # Qwen3-MoE at debug size: 2 layers of 8 experts, top-2, renormalised routing weights
    # (norm_topk_prob, as the published Qwen3-MoE models). --model choices like TINY_CONFIGS
    # (megatron_psrl.training.arguments.MOE_MODEL_NAMES), kept apart from them because the
    # dense tests iterate TINY_CONFIGS.
    "debug-qwen3-moe": dict(_BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256,
                            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, router_aux_loss_coef=0.0),
    # Qwen2-MoE at debug size: q/k/v bias, 8 routed experts top-2 without renormalisation
    # (norm_topk_prob false, as the published Qwen1.5-MoE / Qwen2-57B-A14B), a shared expert of
    # width 48 gated by sigmoid(mlp.shared_expert_gate(x)).
    "debug-qwen2-moe": dict(_BASE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=256,
                            hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
                            use_sliding_window=False, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            router_aux_loss_coef=0.0),
    # Mixtral at debug size: Mistral attention, 8 experts of width intermediate_size, top-2 of
    # the softmax renormalised, no sliding window (as Mixtral-8x7B).
    "debug-mixtral": dict(_BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=256,
                          hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                          sliding_window=None, router_jitter_noise=0.0, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, router_aux_loss_coef=0.0),
}

SHAPE_CONFIGS: Dict[str, Dict[str, Any]] = {
    # Qwen2.5-1.5B's architecture (its published config.json), randomly initialised: the GPU
    # benchmarks' realistic size (benchmarks/gpu_acceptance.py). Not a tiny config: the CPU
    # test suite iterates TINY_CONFIGS, and this one is far too large for it.
    "qwen2.5-1.5b-shape": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
                               hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                               rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16"),
}


def tiny_config(name: str) -> Dict[str, Any]:
    """A copy of the named config (a tiny one, an MoE one of :data:`MOE_CONFIGS`, or a full-size
    shape of :data:`SHAPE_CONFIGS`, all randomly initialised); raises with the list of names when unknown."""
    config = TINY_CONFIGS.get(name, MOE_CONFIGS.get(name, SHAPE_CONFIGS.get(name)))
    if config is None:
        names = ", ".join(sorted(TINY_CONFIGS) + sorted(MOE_CONFIGS) + sorted(SHAPE_CONFIGS))
        raise ConfigurationError(f"unknown tiny model {name!r}; choose from {names}")
    return copy.deepcopy(config)
