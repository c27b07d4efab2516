"""The ``legacy`` checkpoint format (``--ckpt-format legacy``): Megatron-LM's per-rank files
in the shared layout of :mod:`layout` (tracker file, iteration folders, ``psrl_model.json``);
the default format is torch_dist, :mod:`dist_format`.

::

    CKPT_DIR/
      latest_checkpointed_iteration.txt      "release" or the iteration number
      release/ | iter_0000042/
        psrl_model.json                      architecture, TP/PP layout, dtype, iteration
        mp_rank_00/model_optim_rng.pt        (PP = 1)   or  mp_rank_00_000/... (PP > 1)
        mp_rank_01/model_optim_rng.pt

Every ``model_optim_rng.pt`` holds ``{"model": state_dict, "iteration", "checkpoint_version",
and optionally "optimizer", "rng_state"}`` with megatron-core parameter names (local layer
spec), as Megatron-LM writes them. An iteration directory is written atomically (temporary
directory, renamed when every rank has written), then the tracker file is replaced atomically.
A checkpoint saved with one TP/PP layout can be loaded with any other (shards are merged and
re-split).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_psrl.checkpoint.atomic import atomic_directory, atomic_write_text, write_file
from megatron_psrl.checkpoint.checksums import write_manifest
from megatron_psrl.checkpoint.dist_checks import refusal
from megatron_psrl.checkpoint.layout import (
    MODEL_JSON,
    TRACKER,
    CheckpointInfo,
    iteration_dir_name,
    read_checkpoint_info,
)
from megatron_psrl.checkpoint.sharding import (
    PipelineSplit,
    expected_shard_shapes,
    merge_state_dicts,
    shard_state_dict,
    stage_counts,
)
from megatron_psrl.errors import CheckpointError

Tensor = torch.Tensor
RANK_FILE = "model_optim_rng.pt"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _load_rank_file(path: str, expected: Optional[Dict[str, tuple]] = None) -> Dict[str, Any]:
    """One rank file; a missing, empty, truncated or foreign file raises an error naming it, and
    so does a model tensor that is missing, unexpected or of another shape than ``expected``."""
    if not os.path.exists(path):
        raise CheckpointError(path, "missing (the checkpoint is incomplete)")
    if os.path.getsize(path) == 0:
        raise CheckpointError(path, "empty file (0 bytes): the checkpoint is truncated")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
            raise CheckpointError(path, refusal(exc)) from None  # an object that is not a tensor or container
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(path, f"cannot be read: the file is truncated or corrupt ({reason})") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("model"), dict):
        raise CheckpointError(path, "not a megatron_psrl rank file (no 'model' state dict)")
    if expected is not None:
        model = blob["model"]
        missing = [n for n in expected if n not in model]
        unexpected = [n for n in model if n not in expected and not n.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(path, f"does not match psrl_model.json: missing tensors {missing[:5]}, "
                                        f"unexpected tensors {unexpected[:5]}")
        for name, shape in expected.items():
            if tuple(model[name].shape) != shape:
                raise CheckpointError(path, f"shape {tuple(model[name].shape)} does not match {shape} implied by "
                                            "psrl_model.json", tensor=name)
    return blob


def load_full_state_dict(it_dir: str, info: CheckpointInfo, progress=None) -> Dict[str, Tensor]:
    """Merge all rank files of the legacy iteration folder ``it_dir`` (described by ``info``)
    into one full (unpadded) state dict. (Either format, from a checkpoint folder:
    :func:`~megatron_psrl.checkpoint.loading.load_full_state_dict`.)"""
    tp, pp, split = info.tensor_parallel_size, info.num_stage_files, info.pipeline_split
    expected = expected_shard_shapes(info.architecture, tp, split)
    shards = {}
    for p in range(pp):
        for r in range(tp):
            path = os.path.join(it_dir, rank_dir_name(r, p, pp), RANK_FILE)
            shards[(r, p)] = _load_rank_file(path, expected[(r, p)])["model"]
            if progress is not None:
                progress(path)
    return merge_state_dicts(shards, info.architecture, tp, split)


def load_rank_state(
    ckpt_dir: str, tp_rank: int, tp: int, pp_rank: int, pp: PipelineSplit, virtual_pipeline_size: int = 1
) -> Tuple[CheckpointInfo, Dict[str, Tensor], Optional[Dict[str, Any]]]:
    """The model shard of (virtual) stage ``pp_rank`` (re-sharded if the layout differs) and,
    when the layout matches (``virtual_pipeline_size`` included), its saved optimizer state."""
    it_dir, info = read_checkpoint_info(ckpt_dir)
    arch = info.architecture
    if info.tensor_parallel_size == tp and stage_counts(arch, info.pipeline_split) == stage_counts(arch, pp):
        stages = info.num_stage_files
        blob = _load_rank_file(os.path.join(it_dir, rank_dir_name(tp_rank, pp_rank, stages), RANK_FILE),
                               expected_shard_shapes(arch, tp, pp)[(tp_rank, pp_rank)])
        same = info.virtual_pipeline_size == virtual_pipeline_size
        return info, blob["model"], blob.get("optimizer") if same else None
    full = load_full_state_dict(it_dir, info)
    return info, shard_state_dict(full, arch, tp, pp)[(tp_rank, pp_rank)], None


def check_optimizer_expert_parallel(it_dir: str, info: CheckpointInfo, expert_model_parallel_size: int) -> None:
    """Refuse (one line) loading a legacy checkpoint's optimizer state under another
    expert-parallel size than it was saved with: its rank files hold the optimizer of that size
    (with EP > 1 megatron chains a dense and an expert optimizer, over other parameters), and
    the legacy format does not reshard it (torch_dist does)."""
    saved = info.expert_model_parallel_size
    if info.has_optimizer_state and saved != expert_model_parallel_size:
        raise CheckpointError(it_dir, f"(legacy format) holds optimizer state saved with expert-parallel size {saved}, "
                                      f"which cannot be loaded with --expert-model-parallel-size "
                                      f"{expert_model_parallel_size}: pass --no-load-optim to resume with a fresh "
                                      "optimizer from its weights, or save with --ckpt-format torch_dist (its optimizer "
                                      "state loads under any expert-parallel size)")


def load_stage_states(
    ckpt_dir: str, tp_rank: int, tp: int, stages: Sequence[int], pp: PipelineSplit, virtual_pipeline_size: int = 1
) -> Tuple[CheckpointInfo, List[Dict[str, Tensor]], Optional[Dict[str, Any]]]:
    """:func:`load_rank_state` for each of a rank's (virtual) ``stages``: the checkpoint's info,
    one shard per stage, and the rank's optimizer state (saved with its first chunk)."""
    shards, optimizer_state, info = [], None, None
    for stage in stages:
        info, shard, state = load_rank_state(ckpt_dir, tp_rank, tp, stage, pp, virtual_pipeline_size)
        shards.append(shard)
        optimizer_state = optimizer_state if optimizer_state is not None else state
    return info, shards, optimizer_state


def write_rank_file(it_dir: str, tp_rank: int, pp_rank: int, pp: int, payload: Dict[str, Any]) -> None:
    d = os.path.join(it_dir, rank_dir_name(tp_rank, pp_rank, pp))
    os.makedirs(d, exist_ok=True)
    write_file(os.path.join(d, RANK_FILE), lambda f: torch.save(payload, f))


def save_sharded_checkpoint(
    out_dir: str,
    info: CheckpointInfo,
    shards: Dict[tuple, Dict[str, Tensor]],
    overwrite: bool = False,
    release: bool = True,
    progress=None,
    passthrough=None,
) -> None:
    """Write a whole checkpoint from one process (the converter), atomically, with the Hugging
    Face tensors carried through (``passthrough``, :mod:`~megatron_psrl.checkpoint.passthrough`)."""
    from megatron_psrl.checkpoint.passthrough import write_passthrough

    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        it_dir = os.path.join(tmp, iteration_dir_name(None if release else info.iteration))
        os.makedirs(it_dir)
        for (r, p), sd in sorted(shards.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            write_rank_file(it_dir, r, p, info.pipeline_parallel_size, {
                "model": sd, "iteration": info.iteration, "checkpoint_version": 3.0,
            })
            if progress is not None:
                progress(rank_dir_name(r, p, info.pipeline_parallel_size))
        write_passthrough(it_dir, passthrough or {})
        write_file(os.path.join(it_dir, MODEL_JSON), lambda f: f.write(info.to_json().encode("utf-8")))
        write_manifest(it_dir)
        atomic_write_text(os.path.join(tmp, TRACKER), "release" if release else str(info.iteration))
