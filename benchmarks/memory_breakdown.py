"""Where a training step's peak memory goes, measured (issue 35).

``with StepBreakdown(engine) as b: actor.forward_backward(...)``; then ``b.result()``: the step's
peak of C-heap bytes in use above its start (the tracker of ``megatron_psrl.engine.memory``,
``ops`` mode: read after every torch operation) and, at the operation where that peak
happened, what held the bytes:

- ``saved``: tensors autograd keeps for backward, seen by ``torch.autograd.graph.saved_tensors_hooks``
  (one storage counted once however many saved views share it; parameters never), split by
  the module that saved them (``attention core``: the tree attention's q, k, v, output, lse;
  ``qkv/out proj``: the projections' inputs; ``rope``: what RoPE and the attention block's
  reshapes save; ``mlp``; ``norms``; ``embedding``; ``loss head``: the output layer and the
  log-softmax outside any module) and by micro-batch: the one running when the peak happened,
  or another one whose graph is kept (a producer of cached prefixes waiting for its backward);
- ``kv cache``: the block pool's K, V, dK, dV tensors (``BlockKVCache``);
- ``param grads``: gradients accumulated in the parameters;
- ``other``: the rest of the heap above the start: temporaries of the running operation
  (attention blocks, gradients in flight through backward), autograd's own buffers, and the
  allocator's slack (freed chunks the heap has not returned: glibc counts a chunk in use until
  it is freed, so slack here is only rounding; fragmentation shows in the resident size, not here).

Bytes are storage bytes (``untyped_storage().nbytes()``); the heap adds its per-allocation
rounding on top, which lands in ``other``.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_psrl.engine import memory as heap

SAVED_KINDS = ("attention core", "qkv/out proj", "rope", "mlp", "norms", "embedding", "loss head")


def module_kind(name: str) -> str:
    """The saved-tensor kind of a module by its qualified name (innermost match wins)."""
    leaf = name.rsplit(".", 1)[-1]
    if "core_attention" in name:
        return "attention core"
    if leaf in ("linear_qkv", "linear_proj"):
        return "qkv/out proj"
    if "layernorm" in leaf or "q_layernorm" in name or "k_layernorm" in name or leaf.endswith("norm"):
        return "norms"
    if ".mlp" in name or name.startswith("mlp"):
        return "mlp"
    if "self_attention" in name:
        return "rope"
    if "embedding" in name:
        return "embedding"
    return "loss head"  # output_layer, and everything outside the decoder (log-softmax, loss)


class _Saved:
    """What the pack hook returns: the tensor, and a handle whose death ends its accounting."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _PeakMode(TorchDispatchMode):
    def __init__(self, owner: "StepBreakdown"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.owner._after_op(func)
        return out


class StepBreakdown:
    """Heap peak of a block of work and what held it at that moment (see module doc)."""

    def __init__(self, model: torch.nn.Module, runner=None, kv_cache=None):
        self.model, self.runner, self.kv_cache = model, runner, kv_cache
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._stack: List[str] = []
        self._live: Dict[int, list] = {}  # storage ptr -> [refs, bytes, kind, micro-batch]
        self._totals: Dict[Tuple[str, int], int] = defaultdict(int)
        self._micro_batch = -1
        self._phase = "forward"
        self._handles = []
        self.peak = 0
        self.start = 0
        self.at_peak: dict = {}

    # -------------------------------------------------------------- bookkeeping
    def _kind(self) -> str:
        return module_kind(self._stack[-1]) if self._stack else "loss head"

    def _pack(self, t: torch.Tensor):
        saved = _Saved(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return saved
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.params:
            return saved
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [0, storage.nbytes(), self._kind(), self._micro_batch]
            self._totals[(entry[2], entry[3])] += entry[1]
        entry[0] += 1
        weakref.finalize(saved, self._unpack_done, ptr)
        return saved

    def _unpack_done(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._totals[(entry[2], entry[3])] -= entry[1]
            del self._live[ptr]

    def _after_op(self, func) -> None:
        used = heap.heap_bytes_in_use()
        if used > self.peak:
            self.peak = used
            self.at_peak = {"totals": dict(self._totals), "micro_batch": self._micro_batch, "phase": self._phase,
                            "op": str(func), "module": self._stack[-1] if self._stack else "",
                            "kv": self._kv_bytes(), "grads": self._grad_bytes()}

    def _kv_bytes(self) -> int:
        cache = self.kv_cache
        if cache is None:
            return 0
        tensors = []
        for value in vars(cache).values():  # (the pools' storage: a list of tensors, one per pool)
            tensors += [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def _grad_bytes(self) -> int:
        total = 0
        for p in self.model.parameters():
            g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            total += g.untyped_storage().nbytes() if g is not None else 0
        return total

    # -------------------------------------------------------------- hooks
    def _hook_modules(self) -> None:
        for name, mod in self.model.named_modules():
            if not name:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(mod.register_forward_hook(self._leave_module))

    def _enter_module(self, name: str):
        def pre(module, args) -> None:
            self._stack.append(name)
        return pre

    def _leave_module(self, module, args, output) -> None:
        self._stack.pop()

    def _hook_runner(self) -> None:
        runner = self.runner
        if runner is None:
            return
        for method in ("run_forward_backward", "run_forward_keep", "run_forward_drop", "run_backward", "run_forward"):
            original = getattr(runner, method)

            def wrapped(x, step, original=original, method=method):
                self._micro_batch, self._phase = x.micro_batch, method[4:]
                return original(x, step)
            setattr(runner, method, wrapped)
            self._handles.append(method)

    def __enter__(self) -> "StepBreakdown":
        self._hook_modules()
        self._hook_runner()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda s: s.tensor)
        self._saved_hooks.__enter__()
        self.start = self.peak = heap.heap_bytes_in_use()
        self.kv_start, self.grads_start = self._kv_bytes(), self._grad_bytes()
        self._mode = _PeakMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            if isinstance(h, str):
                delattr(self.runner, h)  # the instance attribute shadowing the method
            else:
                h.remove()

    # -------------------------------------------------------------- the answer
    def result(self) -> dict:
        """Bytes above the start at the peak, by holder (``saved`` by kind, running or kept)."""
        p = self.at_peak
        running = p.get("micro_batch", -1)
        saved_running = {k: 0 for k in SAVED_KINDS}
        saved_kept = {k: 0 for k in SAVED_KINDS}
        for (kind, mb), b in p.get("totals", {}).items():
            (saved_running if mb == running else saved_kept)[kind] += b
        kv = p.get("kv", 0) - self.kv_start
        grads = p.get("grads", 0) - self.grads_start
        total = self.peak - self.start
        other = total - sum(saved_running.values()) - sum(saved_kept.values()) - kv - grads
        return {"peak_bytes": total, "saved_running": saved_running, "saved_kept": saved_kept, "kv_cache": kv,
                "param_grads": grads, "other": other, "micro_batch": running, "phase": p.get("phase"),
                "op": p.get("op"), "module": p.get("module")}


def predicted(engine, batch, overrides: Optional[dict] = None) -> dict:
    """The memory plan's prediction for the step ``engine`` would run on ``batch``: its
    timeline's peak (KV blocks, kept graphs, gathered copies, loss head) and the step peak
    (``schedule.memory.step_peak_bytes``: plus the running micro-batch's graph)."""
    _, plan, memory, _ = engine.plan(batch)
    rank = plan.ranks[0]
    return {"micro_batches": len(rank.micro_batches), "plan_peak": memory.peak_bytes if memory else 0,
            "step_peak": engine.predicted_step_peak(plan, memory),
            "recompute_tokens": memory.recompute_tokens if memory else 0,
            "max_micro_batch_tokens": max(mb.num_tokens for mb in rank.micro_batches)}
