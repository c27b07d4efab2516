"""Checkpoint I/O: HF safetensors folders, megatron-core torch_dist and legacy per-rank checkpoints, conversion.

Modules, each depending only on those below it: :mod:`.convert` (HF <-> checkpoint) ->
:mod:`.loading` (models and whole state dicts from any source) -> :mod:`.dist_format` (torch_dist;
its optimizer state across expert-parallel sizes: :mod:`.expert_parallel`) /
:mod:`.legacy_format` (per-rank files) -> :mod:`.layout` (tracker, iteration folders,
``psrl_model.json``, which format) and :mod:`.state_dict` (checkpoint names of parameters).
"""

from megatron_psrl.checkpoint.atomic import OutputExistsError, atomic_directory
from megatron_psrl.checkpoint.loading import ModelSource, load_model
from megatron_psrl.checkpoint.state_dict import canonical_name, canonical_state_dict, load_state_into

__all__ = [
    "ModelSource",
    "OutputExistsError",
    "atomic_directory",
    "canonical_name",
    "canonical_state_dict",
    "load_model",
    "load_state_into",
]
