"""benchmarks/gpu_acceptance.sh (its logic in benchmarks/gpu_acceptance.py) and its training
check, on this machine: without CUDA every part says SKIP (exit 0, the JSON summary written);
a part passes only when something in it passed (fake pytest and script outputs, and the real
kernels command, whose GPU tests all skip here); the bf16-vs-fp32 training check passes on CPU
with the torch kernel."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.torchrun import REPO_ROOT, script_env

SPEC = importlib.util.spec_from_file_location("gpu_acceptance", os.path.join(REPO_ROOT, "benchmarks", "gpu_acceptance.py"))
acceptance = importlib.util.module_from_spec(SPEC)
sys.modules.setdefault("gpu_acceptance", acceptance)  # its dataclasses look their module up
SPEC.loader.exec_module(acceptance)

PARTS = ["kernels", "train-bf16", "memory", "bench"]


@pytest.mark.slow  # a script in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only output")
def test_acceptance_script_skips_every_part_without_cuda(tmp_path):
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "benchmarks", "gpu_acceptance.sh"), "--log-dir",
                           str(tmp_path)], cwd=REPO_ROOT, env=dict(script_env(), PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"SKIP {p}: no CUDA device" for p in PARTS]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_status"] == 0 and summary["meta"]["cuda"] is False
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [(p, "SKIP") for p in PARTS]


@pytest.mark.parametrize("output, code, status", [
    ("ssss\n4 skipped in 0.51s\n", 0, "SKIP"),                      # all skipped: never PASS
    ("SKIPPED [2] tests/attention/test_x.py:9: needs CUDA\n2 skipped, 40 deselected in 3.0s", 0, "SKIP"),
    ("no tests ran in 0.10s", 5, "SKIP"),
    ("40 deselected in 0.20s", 5, "SKIP"),
    ("..ss\n2 passed, 2 skipped in 3.10s", 0, "PASS"),
    ("F..\n1 failed, 2 passed in 2.00s", 1, "FAIL"),
    ("E\n1 error in 0.20s", 2, "FAIL"),                             # a collection error
    ("1 passed, 1 xpassed in 1.00s", 0, "FAIL"),                    # strict expectations broke
    ("Fatal Python error: Segmentation fault", -11, "FAIL"),        # a crash: no summary line
    ("..\n2 passed in 80.00s", 124, "FAIL"),                        # killed at the time limit
    ("2 passed in 1.00s", 3, "FAIL"),                               # internal error after passing
])
def test_pytest_classification(output, code, status):
    assert acceptance.classify_pytest(output, code)[0] == status


def test_pytest_classification_details():
    status, detail = acceptance.classify_pytest(
        "SKIPPED [4] tests/attention/test_core_attention.py:240: flash kernel package not installed\n"
        "4 skipped, 12 deselected in 2.00s", 0)
    assert status == "SKIP" and detail == "0 passed, 4 skipped: flash kernel package not installed"
    assert acceptance.pytest_counts("3 passed, 1 failed, 2 errors, 5 skipped in 9.1s") == dict(
        passed=3, failed=1, error=2, skipped=5, deselected=0, xfailed=0, xpassed=0)


@pytest.mark.parametrize("output, code, status", [
    ("PASS train-bf16 torch: 3 steps\nSKIP train-bf16 flash: flash_attn is not installed\n", 0, "PASS"),
    ("SKIP train-bf16 flash: not installed\nSKIP train-bf16 te: not installed\n", 0, "SKIP"),
    ("", 0, "SKIP"),
    ("PASS memory torch grpo: ...\nFAIL memory flash grpo: measured / plan 1.30\n", 1, "FAIL"),
    ("PASS bench grpo (flash): ...\nTraceback (most recent call last):\nRuntimeError: CUDA out of memory", 1, "FAIL"),
    ("PASS bench grpo (flash): ...", 124, "FAIL"),
])
def test_line_classification(output, code, status):
    assert acceptance.classify_lines(output, code)[0] == status


def test_exit_status_fails_only_on_a_failed_part():
    R = acceptance.PartResult
    assert acceptance.verdict([R("a", "PASS"), R("b", "SKIP")]) == 0
    assert acceptance.verdict([R("a", "SKIP"), R("b", "FAIL")]) == 1


@pytest.mark.slow  # pytest in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU outcome")
def test_kernels_part_without_cuda_is_skip_not_pass(tmp_path):
    """The real kernels command on this machine: its GPU tests all skip, so the part is SKIP
    (the shell script used to print PASS whenever pytest exited 0)."""
    kernels = next(p for p in acceptance.parts(sys.executable, str(tmp_path)) if p.name == "kernels")
    result = acceptance.run_part(kernels, str(tmp_path))
    assert result.status == "SKIP", (result.detail, open(result.log).read()[-2000:])
    assert result.detail.startswith("0 passed") and "skipped" in result.detail


@pytest.mark.slow  # a script in a subprocess
def test_bf16_training_check_passes_on_cpu():
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", "gpu_train_check.py"), "--device",
                           "cpu", "--backends", "torch", "--steps", "2"], cwd=REPO_ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS train-bf16 torch: 2 steps" in proc.stdout and "mechanism 2 on" in proc.stdout
