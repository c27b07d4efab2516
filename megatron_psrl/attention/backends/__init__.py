"""Attention backends: one contract, several kernels.

Every backend computes ``out [t, np, hn]`` from ``q [t, np, hn]``, ``k, v [t, ng, hn]``, an
:class:`~megatron_psrl.attention.plan.AttentionPlan` and optional external (cached prefix)
K/V pairs, exactly (each query sees its ancestors and the earlier tokens of its segment). A
query-subset plan (``AttentionPlan.select_queries``: ``q [n, np, hn]`` for n of the pack's rows,
keys still every row) runs through every backend unchanged: its segments name their causal keys.

- ``torch``: blockwise tree attention with log-sum-exp merging; CPU flash kernels on CPU,
  plain math elsewhere. The default on CPU and the reference for the GPU kernels.
- ``dense``: one SDPA call with the full boolean tree mask (O(t^2)); a plain reference and
  the benchmarks' "dense tree mask" comparison.
- ``flash``: flash-attn varlen over gathered ancestor keys (CUDA).
- ``te``: Transformer Engine DotProductAttention, thd + padding_causal_bottom_right (CUDA).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from megatron_psrl.attention.backends.blockwise import blockwise_tree_attention
from megatron_psrl.attention.backends.dense import dense_tree_attention
from megatron_psrl.attention.backends.varlen import TETreeAttention, flash_tree_attention
from megatron_psrl.errors import ConfigurationError
from megatron_psrl.options import ATTENTION_BACKENDS

BACKENDS = ATTENTION_BACKENDS


OVERLAPS_EXCHANGE = frozenset({"torch"})
"""Backends that overlap a cross-rank step's prefix K/V exchange with their attention: the
``torch`` backend attends to its other keys while the rows are in flight, then waits, attends
to them and merges by log-sum-exp (``ArrivingPrefixKV``). ``flash``, ``te`` and ``dense`` take
their keys as tensors, so they ``materialize`` the received rows (wait) before their kernel
starts: nothing overlaps, and the planner charges them the whole exchange (the calibration
measures no overlap for them). The flash and te kernels return their log-sum-exp, so they
could attend to the local keys first and merge as ``torch`` does; not done."""


READS_CACHED_PREFIXES = frozenset({"torch", "flash", "te"})
"""Backends that read a cached prefix from the KV cache themselves (``CachedPrefixKV``) in the
forward and again in the backward pass, adding its gradients to the cache's dK/dV, so a kept
graph holds no copy of it (the memory plan's ``gathers_in_backward``): ``torch`` in its blockwise
pass, ``flash`` and ``te`` around their kernel (``varlen_tree_attention``). ``dense`` takes copies
(``materialize``) that its graph keeps."""


def default_backend(device_type: str, dtype=None) -> str:
    """``flash`` on CUDA for fp16/bf16 when flash-attn is installed, else ``torch``."""
    import torch

    if device_type == "cuda" and dtype in (None, torch.float16, torch.bfloat16):
        try:
            import flash_attn  # noqa: F401

            return "flash"
        except ImportError:
            return "torch"
    return "torch"


# flash-attn aligns the causal mask of a segment with fewer queries than keys to the bottom
# right from 2.1 on; before, to the top left, which would silently hide ancestor keys.
FLASH_ATTN_MIN_VERSION = (2, 1)

# cuDNN fused attention (Transformer Engine's FusedAttention, the F16 arbitrary-seqlen kernel)
# takes thd + padding_causal_bottom_right with sequence lengths that are not multiples of 64
# from cuDNN 9.7 on, thd on sm90+ (TE's nvte_get_fused_attn_backend); 9.10.0 and 9.10.1 are
# excluded there for known SDPA bugs. cudnnGetVersion() encodes 9.7.0 as 90700.
CUDNN_THD_BOTTOM_RIGHT_MIN = 90700
CUDNN_THD_SM80_MIN = 91801
"""cuDNN 9.18.1 adds thd attention backward on Ampere (sm80-89); older cuDNN needs sm90+."""
CUDNN_BROKEN_SDPA = (91000, 91001)


@dataclass
class KernelFacts:
    """What decides whether a GPU attention backend can run here (gathered by
    :func:`kernel_facts`; tests build them by hand)."""

    device_type: str
    dtype_name: str = "bfloat16"
    flash_attn_version: Optional[Tuple[int, ...]] = None
    """None: flash-attn is not importable."""
    te_installed: bool = False
    cudnn_version: Optional[int] = None
    """cudnnGetVersion()'s number (9.7.0 -> 90700); None without cuDNN."""
    compute_capability: Optional[Tuple[int, int]] = None
    env: Mapping[str, str] = field(default_factory=dict)
    """Transformer Engine's backend switches: NVTE_FLASH_ATTN, NVTE_FUSED_ATTN ("0" disables)."""


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):  # "2.0.4.post1" -> (2, 0, 4); "2.8.0rc1" -> (2, 8, 0)
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def kernel_facts(device_type: str, dtype=None) -> KernelFacts:
    """The facts of this machine for :func:`attention_backend_problem` (imports the kernel
    packages if they are installed; touches CUDA only when ``device_type`` is ``cuda``)."""
    import torch

    facts = KernelFacts(device_type=device_type, dtype_name=str(dtype or torch.bfloat16).replace("torch.", ""),
                        env={k: v for k, v in os.environ.items() if k.startswith("NVTE_")})
    try:
        import flash_attn

        facts.flash_attn_version = _version_tuple(getattr(flash_attn, "__version__", "0"))
    except ImportError:
        pass
    try:
        import transformer_engine.pytorch  # noqa: F401

        facts.te_installed = True
    except ImportError:
        pass
    if device_type == "cuda" and torch.cuda.is_available():
        facts.compute_capability = tuple(torch.cuda.get_device_capability())
        facts.cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return facts


def _te_thd_kernels(facts: KernelFacts) -> Tuple[bool, str]:
    """Whether Transformer Engine has a kernel for thd + padding_causal_bottom_right here, and
    why not: its unfused (plain PyTorch) attention does not take thd, so it needs its flash-attn
    path or cuDNN fused attention."""
    sm = facts.compute_capability or (0, 0)
    reasons = []
    flash_on = facts.env.get("NVTE_FLASH_ATTN", "1") != "0"
    fused_on = facts.env.get("NVTE_FUSED_ATTN", "1") != "0"
    if not flash_on:
        reasons.append("flash-attn: disabled by NVTE_FLASH_ATTN=0")
    elif facts.flash_attn_version is None:
        reasons.append("flash-attn: not installed")
    elif facts.flash_attn_version < FLASH_ATTN_MIN_VERSION:
        reasons.append(f"flash-attn {'.'.join(map(str, facts.flash_attn_version))} < 2.1")
    elif sm < (8, 0):
        reasons.append(f"flash-attn: needs sm80+, this GPU is sm{sm[0]}{sm[1]}")
    else:
        return True, ""
    cudnn = facts.cudnn_version
    if not fused_on:
        reasons.append("cuDNN fused attention: disabled by NVTE_FUSED_ATTN=0")
    elif cudnn is None:
        reasons.append("cuDNN fused attention: no cuDNN")
    elif cudnn < CUDNN_THD_BOTTOM_RIGHT_MIN or cudnn in CUDNN_BROKEN_SDPA:
        reasons.append(f"cuDNN fused attention: cuDNN {cudnn} (needs >= {CUDNN_THD_BOTTOM_RIGHT_MIN}, "
                       f"not {'/'.join(map(str, CUDNN_BROKEN_SDPA))})")
    elif not (sm >= (9, 0) or (sm >= (8, 0) and cudnn >= CUDNN_THD_SM80_MIN)):
        reasons.append(f"cuDNN fused attention: thd needs sm90+ (sm80+ with cuDNN >= {CUDNN_THD_SM80_MIN}), "
                       f"this GPU is sm{sm[0]}{sm[1]}")
    else:
        return True, ""
    return False, "; ".join(reasons)


def attention_backend_problem(backend: str, facts: KernelFacts) -> Optional[str]:
    """Why ``backend`` cannot run with ``facts`` (one line naming the fix), or None.

    Best effort for Transformer Engine: it rules out the configurations TE's own backend
    selection certainly rejects for thd + padding_causal_bottom_right (no flash-attn path and
    no cuDNN fused kernel), which TE would otherwise report only at the first forward pass."""
    if backend not in ("flash", "te"):
        return None
    if facts.device_type != "cuda":
        return (f"attention backend {backend!r} needs a CUDA device (this run is on {facts.device_type}); "
                "use --attention-backend torch")
    if facts.dtype_name not in ("bfloat16", "float16"):
        return (f"attention backend {backend!r} runs fp16/bf16 only (the model is {facts.dtype_name}); "
                "use --dtype bfloat16, or --attention-backend torch")
    if backend == "flash":
        if facts.flash_attn_version is None:
            return "attention backend 'flash' needs flash-attn >= 2.1: pip install flash-attn, or use --attention-backend te / torch"
        if facts.flash_attn_version < FLASH_ATTN_MIN_VERSION:
            version = ".".join(map(str, facts.flash_attn_version))
            return (f"attention backend 'flash' needs flash-attn >= 2.1 (bottom-right causal alignment), found "
                    f"{version}: pip install -U flash-attn, or use --attention-backend torch")
        return None
    if not facts.te_installed:
        return "attention backend 'te' needs transformer-engine: pip install 'transformer-engine[pytorch]', or use --attention-backend flash / torch"
    ok, why = _te_thd_kernels(facts)
    if ok:
        return None
    return (f"attention backend 'te' has no kernel for thd padding_causal_bottom_right attention here ({why}): "
            "use --attention-backend flash, or install flash-attn >= 2.1 (NVTE_FLASH_ATTN=1), or cuDNN >= 9.7 "
            "on sm90+ (NVTE_FUSED_ATTN=1)")


def check_attention_backend(backend: str, device_type: str, dtype=None, facts: Optional[KernelFacts] = None) -> None:
    """Start-up check of the chosen attention backend: raises :class:`ConfigurationError`
    (one line, naming the fix) when it cannot run on this machine, before any model is run."""
    if backend not in ("flash", "te"):
        return
    problem = attention_backend_problem(backend, facts or kernel_facts(device_type, dtype))
    if problem is not None:
        raise ConfigurationError(problem)


__all__ = [
    "BACKENDS",
    "OVERLAPS_EXCHANGE",
    "READS_CACHED_PREFIXES",
    "KernelFacts",
    "attention_backend_problem",
    "check_attention_backend",
    "kernel_facts",
    "TETreeAttention",
    "blockwise_tree_attention",
    "default_backend",
    "dense_tree_attention",
    "flash_tree_attention",
]
