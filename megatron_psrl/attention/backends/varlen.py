"""GPU backends over gathered keys: ``flash`` (flash-attn varlen) and ``te`` (Transformer Engine).

Every segment's queries attend to [its ancestors' keys, its own keys]; the plan lists these
key indices once per micro-batch (``AttentionPlan.gathered_keys``). A varlen kernel with a
causal mask aligned to the bottom right of every (queries, keys) pair is then exact: a query
sees every ancestor key and the earlier tokens of its own segment. Ancestor keys are
gathered (copied) per segment; :class:`GatherRows` sums their gradients back onto the single
copy of every shared prefix token (and onto cached external K/V) in fp32, deterministically.

The kernels save their inputs for the backward pass, the gathered copies included: every
segment its whole ancestor chain (a GRPO group of 16 responses on one prompt: 16 copies of the
prompt's K/V per layer, kept from the forward to the backward). :func:`varlen_tree_attention`
saves a recipe instead (the pack's K/V, the external sources and the index) and gathers again
when the backward pass asks for them, so a kept graph holds no copies and the memory plan's
count of saved tensors is the same as for the ``torch`` backend. A cached prefix handed over as a
reader (:class:`~megatron_psrl.attention.metadata.CachedPrefixKV`) is read from the KV cache in
the forward (:class:`CachedRows`), read again by the recipe, and its gradients go straight to the
cache's fp32 dK/dV: the graph keeps no copy of it either (the ``torch`` backend's rule; the
memory plan's ``gathers_in_backward``). The gather is plain torch and runs on any device (the
tests run it on CPU with a reference kernel).

Both import their kernel lazily and fail with a clear message without CUDA or the package.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from megatron_psrl.attention.metadata import CachedPrefixKV
from megatron_psrl.attention.plan import AttentionPlan
from megatron_psrl.errors import MissingRequirementError
from megatron_psrl.host_copy import host_to_device

Tensor = torch.Tensor

VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int], Tensor]
"""``kernel(q, k_gathered, v_gathered, cu_seqlens_q, cu_seqlens_k, max_q, max_k) -> out``:
causal attention aligned to the bottom right of every segment's (queries, keys)."""


def gather_index(plan: AttentionPlan, device: torch.device):
    """``(key_index, cu_q, cu_k, max_q, max_k)`` of ``plan`` on ``device`` (int64 index, int32
    offsets), computed once per micro-batch and device and shared by all layers."""
    key_index, cu_q, cu_k = plan.gathered_keys()
    cache: Dict = plan.__dict__.setdefault("_device_cache", {})
    if device not in cache:
        cache[device] = (
            host_to_device(key_index, device, np.int64),
            host_to_device(cu_q, device, np.int32),
            host_to_device(cu_k, device, np.int32),
            int((cu_q[1:] - cu_q[:-1]).max()) if len(cu_q) > 1 else 0,
            int((cu_k[1:] - cu_k[:-1]).max()) if len(cu_k) > 1 else 0,
        )
    return cache[device]


class GatherRows(torch.autograd.Function):
    """``source.index_select(0, idx)`` whose backward sums the copies' gradients in fp32, in a
    fixed order.

    A shared prefix row is gathered once per segment that reads it (a GRPO prompt: once per
    response), so its dK/dV is the sum of that many gradients. ``index_select``'s own backward
    adds them in the model dtype (bf16: rounded after every addition, an error that grows with
    the number of readers) and, on CUDA, with atomics (the order, and so the bits, change from
    run to run). Here they are added into an fp32 buffer with ``index_put_(accumulate=True)``:
    on CUDA its sort-based kernel (stable sort of the indices, then every destination row summed
    by one thread in index order) is deterministic, unlike ``index_add_``'s atomics, and on CPU it
    adds serially. The sum is rounded to the model dtype once, where autograd hands it to
    ``source`` (the ``torch`` backend's ``dk.to(k.dtype)``): one rounding whatever the number of
    readers. Transient cost in backward: the gradient of the copies in fp32 (twice their bytes
    in bf16) and the fp32 sum over the source rows (the memory plan's ``VarlenCharge``)."""

    @staticmethod
    def forward(ctx, source: Tensor, idx: Tensor) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.rows = source.shape[0]
        return source.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (idx,) = ctx.saved_tensors
        total = torch.zeros((ctx.rows,) + tuple(grad.shape[1:]), dtype=torch.float32, device=grad.device)
        total.index_put_((idx,), grad.float(), accumulate=True)
        return total, None


def _gather(parts: Sequence[Tensor], idx: Tensor) -> Tensor:
    """Rows ``idx`` of the concatenation of ``parts`` (the pack's K or V, then external sources),
    their gradients summed in fp32 (:class:`GatherRows`)."""
    source = torch.cat(list(parts), dim=0) if len(parts) > 1 else parts[0]
    if torch.is_grad_enabled() and source.requires_grad:
        return GatherRows.apply(source, idx)
    return source.index_select(0, idx)


class CachedRows(torch.autograd.Function):
    """A cached prefix's K and V of one layer, read from the KV cache (``CachedPrefixKV.read``)
    by a node of the graph that saves nothing; its backward hands their gradients to the source
    (``add_grad``: into the cache's fp32 dK/dV). ``anchor``: an empty leaf that requires grad, so
    the rows do (the reader is not a tensor). Nothing references the rows once the layer's gather
    ran (the kernel's saved copies are a recipe that reads them again), so a kept graph holds no
    copy of the prefix."""

    @staticmethod
    def forward(ctx, anchor: Tensor, reader) -> Tuple[Tensor, Tensor]:
        ctx.reader = reader
        ctx.set_materialize_grads(False)  # (a gradient autograd does not compute stays None)
        k, v = reader.read()
        return k, v

    @staticmethod
    def backward(ctx, grad_key: Optional[Tensor], grad_value: Optional[Tensor]):
        ctx.reader.add_grad(grad_key, grad_value)
        return None, None


def _external_rows(external: Sequence, device: torch.device) -> List[Tuple[Tensor, Tensor]]:
    """``(k, v)`` of every external source: pairs as given, cached readers read now (with a
    graph, through :class:`CachedRows`)."""
    track = torch.is_grad_enabled()
    anchor = None
    out = []
    for e in external:
        if isinstance(e, tuple):
            out.append(e)
        elif not track:
            out.append(tuple(e.read()))
        else:
            anchor = anchor if anchor is not None else torch.empty(0, device=device, requires_grad=True)
            out.append(CachedRows.apply(anchor, e))
    return out


class _Regather:
    """The gathered K (``j`` 0) or V (1) of a layer again, in its backward pass: the pack's rows,
    the external pairs as given and the cached prefixes read again from the cache (both K and V
    are read; the one not asked for yet waits here for its turn)."""

    def __init__(self, k: Tensor, v: Tensor, external: Sequence, idx: Tensor):
        self.own, self.external, self.idx = (k, v), list(external), idx
        self.waiting: Dict[Tuple[int, int], Tensor] = {}

    def __call__(self, j: int) -> Tensor:
        parts = [self.own[j]]
        for n, e in enumerate(self.external):
            if isinstance(e, tuple):
                parts.append(e[j])
                continue
            rows = self.waiting.pop((n, j), None)
            if rows is None:
                pair = e.read(again=True)
                self.waiting[(n, 1 - j)] = pair[1 - j]
                rows = pair[j]
            parts.append(rows)
        return _gather(parts, self.idx)


_REGATHER = object()  # marks a saved tensor packed as a recipe


@contextmanager
def _regather_in_backward(gathered: Sequence[Tensor], regather: Callable[[int], Tensor]):
    """While the kernel runs: a tensor it saves for backward that lives in the storage of
    ``gathered[j]`` (the tensor itself or a view of it) is saved as a recipe, and rebuilt by
    ``regather(j)`` when the backward pass unpacks it (the same values: the sources are not
    modified in between). Every other saved tensor is saved as usual."""
    storages = {g.untyped_storage().data_ptr(): j for j, g in enumerate(gathered) if g.numel()}
    device = gathered[0].device

    def pack(t: Tensor):
        try:
            j = storages.get(t.untyped_storage().data_ptr()) if t.device == device and t.numel() else None
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            j = None
        if j is None:
            return t
        return (_REGATHER, j, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(saved):
        if not (isinstance(saved, tuple) and saved and saved[0] is _REGATHER):
            return saved
        _, j, size, stride, offset = saved
        # a fresh gather is contiguous with offset 0, the layout of the forward's copy
        return regather(j).as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def varlen_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
    external: Sequence[Union[Tuple[Tensor, Tensor], CachedPrefixKV]], kernel: VarlenKernel,
) -> Tensor:
    """Tree attention through a varlen ``kernel`` over per-segment gathered keys; the gathered
    copies the kernel saves for backward are gathered again in the backward pass instead of
    kept, and cached prefixes given as readers are read again from the cache then (see the
    module docstring)."""
    idx, cu_q, cu_k, max_q, max_k = gather_index(plan, k.device)
    pairs = _external_rows(external, k.device)
    kg = _gather([k] + [p[0] for p in pairs], idx)
    vg = _gather([v] + [p[1] for p in pairs], idx)
    del pairs  # (the rows read from the cache: only the gathered copies refer to them now)
    if not torch.is_grad_enabled() or not (kg.requires_grad or vg.requires_grad or q.requires_grad):
        return kernel(q, kg, vg, cu_q, cu_k, max_q, max_k)
    with _regather_in_backward((kg, vg), _Regather(k, v, external, idx)):
        return kernel(q, kg, vg, cu_q, cu_k, max_q, max_k)


_PADDED_LOGGED: set = set()


def _log_padding_once(backend: str, hn: int, hv: int, why: str) -> None:
    """One logged line per backend and widths: this run pads the values for that kernel."""
    if (backend, hn, hv) in _PADDED_LOGGED:
        return
    _PADDED_LOGGED.add((backend, hn, hv))
    import logging

    logging.getLogger(__name__).info(
        "attention backend %r: %s, so values of width %d are padded with zeros to the query/key width %d for the "
        "kernel (exact; %.0f%% more value bytes while a layer's attention runs)", backend, why, hv, hn,
        100.0 * (hn - hv) / hv)


def _pad(x: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


class _PaddedValues:
    """A cached prefix (``CachedPrefixKV``) whose V is read padded with zero columns to
    ``width``, and whose V gradient is handed back cut to the V's own width."""

    __slots__ = ("reader", "width", "value_width")

    def __init__(self, reader, width: int, value_width: int):
        self.reader, self.width, self.value_width = reader, width, value_width

    def read(self, again: bool = False, start: int = 0) -> Tuple[Tensor, Tensor]:
        k, v = self.reader.read(again=again, start=start)
        return k, _pad(v, self.width)

    def add_grad(self, grad_key: Optional[Tensor], grad_value: Optional[Tensor], start: int = 0) -> None:
        cut = None if grad_value is None else grad_value[..., :self.value_width]
        self.reader.add_grad(grad_key, cut, start=start)

    def materialize(self, start: int = 0) -> Tuple[Tensor, Tensor]:
        k, v = self.reader.materialize(start=start)
        return k, _pad(v, self.width)


def pad_values(v: Tensor, external: Sequence[Union[Tuple[Tensor, Tensor], CachedPrefixKV]], width: int):
    """``v`` and every external source's V padded with zero columns to ``width`` (the query/key
    head width), for kernels that take one head width: a zero value column gives a zero output
    column (cut off again) and no gradient to anything else (latent attention: K 192, V 128). A
    cached reader pads what it reads (:class:`_PaddedValues`)."""
    return _pad(v, width), [(e[0], _pad(e[1], width)) if isinstance(e, tuple) else _PaddedValues(e, width, v.shape[-1])
                            for e in external]


def require_cuda(name: str, q: Tensor) -> None:
    """Refuse non-CUDA tensors for the CUDA-only attention backend ``name``."""
    if q.device.type != "cuda":
        raise MissingRequirementError(
            f"attention backend {name!r} needs CUDA tensors (got {q.device}); use "
            "--attention-backend torch on CPU"
        )


def flash_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan,
    external: Sequence[Union[Tuple[Tensor, Tensor], CachedPrefixKV]] = (), scale: float = None,
    deterministic: bool = False,
) -> Tensor:
    """flash-attn varlen over per-segment gathered keys, causal aligned bottom right
    (``deterministic``: its deterministic backward, slower, the same bits every run). A
    windowed plan (``AttentionPlan.windowed``) gathers every segment's keys in depth order from
    the first its first query reaches, so flash-attn's own window, ``window - 1`` keys to the
    left of the bottom-right diagonal, is the sliding window exactly."""
    require_cuda("flash", q)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:  # pragma: no cover - GPU extra
        raise MissingRequirementError("attention backend 'flash' needs flash-attn: pip install 'megatron_psrl[gpu]'") from exc

    def kernel(q, kg, vg, cu_q, cu_k, max_q, max_k):
        # flash-attn >= 2.1 aligns the causal mask to the bottom right when seqlen_q < seqlen_k
        # (the start-up check, check_attention_backend, refuses older versions).
        # (window_size: flash-attn >= 2.3; PrefixSharingAttention runs a window elsewhere before)
        window = {} if plan.window is None else dict(window_size=(plan.window - 1, 0))
        return flash_attn_varlen_func(q, kg, vg, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                      causal=True, deterministic=deterministic, **window)

    hn, hv = q.shape[-1], v.shape[-1]
    if hv < hn:  # flash-attn 2 takes one head width for q, k and v (its varlen API has no value width)
        _log_padding_once("flash", hn, hv, "flash-attn 2 needs values as wide as queries and keys")
        v, external = pad_values(v, external, hn)
        return varlen_tree_attention(q, k, v, plan, external, kernel)[..., :hv]
    return varlen_tree_attention(q, k, v, plan, external, kernel)


def te_deterministic() -> None:
    """Transformer Engine's attention without nondeterministic algorithms (atomics in its fused
    backward): TE reads the variable when it picks a kernel, so it holds for the process."""
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"


class TETreeAttention(torch.nn.Module):
    """Transformer Engine's DotProductAttention (thd, padding_causal_bottom_right).

    ``value_dim`` narrower than ``head_dim`` (latent attention): TE is given both widths
    (``kv_channels=(head_dim, value_dim)``, which its releases with MLA support take); a release
    that refuses the pair gets values padded to ``head_dim`` instead (one logged line)."""

    def __init__(self, num_heads: int, num_groups: int, head_dim: int, scale: float, layer_number: int,
                 value_dim: Optional[int] = None):
        super().__init__()
        try:
            import transformer_engine.pytorch as te
        except ImportError as exc:  # pragma: no cover - GPU extra
            raise MissingRequirementError(
                "attention backend 'te' needs transformer-engine: pip install 'megatron_psrl[gpu]'"
            ) from exc
        value_dim = head_dim if value_dim is None else value_dim
        self.widths = (head_dim, value_dim)
        self.pads_values = False
        """TE took one head width only: values are padded to ``head_dim`` for it."""
        # Heads here are already this tensor-parallel rank's heads: no TP inside TE.
        kwargs = dict(num_attention_heads=num_heads, num_gqa_groups=num_groups, attention_dropout=0.0,
                      qkv_format="thd", attn_mask_type="padding_causal_bottom_right", softmax_scale=scale,
                      layer_number=layer_number)
        if value_dim == head_dim:
            self.attention = te.DotProductAttention(kv_channels=head_dim, **kwargs)
            return
        try:
            self.attention = te.DotProductAttention(kv_channels=(head_dim, value_dim), **kwargs)
        except (TypeError, AssertionError, ValueError) as exc:  # pragma: no cover - older TE releases
            _log_padding_once("te", head_dim, value_dim, f"this Transformer Engine takes one head width ({exc})")
            self.pads_values = True
            self.attention = te.DotProductAttention(kv_channels=head_dim, **kwargs)

    def forward(self, q, k, v, plan: AttentionPlan, external=(), scale: float = None) -> Tensor:
        require_cuda("te", q)

        def kernel(q, kg, vg, cu_q, cu_k, max_q, max_k):
            return self.attention(
                q, kg, vg, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                attn_mask_type="padding_causal_bottom_right",
            )

        hv = v.shape[-1]
        if self.pads_values and hv < q.shape[-1]:
            v, external = pad_values(v, external, q.shape[-1])
        out = varlen_tree_attention(q, k, v, plan, external, kernel).view(q.shape[0], q.shape[1], -1)
        return out[..., :hv]  # [t, np, hv] (a view of the padded output when the values were padded)
