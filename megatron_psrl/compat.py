"""Everything megatron_psrl does differently because megatron-core assumes CUDA.

This is the only place that knows; each workaround is inactive when CUDA is used. What they
are, why, and what dropping each one would take:

1. ``transformer_config_overrides``: on CPU, megatron's fused kernels (bias-GELU/SwiGLU,
   bias-dropout-add, masked softmax, RoPE fusion, persistent layer norm, gradient
   accumulation fusion) do not exist; they are switched off and weights are initialised on
   the CPU (``use_cpu_initialization``); megatron's ``torch.compile``d activations
   (``quick_gelu``, gpt-oss) run as their eager originals (``eager_activation``: dynamo's CPU
   compiles cost seconds per kind of shape). Dropping it needs CPU builds of those fusions.
   SwiGLU is the exception (``swiglu_fusion_fields``): megatron's fused SwiGLU runs on every
   device, because its autograd function saves only the fc1 output (3f per token and layer,
   against 5f unfused), so a kept graph holds the same bytes on CPU and GPU and the memory plan
   counts one figure. Its ``torch.compile``d kernels run compiled on CUDA where that compiles a
   bounded number of times and as their eager originals elsewhere, the same math
   (``install_swiglu_kernels``). Dropping that part needs CPU builds of the kernels.
2. ``seed_model_parallel_rng``: ``tensor_parallel.model_parallel_cuda_manual_seed`` saves and
   restores CUDA RNG states. On CPU we install megatron's inference RNG tracker (its
   ``fork()`` is a no-op) and seed torch's CPU generator; dropout is disallowed anyway
   (prefix sharing is exact only without it). Dropping it needs a device-agnostic tracker
   upstream.
3. ``install_cpu_optimizer_shims`` / ``megatron_optimizer_calls``: megatron's
   DistributedDataParallel and its optimizers (``distributed/param_and_grad_buffer.py``,
   ``optimizer/optimizer.py``, ``optimizer/distrib_optimizer.py``, ``optimizer/clip_grads.py``,
   ``optimizer/grad_scaler.py``, ``utils.local_multi_tensor_l2_norm``) allocate their gradient
   buffers and scalars with ``device=torch.cuda.current_device()`` / ``device='cuda'``, check
   parameter types by their CUDA names (``param.type() == 'torch.cuda.FloatTensor'`` in
   Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer's
   ``_build_model_and_main_param_groups`` and ``clip_grad_by_total_norm_fp32``), and move the
   distributed optimizer's gathered checkpoint state to CUDA (``send_tensor.cuda()`` in
   ``get_parameter_state_dp_zero``). Their collectives are plain ``torch.distributed``
   (all-reduce, reduce-scatter and all-gather into one tensor all run over gloo). On CPU those
   modules see the ``torch`` of item 4, and while megatron's DDP / optimizer code runs
   (:func:`megatron_optimizer_calls`) a CPU tensor's ``type()`` answers with the CUDA name of
   its dtype and its ``cuda()`` leaves it where it is. So the same DDP (with
   ``--overlap-grad-reduce``), the same optimizers (fp32; bf16 and fp16 with fp32 main params;
   the distributed optimizer with ``--overlap-param-gather``) and the same checkpoint state run
   on CPU as on CUDA. Nothing changes on CUDA. Dropping it needs device-agnostic buffers, type
   checks by ``dtype`` and a device-agnostic state gather upstream.
4. The CPU ``torch`` (``_CpuTorch``) the modules of items 3 and 7 to 10 see on CPU: its
   ``cuda.current_device()`` is the CPU, its ``cuda.synchronize()`` does nothing, and its
   ``zeros``/``empty``/``tensor`` put ``device='cuda'`` tensors on the CPU; everything else is
   torch itself. Nothing is changed when the model is on CUDA. (megatron's pipeline schedules
   and p2p communication need none: they are not used, every pipeline step runs the project's
   executor, ``engine/pipeline.py``.)
5. ``keeps_cuda_embedding_sync``: with PP > 1 and tied embeddings, megatron's
   ``setup_embeddings_and_output_layer`` moves the last stage's copy of the word embeddings
   to CUDA (``weight.data.cuda()``) before all-reducing it with the first stage's. On CPU
   the model skips that step and ``sync_tied_output_copy`` does the same all-reduce on the
   CPU tensor. Dropping it needs a device-agnostic copy upstream.
6. ``install_cpu_recompute_shims``: megatron's activation checkpointing
   (``tensor_parallel.checkpoint``) saves and restores the CUDA RNG state around the
   recomputation (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``). On CPU those two read
   and restore nothing (dropout is refused, so no recomputed op draws random numbers); the CPU
   generator and the tracker are still saved and restored by megatron. Dropping it needs a
   device-agnostic RNG fork upstream.
7. ``torch_dist_save_strategy`` / ``install_cpu_dist_checkpointing_shims``: megatron's
   ``dist_checkpointing`` (the ``torch_dist`` checkpoint format) writes through
   ``FileSystemWriterAsync``, which even in its synchronous mode starts a multiprocessing
   ``Manager`` (a spawned server process) for its results queue and forks one writer process
   per file, stages tensors with ``torch.cuda.synchronize()`` and broadcasts the outcome in a
   tensor on ``torch.cuda.current_device()``. On CPU we take megatron's own synchronous
   ``TorchDistSaveShardedStrategy`` with ``thread_count=1`` (one file per rank), no
   fully-parallel wrapper, and change only how its write step runs: megatron's own
   ``write_preloaded_data`` is called in this process for each file, its results go through a
   plain in-process queue, and its two modules (``strategies/state_dict_saver.py``,
   ``strategies/filesystem_async.py``) see the ``torch`` of item 4 (``current_device()`` is
   the CPU, ``synchronize()`` does nothing). The files are byte-for-byte what megatron writes;
   loading needs no workaround. Nothing changes on CUDA (megatron's writer as it is). Dropping
   it needs an in-process, device-agnostic writer upstream.

8. ``install_cpu_moe_shims``: megatron's mixture-of-experts layer (``transformer/moe/router.py``,
   ``experts.py``, ``token_dispatcher.py``, ``moe_utils.py``, ``shared_experts.py``,
   ``moe_layer.py``) and ``tensor_parallel/mappings.py`` allocate on
   ``torch.cuda.current_device()`` (the router even moves its weight there in every forward), and
   the all-to-all dispatcher copies its split sizes to the host on a side ``torch.cuda.Stream``.
   On CPU those modules see the ``torch`` of item 4 with do-nothing streams and events;
   ``moe_utils.te_general_gemm`` (unbound without Transformer Engine) is None, as in later
   megatron-core; and the dispatcher's split sizes become host integers, which megatron's
   ``maybe_move_tensor_to_cpu`` does only for CUDA tensors. The routing, permutation, expert
   and all-to-all code is megatron's own. Nothing changes on CUDA. Dropping it needs
   device-agnostic allocations and streams upstream.
9. ``install_cpu_sequence_parallel_shims``: under sequence parallelism megatron's parallel
   linear layers (``tensor_parallel/layers.py``: the backward's gathered input and its
   reduce-scattered gradient) and ``tensor_parallel/mappings.py`` (the scatter / gather /
   reduce-scatter along the sequence) allocate on ``torch.cuda.current_device()``; their
   collectives are plain ``torch.distributed`` and run over gloo. On CPU those modules see the
   ``torch`` of item 4. Nothing changes on CUDA. Dropping it needs device-agnostic allocations
   upstream.
10. ``gated_delta_net_construction``: megatron's ``GatedDeltaNet.__init__``
   (``ssm/gated_delta_net.py``) refuses to build without fla (Triton kernels, CUDA only) and
   allocates its conv and ``dt_bias`` / ``A_log`` on ``torch.cuda.current_device()`` (also in
   ``reset_parameters``). ``TreeGatedDeltaNet`` (``model/linear_attention.py``) never calls
   megatron's fla-bound forward (it has a torch path), so while it is constructed the module's
   ``HAVE_FLA`` check passes when fla is absent, and on a CPU model
   (``use_cpu_initialization``, item 1) the module sees the ``torch`` of item 4. With fla
   installed and a CUDA model nothing changes. Dropping it needs an optional fla and
   device-agnostic allocations upstream.
11. ``latent_attention_construction``: megatron's ``MLASelfAttention.__init__``
   (``transformer/multi_latent_attention.py``) builds its rotary module without passing
   ``use_cpu_initialization``, so ``RotaryEmbedding`` / ``YarnRotaryEmbedding``
   (``models/common/embeddings/``) allocate on ``torch.cuda.current_device()``. While
   ``TreeMLASelfAttention`` (``model/latent_attention.py``, which rotates by the pack's position
   ids and drops that module) is built for a CPU model, those two modules see the ``torch`` of
   item 4. Without Transformer Engine the same ``__init__`` fails on
   ``isinstance(self.linear_proj, TELinear)`` (megatron's import placeholder for ``TELinear`` is
   not a type, yet its ``HAVE_TE`` says True): while it is built, the module's ``HAVE_TE`` is
   False when ``transformer_engine`` cannot be imported. Under tensor parallelism its gathers of
   the column-parallel down-projections (``tensor_parallel/mappings.py``) allocate on
   ``torch.cuda.current_device()``: ``install_cpu_latent_attention_shims`` gives that module the
   ``torch`` of item 4 on CPU (as item 9 does). Nothing changes on CUDA with Transformer Engine.
   Dropping it needs ``use_cpu_initialization`` passed, ``HAVE_TE`` set right and
   device-agnostic gathers upstream.

Design choices that are *not* workarounds (they hold on GPU too): RoPE frequencies come from
explicit per-token position ids (megatron's RotaryEmbedding knows only 0..S-1) and the core
attention is our PrefixSharingAttention (megatron's local DotProductAttention also uses a
CUDA global memory buffer, but we replace it for tree attention anyway).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch

from megatron_psrl import quiet_expected_import_warnings  # noqa: F401  (kept here for callers)


def on_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def swiglu_fusion_compiles_once_per_kind() -> bool:
    """Whether megatron's fused SwiGLU may be on: its kernels are ``torch.compile``d
    (``megatron.core.jit.jit_fuser`` on torch >= 2.2) and a micro-batch's row count changes every
    step. With dynamo's automatic dynamic shapes (torch's default) a function is compiled for
    the first row count, once more with the row count symbolic at the first change, and once for
    a single row, per requires-grad state: a bounded handful, never one per shape (measured on
    CPU, docs/installation.md, "Fused kernels"). Without them every new row count would compile
    again until dynamo's recompile limit, then run eagerly. On CUDA the compiled kernels are
    Triton's: without Triton the fusion stays off and megatron's unfused SwiGLU (the same math)
    runs."""
    import importlib.util

    import torch._dynamo

    return bool(torch._dynamo.config.automatic_dynamic_shapes) and importlib.util.find_spec("triton") is not None


def transformer_config_overrides(device: torch.device) -> Dict[str, Any]:
    """TransformerConfig fields to force on ``device``. On CUDA: megatron's fused bias-SwiGLU
    where it compiles a bounded number of times (:func:`swiglu_fusion_compiles_once_per_kind`;
    else the same math unfused); the other fusions do not apply (our attention has its own
    kernels, RMSNorm is not apex's persistent LayerNorm, RoPE comes from explicit positions)."""
    if on_cuda(device):
        return dict(bias_activation_fusion=swiglu_fusion_compiles_once_per_kind())
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


SWIGLU_KERNELS = ("swiglu", "swiglu_back", "bias_swiglu", "bias_swiglu_back", "weighted_swiglu",
                  "weighted_swiglu_back")
"""megatron's ``torch.compile``d SwiGLU kernels (``megatron.core.fusions.fused_bias_swiglu``); each
takes the tensor that decides its device first."""


def swiglu_fusion_fields() -> Dict[str, Any]:
    """TransformerConfig fields of a SwiGLU model (``silu`` with a gated linear unit): megatron's
    fused SwiGLU on every device (item 1: its autograd functions save the fc1 output only), its
    kernels dispatched per tensor by :func:`install_swiglu_kernels`."""
    install_swiglu_kernels()
    return dict(bias_activation_fusion=True)


def install_swiglu_kernels() -> None:
    """Let megatron's fused SwiGLU autograd functions run on any device (item 1). Each compiled
    kernel they call is replaced by one that runs the compiled kernel on a CUDA tensor where
    compiling is bounded (:func:`swiglu_fusion_compiles_once_per_kind`) and the eager original
    otherwise (CPU: dynamo would build C++ kernels per kind of shape, for seconds each; CUDA
    without Triton or without automatic dynamic shapes). The same arithmetic either way.
    Idempotent."""
    from megatron.core.fusions import fused_bias_swiglu as fused

    if getattr(fused, "_psrl_dispatch", False):
        return
    compiles = swiglu_fusion_compiles_once_per_kind()
    for name in SWIGLU_KERNELS:
        compiled = getattr(fused, name, None)
        eager = getattr(compiled, "_torchdynamo_orig_callable", None)
        if eager is None:  # (not compiled: megatron's jit_fuser is a no-op here)
            continue
        eager = swiglu_back_in_place if name == "swiglu_back" else eager
        setattr(fused, name, _device_dispatch(compiled, eager, compiles))
    fused._psrl_dispatch = True


def swiglu_back_in_place(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """megatron's ``swiglu_back`` (the gradient of ``silu(y1) * y2`` for ``y = [y1, y2]``), the
    same formula, written into its output with one ``f``-wide temporary (the sigmoid): run
    eagerly, megatron's expression holds about six ``f``-wide temporaries at once, which a
    compiled kernel fuses away (the other eager SwiGLU kernels call this one for their gradient)."""
    y1, y2 = torch.chunk(y, 2, -1)
    out = torch.empty_like(y)
    gate, up = torch.chunk(out, 2, -1)
    s = torch.sigmoid(y1)
    torch.mul(y1, s, out=up)  # silu(y1)
    up.mul_(g)  # d up = g silu(y1)
    torch.neg(s, out=gate)
    gate.add_(1).mul_(y1).add_(1).mul_(s).mul_(y2).mul_(g)  # d gate = g s (1 + y1 (1 - s)) y2
    return out


def _device_dispatch(compiled, eager, compiles: bool):
    """``compiled`` on a CUDA tensor where ``compiles``, else ``eager``; megatron's own eager
    function stays reachable as ``_torchdynamo_orig_callable`` (what ``compiled`` compiles)."""
    def kernel(x, *args):
        return compiled(x, *args) if compiles and x.is_cuda else eager(x, *args)

    kernel.__name__ = kernel.__qualname__ = eager.__name__
    kernel._torchdynamo_orig_callable = getattr(compiled, "_torchdynamo_orig_callable", eager)
    return kernel


def eager_activation(func, device: torch.device):
    """``func`` where it runs: megatron's activations are ``torch.compile``d (``jit_fuser``), and
    on CPU dynamo compiles one for seconds per kind of shape and gains nothing over the same
    eager math (gpt-oss's ``quick_gelu``); there the original function is returned. On CUDA
    ``func`` as it is (megatron's fused bias-GLU kernels recognise it by identity)."""
    if on_cuda(device):
        return func
    return getattr(func, "_torchdynamo_orig_callable", func)


def training_fusions(device: torch.device) -> Dict[str, Any]:
    """TransformerConfig fields of a model that trains (megatron's DDP gives every weight the
    fp32 ``main_grad`` its fused kernels add into): ``gradient_accumulation_fusion`` where the
    kernel exists. The weight gradient GEMM then accumulates into ``main_grad`` directly (no
    ``.grad`` tensor, no separate add). It needs apex's ``fused_weight_gradient_mlp_cuda``:
    megatron's own linear layers (the output layer always is one, also with Transformer Engine
    layers, which fuse it themselves) refuse the flag without that extension. Off on CPU: the
    kernel is CUDA only (item 1)."""
    return dict(gradient_accumulation_fusion=on_cuda(device) and gradient_accumulation_kernel_available())


def gradient_accumulation_kernel_available() -> bool:
    """apex's ``fused_weight_gradient_mlp_cuda`` (the wgrad GEMM accumulating into ``main_grad``) imports."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def seed_model_parallel_rng(seed: int, device: torch.device) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (CUDA or the CPU stand-in)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if on_cuda(device):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # The inference tracker never touches CUDA RNG state; torch.cuda.manual_seed is lazy
        # (a no-op without CUDA).
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


# ---------------------------------------------------------------------- 4: pipeline schedules
class _CpuCuda:
    """``torch.cuda`` as megatron's pipeline modules use it, answered for a CPU model."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _on_cpu(factory):
    def make(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _CpuTorch:
    """The ``torch`` module seen by megatron's DDP, optimizer and checkpoint-writer modules on
    CPU (items 3, 4 and 7)."""

    cuda = _CpuCuda()
    zeros = staticmethod(_on_cpu(torch.zeros))
    empty = staticmethod(_on_cpu(torch.empty))
    tensor = staticmethod(_on_cpu(torch.tensor))  # (item 3: the optimizers' scalars)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _give_cpu_torch(module_names) -> None:
    """Replace the ``torch`` these megatron modules see with :class:`_CpuTorch` (once)."""
    import importlib

    for name in module_names:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorch):
            module.torch = _CpuTorch()


# ---------------------------------------------------------------------- 3: DDP and optimizers
_OPTIMIZER_MODULES = ("megatron.core.distributed.param_and_grad_buffer", "megatron.core.optimizer.optimizer",
                      "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
                      "megatron.core.optimizer.grad_scaler", "megatron.core.utils")


def install_cpu_optimizer_shims(device: torch.device) -> None:
    """Let megatron's DistributedDataParallel and optimizers allocate on the CPU (item 3);
    nothing on CUDA. Idempotent."""
    if on_cuda(device):
        return
    _give_cpu_torch(_OPTIMIZER_MODULES)


_TENSOR_TYPE = torch._C.TensorBase.type
_cpu_calls_depth = 0


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type``; without arguments a CPU tensor answers with its CUDA type name."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _already_there(self, device=None, non_blocking=False, memory_format=None):
    """``Tensor.cuda`` for a CPU run: the tensor is on the run's device already (as ``.cuda()``
    on a CUDA tensor, it is returned as it is)."""
    return self


@contextlib.contextmanager
def megatron_optimizer_calls(device: torch.device):
    """Around calls into megatron's DDP and optimizer code: on CPU, ``Tensor.type()`` answers
    with the CUDA type name its checks expect and ``Tensor.cuda()`` leaves a tensor where it is
    (the distributed optimizer's checkpoint gather, ``distrib_optimizer.py``
    ``get_parameter_state_dp_zero``; the fp16 loss scale's ``load_state_dict``) (item 3);
    nothing on CUDA. Re-entrant. The patch is process-wide while active (megatron's calls read
    it from the tensor, not from a module), and on a CPU run either call would fail otherwise."""
    global _cpu_calls_depth
    if on_cuda(device):
        yield
        return
    if _cpu_calls_depth == 0:
        torch.Tensor.type = _cuda_named_type
        torch.Tensor.cuda = _already_there
    _cpu_calls_depth += 1
    try:
        yield
    finally:
        _cpu_calls_depth -= 1
        if _cpu_calls_depth == 0:
            del torch.Tensor.type  # back to TensorBase's
            del torch.Tensor.cuda


# ---------------------------------------------------------------------- 5: tied embeddings under PP
def keeps_cuda_embedding_sync(config) -> bool:
    """Whether megatron's own (CUDA) sync of the tied output copy may run (item 5)."""
    return not getattr(config, "use_cpu_initialization", False) or torch.cuda.is_available()


def sync_tied_output_copy(model) -> None:
    """On CPU with PP > 1 and tied embeddings: what megatron's setup does on CUDA, the first
    and last stages all-reduce their copies (the last stage's starts at zero)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if keeps_cuda_embedding_sync(model.config) or not model.share_embeddings_and_output_weights:
        return
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 or not dist.is_initialized():
        return
    if not parallel_state.is_rank_in_embedding_group() or not (model.pre_process or model.post_process):
        return  # (a middle virtual-stage chunk holds neither copy)
    with torch.no_grad():
        dist.all_reduce(model.shared_embedding_or_output_weight().data, group=parallel_state.get_embedding_group())


# ---------------------------------------------------------------------- 6: activation recompute
def install_cpu_recompute_shims(device: torch.device) -> None:
    """Let megatron's activation checkpointing run on CPU (item 6); nothing on CUDA. Idempotent."""
    if on_cuda(device):
        return
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom, "_psrl_cpu_shim", False):
        return
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.zeros(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._psrl_cpu_shim = True


# ---------------------------------------------------------------------- 7: dist_checkpointing on CPU
_DIST_CKPT_MODULES = ("megatron.core.dist_checkpointing.strategies.state_dict_saver",
                      "megatron.core.dist_checkpointing.strategies.filesystem_async")


def install_cpu_dist_checkpointing_shims(device: torch.device) -> None:
    """Let megatron's torch_dist save run with CPU tensors over gloo (item 7); nothing on CUDA.
    Idempotent."""
    if on_cuda(device):
        return
    import importlib
    import queue

    _give_cpu_torch(_DIST_CKPT_MODULES)
    fs = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if fs._results_queue is None:  # megatron would start a Manager process for it
        fs._results_queue = queue.Queue()


def _write_buckets_in_process(transforms, rank, write_buckets, results_queue) -> None:
    """What megatron's ``write_preloaded_data_multiproc`` does, in this process: each file
    written by megatron's ``write_preloaded_data``, the results (or the first error) put on
    ``results_queue`` for the finalize step."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: Any = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, count, True)
        idx, outcome = local.get()
        if isinstance(outcome, Exception):  # (a full disk, ...): an error naming the file
            from megatron_psrl.errors import CheckpointWriteError

            reason = outcome.strerror if isinstance(outcome, OSError) and outcome.strerror else None
            results = CheckpointWriteError(bucket[0], reason or _refused_write(bucket[0]) or str(outcome))
            break
        results[idx] = outcome
    results_queue.put(results)


def _refused_write(path: str):
    """Why the OS refuses writes next to ``path`` (e.g. "No space left on device"), or None:
    torch's zip writer reports a refused write as "unexpected pos" without the OS error, so a
    small probe file asks the OS again (and is removed)."""
    import os
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-probe-", dir=os.path.dirname(path))
    except OSError as exc:
        return exc.strerror
    try:
        os.write(fd, b"\0" * 65536)
        os.fsync(fd)
    except OSError as exc:
        return exc.strerror
    finally:
        os.close(fd)
        os.unlink(probe)
    return None


def torch_dist_save_strategy(device: torch.device):
    """Megatron's synchronous torch_dist save strategy (one file per rank: ``thread_count=1``);
    on CPU its write step runs in this process (item 7)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if on_cuda(device):
        return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    install_cpu_dist_checkpointing_shims(device)
    return _in_process_save_strategy()


def _in_process_save_strategy():
    from functools import partial

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        """megatron's strategy; only its write step runs in the calling process (item 7)."""

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            if request.async_fn is None:  # nothing to write on this rank
                return request
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            return AsyncRequest(partial(_write_buckets_in_process, transforms), request.async_fn_args,
                                request.finalize_fns,
                                preload_fn=partial(FileSystemWriterAsync.preload_tensors, writer.write_buckets, False))

    return InProcessTorchDistSave("torch_dist", 1, thread_count=1)


# ---------------------------------------------------------------------- 8: mixture-of-experts on CPU
class _CpuStream:
    """A CUDA stream or event as megatron's MoE code uses them, for CPU tensors: nothing to order."""

    def wait_stream(self, *args, **kwargs) -> None:
        return None

    def record_event(self, *args, **kwargs) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        return None

    def wait_event(self, *args, **kwargs) -> None:
        return None


class _CpuCudaStreams(_CpuCuda):
    """``torch.cuda`` for megatron's MoE modules on CPU: item 4's, plus streams and events."""

    _current = _CpuStream()

    @staticmethod
    def Stream(*args, **kwargs) -> _CpuStream:  # noqa: N802 (torch's name)
        return _CpuStream()

    @staticmethod
    def Event(*args, **kwargs) -> _CpuStream:  # noqa: N802 (torch's name)
        return _CpuStream()

    @classmethod
    def current_stream(cls, *args, **kwargs) -> _CpuStream:
        return cls._current

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()


class _CpuTorchStreams(_CpuTorch):
    """The ``torch`` megatron's MoE modules see on CPU (item 8)."""

    cuda = _CpuCudaStreams()


_MOE_MODULES = ("megatron.core.transformer.moe.router", "megatron.core.transformer.moe.experts",
                "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.moe_utils",
                "megatron.core.transformer.moe.shared_experts", "megatron.core.transformer.moe.moe_layer",
                "megatron.core.tensor_parallel.mappings")


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: split sizes
    (``as_numpy``) become host integers, as megatron's CUDA path makes them."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


_SEQUENCE_PARALLEL_MODULES = ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
                              "megatron.core.utils")


def install_cpu_sequence_parallel_shims(device: torch.device) -> None:
    """Let megatron's parallel linear layers and sequence-parallel mappings allocate on the CPU
    (item 9); nothing on CUDA. Idempotent."""
    if on_cuda(device):
        return
    _give_cpu_torch(_SEQUENCE_PARALLEL_MODULES)


def install_cpu_moe_shims(device: torch.device) -> None:
    """Let megatron's MoE layer (router, experts, both token dispatchers) run on the CPU over
    gloo (item 8); nothing on CUDA. Idempotent."""
    if on_cuda(device):
        return
    import importlib

    for name in _MOE_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorchStreams):
            module.torch = _CpuTorchStreams()
    _give_cpu_torch(("megatron.core.utils",))  # GlobalMemoryBuffer
    utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(utils, "te_general_gemm"):  # unbound without Transformer Engine
        utils.te_general_gemm = None
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes


# ---------------------------------------------------------------------- 10: Gated DeltaNet
@contextlib.contextmanager
def gated_delta_net_construction(config):
    """While megatron's ``GatedDeltaNet`` is built (or reset) for ``TreeGatedDeltaNet``: its fla
    check passes without fla, and a CPU model's parameters are allocated on the CPU (item 10).
    Restores the module afterwards; nothing is changed with fla on a CUDA model."""
    import importlib

    module = importlib.import_module("megatron.core.ssm.gated_delta_net")
    saved = (module.HAVE_FLA, module.torch)
    on_cpu = bool(config.use_cpu_initialization) or not torch.cuda.is_available()
    module.HAVE_FLA = True
    if on_cpu:
        module.torch = _CpuTorch()
    try:
        yield
    finally:
        module.HAVE_FLA, module.torch = saved


# ---------------------------------------------------------------------- 11: latent attention
_ROTARY_MODULES = ("megatron.core.models.common.embeddings.rotary_pos_embedding",
                   "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


def install_cpu_latent_attention_shims(device: torch.device) -> None:
    """Let latent attention's tensor-parallel gathers allocate on the CPU (item 11); nothing on
    CUDA. Idempotent."""
    if on_cuda(device):
        return
    _give_cpu_torch(("megatron.core.tensor_parallel.mappings",))


@contextlib.contextmanager
def latent_attention_construction(config):
    """While megatron's ``MLASelfAttention`` is built for ``TreeMLASelfAttention``: on a CPU model
    its rotary module is allocated on the CPU, and without Transformer Engine its TE check is off
    (item 11). Restores the modules afterwards; nothing is changed for a CUDA model with
    Transformer Engine."""
    import importlib
    import importlib.util

    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    on_cpu = bool(config.use_cpu_initialization) or not torch.cuda.is_available()
    modules = [importlib.import_module(name) for name in _ROTARY_MODULES] if on_cpu else []
    saved = [m.torch for m in modules], mla.HAVE_TE
    for m in modules:
        m.torch = _CpuTorch()
    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False
    try:
        yield
    finally:
        for m, t in zip(modules, saved[0]):
            m.torch = t
        mla.HAVE_TE = saved[1]
