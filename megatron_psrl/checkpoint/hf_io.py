"""Reading and writing Hugging Face ``save_pretrained`` folders with safetensors."""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

Tensor = torch.Tensor
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
WEIGHT_INDEX_FILES = (INDEX_NAME, "pytorch_model.bin.index.json")


class HFCheckpointReader:
    """Lazy tensor access to a (possibly sharded) safetensors checkpoint."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX_NAME)
        single_path = os.path.join(hf_dir, SINGLE_NAME)
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as f:
                self.weight_map: Dict[str, str] = json.load(f)["weight_map"]
        elif os.path.exists(single_path):
            with safe_open(single_path, framework="pt") as f:
                self.weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{hf_dir}: no {SINGLE_NAME} or {INDEX_NAME} (only safetensors checkpoints are supported)"
            )
        self._handles: Dict[str, object] = {}

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def get(self, name: str) -> Tensor:
        try:
            filename = self.weight_map[name]
        except KeyError:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} is missing from the checkpoint") from None
        if filename not in self._handles:
            self._handles[filename] = safe_open(os.path.join(self.hf_dir, filename), framework="pt")
        return self._handles[filename].get_tensor(name)


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
    shards: List[Dict[str, Tensor]] = []
    files: List[str] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            shards.append(shard)
            name = f"model-{len(shards):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(out_dir, name), metadata={"format": "pt"})
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
        weight_map[name] = f"model-{len(shards) + 1:05d}.safetensors"
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
        with open(os.path.join(out_dir, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    if template_dir:
        for entry in sorted(os.listdir(template_dir)):
            src = os.path.join(template_dir, entry)
            if entry == "config.json" or entry in WEIGHT_INDEX_FILES or entry.endswith(WEIGHT_FILE_SUFFIXES):
                continue
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(out_dir, entry))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def iter_hf_tensors(reader: HFCheckpointReader, names: Iterable[str]) -> Iterator[Tuple[str, Tensor]]:
    for name in names:
        yield name, reader.get(name)
