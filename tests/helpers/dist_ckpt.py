"""Check a rank's model and optimizer state against the raw tensors of a torch_dist checkpoint."""

from __future__ import annotations

import re
from typing import Dict

import torch


def plain_tensors(it_dir: str) -> Dict[str, torch.Tensor]:
    """Every global tensor of a torch_dist iteration folder, whole (megatron's own reader; a
    collective when torch.distributed is initialised: every rank calls it)."""
    from megatron.core import dist_checkpointing

    from megatron_psrl.checkpoint.dist_format import quiet_deprecation_warnings

    with quiet_deprecation_warnings():
        return dist_checkpointing.load_plain_tensors(it_dir)


def check_rank_against_checkpoint(actor, it_dir: str, plain: Dict[str, torch.Tensor] = None) -> Dict[str, object]:
    """Assert that this rank's weights and optimizer state (Adam moments, fp32 masters) are,
    bit for bit, their slices of the checkpoint's global tensors, wherever the checkpoint was
    saved from (the slices are where this rank's layout puts them: megatron's sharding
    metadata). Returns how many model / optimizer slices were compared, and the global indices
    of the MoE experts among them (``experts``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_psrl.checkpoint.dist_format import model_sharded_state_dict
    from megatron_psrl.checkpoint.expert_parallel import strip_chained_prefixes

    plain = plain if plain is not None else plain_tensors(it_dir)
    model_sd = model_sharded_state_dict(actor.model)
    # the optimizer's keys as the checkpoint stores them (one per parameter, whatever the EP size)
    state = {"model": model_sd, "optimizer": strip_chained_prefixes(actor.optimizer.sharded_state_dict(model_sd))}
    apply_factories(state)
    counts = {"model": 0, "optimizer": 0, "buffers": 0, "experts": set()}
    for part, sub in state.items():
        for sh in nested_values(sub):
            if not isinstance(sh, ShardedTensor) or sh.key.endswith("_extra_state"):
                continue
            assert sh.key in plain, sh.key
            saved = plain[sh.key][sh.global_slice()]
            local = sh.data
            vocab = "word_embeddings" in sh.key or "output_layer" in sh.key
            if vocab and saved.shape != local.shape:  # the vocabulary padded for another TP size
                rows = min(saved.shape[0], local.shape[0])
                saved, local = saved[:rows], local[:rows]
            assert saved.dtype == local.dtype and torch.equal(saved, local.detach().cpu()), (sh.key, sh.global_offset)
            # a router's expert bias is model state without optimizer state (a buffer)
            counts["buffers" if sh.key.endswith("router.expert_bias") else part] += 1
            if ".experts." in sh.key:  # [layers, experts, ...]: the expert axis is the second, unless
                # megatron keys each layer on its own (dense and MoE layers mixed: [experts, ...])
                per_layer = re.search(r"\.layers\.\d+\.", sh.key) is not None
                counts["experts"].add(sh.global_offset[0 if per_layer else 1])
    counts["experts"] = sorted(counts["experts"])
    return counts
