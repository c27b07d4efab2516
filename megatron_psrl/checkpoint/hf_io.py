"""Reading and writing Hugging Face ``save_pretrained`` folders with safetensors."""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_psrl.checkpoint.atomic import write_file
from megatron_psrl.errors import CheckpointError, CheckpointWriteError

Tensor = torch.Tensor
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
WEIGHT_INDEX_FILES = (INDEX_NAME, "pytorch_model.bin.index.json")


class HFCheckpointReader:
    """Lazy tensor access to a (possibly sharded) safetensors checkpoint.

    Every defect raises :class:`~megatron_psrl.errors.CheckpointError` naming the file (and the
    tensor): a corrupt index, an index entry that points outside the folder, a truncated or
    foreign safetensors file, a tensor that is missing or (with ``expected_shape``) of the wrong
    shape."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX_NAME)
        single_path = os.path.join(hf_dir, SINGLE_NAME)
        if os.path.exists(index_path):
            self.weight_map: Dict[str, str] = _read_index(index_path)
        elif os.path.exists(single_path):
            self.weight_map = {k: SINGLE_NAME for k in self._open(SINGLE_NAME).keys()}
        else:
            raise FileNotFoundError(
                f"{hf_dir}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors checkpoints are supported)"
            )
        self._handles: Dict[str, object] = {}

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def path_of(self, name: str) -> str:
        return os.path.join(self.hf_dir, self.weight_map[name])

    def _open(self, filename: str):
        path = os.path.join(self.hf_dir, filename)
        if not os.path.exists(path):
            raise CheckpointError(path, "missing (named by the checkpoint index)")
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, RuntimeError, ValueError) as exc:  # bad header / truncated; OSError passes
            reason = " ".join(str(exc).split())[:200]
            raise CheckpointError(path, f"not a readable safetensors file: truncated or corrupt ({reason})") from None

    def get_slice(self, name: str, dim: int, start: int, stop: int,
                  expected_shape: Optional[Tuple[int, ...]] = None) -> Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``start:stop`` of a tensor, reading only
        those bytes (safetensors ``get_slice``); the full tensor's shape is checked first."""
        handle, path = self._handle(name)
        try:
            lazy = handle.get_slice(name)
            shape = tuple(lazy.get_shape())
            if expected_shape is not None and shape != tuple(expected_shape):
                raise CheckpointError(path, f"shape {shape} does not match {tuple(expected_shape)} implied by "
                                            "config.json", tensor=name)
            return lazy[start:stop] if dim == 0 else lazy[:, start:stop]
        except (SafetensorError, RuntimeError, ValueError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise CheckpointError(path, f"cannot be read: truncated or corrupt ({reason})", tensor=name) from None

    def _handle(self, name: str):
        try:
            filename = self.weight_map[name]
        except KeyError:
            raise CheckpointError(self.hf_dir, "missing from the checkpoint", tensor=name) from None
        if filename not in self._handles:
            self._handles[filename] = self._open(filename)
        return self._handles[filename], os.path.join(self.hf_dir, filename)

    def get(self, name: str, expected_shape: Optional[Tuple[int, ...]] = None) -> Tensor:
        handle, path = self._handle(name)
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, RuntimeError, ValueError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise CheckpointError(path, f"cannot be read: truncated or corrupt ({reason})", tensor=name) from None
        if expected_shape is not None and tuple(tensor.shape) != tuple(expected_shape):
            raise CheckpointError(path, f"shape {tuple(tensor.shape)} does not match {tuple(expected_shape)} "
                                        "implied by config.json", tensor=name)
        return tensor


def _read_index(index_path: str) -> Dict[str, str]:
    """``weight_map`` of a safetensors index; every file it names must lie inside the folder."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(index_path, f"not a safetensors index (corrupt JSON or no 'weight_map': {exc})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index_path, "'weight_map' must map tensor names to file names")
    for name, filename in weight_map.items():
        if (not isinstance(filename, str) or not filename or os.path.isabs(filename)
                or os.path.normpath(filename) != filename or filename.startswith("..")
                or os.sep in filename or (os.altsep and os.altsep in filename)):
            raise CheckpointError(index_path, f"entry for tensor {name!r} names {filename!r}, which is not a file "
                                              "inside the checkpoint folder")
    return weight_map


def write_hf_checkpoint(
    out_dir: str,
    tensors: Iterable[Tuple[str, Tensor]],
    config: dict,
    template_dir: Optional[str] = None,
    max_shard_bytes: int = 5 * 1024**3,
    progress: Optional[callable] = None,
) -> None:
    """Write tensors as safetensors shards (+ index when sharded) and config.json.

    Non-weight files of ``template_dir`` (tokenizer, generation config, ...) are copied.
    """
    shard: Dict[str, Tensor] = {}
    shard_bytes = 0
    files: List[str] = []  # written shards are dropped: a streamed export holds one shard at most

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            _save_safetensors({k: v.contiguous() for k, v in shard.items()}, os.path.join(out_dir, name))
            files.append(name)
            shard, shard_bytes = {}, 0

    weight_map: Dict[str, str] = {}
    total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += nbytes
        total += nbytes
        weight_map[name] = f"model-{len(files) + 1:05d}.safetensors"
        if progress is not None:
            progress(name)
    flush()
    if len(files) == 1:
        os.rename(os.path.join(out_dir, files[0]), os.path.join(out_dir, SINGLE_NAME))
    else:
        renamed = {}
        for i, f in enumerate(files):
            new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.rename(os.path.join(out_dir, f), os.path.join(out_dir, new))
            renamed[f] = new
        index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
        text = json.dumps(index, indent=2, sort_keys=True)
        write_file(os.path.join(out_dir, INDEX_NAME), lambda f: f.write(text.encode("utf-8")))
    if template_dir:
        for entry in sorted(os.listdir(template_dir)):
            src = os.path.join(template_dir, entry)
            if entry == "config.json" or entry in WEIGHT_INDEX_FILES or entry.endswith(WEIGHT_FILE_SUFFIXES):
                continue
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(out_dir, entry))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    write_file(os.path.join(out_dir, "config.json"), lambda f: f.write(text.encode("utf-8")))


def _save_safetensors(tensors: Dict[str, Tensor], path: str) -> None:
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error type
        raise CheckpointWriteError(path, " ".join(str(exc).split())) from exc


def iter_hf_tensors(reader: HFCheckpointReader, names: Iterable[str]) -> Iterator[Tuple[str, Tensor]]:
    for name in names:
        yield name, reader.get(name)
