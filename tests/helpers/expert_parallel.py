"""The expert-parallel checks shared by the MoE torchrun scripts: every parameter this rank
holds against the per-sample reference (dense ones summed over the data-parallel ranks, this
rank's experts renumbered to their global index, a pipeline stage's layers to theirs, a
tensor-parallel rank's shard of the reference), the log-probs, and one SGD step."""

import re
from typing import Callable, Dict

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer

from helpers.hf_reference import hf_grads_to_mcore, per_sample_logprobs
from megatron_psrl.checkpoint.sharding import tp_shard
from megatron_psrl.model.moe import expert_index

LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")


def rank_reference(actor, ref_grads: Dict[str, torch.Tensor], ep_rank: int,
                   ep_size: int) -> Callable[[str], torch.Tensor]:
    """Parameter name of this rank's model -> the reference tensor (``ref_grads``: HF names,
    fused or per-expert experts)."""
    full = hf_grads_to_mcore(ref_grads, actor.arch)
    per_rank = (actor.arch.num_experts or 0) // ep_size
    # a pipeline stage numbers its layers from 0: its first layer is global layer `offset`
    offset = min(m.layer_number for m in actor.model.modules() if isinstance(m, TransformerLayer)) - 1
    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()

    def reference(name):
        parts = expert_index(name)  # this rank's local expert j is global expert ep_rank * E / EP + j
        if parts is not None:
            name = f"{parts[0]}{parts[1] + ep_rank * per_rank}{parts[2]}"
        layer = LAYER.match(name)
        name = f"{layer.group(1)}{int(layer.group(2)) + offset}{layer.group(3)}" if layer else name
        return tp_shard(name, full[name], actor.arch, tp, tp_rank)  # (TP = 1: the tensor itself)

    return reference


def assert_rank_grads_match(actor, ref_grads: Dict[str, torch.Tensor], ep_rank: int, ep_size: int,
                            rel: float = 1e-5) -> float:
    """After ``actor.forward_backward`` and the gradient reduction: every ``main_grad`` of this
    rank within ``rel`` of the reference's; the worst relative error."""
    reference = rank_reference(actor, ref_grads, ep_rank, ep_size)
    worst = 0.0
    for name, p in actor.model.named_parameters():
        expected = reference(name)
        scale = float(expected.abs().max())
        err = float((p.main_grad - expected).abs().max())
        worst = max(worst, err / (scale + 1e-30))
        assert err <= rel * scale + 1e-9, (name, err, scale)
    return worst


def assert_step_grads_match(actor, records, ref_loss: float, ref_grads: Dict[str, torch.Tensor], ep_rank: int,
                            ep_size: int):
    """One ``actor.forward_backward(records)``: its loss within 1e-5 of ``ref_loss``; then the
    gradients summed as megatron's DDP sums them (dense over DP, experts over expert-DP) and
    every rank's ``main_grad`` checked (:func:`assert_rank_grads_match`). Returns
    ``(result, worst relative gradient error)``; the gradients stay for the caller."""
    result = actor.forward_backward(records)
    assert abs(result.loss - ref_loss) <= 1e-5 * abs(ref_loss), (result.loss, ref_loss)
    actor.engine.optimizer.reduce_gradients()
    return result, assert_rank_grads_match(actor, ref_grads, ep_rank, ep_size)


def assert_logprobs_match(actor, records, hf, batch, atol: float = 1e-5) -> float:
    """``actor.compute_logprobs(records)`` within ``atol`` of the per-sample HF model's; the worst error."""
    ours = actor.compute_logprobs(records)
    err = max(float(np.abs(a - b).max()) for a, b in zip(ours, per_sample_logprobs(hf, batch)))
    assert err <= atol, err
    return err


def assert_sgd_step_matches(actor, records, ref_loss: float, ref_grads: Dict[str, torch.Tensor], ep_rank: int,
                            ep_size: int) -> dict:
    """One ``train_step`` of an actor built with SGD, lr 1 and no clipping, through megatron's
    optimizer: the loss is the reference's and every parameter moved by minus the reference
    gradient; the step's metrics."""
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics = actor.train_step(records)
    assert abs(metrics["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (metrics["loss"], ref_loss)
    reference = rank_reference(actor, ref_grads, ep_rank, ep_size)
    for name, p in actor.model.named_parameters():
        expected = reference(name)
        err = float((before[name] - p.detach() - expected).abs().max())
        assert err <= 1e-5 * float(expected.abs().max()) + 2e-7 * float(before[name].abs().max()) + 1e-9, name
    return metrics
