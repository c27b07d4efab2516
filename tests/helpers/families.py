"""Small HF configs of every supported family, for model and checkpoint tests.

Shrunk versions of ``megatron_psrl.model.tiny`` configs (2 layers, GQA 4 query heads over 2
key/value groups) with the family's distinguishing features switched on.
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_psrl.model.tiny import tiny_config

_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=301, max_position_embeddings=4096)


def family_config(name: str, **overrides: Any) -> Dict[str, Any]:
    """A small HF config dict of the named test family."""
    if name == "llama-llama3":  # llama with llama3 RoPE scaling (short original context: it matters)
        cfg = dict(tiny_config("debug-llama"), **_SMALL)
        cfg["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64)
    elif name == "qwen2-yarn":  # q/k/v bias, tied embeddings, yarn RoPE (attention scaling != 1)
        cfg = dict(tiny_config("tiny-qwen2"), **_SMALL)
        cfg["rope_scaling"] = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
        cfg["tie_word_embeddings"] = True
    elif name == "qwen3-tied":  # q/k RMSNorm, head_dim != hidden / heads, tied embeddings
        cfg = dict(tiny_config("tiny-qwen3"), **dict(_SMALL, head_dim=24))
        cfg["tie_word_embeddings"] = True
    elif name == "mistral":
        cfg = dict(tiny_config("tiny-mistral"), **_SMALL)
    elif name == "mistral-linear":  # linear RoPE scaling, theta != 10000
        cfg = dict(tiny_config("tiny-mistral"), **_SMALL)
        cfg.update(rope_theta=50000.0, rope_scaling=dict(rope_type="linear", factor=2.0))
    elif name == "gpt-oss":  # an 8-token window (first layer), sinks, biases, clamped experts, YaRN
        cfg = dict(tiny_config("debug-gpt-oss"), vocab_size=301)
    elif name == "deepseek-v3":  # latent attention, values narrower than keys, YaRN with DeepSeek's mscale
        cfg = tiny_config("debug-deepseek-v3")
    elif name == "deepseek-v3-q-proj":  # no query latent (q_proj), plain RoPE, tied embeddings, odd vocabulary
        cfg = dict(tiny_config("debug-deepseek-v3"), q_lora_rank=None, v_head_dim=20, vocab_size=301,
                   tie_word_embeddings=True)
        del cfg["rope_scaling"]
    elif name == "deepseek-v3-moe":  # latent attention, a dense first layer, then grouped routing (2 of 8 experts)
        cfg = tiny_config("debug-deepseek-v3-moe")
    elif name == "glm4-moe-qk-norm":  # GLM-4.5 with use_qk_norm: a dense first layer, then grouped routing
        cfg = dict(tiny_config("debug-glm4-moe"), **dict(_SMALL, vocab_size=256), use_qk_norm=True)
    else:
        raise ValueError(name)
    cfg.update(overrides)
    if name == "gpt-oss" and "layer_types" not in overrides:  # sliding and full layers alternate
        cfg["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(cfg["num_hidden_layers"])]
    return cfg


FAMILIES = ("llama-llama3", "qwen2-yarn", "qwen3-tied", "mistral", "mistral-linear", "gpt-oss", "glm4-moe-qk-norm")
LATENT_FAMILIES = ("deepseek-v3", "deepseek-v3-q-proj", "deepseek-v3-moe")
"""DeepSeek-V3's latent attention (MLA), with and without the query's latent; with its MoE layers."""


def make_family_checkpoint(config: Dict[str, Any], directory: str, seed: int = 0, dtype=None,
                           max_shard_size=None, qk_gain: float = 2.0) -> str:
    """A random HF checkpoint whose attention is sharp enough for tests to see RoPE and masks.

    With transformers' random init (std 0.02) log-probs are nearly uniform and attention nearly
    flat, so a wrong position or mask moves log-probs by little. Here the weights use std
    ``initializer_range`` (0.1 unless the config sets another value than 0.02), the q/k
    projections (or Qwen3's q/k norms) are scaled so that q.k grows by ``qk_gain``, and norms
    and biases are perturbed away from 1 and 0.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    config.setdefault("initializer_range", 0.1)
    if config.get("initializer_range") == 0.02:
        config["initializer_range"] = 0.1
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    qk_norm = cfg.model_type == "qwen3" or bool(getattr(cfg, "use_qk_norm", False))
    # latent attention: the query's projection, the keys' up-projection (and values) and the RoPE key
    queries_and_keys = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_b_proj.weight",
                        "kv_a_proj_with_mqa.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias") or name.endswith("_bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a visible share
                p.copy_(torch.randn_like(p))
            if cfg.model_type == "gpt_oss" and name.endswith("mlp.experts.gate_up_proj"):
                p.mul_(4.0)  # some gates and ups past the clamp
            if qk_norm and (name.endswith("q_norm.weight") or name.endswith("k_norm.weight")):
                p.mul_(qk_gain ** 0.5)
            elif not qk_norm and name.endswith(queries_and_keys):
                p.mul_(qk_gain ** 0.5)
        for name, b in model.named_buffers():  # a router's expert bias (GLM-4.5, DeepSeek-V3): selection only
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


PARALLEL_CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama": dict(tiny_config("debug-llama"), vocab_size=251, tie_word_embeddings=True),
    "qwen3": dict(tiny_config("debug-llama"), model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=251,
                  tie_word_embeddings=True),
    "gpt_oss": dict(tiny_config("debug-gpt-oss"), vocab_size=251),
    "deepseek": dict(tiny_config("debug-deepseek-v3"), vocab_size=251, tie_word_embeddings=True),
}
"""The multi-rank tests' models: an odd vocabulary (TP pads it), GQA (4 heads over 2 groups),
tied embeddings; Qwen3 adds per-head q/k norms, whose gradients are TP-partial until the
optimizer sums them; gpt-oss (untied) adds windows, sinks split by heads, biases and experts;
DeepSeek-V3's latent attention (4 heads, keys of 24 and values of 12 per head, the latents and
the RoPE key whole on every tensor-parallel rank)."""
