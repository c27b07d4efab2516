"""Hugging Face <-> megatron_psrl checkpoint conversion, torch_dist or legacy format (the library behind
tools/convert_hf_checkpoint.py)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
from tqdm import tqdm

from megatron_psrl.checkpoint.atomic import atomic_directory, atomic_write_text, check_writable_dir, write_file
from megatron_psrl.checkpoint.checksums import write_manifest
from megatron_psrl.checkpoint.dist_format import write_model_checkpoint
from megatron_psrl.checkpoint.hf_io import HFCheckpointReader, write_hf_checkpoint
from megatron_psrl.checkpoint.layout import (
    MODEL_JSON,
    TRACKER,
    CheckpointInfo,
    check_ckpt_format,
    iteration_dir_name,
    read_checkpoint_info,
)
from megatron_psrl.checkpoint.legacy_format import save_sharded_checkpoint
from megatron_psrl.checkpoint.loading import hf_full_state_dict, load_full_state_dict, log_untrained_mtp
from megatron_psrl.checkpoint.passthrough import passthrough_for_export, read_hf_passthrough, write_passthrough
from megatron_psrl.checkpoint.sharding import shard_state_dict
from megatron_psrl.dtypes import DTYPES
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.model.adapters import get_adapter
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.options import DEFAULT_CKPT_FORMAT

logger = logging.getLogger(__name__)


def _bar(total: int, desc: str, enabled: bool):
    # A bar only on a terminal: redrawn lines would corrupt a log file.
    return tqdm(total=total, desc=desc, unit="tensor", disable=not (enabled and sys.stderr.isatty()), leave=False)


def hf_to_mcore(
    hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, overwrite: bool = False, progress: bool = True,
    ckpt_format: str = DEFAULT_CKPT_FORMAT, allow_non_finite: bool = False,
) -> CheckpointInfo:
    """Convert a HF folder into a megatron_psrl checkpoint ("release") in ``ckpt_format``:
    torch_dist (loads under any layout; ``tp`` / ``pp`` only check that the model can be split
    so) or legacy (TP x PP per-rank files). A weight holding NaN or inf is refused, naming
    the tensor and its file, unless ``allow_non_finite`` (then one warning line each)."""
    check_ckpt_format(ckpt_format)
    arch = ModelArchitecture.from_hf_dir(hf_dir)  # refuses unsupported models before any I/O
    if arch.num_kv_heads % tp:
        raise ConfigurationError(f"--tp {tp} must divide the model's {arch.num_kv_heads} key/value heads")
    if arch.num_layers % pp:
        raise ConfigurationError(f"--pp {pp} must divide the model's {arch.num_layers} layers")
    check_writable_dir(os.path.dirname(os.path.abspath(out_dir)), "the parent of --out-dir")
    with _bar(len(get_adapter(arch).hf_keys()), "reading HF tensors", progress) as bar:
        full = hf_full_state_dict(hf_dir, arch, progress=lambda _: bar.update(1), strict=True,
                                   non_finite="warn" if allow_non_finite else "refuse")
    dtype = str(next(iter(full.values())).dtype).replace("torch.", "")
    hf_dtypes = source_dtypes(hf_dir, get_adapter(arch))
    carried = read_hf_passthrough(hf_dir, get_adapter(arch).hf_passthrough_prefixes)  # e.g. a vision tower
    log_untrained_mtp(arch, hf_dir)
    if ckpt_format == "torch_dist":
        info = CheckpointInfo(architecture=arch, tensor_parallel_size=1, pipeline_parallel_size=1, iteration=0,
                              dtype=dtype, hf_dtypes=hf_dtypes)
        save_dist_checkpoint(out_dir, info, full, overwrite=overwrite, passthrough=carried)
        logger.info("wrote %s (torch_dist, %s)", out_dir, dtype)
        return info
    info = CheckpointInfo(architecture=arch, tensor_parallel_size=tp, pipeline_parallel_size=pp, iteration=0, dtype=dtype,
                          hf_dtypes=hf_dtypes)
    shards = shard_state_dict(full, arch, tp, pp)
    with _bar(len(shards), "writing shards", progress) as bar:
        save_sharded_checkpoint(out_dir, info, shards, overwrite=overwrite, progress=lambda _: bar.update(1),
                                passthrough=carried)
    logger.info("wrote %s (legacy, TP=%d, PP=%d, %s)", out_dir, tp, pp, dtype)
    return info


def save_dist_checkpoint(out_dir: str, info: CheckpointInfo, full, overwrite: bool = False,
                         release: bool = True, passthrough=None) -> None:
    """Write a whole model (megatron-core names) as a torch_dist checkpoint from this one
    process, atomically (the layout of :func:`save_sharded_checkpoint`: tracker, iteration
    folder, ``psrl_model.json``), with the Hugging Face tensors carried through
    (``passthrough``, :mod:`~megatron_psrl.checkpoint.passthrough`)."""
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        it_dir = os.path.join(tmp, iteration_dir_name(None if release else info.iteration))
        os.makedirs(it_dir)
        write_model_checkpoint(it_dir, info.architecture, full, info.iteration)
        write_passthrough(it_dir, passthrough or {})
        write_file(os.path.join(it_dir, MODEL_JSON), lambda f: f.write(info.to_json().encode("utf-8")))
        write_manifest(it_dir)
        atomic_write_text(os.path.join(tmp, TRACKER), "release" if release else str(info.iteration))


def mcore_to_mcore(load: str, out_dir: str, tp: int = 1, pp: int = 1, overwrite: bool = False,
                   ckpt_format: str = DEFAULT_CKPT_FORMAT) -> CheckpointInfo:
    """Rewrite a checkpoint (either format, any layout) in ``ckpt_format`` ("release", weights
    only): e.g. a legacy checkpoint as torch_dist, or a torch_dist one as legacy TP x PP files."""
    check_ckpt_format(ckpt_format)
    check_writable_dir(os.path.dirname(os.path.abspath(out_dir)), "the parent of --out-dir")
    saved, full = load_full_state_dict(load)
    arch = saved.architecture
    if ckpt_format == "torch_dist":
        tp, pp = 1, 1
    info = CheckpointInfo(architecture=arch, tensor_parallel_size=tp, pipeline_parallel_size=pp, iteration=0,
                          dtype=saved.dtype, hf_dtypes=saved.hf_dtypes)
    if ckpt_format == "torch_dist":
        save_dist_checkpoint(out_dir, info, full, overwrite=overwrite)
    else:
        save_sharded_checkpoint(out_dir, info, shard_state_dict(full, arch, tp, pp), overwrite=overwrite)
    logger.info("wrote %s (%s)", out_dir, ckpt_format)
    return info


def mcore_to_hf(
    load: str, out_dir: str, hf_template: Optional[str] = None, overwrite: bool = False, progress: bool = True
) -> CheckpointInfo:
    """Convert a megatron_psrl checkpoint (either format, any TP/PP) back into a HF
    save_pretrained folder."""
    if hf_template is not None:
        template_arch = ModelArchitecture.from_hf_dir(hf_template)
    check_writable_dir(os.path.dirname(os.path.abspath(out_dir)), "the parent of --out-dir")
    info, full = load_full_state_dict(load)
    arch = info.architecture
    adapter = get_adapter(arch)
    carried = passthrough_for_export(read_checkpoint_info(load)[0], adapter.hf_passthrough_prefixes, hf_template,
                                     arch.model_type)
    if hf_template is not None and (template_arch.model_type, template_arch.num_layers, template_arch.hidden_size) != (
        arch.model_type, arch.num_layers, arch.hidden_size
    ):
        raise ConfigurationError(f"--hf-template {hf_template} describes a different model than {load}")
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        with _bar(len(adapter.hf_keys()) + len(carried), "writing HF tensors", progress) as bar:
            write_hf_checkpoint(
                tmp, itertools.chain(in_source_dtypes(adapter.mcore_to_hf(full), info.hf_dtypes), carried.items()),
                arch.hf_config,
                template_dir=hf_template,
                progress=lambda _: bar.update(1),
            )
    logger.info("wrote %s", out_dir)
    return info


def describe(path: str) -> str:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.dumps(json.load(f), indent=2)


def source_dtypes(hf_dir: str, adapter) -> Dict[str, str]:
    """The dtype ``hf_dir`` stores each of the adapter's ``hf_fp32_names`` in, where it is not
    fp32 (by HF name): what ``CheckpointInfo.hf_dtypes`` records."""
    names = adapter.hf_fp32_names()
    if not names:
        return {}
    reader = HFCheckpointReader(hf_dir)
    dtypes = {name: reader.get(name).dtype for name in names}  # (small: one value per expert)
    return {name: str(dtype).replace("torch.", "") for name, dtype in dtypes.items() if dtype != torch.float32}


def in_source_dtypes(tensors: Iterable[Tuple[str, torch.Tensor]],
                     hf_dtypes: Dict[str, str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """``tensors`` (HF names) with those of ``hf_dtypes`` cast back to the dtype the converted
    folder had (megatron held them in fp32: the cast is exact)."""
    for name, tensor in tensors:
        yield name, tensor.to(DTYPES[hf_dtypes[name]]) if name in hf_dtypes else tensor
