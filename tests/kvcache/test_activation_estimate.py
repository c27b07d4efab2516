"""The activation estimate the KV cache manager charges for a retained prefix graph is an upper
bound of what a forward pass really keeps alive (measured heap bytes)."""

import gc

import pytest
import torch

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.kvcache import activation_bytes_per_token
from megatron_psrl.training.memory import heap_bytes_in_use


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "debug-llama"])
def test_estimate_bounds_the_measured_activations(name):
    initialize_parallel(1, 1, seed=0, device="cpu")
    arch, model, _ = load_model(ModelSource(tiny=name))
    n = 1024
    ids = torch.randint(0, arch.vocab_size, (n,))
    gc.collect()
    before = heap_bytes_in_use()
    hidden = model(ids, torch.arange(n), TreeAttentionMetadata(plan=causal_plan([n])))
    held = (heap_bytes_in_use() - before) / n
    estimate = activation_bytes_per_token(arch, 1, 4)
    del hidden
    assert held <= estimate <= 1.4 * held, (held, estimate)
