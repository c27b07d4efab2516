"""Atomic writes: a checkpoint or converted model is either complete or absent.

Everything is written into a temporary sibling directory (same filesystem) and renamed into
place at the end, so an interrupted job never leaves a half-written output behind. An existing
non-empty output is only replaced when the caller says so (``--force``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from megatron_psrl.errors import PsrlError


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
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_path)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(final_path):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(final_path)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(final_path, old)
    os.rename(tmp, final_path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str, text: str) -> None:
    """Write a small text file atomically (temp file + os.replace)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
