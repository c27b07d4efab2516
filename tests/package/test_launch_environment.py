"""The launch scripts' GPU environment (launch/common.sh ``gpu_environment``): one hardware queue
per device for megatron's tensor-parallel communication order, NCCL errors raised, longer
InfiniBand retries; a value the job set stays. On a CPU machine it is not applied (megatron's
``CUDA_DEVICE_MAX_CONNECTIONS`` warning is GPU advice)."""

import os
import subprocess

from helpers.torchrun import REPO_ROOT

SHOW = 'printf "%s|%s|%s|%s\\n" "${CUDA_DEVICE_MAX_CONNECTIONS:-}" "${TORCH_NCCL_ASYNC_ERROR_HANDLING:-}" ' \
       '"${NCCL_IB_TIMEOUT:-}" "${NCCL_DEBUG:-}"'


def _run(script: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "CUDA_DEVICE_MAX", "TORCH_NCCL"))}
    return subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=dict(base, **env), capture_output=True,
                          text=True, check=True).stdout.strip()


def test_gpu_environment_sets_its_defaults_and_keeps_the_jobs():
    assert _run(f"source launch/common.sh && gpu_environment && {SHOW}", DEVICE="cpu") == "1|1|22|WARN"
    kept = _run(f"source launch/common.sh && gpu_environment && {SHOW}", DEVICE="cpu", NCCL_IB_TIMEOUT="18",
                CUDA_DEVICE_MAX_CONNECTIONS="8")
    assert kept == "8|1|18|WARN"


def test_a_cpu_job_gets_none_of_it():
    assert _run(f"source launch/common.sh && {SHOW}", DEVICE="cpu") == "|||"
