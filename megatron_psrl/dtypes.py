"""Parameter dtypes by name, in one table: ``ActorConfig.dtype``, ``--bf16`` / ``--fp16``, the
``dtype`` of a checkpoint's ``psrl_model.json``, a verl engine's ``dtype``."""

from __future__ import annotations

import torch

from megatron_psrl.errors import ConfigurationError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Canonical names (what configs and checkpoints store) -> torch dtypes."""

ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short names accepted on input, -> canonical names."""


def canonical_dtype_name(name: str) -> str:
    """``name`` or its alias as the canonical name; a one-line error for anything else."""
    name = ALIASES.get(str(name), str(name))
    if name not in DTYPES:
        raise ConfigurationError(f"unknown dtype {name!r}; choose from {sorted(DTYPES) + sorted(ALIASES)}")
    return name


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical or short name."""
    return DTYPES[canonical_dtype_name(name)]
