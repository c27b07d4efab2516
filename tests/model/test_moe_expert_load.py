"""ExpertLoad: tokens per expert counted from the routers' outputs, once per token and layer
(forwards with autograd only; never the expert-parallel lockstep's empty passes)."""

import pytest
import torch

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.model.moe import ExpertLoad, expert_load_summary, install_moe_runtime
from megatron_psrl.training.metrics_log import expert_load_ratios

T = 40


@pytest.fixture(scope="module")
def model():
    initialize_parallel(1, 1, seed=0, device="cpu")
    install_moe_runtime(torch.device("cpu"))
    arch, model, _ = load_model(ModelSource(tiny="debug-qwen3-moe"))
    return arch, model


def _forward(model, arch):
    ids = torch.randint(0, arch.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    return model(ids, torch.arange(T), TreeAttentionMetadata(plan=causal_plan([T])))


def test_counts_each_token_once_per_layer(model):
    arch, net = model
    with ExpertLoad(net) as load:
        with torch.no_grad():  # a graph-less forward (recomputed later, or a log-prob pass): not counted
            _forward(net, arch)
        with ExpertLoad.uncounted():  # the lockstep's empty passes
            _forward(net, arch).sum().backward()
        assert load.counts().sum() == 0
        _forward(net, arch).sum().backward()
        counts = load.counts()
    assert load.layer_numbers == [1, 2] and counts.shape == (2, arch.num_experts)
    assert counts.sum(dim=1).tolist() == [T * arch.moe_router_topk] * 2
    summary = expert_load_summary(counts)
    assert summary == [[int(c.max()), T * arch.moe_router_topk / arch.num_experts] for c in counts]
    assert all(r >= 1.0 for r in expert_load_ratios(summary))
    n = sum(len(m._forward_hooks) for m in net.modules())
    _forward(net, arch)  # closed: the hooks are gone
    assert n == 0 and load.counts().sum() == T * arch.moe_router_topk * 2
