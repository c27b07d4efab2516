"""Build this rank's randomly initialised PsrlGPTModel (weights are loaded by megatron_psrl.checkpoint)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from megatron.core import parallel_state

from megatron_psrl.compat import (
    install_cpu_latent_attention_shims,
    install_cpu_sequence_parallel_shims,
    sync_tied_output_copy,
)
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import PsrlGPTModel, PsrlModelChunks, build_transformer_config


def parallel_layout() -> Tuple[int, int, int, int]:
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def expert_parallel_layout() -> Tuple[int, int]:
    """``(expert-parallel rank, expert-parallel size)`` of this rank (``(0, 1)`` without EP)."""
    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size())


def sum_expert_gradients_over_expert_data_parallel(chunk: torch.nn.Module) -> None:
    """Mark every expert parameter as megatron marks them under expert parallelism
    (``allreduce = False``: its gradient is summed over the expert-data-parallel group).

    megatron marks them so only when EP > 1; with EP = 1 it sums them over the data-parallel
    ranks as dense parameters. Under sequence parallelism with whole experts (expert TP 1 < TP)
    each tensor-parallel rank's experts see only its share of the rows, so their gradients must
    also be summed over the tensor-parallel ranks: the expert-data-parallel group holds both
    (it is also the group megatron's optimizer computes the experts' share of the gradient norm
    over, without counting the TP copies twice). For the same reason an expert's parameter is
    not summed over the tensor-parallel ranks again as a sequence-parallel one: megatron marks
    an expert's fc2 bias ``sequence_parallel`` (gpt-oss's experts have biases)."""
    from megatron_psrl.model.moe import is_expert_parameter

    for name, param in chunk.named_parameters():
        if is_expert_parameter(name):
            param.allreduce = False
            if getattr(param, "sequence_parallel", False):
                param.sequence_parallel = False


def build_model(
    arch: ModelArchitecture,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    transformer_impl: str = "local",
    pipeline_layers: Optional[Sequence[int]] = None,
    virtual_pipeline_size: int = 1,
    config_overrides: Optional[Dict[str, object]] = None,
    attention_backend: Optional[str] = None,
) -> Union[PsrlGPTModel, PsrlModelChunks]:
    """A randomly initialised model for this rank (parallel_state must be initialised);
    ``pipeline_layers``: each stage's layer count (default: an even split);
    ``virtual_pipeline_size`` V > 1: V chunks of interleaved virtual stages
    (:class:`PsrlModelChunks`); ``attention_backend``: the one it is built for (None: chosen
    at run time; ``te`` builds Transformer Engine's attention now, so its state is in every
    checkpoint from the first)."""
    tp_rank, tp, pp_rank, pp = parallel_layout()
    overrides = dict(config_overrides or {})
    if arch.is_moe:  # the expert-parallel size megatron's parallel state was opened with
        from megatron_psrl.model.moe import check_moe_settings, install_moe_runtime

        overrides.setdefault("expert_model_parallel_size", expert_parallel_layout()[1])
        check_moe_settings(arch, overrides, device, tensor_parallel_size=tp)
        install_moe_runtime(device)
    config = build_transformer_config(arch, tp, pp, params_dtype=dtype, device=device, pipeline_layers=pipeline_layers,
                                      virtual_pipeline_size=virtual_pipeline_size, **overrides)
    if config.sequence_parallel:
        install_cpu_sequence_parallel_shims(device)
    if arch.multi_latent_attention and tp > 1:
        install_cpu_latent_attention_shims(device)
    chunks = []
    for v in range(virtual_pipeline_size):
        chunk = PsrlGPTModel(
            arch, config, pre_process=pp_rank == 0 and v == 0,
            post_process=pp_rank == pp - 1 and v == virtual_pipeline_size - 1, transformer_impl=transformer_impl,
            vp_stage=v if virtual_pipeline_size > 1 else None, attention_backend=attention_backend,
        )
        # megatron's local-spec RMSNorm (torch.nn.RMSNorm) ignores params_dtype: its weight would
        # stay fp32 in a bf16 model (a dtype mismatch in every norm). Megatron-LM casts the whole
        # module (Float16Module); so do we, parameters only: the RoPE frequencies stay fp32, as in HF.
        with torch.no_grad():
            for param in chunk.parameters():
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
        sync_tied_output_copy(chunk)
        if arch.is_moe and tp > 1:
            sum_expert_gradients_over_expert_data_parallel(chunk)
        if arch.moe_router_expert_bias:  # (the trainer counts its update's tokens per sample)
            from megatron_psrl.model.moe import keep_expert_bias_counts_to_the_trainer

            keep_expert_bias_counts_to_the_trainer(chunk)
        chunks.append(chunk.to(device))
    return chunks[0] if virtual_pipeline_size == 1 else PsrlModelChunks(chunks)
