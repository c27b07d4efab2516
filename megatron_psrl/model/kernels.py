"""Which kernels a run uses, in one line for the run's header.

megatron-core warns at import time when apex or Transformer Engine is missing; on a CPU host
that is expected and the warnings are silenced (``megatron_psrl.quiet_expected_import_warnings``).
This line says instead what runs: the layer spec, the prefix-sharing attention kernel, and
which optional GPU packages are installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Dict, Optional

import torch

OPTIONAL_PACKAGES = {"transformer_engine": "transformer-engine", "flash_attn": "flash-attn", "apex": "apex"}
"""Optional GPU packages: import name -> distribution name."""


def installed_version(module: str) -> Optional[str]:
    """The installed version of an optional package (without importing it), or None."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(OPTIONAL_PACKAGES.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def optional_packages() -> Dict[str, Optional[str]]:
    return {dist: installed_version(module) for module, dist in OPTIONAL_PACKAGES.items()}


_ATTENTION = {
    "torch": "blockwise tree attention (torch SDPA)",
    "dense": "dense tree mask (torch SDPA)",
    "flash": "flash-attn varlen",
    "te": "Transformer Engine DotProductAttention",
}


def describe_kernels(device: torch.device, transformer_impl: str, attention_backend: str) -> str:
    """e.g. ``kernels: megatron-core local layers | attention: blockwise tree attention (torch
    SDPA) | transformer-engine -, flash-attn -, apex - (CPU: not used)``."""
    layers = {"local": "megatron-core local layers (torch)",
              "transformer_engine": "megatron-core Transformer Engine layers"}.get(transformer_impl, transformer_impl)
    packages = ", ".join(f"{name} {version or '-'}" for name, version in optional_packages().items())
    note = " (CPU: not used)" if device.type == "cpu" else ""
    return f"kernels: {layers} | attention: {_ATTENTION.get(attention_backend, attention_backend)} | {packages}{note}"
