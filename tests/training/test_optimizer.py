"""The optimizer (megatron's DDP and optimizer, on CPU through compat item 3): megatron's rules
(no decay on norms/biases, clipping by the global norm, fp32 main params and main_grad for a
bf16 model)."""

import pytest
import torch

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine.optimizer import OptimizerSettings, TrainingOptimizer


def _model(dtype):
    initialize_parallel(1, 1, seed=0, device="cpu")
    return load_model(ModelSource(tiny="debug-llama"), dtype=dtype)[1]


def _main_params(opt):
    """``[(model param, fp32 main param)]`` of megatron's Float16OptimizerWithFloat16Params."""
    (inner,) = opt.optimizer.chained_optimizers
    return [(p, m) for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups)
            for p, m in zip(model_group, main_group)]


def _fill_grads(model, value):
    """Every parameter's gradient ``value``, through a backward pass (as training produces it:
    a bf16 model's gradients then land in its fp32 main copies)."""
    sum(p.sum() * value for p in model.parameters()).backward()


def test_bf16_model_steps_through_fp32_masters():
    model = _model(torch.bfloat16)
    opt = TrainingOptimizer(model, OptimizerSettings(optimizer="sgd", lr=1e-4, clip_grad=0.0))
    before = [p.detach().float().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        _fill_grads(model, 1.0)
        opt.step()
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    masters = dict((id(p), m) for p, m in _main_params(opt))
    assert len(masters) == len(before)
    for p, b in zip(model.parameters(), before):
        master = masters[id(p)]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.detach(), b - 3e-4, rtol=0, atol=1e-6)  # exact fp32 updates
        assert torch.equal(p.detach(), master.detach().to(p.dtype))  # the model holds them (rounded)
    state = opt.state_dict()
    assert "fp32_from_fp16_params" in state["optimizer"]


def test_bf16_gradients_accumulate_in_fp32_main_copies():
    """Micro-batches' bf16 gradients add up in fp32: 1000 additions of 1e-3 onto 1.0 stay exact
    to fp32 rounding (in bf16 each addition would round away)."""
    model = _model(torch.bfloat16)
    opt = TrainingOptimizer(model, OptimizerSettings(optimizer="sgd", lr=0.0, clip_grad=0.0))
    _fill_grads(model, 1.0)
    for _ in range(1000):
        _fill_grads(model, 1e-3)
    for p in model.parameters():
        main = opt.main_grad(p)
        assert p.grad is None and main.dtype == torch.float32
        expected = 1.0 + 1000 * float(torch.tensor(1e-3, dtype=torch.bfloat16))  # each addend is bf16-rounded
        torch.testing.assert_close(main, torch.full_like(main, expected), rtol=1e-5, atol=0)
    opt.zero_grad()
    assert all(not opt.main_grad(p).any() for p in model.parameters())


def test_clipping_and_weight_decay_rules():
    model = _model(torch.float32)
    opt = TrainingOptimizer(model, OptimizerSettings(optimizer="sgd", lr=1.0, clip_grad=1.0, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _fill_grads(model, 1.0)
    n_elems = sum(p.numel() for p in model.parameters())
    norm = opt.step().grad_norm
    assert norm == pytest.approx(n_elems ** 0.5, rel=1e-6)
    scale = 1.0 / (norm + 1e-6)
    for n, p in model.named_parameters():
        decay = 0.0 if (p.ndim == 1 or n.endswith(".bias")) else 0.5
        expected = before[n] * (1 - decay) - scale  # torch SGD: p -= lr * (g + wd * p)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_fp16_runs_megatrons_dynamic_loss_scaling_on_cpu():
    """fp16 (refused on CPU before megatron's optimizer ran there): overflowing steps are skipped
    and lower megatron's loss scale until a step goes through, with the unscaled norm."""
    model = _model(torch.float16)
    opt = TrainingOptimizer(model, OptimizerSettings(optimizer="sgd", lr=1e-4, clip_grad=0.0))
    first_scale = opt.loss_scale
    n_elems = sum(p.numel() for p in model.parameters())
    for _ in range(40):
        opt.zero_grad()
        _fill_grads(model, opt.loss_scale)
        outcome = opt.step()
        if not outcome.skipped:
            break
        assert outcome.loss_scale_overflow
    assert not outcome.skipped and opt.loss_scale < first_scale
    assert outcome.grad_norm == pytest.approx(n_elems ** 0.5, rel=1e-3)
