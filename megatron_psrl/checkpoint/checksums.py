"""Checksums of every file a save writes, verified before anything is read back.

Each iteration folder gets ``checksums.sha256`` (the format of ``sha256sum``: ``<hex>  <path>``
per line, paths relative to the folder, so ``cd iter_0000042 && sha256sum -c checksums.sha256``
checks it by hand). Every writer makes it last, once all other files are in place: the
training save (each rank hashes a share of the files, rank 0 writes the list), the converter
(legacy and torch_dist). Every reader verifies it when it reads the folder's
``psrl_model.json`` (:func:`megatron_psrl.checkpoint.layout.read_checkpoint_info`, which all
of them call first), once per process and folder: a missing, short or changed file is one
line naming it, before any tensor is unpickled or handed to megatron's loader.

A folder written before checksums existed still loads, with one note that it cannot be
verified. ``PSRL_VERIFY_CHECKSUMS=0`` (``--no-verify-checksums`` on the command lines) skips
verification, for checkpoints too large to read twice; docs/architecture.md gives its cost.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Dict, Iterable, List, Optional, Tuple

from megatron_psrl.checkpoint.atomic import atomic_write_text
from megatron_psrl.errors import CheckpointError
from megatron_psrl.options import VERIFY_CHECKSUMS_ENV

MANIFEST = "checksums.sha256"
"""The checksum list in every iteration folder."""

VERIFY_ENV = VERIFY_CHECKSUMS_ENV
"""``0`` skips verification on load (``--no-verify-checksums``); anything else verifies."""

_CHUNK = 8 << 20
_VERIFIED: Dict[Tuple[str, int, int], None] = {}
"""Folders this process verified, keyed by the manifest's identity (path, size, mtime)."""
_UNVERIFIABLE: Dict[str, None] = {}
"""Folders without a manifest this process has noted (one note each)."""

logger = logging.getLogger("megatron_psrl")


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_files(it_dir: str) -> List[str]:
    """Every file under an iteration folder (relative paths, sorted), the manifest excepted."""
    out = []
    for folder, _, files in os.walk(it_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), it_dir)
            if rel != MANIFEST:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def hash_files(it_dir: str, files: Iterable[str]) -> Dict[str, str]:
    """``{relative path: hex SHA-256}`` of ``files`` (a share of a folder, on one rank)."""
    return {rel: file_sha256(os.path.join(it_dir, rel)) for rel in files}


def write_manifest(it_dir: str, known: Optional[Dict[str, str]] = None) -> None:
    """Write ``checksums.sha256`` for every file of ``it_dir``; ``known`` holds checksums other
    ranks computed already (files not in it are hashed here). Call it last, once every other
    file of the folder is written."""
    sums = dict(known or {})
    files = folder_files(it_dir)
    sums.update(hash_files(it_dir, [f for f in files if f not in sums]))
    atomic_write_text(os.path.join(it_dir, MANIFEST), [f"{sums[f]}  {f}\n" for f in files])


def verification_enabled() -> bool:
    return os.environ.get(VERIFY_ENV, "1") != "0"


def verify_folder(it_dir: str) -> bool:
    """Check every file ``checksums.sha256`` lists; True when verified (or already verified
    by this process), False (with one note) for a folder written before checksums existed or
    when verification is off. Raises :class:`CheckpointError` naming the first bad file."""
    if not verification_enabled():
        return False
    manifest = os.path.join(it_dir, MANIFEST)
    try:
        stat = os.stat(manifest)
    except FileNotFoundError:
        if os.path.abspath(it_dir) not in _UNVERIFIABLE:
            _UNVERIFIABLE[os.path.abspath(it_dir)] = None
            logger.warning("note: %s has no %s (written before checksums were recorded); it cannot be verified",
                           it_dir, MANIFEST)
        return False
    key = (os.path.abspath(manifest), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return True
    for expected, rel in _read_manifest(manifest):
        path = os.path.join(it_dir, rel)
        try:
            actual = file_sha256(path)
        except FileNotFoundError:
            raise CheckpointError(path, "missing (the checkpoint is incomplete)") from None
        except OSError as exc:
            raise CheckpointError(path, f"cannot be read ({exc.strerror or exc})") from None
        if actual != expected:
            raise CheckpointError(path, "checksum mismatch (corrupt or modified after save)")
    _VERIFIED[key] = None
    return True


def _read_manifest(manifest: str) -> List[Tuple[str, str]]:
    entries = []
    with open(manifest, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            digest, sep, rel = line.rstrip("\n").partition("  ")
            if not sep or len(digest) != 64 or not rel or rel.startswith("/") or ".." in rel.split("/"):
                raise CheckpointError(manifest, f"line {number} is not '<sha256>  <path>' inside the folder; the "
                                                "list is corrupt")
            entries.append((digest, rel))
    return entries


__all__ = ["MANIFEST", "VERIFY_ENV", "file_sha256", "folder_files", "hash_files", "verification_enabled",
           "verify_folder", "write_manifest"]
