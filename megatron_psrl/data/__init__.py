"""Trajectory samples: the columnar batch, loading/writing/validation, synthetic workloads."""

from megatron_psrl.data.loader import load_samples, samples_from_dicts, write_samples
from megatron_psrl.data.samples import SampleBatch, SampleId
from megatron_psrl.data.synthetic import (
    WORKLOADS,
    make_grpo,
    make_mixed,
    make_stepwise,
    make_tree_rollouts,
    make_workload,
)
from megatron_psrl.data.validation import (
    KNOWN_FIELDS,
    SampleValidationError,
    UnknownFieldWarning,
)

__all__ = [
    "KNOWN_FIELDS",
    "SampleBatch",
    "SampleId",
    "SampleValidationError",
    "UnknownFieldWarning",
    "WORKLOADS",
    "load_samples",
    "make_grpo",
    "make_mixed",
    "make_stepwise",
    "make_tree_rollouts",
    "make_workload",
    "samples_from_dicts",
    "write_samples",
]
