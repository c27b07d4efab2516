"""Per-token log-probs of samples under a model (the forward-only pass), with prefix sharing.

``compute_logprobs`` is the library function behind ``tools/compute_logprobs.py``
(the output format of README.md, "Log-probs"): for every sample, ``logprobs[i] = log p(tokens[i] | tokens[:i])``
for i >= 1 and ``logprobs[0] = 0.0``. With sharing every distinct prefix is computed once
(mechanisms 1 and 2); without, samples are packed back to back. Results are identical.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.data.validation import check_max_sample_length
from megatron_psrl.engine.prefix_kv import check_prefix_taps
from megatron_psrl.engine.runners import make_runner
from megatron_psrl.engine.step import ComputedLogprobs, StepRunner
from megatron_psrl.kvcache import BlockKVCache, KVGeometry
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.model.logits import DEFAULT_CHUNK_BYTES
from megatron_psrl.model.stages import split_of_config
from megatron_psrl.schedule.config import PlannerConfig
from megatron_psrl.schedule.cost import CostModel
from megatron_psrl.schedule.memory import MemorySettings
from megatron_psrl.schedule.plan import token_aliases
from megatron_psrl.schedule.with_memory import plan_with_memory, transfer_reasons, whole_tree_reasons
from megatron_psrl.tree.build import build_prefix_tree
from megatron_psrl.tree.prefix_tree import PrefixTree


def compute_logprobs(
    model,
    arch: ModelArchitecture,
    batch: SampleBatch,
    prefix_sharing: bool = True,
    micro_batch_tokens: int = 8192,
    kv_cache_budget: int = 1 << 30,
    attention_backend: Optional[str] = None,
    device: Optional[torch.device] = None,
    allow_rope_extrapolation: bool = False,
    placement: str = "auto",
    cost_model: Optional[CostModel] = None,
    exchange_group=None,
    loss_head_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    planner_settings: Optional[dict] = None,
    cross_group_prefix: str = "auto",
) -> List[np.ndarray]:
    """float32 log-prob arrays, one per sample, aligned with its tokens (index 0 is 0.0), of a
    bare megatron model (an engine's is :meth:`~megatron_psrl.engine.engine.Engine.compute_logprobs`).

    Works in a single process and under torchrun: data (and context) parallel ranks split the
    trees, with the same placement as training (``placement``; a tree may be spread over the
    ranks of an exchange group, ``exchange_group``, default from megatron's parallel state);
    tensor-parallel ranks split the model; every rank returns the full result. Samples longer
    than the model's ``max_position_embeddings`` are refused unless ``allow_rope_extrapolation``.
    ``planner_settings`` (from a cost calibration, ``MeasuredCosts.planner_settings``) replace
    ``cost_model`` for the placement decision; ``cross_group_prefix``: trees split between
    exchange groups recompute or receive their shared prefix (``PlannerConfig``).
    """
    device = device or next(model.parameters()).device
    if arch.sample_length_limit is not None:
        # A window the model reads and no layer applies: longer samples would be silently wrong.
        check_max_sample_length(batch, arch.sample_length_limit, "the model's sliding window")
    if not allow_rope_extrapolation:
        check_max_sample_length(batch, arch.max_position_embeddings, "the model's max_position_embeddings",
                                "--allow-rope-extrapolation scores it anyway")
    initialized = parallel_state.model_parallel_is_initialized()
    ranks = parallel_state.get_data_parallel_world_size(with_context_parallel=True) if initialized else 1
    me = parallel_state.get_data_parallel_rank(with_context_parallel=True) if ranks > 1 else 0
    tp = parallel_state.get_tensor_model_parallel_world_size() if initialized else 1
    cp = parallel_state.get_context_parallel_world_size() if initialized else 1
    if exchange_group is None and ranks > 1:
        exchange_group = parallel_state.get_context_parallel_group() if cp > 1 else parallel_state.get_data_parallel_group()
    group_size = dist.get_world_size(exchange_group) if exchange_group is not None else 1
    dtype = next(model.parameters()).dtype
    pp = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if initialized else 0
    chunks = model_chunks(model)
    split = split_of_config(chunks[0].config) if len(chunks) == 1 else pp * len(chunks)
    geometry = KVGeometry.for_model(arch, tp, split, dtype, device, pipeline_rank=pp_rank,
                                    virtual_pipeline_size=len(chunks))
    check_prefix_taps(arch, geometry, model)
    plan_geometry = KVGeometry.for_pipeline_planning(arch, tp, split, dtype, device, len(chunks))
    fixed = plan_geometry.fixed_bytes_per_source > 0  # (any stage's layers: every stage places alike)
    if whole_tree_reasons(pp, recompute=False, placement=placement, fixed_states=fixed):
        placement = "whole-tree"
    if transfer_reasons(pp, recompute=False, moe=arch.is_moe, fixed_states=fixed):
        cross_group_prefix = "recompute"
    config = PlannerConfig(micro_batch_tokens=micro_batch_tokens, data_parallel_size=ranks,
                           sharing="tree" if prefix_sharing else "none", exchange_group_size=group_size,
                           placement=placement, local_rank=me, cross_group_prefix=cross_group_prefix,
                           **(planner_settings or dict(cost_model=cost_model)))
    group = parallel_state.get_data_parallel_group(with_context_parallel=True) if ranks > 1 else None
    runner = make_runner(model, arch.vocab_size, device, attention_backend, BlockKVCache(geometry, kv_cache_budget),
                         exchange_group=exchange_group, loss_head_chunk_bytes=loss_head_chunk_bytes,
                         head_send_group=group)
    return run_logprobs(runner, plan_geometry, batch, config, kv_cache_budget, me, group)


def run_logprobs(runner: StepRunner, plan_geometry: KVGeometry, batch: SampleBatch, config: PlannerConfig,
                 kv_cache_budget: int, rank: int, group=None, with_entropy: bool = False):
    """The log-prob pass: the batch's tree, planned with ``config`` (K/V blocks only in the
    memory plan), forward on this placement ``rank``'s micro-batches through ``runner`` (model
    in eval mode), every rank's results gathered over ``group`` into per-sample arrays.

    Returns the per-sample log-prob arrays; with ``with_entropy``, ``(log-probs, entropies)``
    where ``entropies[s][i]`` is the entropy of the distribution that predicts token i of
    sample s (0.0 at position 0, like the log-probs)."""
    tree = build_prefix_tree(batch)
    plan, memories, _ = plan_with_memory(tree, config, MemorySettings(plan_geometry, kv_cache_budget).forward)
    model = runner.model
    was_training = model.training
    model.eval()
    try:
        local = runner.logprobs(plan, rank, memories[rank], with_entropy=with_entropy).logprobs
    finally:
        model.train(was_training)
        runner.kv_cache.release_pool()
    aliases = token_aliases(plan.head_sends)
    logprobs = per_sample_logprobs(plan.tree, local, group, fill=0.0, aliases=aliases)
    if not with_entropy:
        return logprobs
    index, _ = local.arrays()
    return logprobs, per_sample_values(plan.tree, index, local.entropy_array(), group, fill=0.0, aliases=aliases)


def per_sample_logprobs(tree: PrefixTree, computed: ComputedLogprobs, group=None, fill: float = 0.0,
                        aliases: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> List[np.ndarray]:
    """Per-sample float32 arrays from the tree-token log-probs ``computed`` on this rank and on
    every rank of ``group`` (one gather of index / value arrays): ``fill`` where no rank
    computed one, 0.0 at position 0 (no log-prob there). ``aliases``: ``(tokens, tokens whose
    values they take)``, the copies of transferred heads (``StepPlan.head_sends``)."""
    index, values = computed.arrays()
    return per_sample_values(tree, index, values, group, fill, aliases)


def per_sample_values(tree: PrefixTree, index: np.ndarray, values: np.ndarray, group=None, fill: float = 0.0,
                      aliases: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> List[np.ndarray]:
    """Per-sample float32 arrays of per-tree-token ``values`` computed at tree tokens ``index``
    on this rank and on every rank of ``group`` (one gather): ``fill`` where no rank computed
    one, 0.0 at position 0; tokens ``aliases[0]`` take the values of ``aliases[1]``."""
    if group is not None and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (index, values), group=group)
        index = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
    batch = tree.batch
    per_tree_token = np.full(tree.num_tree_tokens, fill, dtype=np.float32)
    per_tree_token[index] = values
    if aliases is not None and len(aliases[0]):  # heads a copy imported: the home copy computed them
        per_tree_token[aliases[0]] = per_tree_token[aliases[1]]
    flat = per_tree_token[tree.sample_token_index]
    flat[batch.offsets[:-1]] = 0.0
    return [flat[batch.offsets[s]:batch.offsets[s + 1]].copy() for s in range(batch.num_samples)]
