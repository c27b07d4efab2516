"""The on-disk layout every megatron_psrl checkpoint shares, whichever format holds its tensors.

::

    CKPT_DIR/
      latest_checkpointed_iteration.txt      "release" or the iteration number (the tracker)
      release/ | iter_0000042/
        psrl_model.json                      architecture, TP/PP layout, dtype, iteration
        psrl_cost_calibration.json           the planner's measured costs (runs that measured them)
        checksums.sha256                     SHA-256 of every other file (:mod:`checksums`)
        ...                                  the tensors: torch_dist (:mod:`dist_format`) or
                                             legacy per-rank files (:mod:`legacy_format`)

This module names those files, reads the tracker and ``psrl_model.json``
(:class:`CheckpointInfo`), tells the two formats apart (:func:`checkpoint_format`, by
megatron's ``metadata.json`` in the iteration folder) and undoes what writers that died
mid-save left behind (:func:`recover_checkpoint_dir`). It reads no tensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megatron_psrl.checkpoint.checksums import verify_folder
from megatron_psrl.dtypes import DTYPES, canonical_dtype_name
from megatron_psrl.errors import CheckpointError, ConfigurationError, PsrlError, pid_alive
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.stages import PipelineSplit
from megatron_psrl.options import CKPT_FORMATS

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_JSON = "psrl_model.json"
COST_JSON = "psrl_cost_calibration.json"
"""The start-up cost calibration the saving run planned with (written only by runs that had
one: trees placed over an exchange group); a resumed run plans with it again."""
MEGATRON_METADATA = "metadata.json"
"""megatron's file in a torch_dist iteration folder (``{"sharded_backend": "torch_dist", ...}``)."""
FORMAT_VERSION = 1


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

    expert_model_parallel_size: int = 1
    """EP size the run trained with (MoE models). Informative: a torch_dist checkpoint stores
    every expert at its global index and loads under any EP size (optimizer state included,
    :mod:`~megatron_psrl.checkpoint.expert_parallel`); the legacy format is written at EP = 1
    only."""

    hf_dtypes: Dict[str, str] = field(default_factory=dict)
    """The dtype a converted Hugging Face folder stored a tensor in, by HF name, for the tensors
    megatron keeps in fp32 whatever the model's dtype (a router's expert bias, megatron's fp32
    ``expert_bias`` buffer: the adapter's ``hf_fp32_names``) where the folder had another dtype:
    mcore-to-hf writes them back in it, so a round trip is bit exact in dtype too. Empty for
    a checkpoint saved by training: those tensors export in fp32, the dtype transformers keeps
    them in."""

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

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a torch dtype."""
        return DTYPES[self.dtype]

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
        if self.expert_model_parallel_size > 1:
            d["expert_model_parallel_size"] = self.expert_model_parallel_size
        if self.hf_dtypes:
            d["hf_dtypes"] = dict(sorted(self.hf_dtypes.items()))
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
                expert_model_parallel_size=int(d.get("expert_model_parallel_size", 1)),
                hf_dtypes={str(k): canonical_dtype_name(v) for k, v in dict(d.get("hf_dtypes") or {}).items()},
            )
        except KeyError as exc:
            raise CheckpointError(path, f"missing field {exc.args[0]!r}") from None
        except PsrlError as exc:
            raise CheckpointError(path, str(exc)) from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(path, f"malformed field: {exc}") from None


def iteration_dir_name(iteration: Optional[int]) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


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
    """``(iteration folder, its info)`` of the latest iteration; every file of the folder is
    verified against its checksums first (once per process, :mod:`checksums`): every reader
    calls this before it reads anything else."""
    it_dir = resolve_iteration_dir(ckpt_dir)
    verify_folder(it_dir)
    path = os.path.join(it_dir, MODEL_JSON)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(path, "missing (the checkpoint is incomplete)") from None
    return it_dir, CheckpointInfo.from_json(text, path)


def read_cost_record(it_dir: str) -> Optional[dict]:
    """The fields of ``psrl_cost_calibration.json`` in an iteration folder (verified with the
    folder by :func:`read_checkpoint_info`), or None when the saving run recorded none (no
    calibration, or saved before checkpoints kept it)."""
    path = os.path.join(it_dir, COST_JSON)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"cannot be read ({exc}); the file is corrupt or truncated") from None
    if not isinstance(record, dict):
        raise CheckpointError(path, "expected a JSON object")
    return record


# ---------------------------------------------------------------------- which format
def check_ckpt_format(ckpt_format: str) -> str:
    if ckpt_format not in CKPT_FORMATS:
        raise ConfigurationError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, got {ckpt_format!r}")
    return ckpt_format


def iteration_format(it_dir: str) -> str:
    """``torch_dist`` when ``it_dir`` holds megatron's ``metadata.json``, else ``legacy``."""
    path = os.path.join(it_dir, MEGATRON_METADATA)
    if not os.path.exists(path):
        return "legacy"
    try:
        with open(path, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(path, f"cannot be read ({exc}); the checkpoint is corrupt or truncated") from None
    if backend != "torch_dist":
        raise CheckpointError(path, f"sharded backend {backend!r} is not supported (only torch_dist)")
    return "torch_dist"


def checkpoint_format(ckpt_dir: str) -> str:
    """The format of the latest iteration of ``ckpt_dir``."""
    return iteration_format(resolve_iteration_dir(ckpt_dir))
