"""benchmarks/gpu_acceptance.sh (its logic in benchmarks/gpu_acceptance.py) and its training
check, on this machine: without CUDA every part says SKIP (exit 0, the JSON summary written);
a part passes only when something in it passed (fake pytest and script outputs, and the real
kernels command, whose GPU tests all skip here); the bf16-vs-fp32 training check passes on CPU
with the torch kernel. The NCCL parts (2+ GPUs): planned for 1 to 8 GPUs by ``--dry-run``
(PLAN or SKIP with the reason, never PASS), judged from their training logs, and a part's
commands run in order within its one time limit."""

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

SINGLE = ["kernels", "train-bf16", "memory", "bench"]
NCCL = ["nccl-tp2", "nccl-dp2-cross-rank", "nccl-pp2", "nccl-ep2", "nccl-dist-ckpt"]
MULTI = {"nccl-cp2-dp2": 4, "nccl-tp2-dp4": 8, "nccl-ep4": 4}
"""The 4- and 8-GPU parts and the GPUs each needs."""
PARTS = SINGLE + NCCL + list(MULTI)


@pytest.mark.slow  # a script in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only output")
def test_acceptance_script_skips_every_part_without_cuda(tmp_path):
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "benchmarks", "gpu_acceptance.sh"), "--log-dir",
                           str(tmp_path)], cwd=REPO_ROOT, env=dict(script_env(), PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:-1] == [f"SKIP {p}: no CUDA device" for p in PARTS]
    assert lines[-1].startswith(f"summary: 0 PASS, 0 FAIL, {len(PARTS)} SKIP (exit status 0)")
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


# ---------------------------------------------------------------------- NCCL parts (2+ GPUs)
@pytest.mark.parametrize("gpus", range(0, 9))
def test_dry_run_plans_the_parts_for_each_gpu_count_and_never_passes(tmp_path, capsys, gpus):
    assert acceptance.main(["--dry-run", "--gpus", str(gpus), "--log-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {p["name"]: (p["status"], p["detail"]) for p in summary["parts"]}
    assert list(status) == PARTS and summary["meta"]["dry_run"] is True
    assert all(s != "PASS" for s, _ in status.values())
    for name in PARTS:
        s, detail = status[name]
        if gpus == 0:
            assert (s, detail) == ("SKIP", "no CUDA device")
        elif name in NCCL and gpus < 2:
            assert (s, detail) == ("SKIP", f"needs 2 GPUs, this machine has {gpus}")
        elif name in MULTI and gpus < MULTI[name]:
            assert (s, detail) == ("SKIP", f"needs {MULTI[name]} GPUs, this machine has {gpus}")
        else:
            assert s == "PLAN" and "limit" in detail
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("summary: 0 PASS, 0 FAIL") and len(out) == len(PARTS) + 1


def test_nccl_parts_are_torchrun_training_runs_on_two_gpus(tmp_path):
    parts = {p.name: p for p in acceptance.parts(sys.executable, str(tmp_path))}
    for name in NCCL:
        part = parts[name]
        assert part.gpus == 2 and part.classify == "training" and part.log_json and part.iterations >= 1
        for cmd in [*part.before, part.command]:
            if "torch.distributed.run" in cmd:
                assert cmd[cmd.index("--nproc_per_node") + 1] == "2" and "pretrain_agent_rl.py" in cmd
                assert cmd[cmd.index("--device") + 1] == "cuda"
    assert sum(parts[n].limit_s for n in NCCL) == 660
    layouts = {n: " ".join(parts[n].command) for n in NCCL}
    assert "--tensor-model-parallel-size 2" in layouts["nccl-tp2"]
    assert "--pipeline-model-parallel-size 2" in layouts["nccl-pp2"]
    assert "--expert-model-parallel-size 2" in layouts["nccl-ep2"]
    save = " ".join(parts["nccl-dist-ckpt"].before[0])
    assert "--tensor-model-parallel-size 2" in save and "--ckpt-format torch_dist" in save
    assert "--load" in layouts["nccl-dist-ckpt"] and "--pipeline-model-parallel-size 2" in layouts["nccl-dist-ckpt"]


@pytest.mark.parametrize("records, code, status", [
    ([{"iter": 1, "loss": 0.5}, {"iter": 2, "loss": 0.4}], 0, "PASS"),
    ([{"iter": 1, "loss": 0.5}], 0, "FAIL"),                      # fewer iterations than asked
    ([{"iter": 1, "loss": 0.5}, {"iter": 2, "loss": None}], 0, "FAIL"),  # a non-finite loss
    ([{"iter": 1, "loss": 0.5}, {"iter": 2, "loss": 0.4}], 1, "FAIL"),
    ([{"iter": 1, "loss": 0.5}], 124, "FAIL"),                    # killed at the time limit
    ([], 0, "FAIL"),                                              # ran, logged nothing: never PASS
])
def test_training_classification(records, code, status):
    assert acceptance.classify_training("", code, records, 2)[0] == status


def test_training_checks_name_what_did_not_happen():
    records = [{"iter": 1, "loss": 0.5, "transferred_bytes": 0}]
    status, detail = acceptance.classify_training("", 0, records, 1, acceptance._positive("transferred_bytes",
                                                                                           "head transfer"))
    assert status == "FAIL" and "no head transfer" in detail
    assert acceptance.classify_training("", 0, [{"iter": 2, "loss": 0.1}], 1, acceptance._resumed_at(2))[0] == "PASS"
    status, detail = acceptance.classify_training("", 0, [{"iter": 1, "loss": 0.1}], 1, acceptance._resumed_at(2))
    assert status == "FAIL" and "expected [2]" in detail


def test_a_part_runs_its_commands_in_order_and_stops_at_a_failure(tmp_path):
    log = tmp_path / "log.jsonl"
    write = f"import json; open({str(log)!r}, 'a').write(json.dumps(dict(iter=1, loss=0.25)) + chr(10))"
    part = acceptance.Part("fake", 60, [sys.executable, "-c", write], "training", "fake", gpus=2,
                           before=[[sys.executable, "-c", "print('first')"]], log_json=str(log), iterations=1)
    result = acceptance.run_part(part, str(tmp_path))
    assert result.status == "PASS" and result.data["records"] == [{"iter": 1, "loss": 0.25}]
    assert open(result.log).read().index("first") < open(result.log).read().index("log.jsonl")
    log.unlink()
    part.before = [[sys.executable, "-c", "import sys; sys.exit(3)"]]
    result = acceptance.run_part(part, str(tmp_path))
    assert result.status == "FAIL" and result.detail == "exit status 3" and not log.exists()


def test_multi_gpu_parts_run_the_same_command_on_gloo_first_and_compare():
    parts = {p.name: p for p in acceptance.parts(sys.executable, "/tmp/logs")}
    for name, gpus in MULTI.items():
        part = parts[name]
        gpu, cpu = part.command, part.before[-1]
        assert part.gpus == gpus and gpu[gpu.index("--nproc_per_node") + 1] == str(gpus) == cpu[cpu.index("--nproc_per_node") + 1]
        assert gpu[gpu.index("--device") + 1] == "cuda" and "--bf16" in gpu
        assert cpu[cpu.index("--device") + 1] == "cpu" and "--bf16" not in cpu
        flags = lambda cmd: [a for a in cmd[cmd.index("--quiet") + 1:]]  # noqa: E731
        assert flags(gpu) == flags(cpu)  # the same run, only the device differs
    assert "--context-parallel-size 2" in " ".join(parts["nccl-cp2-dp2"].command)
    assert "--expert-model-parallel-size 4" in " ".join(parts["nccl-ep4"].command)


def test_a_gpu_run_must_agree_with_its_cpu_reference(tmp_path):
    reference = tmp_path / "ref.jsonl"
    reference.write_text("\n".join(json.dumps(r) for r in [{"iter": 1, "loss": 2.0, "grad_norm": 1.0},
                                                             {"iter": 2, "loss": 1.5, "grad_norm": 0.8}]))
    agrees = acceptance._agrees_with(str(reference))
    assert agrees([{"iter": 1, "loss": 2.01, "grad_norm": 1.02}, {"iter": 2, "loss": 1.49, "grad_norm": 0.79}]) is None
    problem = agrees([{"iter": 1, "loss": 2.2, "grad_norm": 1.0}, {"iter": 2, "loss": 1.5, "grad_norm": 0.9}])
    assert "iteration 1 loss 2.2 against 2.0" in problem and "iteration 2 grad_norm 0.9 against 0.8" in problem
    assert "no iteration logged" in acceptance._agrees_with(str(tmp_path / "missing.jsonl"))([])


def test_the_budget_runs_the_most_telling_parts_first_and_says_why_not_the_rest():
    parts = acceptance.parts(sys.executable, "/tmp/logs")
    chosen, why = acceptance.within_budget(parts, 1, 600)
    assert [p.name for p in chosen] == ["kernels", "train-bf16", "memory", "bench"]  # 470 s on one GPU
    chosen, why = acceptance.within_budget(parts, 8, 600)
    names = [p.name for p in chosen]
    assert names[:3] == ["kernels", "train-bf16", "nccl-dp2-cross-rank"] and sum(p.limit_s for p in chosen) <= 600
    assert all("--budget-seconds 600" in why[p.name] for p in parts if p.name not in names)


def test_a_part_killed_at_its_limit_takes_its_children_with_it(tmp_path):
    """torchrun's ranks are children of the command: at the limit the whole process group goes."""
    pid_file = tmp_path / "child.pid"
    spawn = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
             f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)")
    output, code = acceptance._run_command([sys.executable, "-c", spawn], 3)
    assert code == 124
    child = int(pid_file.read_text())
    import time
    for _ in range(50):  # (the kill is asynchronous)
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"child {child} outlived its part")
