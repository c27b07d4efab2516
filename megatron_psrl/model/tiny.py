"""Named debug-size model configs (Hugging Face config dicts) for CI and quick runs.

They are real architectures of each supported family at toy sizes; weights are random. Each
family's bundle owns its configs (:attr:`megatron_psrl.model.families.ModelFamily.tiny_configs`);
the dicts here are views over the registry, split as the rest of the project iterates them.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.families import registered_families
from megatron_psrl.options import TINY_MODEL_NAMES

TINY_CONFIGS: Dict[str, Dict[str, Any]] = {
    name: config for family in registered_families() if not family.has_linear_attention
    for name, config in family.tiny_configs.items() if not family.hf_has_moe_layers(config)}
"""The dense families' debug configs (``tiny-llama``, the default of pretrain_agent_rl.py and the
benchmarks; ``debug-llama``, the smallest useful model, for unit tests; one or more per family)."""
assert tuple(sorted(TINY_CONFIGS)) == TINY_MODEL_NAMES, "megatron_psrl.options.TINY_MODEL_NAMES lists them"

MOE_CONFIGS: Dict[str, Dict[str, Any]] = {
    name: config for family in registered_families() if not family.has_linear_attention
    for name, config in family.tiny_configs.items() if family.hf_has_moe_layers(config)}
"""The MoE families' debug configs: --model choices like :data:`TINY_CONFIGS`
(``megatron_psrl.training.arguments.MOE_MODEL_NAMES``), kept apart from them because the dense
tests iterate :data:`TINY_CONFIGS`."""

HYBRID_CONFIGS: Dict[str, Dict[str, Any]] = {
    name: config for family in registered_families() if family.has_linear_attention
    for name, config in family.tiny_configs.items()}
"""The debug configs of the families with linear-attention layers (Qwen3-Next, Qwen3.5), dense or
MoE, kept apart from :data:`TINY_CONFIGS` and :data:`MOE_CONFIGS`: prefix sharing across
micro-batches cannot hold their layers' recurrent state yet, and the suites iterating those
run it."""

SHAPE_CONFIGS: Dict[str, Dict[str, Any]] = {
    name: config for family in registered_families() for name, config in family.shape_configs.items()}
"""Full-size architectures, randomly initialised (``qwen2.5-1.5b-shape``: the GPU benchmarks'
realistic size, benchmarks/gpu_acceptance.py). Not tiny configs: the CPU test suite iterates
:data:`TINY_CONFIGS`, and these are far too large for it."""


def tiny_config(name: str) -> Dict[str, Any]:
    """A copy of the named config (a tiny one, an MoE one of :data:`MOE_CONFIGS`, or a full-size
    shape of :data:`SHAPE_CONFIGS`, all randomly initialised; or one of a family registered
    since); raises with the list of names when unknown."""
    config = TINY_CONFIGS.get(name, MOE_CONFIGS.get(name, HYBRID_CONFIGS.get(name, SHAPE_CONFIGS.get(name))))
    if config is None:
        for family in registered_families():  # a family registered after this module was loaded
            config = family.tiny_configs.get(name, family.shape_configs.get(name))
            if config is not None:
                break
    if config is None:
        names = ", ".join(sorted(TINY_CONFIGS) + sorted(MOE_CONFIGS) + sorted(HYBRID_CONFIGS) + sorted(SHAPE_CONFIGS))
        raise ConfigurationError(f"unknown tiny model {name!r}; choose from {names}")
    return copy.deepcopy(config)
