"""Per-sample references computed once per test session, whoever asks for them.

The per-sample Hugging Face reference of a batch (one forward and backward per sample, MoE
models through transformers' expert loop) is the slowest part of many multi-rank tests, and
every rank of a torchrun job computes the same one, as do the cases of a shared launch that
test other layouts on the same model and batch. :func:`cached` computes a value once per
session and key: the first process to take a key's lock computes and stores it, the others
wait on the lock and load it. The key is the content of the inputs (the model's parameters and
config, the batch's arrays, the loss settings), so a hit is the same computation's result:
every exactness check still compares against an independent per-sample reference. A model
whose forward is altered (a replaced ``forward``, a hook: :func:`altered`) is computed every
time.

The store is the folder named by ``PSRL_TEST_REFERENCE_CACHE`` (tests/conftest.py makes one per
session; subprocesses inherit it); without it every call computes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from typing import Any, Callable, Iterable

import numpy as np
import torch

CACHE_ENV = "PSRL_TEST_REFERENCE_CACHE"


def fingerprint(parts: Iterable[Any]) -> str:
    """sha1 of the parts: tensors and arrays by dtype, shape and bytes; models by their
    parameters and buffers (names, values) and class; the rest by ``repr``."""
    h = hashlib.sha1()
    for part in parts:
        if isinstance(part, torch.nn.Module):
            h.update(f"{type(part).__qualname__} training={part.training}".encode())
            config = getattr(part, "config", None)  # (a transformers model: its settings too)
            h.update((config.to_json_string() if hasattr(config, "to_json_string") else repr(config)).encode())
            for name, t in list(part.named_parameters()) + list(part.named_buffers()):
                h.update(name.encode())
                _update(h, t)
        elif isinstance(part, (torch.Tensor, np.ndarray)):
            _update(h, part)
        else:
            h.update(repr(part).encode())
    return h.hexdigest()


def altered(model: torch.nn.Module) -> bool:
    """The model computes something its weights and config do not say: a module's ``forward``
    replaced on the instance or a hook registered (e.g. a test replaying MoE routes into it).
    Such a model is never cached: its value depends on what the weights cannot show."""
    for m in model.modules():
        if "forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return True
        if getattr(m, "_backward_pre_hooks", None) or getattr(m, "_forward_hooks_with_kwargs", None):
            return True
    return False


def _update(h, value) -> None:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.view(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    else:
        value = np.ascontiguousarray(value)
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(value.tobytes())


def cached(kind: str, key_parts: Iterable[Any], compute: Callable[[], Any]) -> Any:
    """``compute()``, or the value an earlier call with equal ``key_parts`` stored this session."""
    root = os.environ.get(CACHE_ENV)
    if not root or not os.path.isdir(root) or any(altered(p) for p in key_parts if isinstance(p, torch.nn.Module)):
        return compute()
    path = os.path.join(root, f"{kind}-{fingerprint(key_parts)}.pt")
    with open(path + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (another process computing this key: wait for it)
        try:
            if os.path.exists(path):
                return torch.load(path, weights_only=False)
            value = compute()
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save(value, tmp)
            os.replace(tmp, path)  # readers never see a half-written value
            return value
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
