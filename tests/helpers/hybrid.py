"""Tiny random Hugging Face checkpoints of the hybrid families (Qwen3-Next, Qwen3.5 and its
multimodal wrappers), for model and checkpoint tests."""

from __future__ import annotations

from typing import Any, Dict

import torch

WRAPPERS = ("qwen3_5", "qwen3_5_moe")
"""The multimodal wrapper model types (``...ForConditionalGeneration``)."""


def hf_model(config: Dict[str, Any], seed: int = 0):
    """A randomly initialised transformers model of ``config`` (fp32), its norms perturbed away
    from their initial values (zero-centred norms start at 0, the gated norm at 1) so that a
    test sees them, and its linear layers' decay moderate: transformers draws ``A`` from (0, 16),
    which makes ``exp(g)`` vanish and the recurrence, with the gradients of ``A_log`` and
    ``dt_bias``, nearly nothing; here ``A`` is in (0.2, 1) and ``dt_bias`` about -1."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if cfg.model_type in WRAPPERS else AutoModelForCausalLM
    model = auto.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.2, 1.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(-1.0 + 0.3 * torch.randn_like(p))
    return model


def read_safetensors(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, by name, as stored."""
    import os

    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def make_hybrid_checkpoint(config: Dict[str, Any], directory: str, seed: int = 0) -> str:
    """Save :func:`hf_model` of ``config`` (safetensors) into ``directory`` and return it."""
    hf_model(config, seed).save_pretrained(directory, safe_serialization=True)
    return directory
