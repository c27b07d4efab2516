"""Atomic writes: a checkpoint or converted model is either complete or absent.

Everything is written into a temporary sibling directory (same filesystem) and renamed into
place at the end, so an interrupted job never leaves a half-written output behind. An existing
non-empty output is only replaced when the caller says so (``--force``).

Temporaries carry the writer's pid (``NAME.tmp-<pid>...``). A writer that fails removes its
own; one that is killed cannot, so the next writer removes those whose process is gone
(:func:`remove_stale_temporaries`), and a disk filled by a dead save does not stay full.
Files are written through :func:`write_file`, which turns every write failure (a full disk
included, which torch reports without a path) into one error naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from typing import IO, Callable, Iterable, Iterator, List, Optional, Union

from megatron_psrl.errors import CheckpointWriteError, PsrlError, pid_alive
from megatron_psrl.tempfiles import output_mkdtemp, output_mkstemp

_TEMPORARY = re.compile(r"\.(?:tmp|old)-(\d+)(?:[-.].*)?$")
"""A temporary of :func:`atomic_directory` / :func:`atomic_write_text` / a checkpoint save,
with its writer's pid."""


class OutputExistsError(PsrlError, FileExistsError):
    """The output directory exists and is not empty (and overwriting was not requested)."""


def is_nonempty_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(os.listdir(path))


@contextlib.contextmanager
def atomic_directory(final_path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory that becomes ``final_path`` when the block succeeds."""
    final_path = os.path.abspath(final_path)
    if os.path.exists(final_path) and not os.path.isdir(final_path):
        raise OutputExistsError(f"{final_path} exists and is not a directory")
    if is_nonempty_dir(final_path) and not overwrite:
        raise OutputExistsError(f"{final_path} is not empty; pass --force to overwrite it")
    parent = os.path.dirname(final_path)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporaries(parent, prefix=f".{os.path.basename(final_path)}.")
    # Not tempfile.mkdtemp: its 0700 would become the output's mode (see megatron_psrl.tempfiles).
    tmp = output_mkdtemp(parent, prefix=f".{os.path.basename(final_path)}.tmp-{os.getpid()}-")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(final_path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(final_path)}.old-{os.getpid()}-", dir=parent)
        os.rmdir(old)
        os.rename(final_path, old)
    os.rename(tmp, final_path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str, text: Union[str, Iterable[str]]) -> None:
    """Write a text file atomically (temp file + os.replace); ``text`` may be an iterable of
    chunks (lines with their newlines), written as they come. A failure names ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    # Not tempfile.mkstemp: its 0600 would survive the rename, and a teammate could not read
    # the tracker or the checksums of a checkpoint whose data files they can read.
    fd, tmp = output_mkstemp(directory, prefix=f".tmp-{os.getpid()}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for chunk in [text] if isinstance(text, str) else text:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise CheckpointWriteError(path, exc.strerror or str(exc)) from exc
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_file(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Create ``path`` and fill it with ``write(f)``, synced to disk.

    Any failure (full disk, quota, permissions, I/O error) raises
    :class:`~megatron_psrl.errors.CheckpointWriteError` naming ``path``; the partial file is
    removed."""
    writer = None
    try:
        with open(path, "wb", buffering=0) as raw:
            writer = _WriteAll(raw)
            write(writer)
            os.fsync(raw.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        reason = exc.strerror or str(exc)
        raise CheckpointWriteError(path, reason) from exc
    except RuntimeError as exc:  # torch's zip writer swallows the OS error and reports a position
        if writer is None or writer.error is None:
            raise  # not a write failure: a bug (e.g. something that cannot be pickled)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise CheckpointWriteError(path, writer.error.strerror or str(writer.error)) from exc


class _WriteAll:
    """A file whose ``write`` writes everything or raises, and remembers the OS error: on a
    nearly full disk the OS accepts part of a write and refuses the rest (ENOSPC) only on the
    next call, and torch's writer swallows that exception, reporting an "unexpected pos"."""

    def __init__(self, raw):
        self._raw = raw
        self.error: Optional[OSError] = None
        """The first OS error of a write (what torch does not pass on)."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = view.nbytes
        try:
            while view.nbytes:
                n = self._raw.write(view)
                if not n:
                    raise OSError(errno.EIO, "the write made no progress")
                view = view[n:]
        except OSError as exc:
            self.error = self.error or exc
            raise
        return total

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


def remove_stale_temporaries(directory: str, prefix: str = "") -> List[str]:
    """Remove the temporaries in ``directory`` (names starting with ``prefix``) whose writer's
    process no longer exists. Returns what it removed."""
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for name in entries:
        m = _TEMPORARY.search(name)
        if not name.startswith(prefix) or m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        removed.append(path)
    return removed


def check_writable_dir(path: str, what: str) -> None:
    """Create ``path`` if needed and prove it writable (a probe file), before any work is done.

    Raises :class:`~megatron_psrl.errors.CheckpointWriteError` naming ``what`` and the path."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointWriteError(path, f"{what} is not writable: {exc.strerror or exc}") from exc
