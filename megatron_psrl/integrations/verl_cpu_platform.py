"""A CPU platform for verl (0.9.x), for testing and development on machines without a GPU.

verl looks its device up through a platform object (``verl.plugin.platform``): the device name
("cuda"), the ``torch.<device>`` module it calls for seeds, streams and memory statistics, and
the collective backend ("nccl"). verl 0.9.1 ships CUDA, ROCm and NPU platforms only, so on a
CPU-only machine its worker asks for NCCL and its ``TrainingWorker`` puts the loss on ``cuda``.
This module registers a ``cpu`` platform (gloo, ``torch.device("cpu")``) and makes it verl's
current platform. Load it through verl's own hook, before verl is imported::

    VERL_USE_EXTERNAL_MODULES=megatron_psrl.integrations.verl_cpu_platform python ...

(``import verl`` imports the modules named there), or import it before anything calls
``verl.plugin.platform.get_platform()``. Ray workers inherit the variable from the driver's
environment. verl's engine registry keys engines by that device name: the ``psrl`` engine is
registered for ``cpu``; an engine registered for ``cuda`` only (verl's FSDP engines) is found
with ``VERL_ENGINE_DEVICE=cuda`` and then runs on CPU with this platform.

What it answers, and how:

- device ``cpu``, vendor ``cpu``, one device; the current device is ``"cpu"``, not an index (verl
  passes it to ``.to()``, where ``0`` would mean ``cuda:0``); no compute capability, no IPC;
- collectives on gloo (the worker's process group is ``cpu:gloo``);
- Ray: one CPU per worker as its "accelerator" (``num_cpus``);
- memory statistics verl logs (``max_memory_allocated`` and the like) are the process's
  resident set: its peak (``max_*``) and current size, as psutil and ``getrusage`` see them; a
  CPU has no allocator cache, so ``empty_cache`` frees nothing.

verl resolves its platform once while ``import verl`` runs, before its hook imports this module
(it logs a fallback to ``nvidia``, then "Replacing already-initialised platform 'cuda' with
'cpu'"): verl's functions ask the platform at each call and get this one; a value a verl module
computed at its own import in between keeps ``cuda`` (the FSDP engine module's ``device_name``,
used only for Ulysses sequence-parallel meshes).

Not for production: it makes verl run its CUDA code paths on CPU tensors; use it to try a
configuration, to test, and to debug.
"""

from __future__ import annotations

import resource
import sys
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

try:
    from verl.plugin.platform import PlatformBase, PlatformRegistry, platform_manager, set_platform
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"megatron_psrl.integrations.verl_cpu_platform needs verl 0.9.x: {exc}") from exc

PLATFORM = "cpu"
"""The platform's name (``VERL_PLATFORM=cpu`` selects it too)."""


def _peak_rss_bytes() -> int:
    # ru_maxrss is in kilobytes on Linux (bytes on macOS); the kernel updates it lazily, so it
    # can trail the resident set read now
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(int(peak) if sys.platform == "darwin" else int(peak) * 1024, _rss_bytes())


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes that ``torch.cpu`` lacks."""
    import psutil

    module = types.ModuleType("verl_cpu_device", "torch.cpu with the torch.cuda calls verl makes (see the "
                              "module docstring of megatron_psrl.integrations.verl_cpu_platform)")
    for name in ("Event", "Stream", "StreamContext", "current_stream", "stream", "synchronize", "is_available"):
        setattr(module, name, getattr(torch.cpu, name))
    module.current_device = torch.cpu.current_device  # "cpu"
    module.device_count = lambda: 1
    module.set_device = lambda device=None: None
    module.get_device_name = lambda device=None: "cpu"
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda device=None: torch.get_rng_state()
    module.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    module.empty_cache = lambda: None
    module.ipc_collect = lambda: None
    module.set_per_process_memory_fraction = lambda fraction, device=None: None
    module.memory_allocated = lambda device=None: _rss_bytes()
    module.memory_reserved = lambda device=None: _rss_bytes()
    module.max_memory_allocated = lambda device=None: _peak_rss_bytes()
    module.max_memory_reserved = lambda device=None: _peak_rss_bytes()
    module.reset_peak_memory_stats = lambda device=None: None
    module.mem_get_info = lambda device=None: (psutil.virtual_memory().available, psutil.virtual_memory().total)
    return module


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl's platform interface on CPU (see the module docstring)."""

    _module = None

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        if PlatformCPU._module is None:
            PlatformCPU._module = _device_module()
        return PlatformCPU._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:
        # verl passes this as a device (``model.to(get_device_id())``): an index would mean cuda:N
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None  # CUDA's caching-allocator settings (expandable segments) mean nothing here

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # verl reads and writes it around Ray workers; nothing uses it on CPU

    @contextmanager
    def nvtx_range(self, msg: str):
        with torch.profiler.record_function(msg):
            yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def use_cpu_platform() -> PlatformCPU:
    """Make the CPU platform verl's current one (what importing this module does)."""
    current = platform_manager._current_platform  # verl has no public "is one chosen yet?"
    if isinstance(current, PlatformCPU):
        return current
    platform = PlatformCPU()
    set_platform(platform)
    return platform


def open_process_group() -> None:
    """Open the worker's gloo process group the way verl's workers do (``RANK``, ``WORLD_SIZE``
    and ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment a Ray worker group sets; one
    process on a free local port without them), unless one is open.

    verl's workers ask for ``f"cpu:gloo,{device}:{backend}"``, which on this platform is
    ``cpu:gloo,cpu:gloo``: torch refuses a device named twice, and a group opened first is
    kept (verl opens one only when none is)."""
    import os
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        dist.init_process_group(backend="gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def cpu_worker(worker_class: type) -> type:
    """A subclass of a verl worker class (``TrainingWorker``, ...) that opens its gloo process
    group before verl's ``__init__`` runs (see :func:`open_process_group`), e.g.
    ``ray.remote(cpu_worker(TrainingWorker))``."""

    def __init__(self, *args, **kwargs):
        open_process_group()
        worker_class.__init__(self, *args, **kwargs)

    return type(f"Cpu{worker_class.__name__}", (worker_class,), {"__init__": __init__,
                                                                  "__module__": __name__,
                                                                  "__qualname__": f"Cpu{worker_class.__name__}"})


use_cpu_platform()

__all__ = ["PLATFORM", "PlatformCPU", "cpu_worker", "open_process_group", "use_cpu_platform"]
