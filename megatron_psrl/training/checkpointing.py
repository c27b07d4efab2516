"""Saving and resuming training checkpoints (every rank writes its shard, atomically as a whole).

Layout and format: :mod:`megatron_psrl.checkpoint.mcore_format` (Megatron legacy per-rank
files + ``psrl_model.json``), readable by ``--load``, ``tools/compute_logprobs.py`` and
``tools/convert_hf_checkpoint.py mcore-to-hf``. Procedure: rank 0 creates a temporary
iteration directory; the first data-parallel replica of every (TP, PP) rank writes its model
shard and optimizer state; after a barrier rank 0 writes the model description, renames the
directory into place and atomically updates the tracker file. An interrupted save leaves the
previous checkpoint untouched.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megatron_psrl.checkpoint.atomic import atomic_write_text
from megatron_psrl.checkpoint.loading import canonical_state_dict
from megatron_psrl.checkpoint.mcore_format import (
    MODEL_JSON,
    TRACKER,
    CheckpointInfo,
    iteration_dir_name,
    write_rank_file,
)
from megatron_psrl.distributed.setup import ParallelLayout
from megatron_psrl.model.architecture import ModelArchitecture


def _broadcast_str(value: Optional[str]) -> str:
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def save_training_checkpoint(
    save_dir: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer,
    arch: ModelArchitecture,
    layout: ParallelLayout,
) -> str:
    """Write iteration ``iteration`` of a training run into ``save_dir``; returns its path."""
    final = os.path.join(os.path.abspath(save_dir), iteration_dir_name(iteration))
    tmp = None
    if layout.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        tmp = final + f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    tmp = _broadcast_str(tmp)
    if layout.dp_rank == 0:
        state = canonical_state_dict(model)
        write_rank_file(tmp, layout.tp_rank, layout.pp_rank, layout.pipeline_parallel_size, {
            "model": state,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "iteration": iteration,
            "checkpoint_version": 3.0,
        })
    dist.barrier()
    if layout.rank == 0:
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        info = CheckpointInfo(arch, layout.tensor_parallel_size, layout.pipeline_parallel_size, iteration, dtype,
                              has_optimizer_state=optimizer is not None)
        with open(os.path.join(tmp, MODEL_JSON), "w", encoding="utf-8") as f:
            f.write(info.to_json())
        old = None
        if os.path.exists(final):  # re-saving an iteration: swap, never leave it missing
            old = final + f".old-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        atomic_write_text(os.path.join(save_dir, TRACKER), str(iteration))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final
