"""Calibrate the planner's cost model on the real model, device and links.

FLOP counts predict time poorly on real hardware: small GEMMs, the attention kernels, the
loss head and per-micro-batch overhead all run at different rates. Before its first step a
run that may place tree fragments across ranks measures, on its own model:

- seconds per token (the transformer layers), per (query, key) pair (attention) and per logit
  row (the output layer and the log-softmax), and a fixed cost per micro-batch: forward +
  backward of a few synthetic packs, fitted by least squares;
- seconds per byte and per exchange of the prefix K/V all-to-all over the exchange group.

The measurements are averaged over all ranks, so every rank plans with the same numbers (the
plans, and so the collectives, must be identical everywhere). The measuring passes leave no
gradient behind (:func:`discard_gradients`): the optimizer exists already, and its first step
must see only its own batch's gradients. ``--cost-profile FILE`` stores
them and reuses them on later runs of the same model, dtype, device and parallel layout.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
from megatron_psrl.checkpoint.atomic import atomic_write_text
from megatron_psrl.distributed.kv_exchange import return_replica_grads
from megatron_psrl.errors import CheckpointError
from megatron_psrl.model.logits import vocab_parallel_logprobs
from megatron_psrl.tree.cost import CostModel


@dataclass
class MeasuredCosts:
    """Seconds of the update step's parts on this model and device (forward + backward)."""

    seconds_per_token: float
    """Transformer layers' GEMMs and elementwise work, per computed token."""

    seconds_per_key: float
    """Attention, per (query, key) pair."""

    seconds_per_row: float
    """Output layer and log-softmax (forward + backward), per logit row."""

    seconds_per_micro_batch: float
    """Fixed overhead of one micro-batch (kernel launches, Python, packing)."""

    seconds_per_byte: float = 0.0
    """Prefix K/V exchange, per byte a rank sends to the others (0: no exchange group)."""

    seconds_per_exchange: float = 0.0
    """Prefix K/V exchange, fixed cost (latency) of one per-layer all-to-all."""

    key: str = ""
    """What the measurement is valid for (model, dtype, device, layout)."""

    def cost_model(self) -> CostModel:
        return CostModel(self.seconds_per_token, self.seconds_per_key, self.seconds_per_row, name="measured")

    def planner_settings(self, num_layers: int, kv_bytes_per_token: float) -> dict:
        """``PlannerConfig`` fields in seconds: a cross-rank step pays one all-to-all per layer
        forward and one backward, and moves ``kv_bytes_per_token`` (K and V of all layers) per
        exchanged token."""
        return dict(cost_model=self.cost_model(), kv_bytes_per_token=kv_bytes_per_token,
                    cost_per_exchanged_byte=self.seconds_per_byte,
                    cost_per_exchange=2 * num_layers * self.seconds_per_exchange,
                    cost_per_micro_batch=self.seconds_per_micro_batch)

    def predict(self, tokens: float, keys: float, rows: float, micro_batches: int = 1) -> float:
        return (self.seconds_per_token * tokens + self.seconds_per_key * keys + self.seconds_per_row * rows
                + self.seconds_per_micro_batch * micro_batches)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def discard_gradients(model) -> None:
    """Drop every gradient a backward pass left in ``model``: ``.grad``, and megatron DDP's fp32
    ``main_grad`` buffer its hooks moved it into (the optimizer's main-parameter gradients are
    only filled from that buffer by its step). DDP's ``--overlap-grad-reduce`` bookkeeping
    counts nothing outside a step (``TrainingOptimizer`` holds its buckets)."""
    for p in model.parameters():
        p.grad = None
        main_grad = getattr(p, "main_grad", None)
        if main_grad is not None:
            main_grad.zero_()


def pack_step(model, vocab_size: int, device, segments: List[int], rows: int):
    """Forward + backward of one synthetic pack: ``segments`` causal chains, ``rows`` logits."""
    n = int(sum(segments))
    gen = torch.Generator().manual_seed(n + 7 * len(segments) + rows)
    ids = torch.randint(0, vocab_size, (n,), generator=gen).to(device)
    pos = torch.cat([torch.arange(s) for s in segments]).to(device)
    meta = TreeAttentionMetadata(plan=causal_plan(segments))

    def run():
        hidden = model(ids, pos, meta)[:, 0]
        loss = hidden.float().square().mean()
        if rows:
            logits = model.output_logits(hidden[:rows])
            logp, _ = vocab_parallel_logprobs(logits, ids[:rows], vocab_size)
            loss = loss + logp.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)  # (megatron's DDP hooks moved it to main_grad already)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def measure_compute(model, vocab_size: int, device, max_tokens: int, repeats: int = 3) -> np.ndarray:
    """``[seconds/token, seconds/key, seconds/row, seconds/micro-batch]`` on this rank."""
    n = int(max(64, min(max_tokens, 1024)))
    configs = [  # (segments, rows): vary tokens, key pairs and rows independently
        ([n], 0),
        ([n // 8] * 8, 0),
        ([n // 2], 0),
        ([n // 4], 0),
        ([n], n // 2),
    ]
    rows_a, times = [], []
    try:
        for segments, rows in configs:
            tokens = sum(segments)
            keys = sum(s * (s + 1) // 2 for s in segments)
            rows_a.append([tokens, keys, rows, 1.0])
            times.append(median_seconds(pack_step(model, vocab_size, device, segments, rows), repeats))
    finally:
        # Once, not per pass: zeroing a large model's fp32 buffer would count as per-pass cost.
        discard_gradients(model)
    coef, *_ = np.linalg.lstsq(np.asarray(rows_a, dtype=np.float64), np.asarray(times), rcond=None)
    floor = np.array([1e-12, 1e-15, 1e-12, 0.0])
    return np.maximum(coef, floor)


def measure_exchange(group, bytes_per_row: int, device, repeats: int = 3) -> np.ndarray:
    """``[seconds/byte, seconds/exchange]`` of the per-layer all-to-all over ``group``: rows of
    ``bytes_per_row`` (one layer's K and V of a token), to every other rank; the latency from
    one row, the bandwidth from the slope to 2048 rows (bytes sent to other ranks)."""
    g = dist.get_world_size(group)
    times, sizes = [], [1, 2048]
    for rows in sizes:
        send = torch.zeros((rows * g, max(1, bytes_per_row // 4)), dtype=torch.float32, device=device)
        counts = [rows] * g
        times.append(median_seconds(lambda send=send, counts=counts: return_replica_grads(send, counts, counts, group), repeats))
    per_byte = max((times[1] - times[0]) / ((sizes[1] - sizes[0]) * (g - 1) * bytes_per_row), 0.0)
    return np.array([per_byte, max(times[0], 0.0)])


def calibrate_for_planning(model, arch, geometry, device, max_tokens: int, exchange_group,
                           profile: Optional[str] = None) -> MeasuredCosts:
    """:func:`calibrate` for a run that places trees over an exchange group (training and the
    log-prob tool alike): the key names the model, dtype, device and layout."""
    g = dist.get_world_size(exchange_group) if exchange_group is not None else 1
    key = (f"{arch.model_type}-h{arch.hidden_size}-L{arch.num_layers}-{geometry.dtype}-{device.type}"
           f"-kv{geometry.num_groups}x{geometry.head_dim}-group{g}")
    return calibrate(model, arch.vocab_size, device, max_tokens, exchange_group,
                     2 * geometry.bytes_per_token // geometry.num_layers, profile=profile, key=key)


def calibrate(model, vocab_size: int, device, max_tokens: int, exchange_group=None, layer_row_bytes: int = 0,
              profile: Optional[str] = None, key: str = "") -> MeasuredCosts:
    """Measure (or read from ``profile``) this run's costs, the same on every rank: rank 0
    reads the profile and tells the others, so all measure or none does."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    stored = None
    if profile and (not distributed or dist.get_rank() == 0) and os.path.exists(profile):
        try:
            with open(profile, encoding="utf-8") as f:
                stored = MeasuredCosts(**json.load(f))
        except (ValueError, TypeError) as exc:
            raise CheckpointError(profile, f"not a cost profile: {exc}") from None
        if stored.key != key:
            stored = None
    if distributed:
        box = [stored]
        dist.broadcast_object_list(box, src=0)
        stored = box[0]
    if stored is not None:
        return stored
    compute = measure_compute(model, vocab_size, device, max_tokens)
    link = np.zeros(2)
    if exchange_group is not None and dist.get_world_size(exchange_group) > 1 and layer_row_bytes:
        link = measure_exchange(exchange_group, layer_row_bytes, device)
    values = torch.tensor(np.concatenate([compute, link]), dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    v = values.tolist()
    measured = MeasuredCosts(*v[:4], seconds_per_byte=v[4], seconds_per_exchange=v[5], key=key)
    if profile and (not dist.is_initialized() or dist.get_rank() == 0):
        atomic_write_text(profile, json.dumps(asdict(measured), indent=2) + "\n")
    return measured
