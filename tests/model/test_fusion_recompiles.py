"""megatron's fused SwiGLU (``bias_activation_fusion``, on CUDA) runs ``torch.compile``d kernels
(``megatron.core.jit.jit_fuser``) on micro-batches whose row count changes every step. With
dynamo's automatic dynamic shapes the compilations stop after the first few shapes; without
them every new row count compiles again, so the fusion is on only with them
(``megatron_psrl.compat.swiglu_fusion_compiles_once_per_kind``).

The count is dynamo's (guards and recompilations happen before any backend runs): megatron's
own functions are compiled again here with the ``eager`` backend, which keeps the test in
seconds on CPU (inductor would generate and build C++ kernels)."""

import pytest
import torch
import torch._dynamo
from megatron.core.fusions import fused_bias_swiglu as fused
from torch._dynamo.utils import counters

from megatron_psrl.compat import transformer_config_overrides

FFN = 32
ROW_COUNTS = [37, 512, 129, 1000, 77, 5, 300, 61, 1, 900, 1, 2048, 13, 700]
"""Rows of successive micro-batches (a one-row pack among them)."""


@pytest.fixture
def eager_compiled_swiglu(monkeypatch):
    for name in ("swiglu", "swiglu_back"):
        monkeypatch.setattr(fused, name, torch.compile(getattr(fused, name)._torchdynamo_orig_callable,
                                                       backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _frames_after_each_step(row_counts):
    """Frames dynamo has compiled after each micro-batch (a forward and backward through
    megatron's fused SwiGLU, and a forward without autograd, as a log-prob pass runs)."""
    frames = []
    for rows in row_counts:
        x = torch.randn(rows, 1, 2 * FFN, requires_grad=True)  # [t, 1, 2f]: an MLP's fc1 output
        fused.bias_swiglu_impl(x, None).sum().backward()
        with torch.no_grad():
            fused.bias_swiglu_impl(x.detach(), None)
        frames.append(counters["frames"]["ok"])
    return frames


def test_fused_swiglu_compiles_a_bounded_number_of_times(eager_compiled_swiglu):
    assert torch._dynamo.config.automatic_dynamic_shapes  # torch's default, what the fusion relies on
    frames = _frames_after_each_step(ROW_COUNTS)
    # first shape, the first change (rows symbolic) and one row, for swiglu (x2: with and
    # without requires_grad) and swiglu_back: nothing more, however many shapes follow
    assert frames[-1] <= 9, frames
    assert frames[ROW_COUNTS.index(1)] == frames[-1], frames  # no compilation after the one-row pack


def test_without_automatic_dynamic_shapes_every_shape_compiles(eager_compiled_swiglu):
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        frames = _frames_after_each_step(ROW_COUNTS[:4])  # (then dynamo's recompile limit, 8, would stop it)
    assert frames == [3, 6, 9, 12], frames  # swiglu twice and swiglu_back, for every shape


def test_the_fusion_is_on_on_cuda_only_with_automatic_dynamic_shapes(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    assert transformer_config_overrides(torch.device("cuda"))["bias_activation_fusion"] is True
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        assert transformer_config_overrides(torch.device("cuda"))["bias_activation_fusion"] is False
    assert transformer_config_overrides(torch.device("cpu"))["bias_activation_fusion"] is False


def test_without_triton_the_cuda_swiglu_runs_unfused(monkeypatch):
    """torch.compile's CUDA kernels are Triton's: without it megatron's plain SwiGLU runs."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert transformer_config_overrides(torch.device("cuda"))["bias_activation_fusion"] is False


def test_swiglu_models_run_the_fused_swiglu_on_cpu_eagerly():
    """A SwiGLU model's config turns megatron's fused SwiGLU on on CPU too (it saves the fc1 output
    only: the memory plan's 3f); its kernels run as their eager originals there (no dynamo frame),
    with the unfused activation's values and gradients. gpt-oss's clamped GLU stays unfused."""
    from megatron_psrl.model.architecture import ModelArchitecture
    from megatron_psrl.model.gpt import build_transformer_config
    from megatron_psrl.model.tiny import tiny_config

    config = build_transformer_config(ModelArchitecture.from_hf_config(tiny_config("tiny-llama")))
    assert config.bias_activation_fusion is True
    oss = build_transformer_config(ModelArchitecture.from_hf_config(tiny_config("debug-gpt-oss")))
    assert oss.bias_activation_fusion is False
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(7, 1, 2 * FFN, dtype=torch.float64, requires_grad=True)
    fused.bias_swiglu_impl(x, None).square().sum().backward()
    assert counters["frames"]["ok"] == 0  # nothing compiled
    ref = x.detach().clone().requires_grad_(True)
    gate, up = ref.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).square().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_the_swiglu_kernels_run_compiled_on_cuda_tensors_only_where_compiling_is_bounded():
    from megatron_psrl.compat import _device_dispatch

    class Rows:
        def __init__(self, is_cuda):
            self.is_cuda = is_cuda

    kernel = _device_dispatch(lambda x, *a: "compiled", lambda x, *a: "eager", compiles=True)
    assert (kernel(Rows(True)), kernel(Rows(False))) == ("compiled", "eager")
    assert _device_dispatch(lambda x: "compiled", lambda x: "eager", compiles=False)(Rows(True)) == "eager"
