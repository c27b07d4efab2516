"""Step sums stay where their terms live and are read once; index arrays reach the device
(pinned and non-blocking on CUDA)."""

import numpy as np
import pytest
import torch

from megatron_psrl.host_copy import DeviceSums, host_to_device


def test_device_sums_add_tensors_and_floats_and_read_once():
    sums = DeviceSums()
    for i in range(5):
        sums.add("loss", torch.tensor(0.5 * i, requires_grad=True) * 2)
        sums.add("clip_frac", 0.25)
        sums.add("skipped", None)
    assert sums.read() == {"loss": 10.0, "clip_frac": 1.25}  # 0 + 1 + 2 + 3 + 4
    assert DeviceSums().read() == {}


def test_host_to_device_copies_arrays_on_cpu():
    a = np.arange(10, dtype=np.int64)[::2]  # a strided view: made contiguous
    t = host_to_device(a, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [0, 2, 4, 6, 8]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_to_device_is_pinned_and_lands_on_cuda():
    t = host_to_device(np.arange(1000), torch.device("cuda"))
    torch.cuda.synchronize()
    assert t.is_cuda and t.cpu().tolist() == list(range(1000))
