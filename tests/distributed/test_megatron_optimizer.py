"""megatron's DistributedDataParallel and optimizer, the one optimizer path on CPU and GPU, with
2 data-parallel ranks over gloo (torchrun; see the scripts for what each case checks).

- calibration (R1, R5): start-up calibration leaves no gradient in ``.grad`` or DDP's
  ``main_grad`` and records no ``--overlap-grad-reduce`` gradient counts; the steps after it
  equal a run without it. Before the fix: ``finish_grad_sync``'s "Communication call has not
  been issued for this bucket" assertion, and calibration's gradients in ``main_grad``.
- param-gather (R4): ``--overlap-param-gather`` with a rank that has no micro-batch in a step,
  an extra forward on one rank and a weight read on one rank: equal to the synchronous
  all-gather bit for bit. Before the fix: mismatched collectives (a gloo timeout).
- grad-overlap: ``--overlap-grad-reduce`` started during a prefix-shared step's last backward
  pass: gradients bit for bit those of the reduce after the step (one bucket, and the same
  buckets), the distributed optimizer's step too; buckets start in order, none before the
  last backward, some before its last gradient arrives (and, when the last backward is a shared
  prompt's dK/dV only, before it produces any); a gradient after its bucket started raises.
"""

from __future__ import annotations

import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "megatron_optimizer_steps.py")


@pytest.mark.slow  # a 2-rank torchrun launch
@pytest.mark.parametrize("case,expected", [
    ("calibration", ["OK calibration overlap_grad_reduce=True distributed=False",
                     "OK calibration overlap_grad_reduce=True distributed=True",
                     "OK calibration overlap_grad_reduce=False distributed=False"]),
    ("param-gather", ["OK param-gather"]),
    ("grad-overlap", ["OK grad-overlap"]),
])
def test_megatron_optimizer_over_gloo(distributed_launches, case, expected):
    out = distributed_launches(case)  # SCRIPT --case CASE, 2 ranks (one launch with others: conftest.py)
    for line in expected:
        assert out.count(line) == 2, out[-3000:]  # both ranks


def test_reachable_parameters_follow_the_backward_graph():
    """What a backward from given roots reaches decides which buckets are complete from the
    start of the step's last backward: a root that skips a layer leaves its weight out; a
    reentrant checkpoint hides its parameters, so nothing can be told."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from megatron_psrl.engine.grad_reduce import reachable_parameters

    low, high = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    x = torch.randn(3, 4)
    hidden = low(x)
    loss = high(hidden).sum()
    assert reachable_parameters([hidden]) == {id(low.weight), id(low.bias)}
    assert reachable_parameters([loss, hidden]) == {id(p) for p in (*low.parameters(), *high.parameters())}
    kept = checkpoint(low, x, use_reentrant=False)  # (non-reentrant: the graph holds the weights)
    assert reachable_parameters([kept]) == {id(low.weight), id(low.bias)}
    hidden_again = checkpoint(low, x.requires_grad_(), use_reentrant=True)
    assert reachable_parameters([hidden_again]) is None


def test_a_last_backward_from_no_roots_starts_every_bucket_at_once():
    """A pipeline stage whose last backward has nothing to run (no loss, no produced prefix in
    its layers) starts every bucket's reduce right then, as its data-parallel peers start
    theirs during their last backward, before the step's next collective over the group;
    unknown roots still wait for every gradient."""
    from types import SimpleNamespace

    import torch

    from megatron_psrl.engine.grad_reduce import BucketLaunches

    started = []

    class Group:
        def __init__(self, name, params):
            self.name, self.params, self.grad_reduce_handle = name, params, None

        def start_grad_sync(self):
            started.append(self.name)

    low, high = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    ddp = SimpleNamespace(bucket_groups=[Group("high", list(high.parameters())), Group("low", list(low.parameters()))],
                          expert_parallel_bucket_groups=[], module=torch.nn.Sequential(low, high))
    launches = BucketLaunches([ddp], torch.device("cpu"))
    launches.arm(None)
    assert started == [] and launches.started == 0
    launches.reset()
    launches.arm([])
    assert started == ["high", "low"] and launches.started == 2


def test_gradient_accumulation_fusion_only_where_its_kernel_is(monkeypatch):
    """On for a training model on CUDA when apex's fused_weight_gradient_mlp_cuda imports;
    off on CPU (no such kernel) and without the extension."""
    import sys
    import types

    import torch

    from megatron_psrl.compat import training_fusions

    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", types.ModuleType("fused_weight_gradient_mlp_cuda"))
    assert training_fusions(torch.device("cuda")) == {"gradient_accumulation_fusion": True}
    assert training_fusions(torch.device("cpu")) == {"gradient_accumulation_fusion": False}
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", None)  # (import fails)
    assert training_fusions(torch.device("cuda")) == {"gradient_accumulation_fusion": False}


def test_cpu_calls_patch_only_while_megatron_runs():
    """compat item 3: inside megatron's optimizer calls a CPU tensor answers with its CUDA type
    name and ``cuda()`` keeps it on the CPU; nested calls restore torch only at the outermost."""
    import torch

    from megatron_psrl.compat import megatron_optimizer_calls

    x = torch.zeros(2, dtype=torch.bfloat16)
    with megatron_optimizer_calls(torch.device("cpu")):
        with megatron_optimizer_calls(torch.device("cpu")):
            assert x.type() == "torch.cuda.BFloat16Tensor" and x.cuda() is x
        assert x.type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float32).dtype == torch.float32  # a conversion is still one
    assert x.type() == "torch.BFloat16Tensor"
    assert "type" not in vars(torch.Tensor) and "cuda" not in vars(torch.Tensor)
