"""Hugging Face tensors a conversion carries through unchanged: the parts of a checkpoint that
are not in the megatron model (a multimodal wrapper's vision tower, ``model.visual.*``; the
family's adapter names them, ``hf_passthrough_prefixes``).

hf-to-mcore writes them, named and shaped as in the Hugging Face folder, into the iteration
folder as :data:`PASSTHROUGH_FILE` (safetensors, covered by the checksum manifest); mcore-to-hf
writes them back. A checkpoint saved by training holds the model only: its mcore-to-hf takes
them from ``--hf-template`` (the Hugging Face folder the run started from), and refuses in one
line without it.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_psrl.errors import CheckpointError

PASSTHROUGH_FILE = "hf_passthrough.safetensors"


def passthrough_names(names, prefixes: Tuple[str, ...]) -> list:
    """The names among ``names`` that a conversion carries through (sorted)."""
    return sorted(n for n in names if prefixes and n.startswith(prefixes))


def read_hf_passthrough(hf_dir: str, prefixes: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder under ``prefixes``, as they are stored."""
    if not prefixes:
        return {}
    from megatron_psrl.checkpoint.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(hf_dir)
    return {name: reader.get(name) for name in passthrough_names(reader.keys(), prefixes)}


def write_passthrough(it_dir: str, tensors: Dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` into the iteration folder (nothing when there are none)."""
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(it_dir, PASSTHROUGH_FILE),
                  metadata={"format": "pt"})


def load_passthrough(it_dir: str) -> Optional[Dict[str, torch.Tensor]]:
    """The carried tensors of an iteration folder, None when it has none."""
    path = os.path.join(it_dir, PASSTHROUGH_FILE)
    if not os.path.exists(path):
        return None
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def passthrough_for_export(it_dir: str, prefixes: Tuple[str, ...], hf_template: Optional[str],
                           model_type: str) -> Dict[str, torch.Tensor]:
    """What mcore-to-hf writes besides the model: the checkpoint's carried tensors, else those
    of ``hf_template``; a family that carries some (``prefixes``) and finds none is refused."""
    if not prefixes:
        return {}
    carried = load_passthrough(it_dir)
    if carried is None and hf_template is not None:
        carried = read_hf_passthrough(hf_template, prefixes)
    if not carried:
        raise CheckpointError(it_dir, f"holds no {'/'.join(p + '*' for p in prefixes)} tensors, which a "
                                      f"{model_type} checkpoint carries besides the trained model (a "
                                      "checkpoint saved by training holds the model only): pass --hf-template "
                                      "with the Hugging Face folder the run started from")
    return carried
