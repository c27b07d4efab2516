"""How pipeline stages split a model's layers (one place for the rule Megatron-LM uses).

A :data:`PipelineSplit` is either the number of stages (layers split evenly) or each stage's
layer count; ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
give the first / last stage fewer layers to balance the embedding and the output layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

from megatron_psrl.errors import ConfigurationError

if TYPE_CHECKING:
    from megatron_psrl.model.architecture import ModelArchitecture

PipelineSplit = Union[int, Sequence[int]]
"""A pipeline layout: the number of stages (layers split evenly) or each stage's layer count."""


def pipeline_layer_counts(num_layers: int, pp: int, first: Optional[int] = None,
                          last: Optional[int] = None) -> Tuple[int, ...]:
    """Layers of every pipeline stage, as Megatron-LM splits them: ``first`` / ``last`` layers
    on the first / last stage when given (``--decoder-first/last-pipeline-num-layers``, to
    balance the embedding and the output layer), the rest evenly over the other stages."""
    if pp < 1:
        raise ConfigurationError(f"pipeline parallel size must be at least 1, got {pp}")
    counts: List[Optional[int]] = [None] * pp
    for flag, value, stage in (("--decoder-first-pipeline-num-layers", first, 0),
                               ("--decoder-last-pipeline-num-layers", last, pp - 1)):
        if value is None:
            continue
        if pp == 1:
            raise ConfigurationError(f"{flag} needs --pipeline-model-parallel-size > 1")
        if not 1 <= value < num_layers:
            raise ConfigurationError(f"{flag} {value}: must be between 1 and {num_layers - 1} (the model has "
                                     f"{num_layers} layers)")
        counts[stage] = value
    rest = num_layers - sum(c for c in counts if c is not None)
    free = counts.count(None)
    if free == 0:
        if rest != 0:
            raise ConfigurationError(f"the pipeline stages hold {num_layers - rest} layers, the model has {num_layers}")
        return tuple(counts)  # type: ignore[arg-type]
    if rest < free or rest % free:
        what = "" if free == pp else " left after the first/last stage's"
        raise ConfigurationError(f"the {rest} layers{what} cannot be split evenly over {free} pipeline stage(s) "
                                 f"(pipeline parallel size {pp}, {num_layers} layers)")
    return tuple(c if c is not None else rest // free for c in counts)


def stage_counts(arch: ModelArchitecture, pp: PipelineSplit) -> Tuple[int, ...]:
    """Each stage's layer count of a :data:`PipelineSplit` (validated against ``arch``)."""
    if isinstance(pp, int):
        return pipeline_layer_counts(arch.num_layers, pp)
    counts = tuple(int(c) for c in pp)
    if sum(counts) != arch.num_layers or min(counts) < 1:
        raise ConfigurationError(f"pipeline stages of {list(counts)} layers do not split the model's "
                                 f"{arch.num_layers} layers")
    return counts


def split_of_config(config) -> PipelineSplit:
    """The :data:`PipelineSplit` a megatron ``TransformerConfig`` builds."""
    pp = config.pipeline_model_parallel_size
    first = getattr(config, "num_layers_in_first_pipeline_stage", None)
    last = getattr(config, "num_layers_in_last_pipeline_stage", None)
    if first is None and last is None:
        return pp
    return pipeline_layer_counts(config.num_layers, pp, first, last)


def virtual_pipeline_size(num_layers: int, pp: int, layers_per_virtual_stage: Optional[int],
                          uneven: bool = False) -> int:
    """Model chunks per pipeline rank for ``--num-layers-per-virtual-pipeline-stage``
    (Megatron-LM's rule: ``layers / PP / layers_per_virtual_stage``); 1 without it."""
    if layers_per_virtual_stage is None:
        return 1
    flag = "--num-layers-per-virtual-pipeline-stage"
    if pp < 2:
        raise ConfigurationError(f"{flag} needs --pipeline-model-parallel-size > 1")
    if uneven:
        raise ConfigurationError(f"{flag} needs an even split of the layers (no --decoder-first/last-pipeline-num-"
                                 "layers)")
    per_stage = pipeline_layer_counts(num_layers, pp)[0]
    if layers_per_virtual_stage < 1 or per_stage % layers_per_virtual_stage:
        raise ConfigurationError(f"{flag} {layers_per_virtual_stage} must divide the {per_stage} layers of each "
                                 f"pipeline stage ({num_layers} layers / PP {pp})")
    return per_stage // layers_per_virtual_stage


def virtual_stages(pp_rank: int, pp: int, virtual_pipeline_size: int = 1) -> List[int]:
    """The (virtual) stages pipeline rank ``pp_rank`` holds, in chunk order: chunk ``v`` is
    virtual stage ``v * PP + pp_rank`` (Megatron-LM's interleaving); ``[pp_rank]`` without."""
    return [v * pp + pp_rank for v in range(virtual_pipeline_size)]
