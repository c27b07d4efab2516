"""Start-up checks of everything a run will write, before any compute.

A run that trains for hours and then cannot write its checkpoint has lost those hours. So at
start-up, on the logging rank, with the result broadcast so every rank stops alike:

- ``--save``: the folder is created and proven writable, its lock is taken (one writer per
  folder, :mod:`megatron_psrl.checkpoint.lock`), and temporaries of dead writers are removed;
- ``--log-json``: its folder is created and the file opened for appending (kept open);
- free disk space under ``--save`` is compared with the size of one checkpoint (a warning).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import IO, Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_psrl.checkpoint.atomic import check_writable_dir
from megatron_psrl.checkpoint.layout import recover_checkpoint_dir
from megatron_psrl.checkpoint.lock import SaveDirLock
from megatron_psrl.errors import CheckpointWriteError, ConfigurationError, PsrlError, error_text
from megatron_psrl.model.architecture import ModelArchitecture

logger = logging.getLogger("megatron_psrl")


@dataclass
class RunOutputs:
    """What the logging rank holds open for the run (release with :meth:`close`)."""

    save_lock: Optional[SaveDirLock] = None
    """The lock of ``--save`` (logging rank only)."""

    log_json: Optional[IO[str]] = None
    """``--log-json`` opened for appending (logging rank only)."""

    notes: List[str] = field(default_factory=list)
    """What the checks did that the log should say (a lock taken over, stale folders removed)."""

    created: List[str] = field(default_factory=list)
    """Folders and files the checks created (removed again by ``close(abandon=True)`` if empty)."""

    def close(self, abandon: bool = False) -> None:
        """Release everything; ``abandon`` (the run failed before training) also removes the
        folders and files the checks created, when still empty, so a refused run leaves nothing."""
        if self.log_json is not None:
            self.log_json.close()
            self.log_json = None
        if self.save_lock is not None:
            self.save_lock.release()
            self.save_lock = None
        if abandon:
            for path in reversed(self.created):
                try:
                    if os.path.isdir(path):
                        os.rmdir(path)  # only if empty
                    elif os.path.getsize(path) == 0:
                        os.unlink(path)
                except OSError:
                    pass
            self.created = []


def _missing_parents(path: str) -> List[str]:
    """``path`` and its ancestors that do not exist yet, outermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


def _open_log_json(path: str, created: List[str]) -> IO[str]:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        created += _missing_parents(path)
        os.makedirs(directory, exist_ok=True)
        return open(path, "a", encoding="utf-8")
    except OSError as exc:
        raise CheckpointWriteError(path, f"--log-json cannot be written: {exc.strerror or exc}") from exc


def on_logging_rank(check: Callable[[], None], is_logging_rank: bool) -> None:
    """Run ``check`` on the logging rank only; if it raises a user-facing error, every rank
    raises it (the others with the same message), so all ranks stop alike. Every rank calls
    this (one broadcast)."""
    error: Optional[BaseException] = None
    if is_logging_rank:
        try:
            check()
        except (PsrlError, OSError) as exc:
            error = exc
    message = [error_text(error) if error is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise ConfigurationError(message[0])


def prepare_outputs(save: Optional[str], log_json: Optional[str], is_logging_rank: bool) -> RunOutputs:
    """Check and open the run's outputs (see the module docstring); every rank calls it.

    Raises on every rank when the logging rank's checks fail (the same message everywhere)."""
    outputs = RunOutputs()

    def check() -> None:
        try:
            if save:
                outputs.created += _missing_parents(save)
                check_writable_dir(save, "--save")
                outputs.save_lock = SaveDirLock(save).acquire()
                holder = outputs.save_lock.took_over
                if holder is not None:
                    outputs.notes.append(f"took over the lock of {save} from a run that is gone "
                                         f"(pid {holder.get('pid')} on {holder.get('host')!r})")
                outputs.notes += recover_checkpoint_dir(save)
            if log_json:
                outputs.log_json = _open_log_json(log_json, outputs.created)
        except BaseException:
            outputs.close(abandon=True)
            raise

    on_logging_rank(check, is_logging_rank)
    return outputs


def checkpoint_bytes(arch: ModelArchitecture, dtype: torch.dtype, optimizer: str, sgd_momentum: float) -> int:
    """Bytes of one training checkpoint: the model in ``dtype`` plus the optimizer state
    (Adam's two fp32 moments, SGD's momentum, fp32 master weights when ``dtype`` is not fp32)."""
    n = arch.num_parameters()
    size = n * torch.tensor([], dtype=dtype).element_size()
    state_words = 2 if optimizer == "adam" else (1 if sgd_momentum else 0)
    if dtype != torch.float32:
        state_words += 1
    return size + 4 * n * state_words


def warn_if_disk_short(save: str, needed: int) -> Optional[str]:
    """A warning line when the disk under ``save`` has less free space than ``needed``."""
    try:
        free = shutil.disk_usage(save).free
    except OSError:
        return None
    if free >= needed:
        return None
    return (f"warning: {save} has {free / 2**30:.2f} GiB free but one checkpoint needs about "
            f"{needed / 2**30:.2f} GiB; saves will fail unless space is freed")
