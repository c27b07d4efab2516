"""benchmarks/gpu_acceptance.sh and its training check run on this machine: without CUDA every
part says SKIP (exit 0); the bf16-vs-fp32 training check passes on CPU with the torch kernel."""

import os
import subprocess
import sys

import pytest
import torch
from helpers.torchrun import REPO_ROOT, script_env

pytestmark = pytest.mark.slow  # scripts in subprocesses


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only output")
def test_acceptance_script_skips_every_part_without_cuda():
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "benchmarks", "gpu_acceptance.sh")], cwd=REPO_ROOT,
                          env=dict(script_env(), PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["SKIP kernels: no CUDA device", "SKIP train-bf16: no CUDA device",
                                           "SKIP bench: no CUDA device"]


def test_bf16_training_check_passes_on_cpu():
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", "gpu_train_check.py"), "--device",
                           "cpu", "--backends", "torch", "--steps", "2"], cwd=REPO_ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS train-bf16 torch: 2 steps" in proc.stdout and "mechanism 2 on" in proc.stdout
