"""Calibrate the planner's cost model on the real model, device and links.

FLOP counts predict time poorly on real hardware: small GEMMs, the attention kernels, the
loss head and per-micro-batch overhead all run at different rates. Before its first step a
run that may place tree fragments across ranks measures, on its own model:

- seconds per token (the transformer layers), per (query, key) pair (attention) and per logit
  row (the output layer and the log-softmax), and a fixed cost per micro-batch: forward +
  backward of a few synthetic packs, fitted by least squares;
- seconds per byte and per exchange of the prefix K/V all-to-all over the exchange group;
- the share of that exchange the overlap leaves exposed (``exchange_exposed_fraction``): one
  layer's all-to-all started asynchronously while one layer's attention over a micro-batch's
  keys runs, as the overlapped exchange does, through the attention backend the run uses
  (:func:`measure_exchange_overlap`). With the overlap on (``--no-overlap-kv-exchange`` turns
  it off) the planner charges only that share of the exchange
  (:func:`megatron_psrl.schedule.cost.exposed_exchange_cost`). Only the ``torch`` backend
  overlaps (:data:`~megatron_psrl.attention.backends.OVERLAPS_EXCHANGE`): ``flash``, ``te``
  and ``dense`` wait for the received rows before their kernel starts, so a run with them is
  charged the whole exchange and nothing is measured.

Every time is taken by :func:`timed_seconds`, which drains the device before the clock starts
and before it stops: CUDA kernels and NCCL collectives run asynchronously, and a host timer
around their launch would time the launch (an exchange would look free).

The measurements are averaged over all ranks, so every rank plans with the same numbers (the
plans, and so the collectives, must be identical everywhere). The measuring passes leave no
gradient behind (:func:`discard_gradients`): the optimizer exists already, and its first step
must see only its own batch's gradients. ``--cost-profile FILE`` stores
them and reuses them on later runs of the same model, dtype, device and parallel layout. A
checkpoint records the costs its run planned with, and a run resuming it plans with them again
(``--recalibrate`` measures anew): plans follow the costs, so a resumed run that measured again
could place and cut trees otherwise, and sum the same numbers in another order.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
from megatron_psrl.attention.backends import OVERLAPS_EXCHANGE, blockwise_tree_attention
from megatron_psrl.checkpoint.atomic import atomic_write_text
from megatron_psrl.distributed.kv_exchange import ExchangeInFlight, return_replica_grads
from megatron_psrl.errors import CheckpointError
from megatron_psrl.kvcache.prefix_state import PrefixState
from megatron_psrl.model.logits import vocab_parallel_logprobs
from megatron_psrl.schedule.cost import CostModel, exposed_exchange_fraction


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

    exchange_exposed_fraction: float = 1.0
    """Share of a per-layer exchange left exposed when it overlaps with the attention over the
    rank's own keys: ``max(0, exchange - hidden) / exchange`` measured at a micro-batch's size
    (:func:`measure_exchange_overlap`; 1: nothing hidden, or not measured)."""

    key: str = ""
    """What the measurement is valid for (model, dtype, device, layout)."""

    overlap_kv_exchange: bool = True
    """The run overlaps the exchange (``ActorConfig.overlap_kv_exchange``): the planner charges
    the exposed share only. A setting of the run, not a measurement (a stored profile's value
    is replaced by the run's)."""

    def to_record(self) -> dict:
        """The fields as JSON-ready values (a ``--cost-profile`` file, a checkpoint's record)."""
        return asdict(self)

    @classmethod
    def from_record(cls, record, path: str) -> "MeasuredCosts":
        """The costs a profile or checkpoint stores; a malformed record is one
        :class:`CheckpointError` naming ``path``."""
        if not isinstance(record, dict):
            raise CheckpointError(path, "not a cost calibration record: expected a JSON object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - names)
        if unknown:
            raise CheckpointError(path, f"not a cost calibration record: unknown field(s) {', '.join(unknown)}")
        try:
            costs = cls(**record)
        except TypeError as exc:  # a missing field
            raise CheckpointError(path, f"not a cost calibration record: {exc}") from None
        numbers = [getattr(costs, f.name) for f in fields(cls) if f.name not in ("key", "overlap_kv_exchange")]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                   for x in numbers) or not isinstance(costs.key, str):
            raise CheckpointError(path, "not a cost calibration record: every cost must be a finite number >= 0")
        return costs

    def cost_model(self) -> CostModel:
        return CostModel(self.seconds_per_token, self.seconds_per_key, self.seconds_per_row, name="measured")

    def planner_settings(self, num_layers: int, kv_bytes_per_token: float, overlap: Optional[bool] = None) -> dict:
        """``PlannerConfig`` fields in seconds: a cross-rank step pays one all-to-all per layer
        forward and one backward, and moves ``kv_bytes_per_token`` (K and V of all layers) per
        exchanged token. With the exchange overlapped (``overlap``, default the run's
        ``overlap_kv_exchange``) both are charged only for their exposed share
        (``exchange_exposed_fraction``: ``max(0, exchange - overlappable)`` per layer, as a
        share measured at a micro-batch's size)."""
        overlap = self.overlap_kv_exchange if overlap is None else overlap
        exposed = min(1.0, max(0.0, self.exchange_exposed_fraction)) if overlap else 1.0
        # A prefix head sent between groups travels once, all layers together, not overlapped:
        # its bytes at the measured link speed, a send and a receive of latency.
        return dict(cost_model=self.cost_model(), kv_bytes_per_token=kv_bytes_per_token,
                    cost_per_exchanged_byte=self.seconds_per_byte * exposed,
                    cost_per_exchange=2 * num_layers * self.seconds_per_exchange * exposed,
                    cost_per_micro_batch=self.seconds_per_micro_batch,
                    cost_per_transferred_byte=self.seconds_per_byte, cost_per_transfer=2 * self.seconds_per_exchange)

    def predict(self, tokens: float, keys: float, rows: float, micro_batches: int = 1) -> float:
        return (self.seconds_per_token * tokens + self.seconds_per_key * keys + self.seconds_per_row * rows
                + self.seconds_per_micro_batch * micro_batches)


def drain(device) -> None:
    """Wait until the work queued on ``device`` has run (CUDA: every stream of the device, NCCL's
    included; CPU runs synchronously: nothing)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_seconds(fn, device=None) -> float:
    """Seconds ``fn()`` keeps ``device`` busy: the device is drained before the clock starts (work
    queued earlier is not ``fn``'s) and before it stops (``fn``'s own kernels have run, not only
    been launched). The one clock of the calibration (a test checks it is the only one)."""
    drain(device)
    t0 = time.perf_counter()
    fn()
    drain(device)
    return time.perf_counter() - t0


def median_seconds(fn, repeats: int, device=None) -> float:
    """Median of ``repeats`` :func:`timed_seconds` of ``fn`` on ``device`` after one warm-up call."""
    timed_seconds(fn, device)  # warm-up
    return float(np.median([timed_seconds(fn, device) for _ in range(repeats)]))


def discard_gradients(model) -> None:
    """Drop every gradient a backward pass left in ``model``: ``.grad``, and megatron DDP's fp32
    ``main_grad`` buffer its hooks moved it into (the optimizer's main-parameter gradients are
    only filled from that buffer by its step). DDP's ``--overlap-grad-reduce`` bookkeeping
    counts nothing outside a step's last backward (``TrainingOptimizer.bucket_launches``)."""
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
            times.append(median_seconds(pack_step(model, vocab_size, device, segments, rows), repeats, device))
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
        times.append(median_seconds(lambda send=send, counts=counts: return_replica_grads(send, counts, counts, group),
                                    repeats, device))
    per_byte = max((times[1] - times[0]) / ((sizes[1] - sizes[0]) * (g - 1) * bytes_per_row), 0.0)
    return np.array([per_byte, max(times[0], 0.0)])


def measure_exchange_overlap(group, num_heads: int, num_groups: int, head_dim: int, dtype, device, tokens: int,
                             rows: int, repeats: int = 3, backend: str = "torch") -> float:
    """The exposed share of one layer's prefix K/V all-to-all (``rows`` rows of K and V to every
    rank of ``group``) overlapped with one layer's attention over ``tokens`` causal keys through
    ``backend`` (the forward of a micro-batch's own attention, what the overlapped exchange
    hides it behind): hidden = t(exchange) + t(attention) - t(both), exposed share =
    ``max(0, t(exchange) - hidden) / t(exchange)`` (:func:`exposed_exchange_fraction`).

    1 without measuring for a backend that does not overlap the exchange (not in
    :data:`OVERLAPS_EXCHANGE`): it waits for the received rows before its kernel starts."""
    if backend not in OVERLAPS_EXCHANGE:
        return 1.0
    g = dist.get_world_size(group)
    gen = torch.Generator().manual_seed(tokens + rows)
    row_shape = PrefixState.softmax(num_groups, head_dim, dtype=dtype).row_shape  # one token's K and V
    send = torch.randn((rows * g,) + row_shape, generator=gen).to(device=device, dtype=dtype)
    counts = [rows] * g
    q = torch.randn((tokens, num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    k = torch.randn((tokens, num_groups, head_dim), generator=gen).to(device=device, dtype=dtype)
    v = torch.randn((tokens, num_groups, head_dim), generator=gen).to(device=device, dtype=dtype)
    plan = causal_plan([tokens])

    def exchange():
        ExchangeInFlight(send, counts, counts, group).wait()

    def attention():
        blockwise_tree_attention(q, k, v, plan, (), head_dim ** -0.5)

    def both():
        transfer = ExchangeInFlight(send, counts, counts, group)
        blockwise_tree_attention(q, k, v, plan, (), head_dim ** -0.5)
        transfer.wait()

    t_exchange, t_attention, t_both = (median_seconds(fn, repeats, device) for fn in (exchange, attention, both))
    return exposed_exchange_fraction(t_exchange, t_exchange + t_attention - t_both)


PLANNING_COST_ORIGINS = ("measured", "profile", "checkpoint")
"""Where a run's planning costs came from: measured at start-up, ``--cost-profile``, or the
checkpoint it resumes."""


def planning_key(arch, geometry, device, group_size: int, backend: str = "torch") -> str:
    """What a planning measurement is valid for: the model, dtype, device, attention backend
    (the overlap is measured through it) and layout."""
    return (f"{arch.model_type}-h{arch.hidden_size}-L{arch.num_layers}-{geometry.dtype}-{device.type}"
            f"-kv{geometry.num_groups}x{geometry.head_dim}-{backend}-group{group_size}")


def calibrate_for_planning(model, arch, geometry, device, max_tokens: int, exchange_group,
                           profile: Optional[str] = None, overlap_kv_exchange: bool = True,
                           recorded: Optional[MeasuredCosts] = None, recalibrate: bool = False,
                           backend: str = "torch") -> Tuple[MeasuredCosts, str]:
    """:func:`calibrate` for a run that places trees over an exchange group (training and the
    log-prob tool alike): ``(costs, origin)``, ``origin`` one of :data:`PLANNING_COST_ORIGINS`.

    ``recorded``: the costs the checkpoint being resumed planned with. They are used again
    when they were measured for this run's key (model, dtype, device, layout), before a
    ``profile``, because plans (placement, tree-to-rank assignment, fragment cuts) follow the
    costs, and another plan sums the same numbers in another order. ``recalibrate``: measure
    anew whatever is stored (and replace ``profile``'s content). ``backend``: the run's attention
    backend; one that does not overlap the exchange is charged all of it."""
    g = dist.get_world_size(exchange_group) if exchange_group is not None else 1
    key = planning_key(arch, geometry, device, g, backend)
    heads = geometry.num_groups * (arch.num_attention_heads // arch.num_kv_heads)  # this TP rank's query heads
    stored, origin = _stored_or_measured(
        key, profile, lambda: measure_costs(
            model, arch.vocab_size, device, max_tokens, exchange_group, geometry.row_bytes_per_token // geometry.num_layers,
            key=key, attention_shape=(heads, geometry.num_groups, geometry.head_dim, geometry.dtype), backend=backend),
        recorded, recalibrate)
    return replace(stored, overlap_kv_exchange=overlap_kv_exchange and backend in OVERLAPS_EXCHANGE), origin


def _stored_or_measured(key: str, profile: Optional[str], measure, recorded: Optional[MeasuredCosts] = None,
                        recalibrate: bool = False) -> Tuple[MeasuredCosts, str]:
    """``(costs, origin)``: rank 0 picks the stored costs measured for ``key`` (``recorded``,
    the resumed checkpoint's, then ``profile``'s; none with ``recalibrate``) and every rank takes
    its pick, so all measure or none does; with none, ``measure()`` (a collective) and ``profile``
    keeps the result."""
    stored, origin = None, "measured"
    if not recalibrate and _is_first_rank():
        if recorded is not None and recorded.key == key:
            stored, origin = recorded, "checkpoint"
        else:
            stored = read_profile(profile, key)
            origin = "measured" if stored is None else "profile"
    stored, origin = _from_first_rank((stored, origin))  # every rank plans with the same numbers
    if stored is None:
        stored = measure()
        write_profile(profile, stored)
    return stored, origin


def calibrate(model, vocab_size: int, device, max_tokens: int, exchange_group=None, layer_row_bytes: int = 0,
              profile: Optional[str] = None, key: str = "", attention_shape: Optional[tuple] = None) -> MeasuredCosts:
    """Measure (or read from ``profile``) this run's costs, the same on every rank: rank 0
    reads the profile and tells the others, so all measure or none does. ``attention_shape``
    ``(query heads, K/V groups, head dim, dtype)`` of a layer's attention on this rank: measure
    how much of the exchange the overlap hides (:func:`measure_exchange_overlap`)."""
    return _stored_or_measured(key, profile, lambda: measure_costs(
        model, vocab_size, device, max_tokens, exchange_group, layer_row_bytes, key=key,
        attention_shape=attention_shape))[0]


def measure_costs(model, vocab_size: int, device, max_tokens: int, exchange_group=None, layer_row_bytes: int = 0,
                  key: str = "", attention_shape: Optional[tuple] = None, backend: str = "torch") -> MeasuredCosts:
    """Measure this run's costs on every rank and average them (a collective)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    compute = measure_compute(model, vocab_size, device, max_tokens)
    link = np.array([0.0, 0.0, 1.0])
    if exchange_group is not None and dist.get_world_size(exchange_group) > 1 and layer_row_bytes:
        link[:2] = measure_exchange(exchange_group, layer_row_bytes, device)
        if attention_shape is not None:
            # one layer of a micro-batch: its own keys (at most 1024, as measure_compute), a
            # quarter of them sent to every other rank
            tokens = int(max(64, min(max_tokens, 1024)))
            link[2] = measure_exchange_overlap(exchange_group, *attention_shape, device, tokens, tokens // 4,
                                               backend=backend)
    values = torch.tensor(np.concatenate([compute, link]), dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    v = values.tolist()
    return MeasuredCosts(*v[:4], seconds_per_byte=v[4], seconds_per_exchange=v[5], exchange_exposed_fraction=v[6],
                         key=key)


def read_profile(profile: Optional[str], key: str) -> Optional[MeasuredCosts]:
    """The costs ``profile`` stores for ``key`` (None: no file, or measured for another key)."""
    if not profile or not os.path.exists(profile):
        return None
    try:
        with open(profile, encoding="utf-8") as f:
            record = json.load(f)
    except ValueError as exc:
        raise CheckpointError(profile, f"not a cost profile: {exc}") from None
    stored = MeasuredCosts.from_record(record, profile)
    return stored if stored.key == key else None


def write_profile(profile: Optional[str], measured: MeasuredCosts) -> None:
    """Rank 0 keeps ``measured`` in ``profile`` (atomically; nothing without a profile)."""
    if profile and _is_first_rank():
        atomic_write_text(profile, json.dumps(measured.to_record(), indent=2) + "\n")


def _is_first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _from_first_rank(value):
    """Rank 0's ``value`` on every rank (``value`` itself without other ranks)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
