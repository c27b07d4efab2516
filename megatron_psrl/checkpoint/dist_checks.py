"""What is checked in a torch_dist iteration folder before megatron's reader touches it, and
how its failures are told: one line naming the file (and the tensor).

``checksums.sha256`` (:mod:`checksums`) catches any changed byte first. These checks are what
stands when it cannot: a folder written before checksums existed, or verification turned off
(``--no-verify-checksums``). Before megatron reads, :func:`check_folder`

- reads torch.distributed.checkpoint's index ``.metadata`` with an unpickler that admits only
  the index's own record classes (torch's reader would ``pickle.load`` anything);
- checks that every file the index names is there and long enough for the byte ranges it
  records (so a deleted, empty or truncated ``__<rank>_0.distcp`` is named up front instead of
  failing as an ``EOFError`` deep inside a collective);
- unpickles the non-tensor items (megatron's RNG state, ``_extra_state``) with torch's
  weights-only unpickler: torch's planner loads them with ``weights_only=False``;
- for a folder without ``checksums.sha256`` (and verification on), checks the CRC-32 that each
  stored item carries (every item is a ``torch.save`` zip record); this reads the data once,
  like the checksums would. With verification off, a flipped byte inside tensor data cannot be
  detected: only the checksums (or this CRC pass) catch it.

``common.pt`` is read with ``weights_only=True`` (:func:`safe_torch_load`), and before every
``dist_checkpointing.load`` too, since megatron reads it with torch's default (which an
environment variable can turn unsafe). What still fails inside megatron is turned into one
line by :func:`explain_failure`.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import re
import sys
import zipfile
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_psrl.checkpoint.checksums import MANIFEST, verification_enabled
from megatron_psrl.errors import CheckpointError

INDEX = ".metadata"
"""torch.distributed.checkpoint's index of every stored item (a pickle)."""
COMMON = "common.pt"
"""megatron's non-sharded state (iteration, scheduler, optimizer layout)."""
SAFE_ONLY = "only tensors and plain containers are loaded"
_CHUNK = 8 << 20
_CRC_CHECKED: Dict[Tuple, None] = {}
"""Folders whose CRC-32s this process checked, keyed by the files' (path, size, mtime)."""


# ---------------------------------------------------------------------- safe unpickling
def _numpy_globals() -> List[Any]:
    """What a numpy array needs from the weights-only unpickler: megatron's RNG state holds
    numpy's generator state (a uint32 array). Constructing arrays and dtypes runs no code."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def refusal(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused, in a few words (its own message is a
    paragraph of advice to load the file unsafely)."""
    text = str(exc)
    m = re.search(r"GLOBAL ([\w.]+)", text)  # "Unsupported global: GLOBAL x" / "unsupported GLOBAL x whose ..."
    if m:
        return f"refused to unpickle {m.group(1)}: {SAFE_ONLY}"
    m = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    what = f" ({m.group(1).strip().rstrip('.')})" if m else ""
    return f"refused to unpickle it{what}: {SAFE_ONLY}"


def safe_torch_load(source, path: str, tensor: Optional[str] = None) -> Any:
    """``torch.load`` of a file or byte stream with ``weights_only=True`` (tensors, plain
    containers and numpy arrays; never arbitrary objects). A refused object or an unreadable
    file raises :class:`CheckpointError` naming ``path`` (and ``tensor``, the item in it)."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise CheckpointError(path, refusal(exc), tensor=tensor) from None
        raise CheckpointError(path, f"cannot be read: truncated or corrupt ({_first_line(exc)})", tensor=tensor) \
            from None
    except FileNotFoundError:
        raise CheckpointError(path, "missing (the checkpoint is incomplete)") from None
    except (RuntimeError, EOFError, ValueError, AttributeError, ImportError, TypeError, KeyError) as exc:
        raise CheckpointError(path, f"cannot be read: truncated or corrupt ({_first_line(exc)})", tensor=tensor) \
            from None


_INDEX_RECORD_MODULES = "torch.distributed.checkpoint."
"""The package whose dataclasses and enums are the index's records."""
_INDEX_GLOBALS = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
                  ("builtins", "frozenset")}
"""Other globals an index may name (``_get_layout`` looks a layout up by name)."""


class _IndexUnpickler(pickle.Unpickler):
    """Admits the record classes of torch.distributed.checkpoint's index (dataclasses and
    enums of its own modules), ``torch.Size``, dtypes and layouts; nothing else.

    Decided from the names before anything is imported: ``pickle``'s own ``find_class`` imports
    the named module first, so a crafted index could make the reader run any installed
    module's import-time code before being refused. Here a name outside the list is refused
    as it is, and an admitted one is looked up in a module that is already loaded
    (:func:`read_index` imports torch.distributed.checkpoint, which loads its record modules).
    """

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if module == "torch" or module.startswith(_INDEX_RECORD_MODULES) or (module, name) in _INDEX_GLOBALS:
            loaded = sys.modules.get(module)
            # vars(), not getattr(): a module's __getattr__ may import (torch loads submodules lazily).
            obj = vars(loaded).get(name) if loaded is not None else None
        allowed = False
        if module.startswith(_INDEX_RECORD_MODULES) and isinstance(obj, type):
            allowed = dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
        elif module == "torch" and obj is not None:
            allowed = obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
        elif (module, name) in _INDEX_GLOBALS:
            allowed = obj is not None
        if not allowed:
            raise pickle.UnpicklingError(f"refused to unpickle {module}.{name}")
        return obj


def read_index(it_dir: str):
    """The ``.metadata`` index of a torch_dist folder, unpickled safely (:class:`_IndexUnpickler`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(it_dir, INDEX)
    try:
        with open(path, "rb") as f:
            index = _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(path, "missing (the checkpoint is incomplete)") from None
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if text.startswith("refused to unpickle"):
            raise CheckpointError(path, f"{text}: only torch.distributed.checkpoint's index records, tensors and "
                                        "plain containers are loaded") from None
        raise CheckpointError(path, f"cannot be read: truncated or corrupt ({_first_line(exc)})") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        reason = "empty file (0 bytes)" if os.path.getsize(path) == 0 else _first_line(exc)
        raise CheckpointError(path, f"cannot be read: truncated or corrupt ({reason})") from None
    if not isinstance(index, Metadata) or not isinstance(getattr(index, "storage_data", None), dict):
        raise CheckpointError(path, "not torch.distributed.checkpoint's index (no storage records)")
    return index


# ---------------------------------------------------------------------- the files against the index
def _items_by_file(it_dir: str, index) -> Dict[str, List[Tuple[str, int, int]]]:
    """``{file name: [(item, offset, length), ...]}`` of the index, every name checked to be a
    plain file name inside the folder (an index naming ``../x`` is refused)."""
    files: Dict[str, List[Tuple[str, int, int]]] = {}
    for key, info in index.storage_data.items():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (not isinstance(rel, str) or not rel or os.path.basename(rel) != rel or rel in (".", "..")
                or not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0):
            raise CheckpointError(os.path.join(it_dir, INDEX), f"record of item {getattr(key, 'fqn', key)!r} is "
                                                               "malformed (the index is corrupt)")
        files.setdefault(rel, []).append((getattr(key, "fqn", str(key)), offset, length))
    return files


def check_files(it_dir: str, index) -> Dict[str, List[Tuple[str, int, int]]]:
    """Every file the index names exists and holds every byte range it records; returns the
    items by file. A short file names the first item that lies past its end."""
    files = _items_by_file(it_dir, index)
    for rel, items in sorted(files.items()):
        path = os.path.join(it_dir, rel)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(path, f"missing (the index {INDEX} records {len(items)} items stored in it; the "
                                        "checkpoint is incomplete)") from None
        need = max(offset + length for _, offset, length in items)
        if size < need:
            name, offset, length = min((i for i in items if i[1] + i[2] > size), key=lambda i: i[1])
            what = "empty file (0 bytes)" if size == 0 else f"truncated: {size} bytes"
            raise CheckpointError(path, f"{what}, but the index {INDEX} records data up to byte {need} (item "
                                        f"{name!r} at bytes {offset}-{offset + length}); the checkpoint is "
                                        "truncated")
    return files


def check_objects(it_dir: str, index, files: Dict[str, List[Tuple[str, int, int]]]) -> None:
    """Unpickle every non-tensor item (megatron's RNG state, ``_extra_state``) with the
    weights-only unpickler, so that torch's planner, which loads them with
    ``weights_only=False``, only ever sees what that admits. These items are small."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects = {k for k, v in index.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for rel, items in sorted(files.items()):
        wanted = [i for i in items if i[0] in objects]
        if not wanted:
            continue
        path = os.path.join(it_dir, rel)
        with open(path, "rb") as f:
            for name, offset, length in wanted:
                f.seek(offset)
                safe_torch_load(io.BytesIO(f.read(length)), path, tensor=name)


class _FileSlice(io.RawIOBase):
    """Bytes ``start:start+length`` of an open file as a seekable stream (an item of a .distcp
    file read as the zip archive it is, without copying it into memory)."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def check_crcs(it_dir: str, files: Dict[str, List[Tuple[str, int, int]]]) -> None:
    """Check the CRC-32 of every stored item (each is a ``torch.save`` zip archive whose records
    carry one; torch's reader does not check them). Once per process and folder state."""
    stats = {rel: os.stat(os.path.join(it_dir, rel)) for rel in files}
    key = (os.path.abspath(it_dir),) + tuple(sorted((rel, s.st_size, s.st_mtime_ns) for rel, s in stats.items()))
    if key in _CRC_CHECKED:
        return
    for rel, items in sorted(files.items()):
        path = os.path.join(it_dir, rel)
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                continue  # not written as torch.save records (another serialization): nothing to check
            for name, offset, length in sorted(items, key=lambda i: i[1]):
                try:
                    with zipfile.ZipFile(_FileSlice(f, offset, length)) as archive:
                        bad = archive.testzip()
                except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
                    raise CheckpointError(path, f"bytes {offset}-{offset + length} are not a readable record "
                                                f"({_first_line(exc)}): the file is corrupt", tensor=name) from None
                if bad is not None:
                    raise CheckpointError(path, f"stored data (bytes {offset}-{offset + length}) fails its CRC-32 "
                                                "check: the file is corrupt", tensor=name)
    _CRC_CHECKED[key] = None


def check_folder(it_dir: str):
    """Everything in the module docstring, before megatron reads ``it_dir``; returns the index
    (for :func:`explain_failure`). Identical on every rank (it depends on the files only), so a
    refusal never leaves other ranks waiting in a collective."""
    index = read_index(it_dir)
    files = check_files(it_dir, index)
    safe_torch_load(os.path.join(it_dir, COMMON), os.path.join(it_dir, COMMON))
    check_objects(it_dir, index, files)
    if verification_enabled() and not os.path.exists(os.path.join(it_dir, MANIFEST)):
        check_crcs(it_dir, files)
    return index


# ---------------------------------------------------------------------- megatron's failures, in one line
def _first_line(exc: BaseException) -> str:
    """An exception's message, its first line, cut to 200 characters (never a traceback)."""
    text = str(exc).strip() or type(exc).__name__
    text = text.split("Traceback (most recent call last)")[0].strip() or type(exc).__name__
    return " ".join(text.splitlines()[0].split())[:200]


def _root_cause(exc: BaseException) -> BaseException:
    """The rank's own exception inside torch's CheckpointException (which carries one per failed
    rank as ``(exception, traceback)``) or megatron's wrappers."""
    seen = 0
    while seen < 5:
        seen += 1
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = failures[min(failures)]
            exc = first[0] if isinstance(first, tuple) else first
            continue
        if exc.__cause__ is not None and not isinstance(exc, (OSError, EOFError)):
            exc = exc.__cause__
            continue
        break
    return exc


def _shape(text: str) -> Tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text))


def _file_of(it_dir: str, index, tensor: Optional[str]) -> str:
    """The data file holding ``tensor`` (its first record), else the only data file, else the folder."""
    rels = sorted({info.relative_path for info in index.storage_data.values()}) if index is not None else []
    if tensor is not None and index is not None:
        for key, info in index.storage_data.items():
            if getattr(key, "fqn", None) == tensor:
                return os.path.join(it_dir, info.relative_path)
    return os.path.join(it_dir, rels[0]) if len(rels) == 1 else it_dir


def explain_failure(exc: BaseException, it_dir: str, index=None) -> CheckpointError:
    """One :class:`CheckpointError` for a failure of megatron's torch_dist load of ``it_dir``,
    naming the file (and tensor) where it can be told, never carrying a traceback's text."""
    cause = _root_cause(exc)
    text = str(cause)
    m = re.search(r"Global shape mismatch for loaded \((.*?)\) and expected \((.*?)\) tensor for key (\S+)", text)
    if m:
        stored, wanted, tensor = _shape(m.group(1)), _shape(m.group(2)), m.group(3)
        return CheckpointError(_file_of(it_dir, index, tensor), f"stored shape {stored} does not match {wanted} of "
                                                                f"the model psrl_model.json describes", tensor=tensor)
    m = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", text.strip())
    if m:
        return CheckpointError(os.path.join(it_dir, INDEX), "records no such tensor, but the model "
                                                            "psrl_model.json describes has it", tensor=m.group(1))
    if isinstance(cause, OSError) and cause.filename:
        return CheckpointError(str(cause.filename), f"cannot be read ({cause.strerror or _first_line(cause)})")
    if isinstance(cause, pickle.UnpicklingError) and "Weights only load failed" in text:
        return CheckpointError(_file_of(it_dir, index, None), refusal(cause))
    if isinstance(cause, (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile)):
        return CheckpointError(_file_of(it_dir, index, None), f"cannot be read: truncated or corrupt "
                                                              f"({type(cause).__name__}: {_first_line(cause)})")
    return CheckpointError(it_dir, f"cannot be loaded as a torch_dist checkpoint ({type(cause).__name__}: "
                                   f"{_first_line(cause)})")


__all__ = ["COMMON", "INDEX", "SAFE_ONLY", "check_crcs", "check_files", "check_folder", "check_objects",
           "explain_failure", "read_index", "refusal", "safe_torch_load"]
