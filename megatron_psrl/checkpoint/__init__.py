"""Checkpoint I/O: HF safetensors folders, megatron-core torch_dist and legacy per-rank checkpoints, conversion."""

from megatron_psrl.checkpoint.atomic import OutputExistsError, atomic_directory
from megatron_psrl.checkpoint.loading import (
    ModelSource,
    canonical_name,
    canonical_state_dict,
    load_model,
    load_state_into,
)

__all__ = [
    "ModelSource",
    "OutputExistsError",
    "atomic_directory",
    "canonical_name",
    "canonical_state_dict",
    "load_model",
    "load_state_into",
]
