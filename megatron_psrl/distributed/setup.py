"""Process-group setup: torch.distributed (NCCL on GPU, gloo on CPU) and megatron's parallel_state.

Works under ``torchrun`` (reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) and in a plain
single process (a one-rank gloo group on a free local port), so library users and tests need
no launcher for TP = PP = DP = 1.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.compat import quiet_expected_import_warnings, seed_model_parallel_rng
from megatron_psrl.distributed import nccl_emulation
from megatron_psrl.distributed.monitor import DEFAULT_TIMEOUT_MINUTES, CollectiveMonitor, timeout_delta
from megatron_psrl.distributed.worker_group import close_worker_group_store, worker_group_store
from megatron_psrl.errors import ConfigurationError, MissingRequirementError

quiet_expected_import_warnings()


@dataclass
class ParallelLayout:
    """This process's place in the TP x PP x DP grid."""

    rank: int
    """Global rank."""

    world_size: int
    """Number of processes."""

    tensor_parallel_size: int
    """TP size."""

    pipeline_parallel_size: int
    """PP size."""

    data_parallel_size: int
    """DP size = world / (TP * PP * CP)."""

    tp_rank: int
    """Rank inside the TP group."""

    pp_rank: int
    """Rank inside the PP group (pipeline stage)."""

    dp_rank: int
    """Rank inside the DP group."""

    device: torch.device
    """Device this rank computes on."""

    context_parallel_size: int = 1
    """CP size: ranks of one CP group share the fragments of the same trees (exchanging their
    prefix K/V); gradients are summed over DP x CP."""

    cp_rank: int = 0
    """Rank inside the CP group."""

    monitor: CollectiveMonitor = field(default=None, repr=False, compare=False)
    """Names the phase and the peer when a collective times out (``monitor.phase(name)``;
    always set by :func:`initialize_parallel`)."""

    @property
    def placement_rank(self) -> int:
        """This rank's index among the DP x CP ranks that share a step's batch (the index of its
        plan in ``StepPlan.ranks``): CP groups are consecutive blocks of it."""
        return self.dp_rank * self.context_parallel_size + self.cp_rank

    @property
    def placement_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise MissingRequirementError("--device cuda requested but CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(requested)


def _init_process_group(dev: torch.device, timeout_minutes: float) -> None:
    """torch.distributed's default process group, from torchrun's, another launcher's or no
    environment."""
    # On CUDA: NCCL for tensors on the GPU and gloo for CPU tensors (object collectives,
    # small metadata), so neither kind of collective can hit a backend that lacks it.
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    timeout = timeout_delta(timeout_minutes)
    # Bound to its GPU, the process group creates NCCL communicators eagerly (the default
    # group's now, megatron's groups as they are made): lazily, a group's communicator is
    # made at its first operation by all members together, which deadlocks a rank whose first
    # operation there waits behind a peer busy elsewhere.
    eager = dict(device_id=dev) if dev.type == "cuda" else {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun
        dist.init_process_group(backend=backend, store=worker_group_store(timeout), timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **eager)
    elif "RANK" in os.environ:  # another launcher
        dist.init_process_group(backend=backend, timeout=timeout, **eager)
    else:  # a plain single process; no environment variables are set (children inherit them)
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, timeout=timeout, **eager)


def initialize_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    seed: int = 1234,
    device: str = "auto",
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
) -> ParallelLayout:
    """Initialise torch.distributed (if needed), megatron's parallel_state, and RNG seeds.

    ``timeout_minutes`` (``--distributed-timeout-minutes``) bounds every collective: a rank
    that waits longer on a stopped or dead peer raises an error naming the operation and the
    peer (see :mod:`megatron_psrl.distributed.monitor`). ``expert_model_parallel_size``: MoE
    experts split over that many data-parallel ranks (megatron's expert-parallel groups)."""
    dev = pick_device(device)
    if not dist.is_initialized():
        _init_process_group(dev, timeout_minutes)
    # PSRL_EMULATE_NCCL=1: point-to-point on gloo behaves as on NCCL (CI catches ordering hangs)
    nccl_emulation.install(timeout_delta(timeout_minutes).total_seconds())
    world = dist.get_world_size()
    model_ranks = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    if world % model_ranks:
        layout = (f"TP {tensor_parallel_size} x PP {pipeline_parallel_size}"
                  + (f" x CP {context_parallel_size}" if context_parallel_size > 1 else ""))
        if world == 1:
            raise ConfigurationError(
                f"{layout} needs {model_ranks} processes, this is one: launch with "
                f"`torchrun --nproc_per_node {model_ranks} ...` (or a multiple of {model_ranks} for data parallelism)")
        raise ConfigurationError(f"world size {world} is not a multiple of {layout}")
    if expert_model_parallel_size < 1 or (world // pipeline_parallel_size) % expert_model_parallel_size:
        # (expert tensor parallelism 1: experts are split over the data x context x tensor parallel ranks)
        raise ConfigurationError(f"--expert-model-parallel-size {expert_model_parallel_size} must divide the "
                                 f"{world // pipeline_parallel_size} ranks of a pipeline stage (experts are split "
                                 "over the data- and tensor-parallel ranks)")
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel_size
            or parallel_state.get_pipeline_model_parallel_world_size() != pipeline_parallel_size
            or parallel_state.get_context_parallel_world_size() != context_parallel_size
            or parallel_state.get_expert_model_parallel_world_size() != expert_model_parallel_size
        ):
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        # Its sub-groups get the same timeout (megatron takes minutes; fractions work).
        parallel_state.initialize_model_parallel(
            tensor_parallel_size, pipeline_parallel_size, context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size, expert_tensor_parallel_size=1,
            distributed_timeout_minutes=timeout_delta(timeout_minutes).total_seconds() / 60.0,
        )
    if dev.type == "cuda" or nccl_emulation.enabled():
        warm_up_groups(dev)
    seed_model_parallel_rng(seed, dev)
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=world,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        context_parallel_size=context_parallel_size,
        cp_rank=parallel_state.get_context_parallel_rank(),
        device=dev,
        monitor=_monitor(timeout_minutes),
    )


def megatron_groups() -> List:
    """This rank's process groups of megatron's parallel state, each once, in an order every
    rank shares (groups of one kind are disjoint: each rank meets its own of every kind in turn)."""
    getters = [
        lambda: dist.group.WORLD,
        parallel_state.get_tensor_model_parallel_group,
        parallel_state.get_pipeline_model_parallel_group,
        parallel_state.get_data_parallel_group,
        parallel_state.get_context_parallel_group,
        lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
        parallel_state.get_tensor_and_context_parallel_group,
        parallel_state.get_model_parallel_group,
        parallel_state.get_expert_model_parallel_group,
        parallel_state.get_expert_tensor_parallel_group,
        parallel_state.get_expert_data_parallel_group,
        parallel_state.get_expert_tensor_and_model_parallel_group,
        parallel_state.get_expert_tensor_model_pipeline_parallel_group,
        lambda: parallel_state.get_embedding_group(check_initialized=False),
        lambda: parallel_state.get_position_embedding_group(check_initialized=False),
    ]
    groups, seen = [], set()
    for getter in getters:
        try:
            group = getter()
        except (AssertionError, AttributeError, RuntimeError, TypeError):
            continue  # a kind this megatron does not make, or this rank is in none of
        if group is not None and id(group) not in seen and dist.get_rank(group) >= 0:
            seen.add(id(group))
            groups.append(group)
    return groups


def warm_up_groups(device: torch.device, groups: Optional[List] = None) -> None:
    """One collective on every group (``groups``; default: :func:`megatron_groups`) at
    start-up, so that no group's NCCL communicator is first made in the middle of a step
    (``device``: the tensor's, the backend that gets the communicator)."""
    probe = torch.zeros(1, device=device)
    for group in megatron_groups() if groups is None else groups:
        dist.all_reduce(probe, group=group)


_MONITORS: Dict[str, CollectiveMonitor] = {}
"""The heartbeat of this process's process group (one, like the process group itself)."""


def _monitor(timeout_minutes: float) -> CollectiveMonitor:
    if "current" not in _MONITORS:
        _MONITORS["current"] = CollectiveMonitor(timeout_minutes)
    return _MONITORS["current"]


def exchange_group_of(layout: ParallelLayout):
    """``(process group, size)`` of the ranks that exchange prefix K/V with this one.

    With context parallelism, the CP group: megatron puts its ranks next to each other (inside
    a node, on the fast links), and trees are balanced whole over the data-parallel replicas.
    Without it, the data-parallel group of this tensor-parallel rank (one tree may then be
    spread over all data-parallel ranks)."""
    if layout.context_parallel_size > 1:
        return parallel_state.get_context_parallel_group(), layout.context_parallel_size
    return parallel_state.get_data_parallel_group(), layout.data_parallel_size


def gradient_group():
    """The ranks whose gradients are summed: data x context parallel (as megatron does)."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def shutdown_parallel() -> None:
    monitor = _MONITORS.pop("current", None)
    if monitor is not None:
        monitor.close()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    nccl_emulation.close_streams()
    if dist.is_initialized():
        dist.destroy_process_group()
    close_worker_group_store()
