"""initialize_parallel in a plain single process (gloo, one rank); torchrun is covered by
test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_psrl.distributed.setup import initialize_parallel, pick_device


def test_single_process_layout():
    layout = initialize_parallel(1, 1, seed=7, device="cpu")
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (layout.rank, layout.world_size, layout.tensor_parallel_size, layout.pipeline_parallel_size) == (0, 1, 1, 1)
    assert (layout.data_parallel_size, layout.tp_rank, layout.pp_rank, layout.dp_rank) == (1, 0, 0, 0)
    assert layout.device == torch.device("cpu") and layout.is_logging_rank
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    # idempotent, and (re)seeds torch's generator
    x = torch.rand(3)
    initialize_parallel(1, 1, seed=7, device="cpu")
    assert torch.equal(torch.rand(3), x)


def test_layout_that_does_not_fit_the_world_is_refused():
    initialize_parallel(1, 1, device="cpu")
    with pytest.raises(ValueError, match="TP 2 x PP 1 needs 2 processes.*torchrun --nproc_per_node 2"):
        initialize_parallel(2, 1, device="cpu")
    assert parallel_state.get_tensor_model_parallel_world_size() == 1  # state untouched


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_cuda_requested_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        pick_device("cuda")
    assert pick_device("auto") == torch.device("cpu")
