"""The start-up check of the attention backend: a flash / te choice that cannot run on this
machine fails when the engine is built, in one line naming the fix, instead of at the first
forward pass (Transformer Engine's thd + padding_causal_bottom_right needs its flash-attn path
or a cuDNN fused kernel; without either TE raises only when it first runs). The machine's
facts are built by hand or faked with monkeypatch, so every branch runs on CPU."""

import sys
import types

import pytest
import torch

from megatron_psrl.attention.backends import (
    KernelFacts,
    attention_backend_problem,
    check_attention_backend,
    kernel_facts,
)
from megatron_psrl.errors import ConfigurationError

H100, A100 = (9, 0), (8, 0)


def _gpu(**kw):
    base = dict(device_type="cuda", dtype_name="bfloat16", te_installed=True, compute_capability=H100)
    base.update(kw)
    return KernelFacts(**base)


@pytest.mark.parametrize("facts", [
    _gpu(flash_attn_version=(2, 6, 3)),                                   # TE's flash-attn path
    _gpu(cudnn_version=90700),                                            # cuDNN fused, thd bottom right
    _gpu(cudnn_version=91800, env={"NVTE_FLASH_ATTN": "0"}),              # fused only, flash switched off
    _gpu(cudnn_version=91801, compute_capability=A100),                   # thd on Ampere from 9.18.1
    _gpu(flash_attn_version=(2, 1, 0), cudnn_version=90100, compute_capability=A100),
], ids=["flash-attn", "cudnn-9.7", "fused-only", "ampere-cudnn-9.18.1", "flash-attn-2.1-on-a100"])
def test_te_accepted_where_a_thd_bottom_right_kernel_exists(facts):
    assert attention_backend_problem("te", facts) is None


@pytest.mark.parametrize("facts, why", [
    (_gpu(cudnn_version=90100), "flash-attn: not installed; cuDNN fused attention: cuDNN 90100"),
    (_gpu(flash_attn_version=(2, 6), cudnn_version=90100, env={"NVTE_FLASH_ATTN": "0"}), "NVTE_FLASH_ATTN=0"),
    (_gpu(cudnn_version=90800, env={"NVTE_FUSED_ATTN": "0"}), "disabled by NVTE_FUSED_ATTN=0"),
    (_gpu(cudnn_version=91000), "cuDNN 91000"),                           # excluded by TE (SDPA bugs)
    (_gpu(cudnn_version=90800, compute_capability=A100), "thd needs sm90+"),
    (_gpu(flash_attn_version=(2, 0, 4), cudnn_version=None), "flash-attn 2.0.4 < 2.1"),
], ids=["old-cudnn", "flash-switched-off", "fused-switched-off", "cudnn-9.10.0", "ampere", "old-flash-attn"])
def test_te_refused_without_a_thd_bottom_right_kernel(facts, why):
    problem = attention_backend_problem("te", facts)
    assert problem is not None and why in problem, problem
    assert "\n" not in problem
    # it names the ways out
    assert "--attention-backend flash" in problem and "flash-attn >= 2.1" in problem and "NVTE_FUSED_ATTN=1" in problem


def test_flash_and_te_refused_off_cuda_in_fp32_or_without_their_package():
    assert "needs a CUDA device" in attention_backend_problem("flash", KernelFacts(device_type="cpu"))
    assert "--attention-backend torch" in attention_backend_problem("te", KernelFacts(device_type="cpu"))
    assert "fp16/bf16 only" in attention_backend_problem("flash", _gpu(dtype_name="float32", flash_attn_version=(2, 6)))
    assert "pip install flash-attn" in attention_backend_problem("flash", _gpu())
    # flash-attn before 2.1 aligns the causal mask top left: silently wrong for ancestor keys
    assert "found 2.0.9" in attention_backend_problem("flash", _gpu(flash_attn_version=(2, 0, 9)))
    assert attention_backend_problem("flash", _gpu(flash_attn_version=(2, 7, 4))) is None
    assert "needs transformer-engine" in attention_backend_problem("te", _gpu(te_installed=False, cudnn_version=90800))
    for backend in ("torch", "dense"):  # run anywhere
        assert attention_backend_problem(backend, KernelFacts(device_type="cpu")) is None


def test_kernel_facts_read_the_environment_and_packages(monkeypatch):
    """The facts come from NVTE_* variables and the installed packages (faked here)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.0.4.post1"))
    facts = kernel_facts("cpu", torch.bfloat16)
    assert facts.env["NVTE_FUSED_ATTN"] == "0" and facts.flash_attn_version == (2, 0, 4)
    assert facts.dtype_name == "bfloat16" and facts.compute_capability is None  # CUDA untouched off cuda
    facts.device_type, facts.compute_capability, facts.te_installed, facts.cudnn_version = "cuda", H100, True, 90900
    with pytest.raises(ConfigurationError, match="NVTE_FUSED_ATTN=0.*use --attention-backend flash"):
        check_attention_backend("te", "cuda", torch.bfloat16, facts=facts)
    with pytest.raises(ConfigurationError, match="found 2.0.4"):
        check_attention_backend("flash", "cuda", torch.bfloat16, facts=facts)
    check_attention_backend("torch", "cuda", torch.bfloat16, facts=facts)  # nothing to check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU start-up error")
@pytest.mark.parametrize("backend", ["flash", "te"])
def test_engine_build_fails_at_start_up(backend):
    """The engine's build step that picks the backend refuses it (before any model runs)."""
    from megatron_psrl.engine.builder import cache_and_runner
    from megatron_psrl.engine.config import ActorConfig

    layout = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match=f"attention backend '{backend}' needs a CUDA device"):
        cache_and_runner(ActorConfig(device="cpu", attention_backend=backend), layout, None, None, None,
                         recompute=False, log=print)
