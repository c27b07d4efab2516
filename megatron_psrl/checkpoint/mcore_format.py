"""megatron_psrl checkpoints: Megatron-LM's legacy per-rank layout plus a model description
(``--ckpt-format legacy``; the default torch_dist format is :mod:`dist_format`, which shares the
tracker file, ``psrl_model.json`` and the folder recovery below).

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

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_psrl.checkpoint.atomic import atomic_directory, atomic_write_text, write_file
from megatron_psrl.checkpoint.sharding import (
    PipelineSplit,
    expected_shard_shapes,
    merge_state_dicts,
    shard_state_dict,
    stage_counts,
)
from megatron_psrl.errors import CheckpointError, PsrlError, pid_alive
from megatron_psrl.model.architecture import ModelArchitecture

Tensor = torch.Tensor
TRACKER = "latest_checkpointed_iteration.txt"
MODEL_JSON = "psrl_model.json"
RANK_FILE = "model_optim_rng.pt"
FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CheckpointInfo:
    """What ``psrl_model.json`` records about one saved iteration."""

    architecture: ModelArchitecture
    """The model."""

    tensor_parallel_size: int
    """TP size the shards were written with."""

    pipeline_parallel_size: int
    """PP size the shards were written with."""

    iteration: int
    """Training iteration (0 for converted checkpoints)."""

    dtype: str
    """Parameter dtype of the stored tensors."""

    has_optimizer_state: bool = False
    """The rank files carry optimizer and scheduler state (training checkpoints)."""

    pipeline_layers: Optional[Tuple[int, ...]] = None
    """Layers of each pipeline stage when they are not split evenly
    (``--decoder-first/last-pipeline-num-layers``); None for an even split."""

    virtual_pipeline_size: int = 1
    """Virtual stages per pipeline rank the run trained with. Its files are those of a
    PP x V checkpoint (one per virtual stage, the same layers), with the rank's optimizer
    state in the file of its first chunk."""

    @property
    def pipeline_split(self) -> PipelineSplit:
        """The (virtual) stages' layout as the sharding functions take it."""
        if self.pipeline_layers:
            return tuple(self.pipeline_layers)
        return self.pipeline_parallel_size * self.virtual_pipeline_size

    @property
    def num_stage_files(self) -> int:
        """Rank files per tensor-parallel rank: one per (virtual) stage."""
        return self.pipeline_parallel_size * self.virtual_pipeline_size

    def to_json(self) -> str:
        d = {
            "format_version": FORMAT_VERSION,
            "architecture": self.architecture.to_dict(),
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "iteration": self.iteration,
            "dtype": self.dtype,
            "has_optimizer_state": self.has_optimizer_state,
        }
        if self.pipeline_layers:
            d["pipeline_layers"] = list(self.pipeline_layers)
        if self.virtual_pipeline_size > 1:
            d["virtual_pipeline_size"] = self.virtual_pipeline_size
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str, path: str) -> "CheckpointInfo":
        """Parse ``psrl_model.json``; any defect raises :class:`CheckpointError` naming ``path``."""
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(path, f"not valid JSON ({exc}); the file is corrupt or truncated") from None
        if not isinstance(d, dict):
            raise CheckpointError(path, "expected a JSON object")
        if d.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(path, f"unsupported checkpoint format version {d.get('format_version')!r}")
        try:
            return cls(
                architecture=ModelArchitecture.from_dict(d["architecture"]),
                tensor_parallel_size=int(d["tensor_parallel_size"]),
                pipeline_parallel_size=int(d["pipeline_parallel_size"]),
                iteration=int(d["iteration"]),
                dtype=str(d["dtype"]),
                has_optimizer_state=bool(d.get("has_optimizer_state", False)),
                pipeline_layers=tuple(int(c) for c in d["pipeline_layers"]) if d.get("pipeline_layers") else None,
                virtual_pipeline_size=int(d.get("virtual_pipeline_size", 1)),
            )
        except KeyError as exc:
            raise CheckpointError(path, f"missing field {exc.args[0]!r}") from None
        except PsrlError as exc:
            raise CheckpointError(path, str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(path, f"malformed field: {exc}") from None


def iteration_dir_name(iteration: Optional[int]) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def has_checkpoint(ckpt_dir: str) -> bool:
    """``ckpt_dir`` holds a saved iteration (its tracker file exists)."""
    return os.path.exists(os.path.join(ckpt_dir, TRACKER))


_SAVE_TEMPORARY = re.compile(r"^(iter_\d{7})\.(tmp|old)-(\d+)$")
_TRACKER_TEMPORARY = re.compile(r"^\.tmp-(\d+)-")


def recover_checkpoint_dir(save_dir: str) -> List[str]:
    """Undo what writers that died mid-save left in a training checkpoint folder.

    Call only while holding the folder's lock (:mod:`megatron_psrl.checkpoint.lock`), so no
    other trainer writes there. If the tracker names an iteration whose folder is missing but
    a re-save had moved it aside (``iter_N.old-<pid>``), it is put back. Every other
    ``iter_N.tmp-<pid>`` / ``iter_N.old-<pid>`` of another process is removed, and so are
    tracker temporaries (``.tmp-<pid>-*``) whose process is gone (other tools may write their
    own temporaries here). Returns what it did, for the log."""
    done: List[str] = []
    try:
        names = sorted(os.listdir(save_dir))
    except OSError:
        return done
    tracked = None
    try:
        with open(os.path.join(save_dir, TRACKER), encoding="utf-8") as f:
            value = f.read().strip()
        tracked = iteration_dir_name(int(value)) if value.isdigit() else None
    except OSError:
        pass
    if tracked and not os.path.isdir(os.path.join(save_dir, tracked)):
        moved = [n for n in names if (m := _SAVE_TEMPORARY.match(n)) and m.group(1) == tracked and m.group(2) == "old"]
        if moved:
            os.rename(os.path.join(save_dir, moved[-1]), os.path.join(save_dir, tracked))
            done.append(f"restored {tracked} from {moved[-1]} (a re-save was interrupted)")
            names.remove(moved[-1])
    for name in names:
        path = os.path.join(save_dir, name)
        m = _SAVE_TEMPORARY.match(name)
        if m and int(m.group(3)) != os.getpid() and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {name} (an unfinished save of a run that is gone)")
            continue
        m = _TRACKER_TEMPORARY.match(name)
        if m and not pid_alive(int(m.group(1))) and os.path.isfile(path):
            os.unlink(path)
            done.append(f"removed {name}")
    return done


def resolve_iteration_dir(ckpt_dir: str) -> str:
    """The directory of the latest saved iteration of ``ckpt_dir``."""
    tracker = os.path.join(ckpt_dir, TRACKER)
    if not os.path.exists(tracker):
        raise FileNotFoundError(f"{ckpt_dir}: not a megatron_psrl checkpoint (no {TRACKER})")
    with open(tracker, encoding="utf-8", errors="replace") as f:
        value = f.read().strip()
    if value != "release" and not value.isdigit():
        raise CheckpointError(tracker, f"expected an iteration number or 'release', found {value[:40]!r}")
    name = "release" if value == "release" else iteration_dir_name(int(value))
    path = os.path.join(ckpt_dir, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{tracker} names {value!r} but {path} does not exist")
    return path


def read_checkpoint_info(ckpt_dir: str) -> Tuple[str, CheckpointInfo]:
    it_dir = resolve_iteration_dir(ckpt_dir)
    path = os.path.join(it_dir, MODEL_JSON)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(path, "missing (the checkpoint is incomplete)") from None
    return it_dir, CheckpointInfo.from_json(text, path)


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


def load_full_state_dict(ckpt_dir: str, progress=None) -> Tuple[CheckpointInfo, Dict[str, Tensor]]:
    """Merge all shards of the latest iteration into one full (unpadded) state dict (either
    format: a torch_dist checkpoint is read in this one process, see
    :func:`~megatron_psrl.checkpoint.dist_format.load_full_state_dict`)."""
    from megatron_psrl.checkpoint import dist_format

    it_dir, info = read_checkpoint_info(ckpt_dir)
    if dist_format.iteration_format(it_dir) == "torch_dist":
        return info, dist_format.load_full_state_dict(it_dir, info.architecture, _DTYPES[info.dtype])
    tp, pp, split = info.tensor_parallel_size, info.num_stage_files, info.pipeline_split
    expected = expected_shard_shapes(info.architecture, tp, split)
    shards = {}
    for p in range(pp):
        for r in range(tp):
            path = os.path.join(it_dir, rank_dir_name(r, p, pp), RANK_FILE)
            shards[(r, p)] = _load_rank_file(path, expected[(r, p)])["model"]
            if progress is not None:
                progress(path)
    return info, merge_state_dicts(shards, info.architecture, tp, split)


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
    _, full = load_full_state_dict(ckpt_dir)
    return info, shard_state_dict(full, arch, tp, pp)[(tp_rank, pp_rank)], None


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
) -> None:
    """Write a whole checkpoint from one process (the converter), atomically."""
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        it_dir = os.path.join(tmp, iteration_dir_name(None if release else info.iteration))
        os.makedirs(it_dir)
        for (r, p), sd in sorted(shards.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            write_rank_file(it_dir, r, p, info.pipeline_parallel_size, {
                "model": sd, "iteration": info.iteration, "checkpoint_version": 3.0,
            })
            if progress is not None:
                progress(rank_dir_name(r, p, info.pipeline_parallel_size))
        write_file(os.path.join(it_dir, MODEL_JSON), lambda f: f.write(info.to_json().encode("utf-8")))
        atomic_write_text(os.path.join(tmp, TRACKER), "release" if release else str(info.iteration))
