"""Temporary files and folders that are renamed into place as outputs.

``tempfile.mkstemp`` creates files 0600 and ``tempfile.mkdtemp`` folders 0700 whatever the
umask, because its temporaries are meant to be private; renamed into place they keep that mode,
and a checkpoint saved by one user could not be read by a teammate while its data files (plain
``open``) could. These create them as ``open`` and ``os.mkdir`` do: the kernel applies the
process umask (and a folder's default ACL) to 0666 / 0777 at creation, so there is no
process-global ``os.umask`` to read and restore, and no window with another mode.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Tuple

_ATTEMPTS = 100
_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _names(directory: str, prefix: str, suffix: str):
    for _ in range(_ATTEMPTS):
        yield os.path.join(directory, f"{prefix}{secrets.token_hex(4)}{suffix}")


def _exhausted(directory: str, prefix: str) -> FileExistsError:
    return FileExistsError(errno.EEXIST, f"no unused temporary name after {_ATTEMPTS} tries",
                           os.path.join(directory, prefix + "*"))


def output_mkstemp(directory: str, prefix: str, suffix: str = "") -> Tuple[int, str]:
    """``(fd, path)`` of a new file ``directory/prefix<random>suffix``, open for reading and
    writing, with the mode ``open(path, "w")`` would give it (0644 under a umask of 022)."""
    for path in _names(directory, prefix, suffix):
        try:
            return os.open(path, _FILE_FLAGS, 0o666), path
        except FileExistsError:
            continue
    raise _exhausted(directory, prefix)


def output_mkdtemp(directory: str, prefix: str) -> str:
    """The path of a new folder ``directory/prefix<random>`` with the mode ``os.mkdir`` would
    give it (0755 under a umask of 022)."""
    for path in _names(directory, prefix, ""):
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise _exhausted(directory, prefix)
