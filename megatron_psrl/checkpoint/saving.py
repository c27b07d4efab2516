"""Saving and resuming training checkpoints (every rank writes its shard, atomically as a whole).

Two formats (``--ckpt-format``): ``torch_dist`` (the default, Megatron-LM's: one sharded
checkpoint written with megatron-core's ``dist_checkpointing``, loadable under any TP/PP/DP
layout with its optimizer state, :mod:`megatron_psrl.checkpoint.dist_format`) and ``legacy``
(Megatron's per-rank ``model_optim_rng.pt`` files, :mod:`megatron_psrl.checkpoint.legacy_format`).
Both carry ``psrl_model.json`` and are readable by ``--load``, ``tools/compute_logprobs.py``
and ``tools/convert_hf_checkpoint.py mcore-to-hf``. Procedure:

1. rank 0 undoes what dead writers left (``recover_checkpoint_dir``) and creates this save's
   temporary iteration directory;
2. every rank checks that every tensor it is about to write is finite (legacy: the first
   data-parallel replica of every (TP, PP) rank, which then writes its model shard and
   optimizer state);
3. every rank learns whether every other rank succeeded (one all-gather of the error, if any);
   on any failure (a full disk, a non-finite tensor) rank 0 removes the temporary directory
   and every rank raises the same error naming the file. torch_dist: only when every rank
   passed its checks do all ranks enter megatron's save (itself a collective, which reports a
   write failure to every rank), and its outcome is all-gathered the same way;
4. every rank hashes a share of the written files (SHA-256, :mod:`megatron_psrl.checkpoint.checksums`);
5. rank 0 writes the model description, the cost calibration the run planned with (when it
   had one) and ``checksums.sha256`` (every file's checksum, those two included), renames the directory into place and atomically updates the tracker file.

An interrupted save leaves the previous checkpoint untouched, and its temporary directory is
removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_psrl.checkpoint.atomic import atomic_write_text, write_file
from megatron_psrl.checkpoint.checksums import folder_files, hash_files, write_manifest
from megatron_psrl.checkpoint.dist_format import save_training_state
from megatron_psrl.checkpoint.layout import (
    COST_JSON,
    MODEL_JSON,
    TRACKER,
    CheckpointInfo,
    check_ckpt_format,
    iteration_dir_name,
    recover_checkpoint_dir,
)
from megatron_psrl.checkpoint.legacy_format import rank_dir_name, write_rank_file
from megatron_psrl.checkpoint.state_dict import canonical_state_dict
from megatron_psrl.distributed.setup import ParallelLayout
from megatron_psrl.errors import CheckpointWriteError, NonFiniteTrainingError, PsrlError, error_text
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.stages import split_of_config, virtual_stages
from megatron_psrl.options import DEFAULT_CKPT_FORMAT


def _broadcast_obj(value: Any) -> Any:
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def _tensors(obj: Any, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts / lists, with a dotted path."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i))


def check_finite(payload: Any, where: str) -> None:
    """Refuse to save a NaN or inf (a checkpoint never holds one)."""
    for name, t in _tensors(payload):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteTrainingError(f"{where}: tensor {name!r} holds NaN or inf; refusing to save it")


def save_training_checkpoint(
    save_dir: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer,
    arch: ModelArchitecture,
    layout: ParallelLayout,
    ckpt_format: str = DEFAULT_CKPT_FORMAT,
    cost_record: Optional[Dict[str, Any]] = None,
) -> str:
    """Write iteration ``iteration`` of a training run into ``save_dir`` in ``ckpt_format``
    (``torch_dist`` or ``legacy``); returns its path. ``cost_record``: the start-up cost
    calibration the run planned with (``MeasuredCosts.to_record()``), kept as
    ``psrl_cost_calibration.json`` so that a resumed run plans alike (rank 0's is written).

    Every rank must call it: every rank takes part in the same collectives whatever fails
    where, so a failure on any rank ends the save on every rank with the same error. The
    caller holds ``save_dir``'s lock."""
    check_ckpt_format(ckpt_format)
    final = os.path.join(os.path.abspath(save_dir), iteration_dir_name(iteration))
    ep = _expert_parallel_size(model)
    if ckpt_format == "legacy" and ep > 1:  # the same on every rank: refused before any collective
        raise CheckpointWriteError(final, f"the legacy format holds one data-parallel replica's tensors, so it cannot "
                                          f"hold the experts of expert-parallel size {ep} (each rank holds "
                                          f"{arch.num_experts // ep} of {arch.num_experts}): save with ckpt_format "
                                          "torch_dist (the default), which loads under any EP size")
    tmp = final + f".tmp-{os.getpid()}"
    error: Optional[str] = None
    if layout.rank == 0:
        try:
            recover_checkpoint_dir(save_dir)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except (PsrlError, OSError) as exc:
            error = error_text(exc)
    tmp, error = _broadcast_obj((tmp, error))  # 1: where to write, or rank 0's failure
    if error is not None:
        raise CheckpointWriteError(final, f"the save could not start; rank 0: {error}")
    failure: Optional[BaseException] = None
    if ckpt_format == "torch_dist":
        error, failure = _outcome(lambda: _check_dist_payload(tmp, model, optimizer))
        _raise_if_any_failed(error, failure, tmp, final, layout)  # 2a: every rank's checks
        error, failure = _outcome(lambda: save_training_state(tmp, iteration, model, optimizer, layout.device))
    elif layout.placement_rank == 0:  # one data (x context) parallel replica writes each shard
        error, failure = _outcome(lambda: _write_legacy_shards(tmp, iteration, model, optimizer, layout))
    _raise_if_any_failed(error, failure, tmp, final, layout)  # 2: every rank's outcome
    # Every file is written: each rank hashes a share of them (rank 0 lists them all).
    error, failure, sums = None, None, {}
    try:
        files = folder_files(tmp)
        sums = hash_files(tmp, files[layout.rank::layout.world_size])
    except OSError as exc:
        error, failure = error_text(exc), exc
    _raise_if_any_failed(error, failure, tmp, final, layout)  # 3: every rank's checksums
    shares = [None] * layout.world_size
    dist.all_gather_object(shares, sums)
    if layout.rank == 0:
        try:
            known = {path: digest for share in shares for path, digest in share.items()}
            _publish(tmp, final, save_dir, iteration, model, optimizer, arch, layout, known, cost_record)
        except (PsrlError, OSError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = error_text(exc)
    error = _broadcast_obj(error if layout.rank == 0 else None)  # 4: the outcome (and a barrier)
    if error is not None:
        raise CheckpointWriteError(final, f"the save failed and was removed; rank 0: {error}")
    return final


def _write_legacy_shards(tmp: str, iteration: int, model, optimizer, layout: ParallelLayout) -> None:
    """This rank's legacy files: one per (virtual) stage, chunk v of stage p being virtual
    stage v * PP + p; the rank's optimizer state goes with its first chunk."""
    chunks = model_chunks(model)
    stages = layout.pipeline_parallel_size * len(chunks)
    for v, (stage, chunk) in enumerate(zip(virtual_stages(layout.pp_rank, layout.pipeline_parallel_size,
                                                          len(chunks)), chunks)):
        payload = {
            "model": canonical_state_dict(chunk),
            "optimizer": optimizer.state_dict() if optimizer is not None and v == 0 else None,
            "iteration": iteration,
            "checkpoint_version": 3.0,
        }
        check_finite(payload, os.path.join(tmp, rank_dir_name(layout.tp_rank, stage, stages)))
        write_rank_file(tmp, layout.tp_rank, stage, stages, payload)


def _expert_parallel_size(model) -> int:
    """The EP size the model was built with (1 for a dense model)."""
    return int(getattr(model_chunks(model)[0].config, "expert_model_parallel_size", 1) or 1)


def _outcome(work) -> Tuple[Optional[str], Optional[BaseException]]:
    """Run ``work``; ``(error text, exception)`` of its failure, ``(None, None)`` on success."""
    try:
        work()
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        return (error_text(exc) if isinstance(exc, (PsrlError, OSError)) else f"{type(exc).__name__}: {exc}"), exc
    return None, None


def _raise_if_any_failed(error: Optional[str], failure: Optional[BaseException], tmp: str, final: str,
                         layout: ParallelLayout) -> None:
    """All-gather every rank's error; if any rank failed, remove the temporary directory and
    raise the same error everywhere (a bug's own exception where it happened)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if layout.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is not None and not isinstance(failure, (PsrlError, OSError)):
        raise failure  # a bug: keep its traceback
    rank, first = failed[0]
    where = "" if rank == layout.rank else f"rank {rank}: "
    raise CheckpointWriteError(final, f"the save failed and was removed; {where}{first}")


def _check_dist_payload(it_dir: str, model: torch.nn.Module, optimizer) -> None:
    """torch_dist: refuse a NaN or inf in this rank's weights or optimizer state before any
    rank starts megatron's (collective) save."""
    for v, chunk in enumerate(model_chunks(model)):
        check_finite({"model": canonical_state_dict(chunk)}, f"{it_dir} (model chunk {v} of rank {dist.get_rank()})")
    if optimizer is not None:
        check_finite({"optimizer": optimizer.state_dict()}, f"{it_dir} (optimizer state of rank {dist.get_rank()})")


def _publish(tmp: str, final: str, save_dir: str, iteration: int, model, optimizer, arch: ModelArchitecture,
             layout: ParallelLayout, known_checksums: Dict[str, str], cost_record: Optional[Dict[str, Any]]) -> None:
    """Rank 0: describe the model (and the cost calibration), list every file's checksum, move
    the iteration into place, point the tracker at it."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    split = split_of_config(model.config)
    info = CheckpointInfo(arch, layout.tensor_parallel_size, layout.pipeline_parallel_size, iteration, dtype,
                          has_optimizer_state=optimizer is not None,
                          pipeline_layers=None if isinstance(split, int) else split,
                          virtual_pipeline_size=len(model_chunks(model)),
                          expert_model_parallel_size=_expert_parallel_size(model))
    write_file(os.path.join(tmp, MODEL_JSON), lambda f: f.write(info.to_json().encode("utf-8")))
    if cost_record is not None:
        text = json.dumps(cost_record, indent=2) + "\n"
        write_file(os.path.join(tmp, COST_JSON), lambda f: f.write(text.encode("utf-8")))
    write_manifest(tmp, known_checksums)  # (hashes what is not in known: the files written here)
    old = None
    if os.path.exists(final):  # re-saving an iteration: swap, never leave it missing
        old = final + f".old-{os.getpid()}"
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        raise
    atomic_write_text(os.path.join(save_dir, TRACKER), str(iteration))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
