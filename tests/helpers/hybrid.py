"""Tiny random Hugging Face checkpoints of the hybrid families (Qwen3-Next, Qwen3.5 and its
multimodal wrappers), for model and checkpoint tests."""

from __future__ import annotations

from typing import Any, Dict

import torch

WRAPPERS = ("qwen3_5", "qwen3_5_moe")
"""The multimodal wrapper model types (``...ForConditionalGeneration``)."""


def hf_model(config: Dict[str, Any], seed: int = 0):
    """A randomly initialised transformers model of ``config`` (fp32), its norms and
    linear-attention scalars perturbed away from their initial values (zero-centred norms
    start at 0, the gated norm at 1) so that a test sees them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if cfg.model_type in WRAPPERS else AutoModelForCausalLM
    model = auto.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")) or ".bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_hybrid_checkpoint(config: Dict[str, Any], directory: str, seed: int = 0) -> str:
    """Save :func:`hf_model` of ``config`` (safetensors) into ``directory`` and return it."""
    hf_model(config, seed).save_pretrained(directory, safe_serialization=True)
    return directory
