#!/usr/bin/env python
"""GPU acceptance: the first thing a lent machine of 1 to 8 GPUs runs (never run on a GPU yet).

    bash benchmarks/gpu_acceptance.sh                 (from the repository root, its venv active)
    python benchmarks/gpu_acceptance.py [--parts kernels memory] [--summary PATH] [--gpus N] [--dry-run]

Parts, each in a process of its own with a time limit, each printed as one ``PASS`` /
``FAIL`` / ``SKIP`` line (details indented under it) and written to one JSON file
(``runs/gpu_acceptance/summary.json``; logs beside it):

1. ``kernels``: the flash and te tree-attention kernels against the torch backend in bf16 and
   fp16 on tree workloads (cached prefixes, a GRPO group, a step-wise chain): outputs and
   gradients (``tests/attention``, the tests marked ``gpu``);
2. ``train-bf16``: 3 bf16 training steps per backend with mechanism 2 active against an fp32
   run (``benchmarks/gpu_train_check.py``);
3. ``memory``: per backend, the measured peak of a training step
   (``torch.cuda.max_memory_allocated`` above the step's start) against the memory plan's
   prediction (:func:`megatron_psrl.schedule.memory.step_peak_bytes`) on the Qwen2.5-1.5B shape,
   and the host syncs of one step (``torch.cuda.set_sync_debug_mode("warn")``'s warnings,
   counted and printed; a figure, not a pass condition);
4. ``bench``: the update step on the Qwen2.5-1.5B shape (random weights, bf16) with prefix
   sharing, without (``--no-prefix-sharing``) and as one causal pass over the same number of
   unique tokens (the floor sharing aims at).

With two GPUs or more (up to 8; each part uses 2), NCCL parts follow, each a ``torchrun`` of
``pretrain_agent_rl.py`` on CUDA (bf16, random tiny models) with its own time limit:

5. ``nccl-tp2``: 2 steps with tensor parallelism 2;
6. ``nccl-dp2-cross-rank``: data parallelism 2, one tree spread over both ranks (its prefix K/V
   exchanged: ``exchanged_bytes`` > 0), then trees placed whole with a tree split between the
   ranks and its shared prefix's K/V sent from one to the other (a head transfer:
   ``transferred_bytes`` > 0);
7. ``nccl-pp2``: 2 steps with pipeline parallelism 2;
8. ``nccl-ep2``: 2 steps of the tiny Qwen3-MoE with expert parallelism 2 (alltoall dispatcher);
9. ``nccl-dist-ckpt``: a torch_dist checkpoint saved with TP = 2, loaded with PP = 2 (iteration,
   weights and optimizer state resharded) and trained one more step.

A training part passes when every run exits 0, logged every iteration with a finite loss, and
its own check held (each part's line says what it checked). With fewer GPUs than a part needs,
it is ``SKIP`` with that reason.

A part passes only when something in it passed and nothing failed: a part whose tests were all
skipped (no kernel package, say) is ``SKIP``, never ``PASS``. Without CUDA every part is
``SKIP`` and the exit status is 0; otherwise it is 1 when a part failed. ``--dry-run`` plans the
parts for ``--gpus N`` without running any: ``PLAN`` for a part that would run, ``SKIP`` with the
reason for one that would not (never ``PASS``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
PLAN = "PLAN"
"""``--dry-run``: the part would run (it has not: never PASS)."""
MAX_GPUS = 8
TIMEOUT_CODES = (124, 137, -9)
"""Exit codes of a part killed at its time limit (``timeout``'s, SIGKILL's, subprocess's)."""

SHAPE = "qwen2.5-1.5b-shape"
"""The model of the memory and bench parts: Qwen2.5-1.5B's architecture, random weights."""

BACKENDS = ("torch", "flash", "te")
MEMORY_MARGIN = 1.0
"""The plan is an upper bound: the measured peak must not exceed the prediction..."""
WORKSPACE_BYTES = 96 << 20
"""...plus what no plan counts, the kernels' workspaces: cuBLAS's (up to 4 x 8 MiB per stream
under ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, 32 MiB), cuDNN's and flash-attn's scratch, the
caching allocator's rounding of the step's largest blocks (up to 20 MiB each over 1 MiB)."""

LOSS_TOLERANCE = 2e-2
"""bench: relative difference of the loss with and without sharing (bf16)."""

AGREEMENT = (("loss", 2e-2), ("grad_norm", 5e-2))
"""A multi-GPU bf16 run against the same run on gloo / CPU in fp32, relative, per iteration: the
tolerances of the single-GPU bf16-vs-fp32 check (benchmarks/gpu_train_check.py)."""


@dataclass
class PartResult:
    """One part's outcome, as printed and written to the summary."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    log: Optional[str] = None
    data: Dict = field(default_factory=dict)


# ---------------------------------------------------------------------- classification
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")


def pytest_counts(output: str) -> Dict[str, int]:
    """Counts of pytest's final summary line (``3 passed, 2 skipped in 1.2s``), zeros if none."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "deselected": 0, "xfailed": 0, "xpassed": 0}
    lines = [ln for ln in output.splitlines() if _PYTEST_COUNT.search(ln) and re.search(r"\bin [\d.]+s", ln)]
    if not lines:
        return counts
    for n, kind in _PYTEST_COUNT.findall(lines[-1]):
        counts["error" if kind.startswith("error") else kind] += int(n)
    return counts


def classify_pytest(output: str, returncode: int) -> Tuple[str, str]:
    """``(status, detail)`` of a pytest run: FAIL on a failure, an error, a crash or a timeout;
    SKIP when nothing passed (every test skipped or none selected); PASS otherwise."""
    c = pytest_counts(output)
    summary = ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if c[k] or k == "passed")
    if returncode in TIMEOUT_CODES:
        return FAIL, f"timed out ({summary})"
    if c["failed"] or c["error"] or c["xpassed"]:
        return FAIL, summary
    if returncode not in (0, 5):  # 5: no tests collected
        return FAIL, f"pytest exited {returncode} ({summary})"
    if c["passed"] == 0:
        reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", output, flags=re.M)
        return SKIP, summary + (f": {reasons[0]}" if reasons else "")
    return PASS, summary


def classify_lines(output: str, returncode: int) -> Tuple[str, str]:
    """``(status, detail)`` of a script that prints ``PASS`` / ``FAIL`` / ``SKIP`` lines: FAIL
    on a FAIL line, a non-zero exit or a timeout; PASS when a line passed; SKIP otherwise."""
    marks = [ln.split()[0] for ln in output.splitlines() if ln.split()[:1] in ([PASS], [FAIL], [SKIP])]
    n = {s: marks.count(s) for s in (PASS, FAIL, SKIP)}
    summary = f"{n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped"
    if returncode in TIMEOUT_CODES:
        return FAIL, f"timed out ({summary})"
    if n[FAIL] or returncode != 0:
        return FAIL, summary + (f"; exit status {returncode}" if returncode else "")
    if n[PASS] == 0:
        return SKIP, summary
    return PASS, summary


def classify_training(output: str, returncode: int, records: List[Dict], iterations: int,
                      check: Optional[Callable[[List[Dict]], Optional[str]]] = None) -> Tuple[str, str]:
    """``(status, detail)`` of training runs (their last ``--log-json`` records): FAIL on a
    timeout, a non-zero exit, fewer iterations logged than asked, a non-finite loss or the
    part's ``check`` naming a problem; PASS otherwise. Never SKIP: a part that ran is judged."""
    if returncode in TIMEOUT_CODES:
        return FAIL, f"timed out after {len(records)} logged iterations"
    if returncode != 0:
        return FAIL, f"exit status {returncode}"
    if len(records) < iterations:
        return FAIL, f"{len(records)} of {iterations} iterations logged"
    losses = [r.get("loss") for r in records]
    if any(loss is None for loss in losses):  # --log-json writes a non-finite loss as null
        return FAIL, f"non-finite loss in {losses}"
    problem = check(records) if check is not None else None
    if problem:
        return FAIL, problem
    return PASS, f"{len(records)} iterations, loss {', '.join(f'{x:.4f}' for x in losses)}"


def verdict(results: Sequence[PartResult]) -> int:
    """Exit status: 1 if a part failed, else 0 (skips do not fail the run)."""
    return 1 if any(r.status == FAIL for r in results) else 0


# ---------------------------------------------------------------------- the parts
@dataclass
class Part:
    name: str
    limit_s: int
    command: List[str]
    classify: str  # "pytest", "lines" or "training"
    what: str
    gpus: int = 1
    """GPUs the part needs."""
    before: List[List[str]] = field(default_factory=list)
    """Commands run first, in order, within the same time limit (a failing one fails the part)."""
    log_json: Optional[str] = None
    """training: the ``--log-json`` file of ``command``."""
    iterations: int = 0
    """training: iterations ``command`` must log."""
    check: Optional[Callable[[List[Dict]], Optional[str]]] = None
    """training: what else the records must show (a problem, or None)."""


def skip_reason(part: Part, gpus: int) -> Optional[str]:
    """Why ``part`` cannot run on a machine with ``gpus`` CUDA devices, or None."""
    if gpus == 0:
        return "no CUDA device"
    if part.gpus > gpus:
        return f"needs {part.gpus} GPUs, this machine has {gpus}"
    return None


def parts(py: str, log_dir: str) -> List[Part]:
    """The parts in their order; the single-GPU ones' limits add up to 470 s, the NCCL ones' 660 s."""
    me = os.path.join("benchmarks", "gpu_acceptance.py")
    return [
        Part("kernels", 90, [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", "-m",
                             "gpu", "tests/attention"], "pytest",
             "flash / te tree attention vs torch, bf16 + fp16, outputs and gradients"),
        Part("train-bf16", 120, [py, os.path.join("benchmarks", "gpu_train_check.py"), "--device", "cuda",
                                 "--steps", "3"], "lines",
             "3 bf16 steps per backend, mechanism 2 on, vs fp32"),
        Part("memory", 120, [py, me, "_memory", "--out", os.path.join(log_dir, "memory.json")], "lines",
             "measured step peak vs the memory plan, per backend"),
        Part("bench", 140, [py, me, "_bench", "--out", os.path.join(log_dir, "bench.json")], "lines",
             f"update step on {SHAPE}: sharing vs none vs one causal pass"),
        *nccl_parts(py, log_dir),
        *multi_gpu_parts(py, log_dir),
    ]


PRIORITY = ("kernels", "train-bf16", "nccl-dp2-cross-rank", "nccl-cp2-dp2", "memory", "nccl-tp2-dp4", "nccl-ep4",
            "nccl-tp2", "nccl-pp2", "nccl-ep2", "nccl-dist-ckpt", "bench")
"""``--budget-seconds``: the parts, most telling first (kernels and exactness before memory,
multi-GPU communication before the two-GPU variants of it, speed last)."""


def within_budget(selected: Sequence[Part], gpus: int, seconds: float) -> Tuple[List[Part], Dict[str, str]]:
    """``(the parts to run, in priority order; {part: why not})``: the parts that can run on
    ``gpus`` GPUs, most telling first (:data:`PRIORITY`), while their time limits fit ``seconds``."""
    rank = {name: k for k, name in enumerate(PRIORITY)}
    runnable = sorted((p for p in selected if skip_reason(p, gpus) is None), key=lambda p: rank.get(p.name, len(rank)))
    chosen, left, why = [], float(seconds), {}
    for part in runnable:
        if part.limit_s <= left:
            chosen.append(part)
            left -= part.limit_s
        else:
            why[part.name] = f"its {part.limit_s} s limit does not fit what is left of --budget-seconds {seconds:g}"
    return chosen, why


# ---------------------------------------------------------------------- NCCL parts (2+ GPUs)
def _train(py: str, log_json: str, *flags: str, model: str = "tiny-llama", iters: int = 2, nproc: int = 2,
           device: str = "cuda") -> List[str]:
    """``torchrun`` of ``pretrain_agent_rl.py`` on ``nproc`` GPUs (NCCL, bf16), or ranks on the CPU
    (gloo, fp32: the reference a GPU run is compared with), logging to ``log_json``."""
    precision = ["--bf16"] if device == "cuda" else []
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "pretrain_agent_rl.py",
            "--device", device, *precision, "--model", model, "--train-iters", str(iters), "--log-json", log_json,
            "--quiet", *flags]


def _agrees_with(reference: str) -> Callable[[List[Dict]], Optional[str]]:
    """The records agree, iteration by iteration, with those of ``reference`` (the same run on
    gloo / CPU in fp32): loss and gradient norm within the bf16 tolerances."""
    def check(records: List[Dict]) -> Optional[str]:
        want = {r["iter"]: r for r in read_log_json(reference)}
        if not want:
            return f"no iteration logged in {os.path.basename(reference)} (the CPU reference)"
        problems = []
        for r in records:
            ref = want.get(r["iter"])
            if ref is None:
                problems.append(f"iteration {r['iter']} is not in the CPU reference")
                continue
            for key, tol in AGREEMENT:
                a, b = r.get(key), ref.get(key)
                if a is None or b is None or abs(a - b) > tol * max(1.0, abs(b)):
                    problems.append(f"iteration {r['iter']} {key} {a} against {b} on the CPU (tolerance {tol:g})")
        return "; ".join(problems) or None
    return check


def _positive(key: str, what: str) -> Callable[[List[Dict]], Optional[str]]:
    def check(records: List[Dict]) -> Optional[str]:
        return None if any((r.get(key) or 0) > 0 for r in records) else f"no {what} ({key} 0 in every iteration)"
    return check


def _resumed_at(iteration: int) -> Callable[[List[Dict]], Optional[str]]:
    def check(records: List[Dict]) -> Optional[str]:
        iters = [r.get("iter") for r in records]
        return None if iters == [iteration] else f"resumed run logged iterations {iters}, expected [{iteration}]"
    return check


ONE_TREE = ("from megatron_psrl.data.loader import write_samples; from megatron_psrl.data.synthetic import "
            "make_tree_rollouts; write_samples(make_tree_rollouts(num_roots=1, branching=2, depth=3, "
            "segment_len=(6, 16), prompt_len=(40, 60), obs_len=(8, 20), vocab_size=251, seed=5), {path!r})")
"""Writes one rollout tree several times larger than a 64-token micro-batch (as the CPU
cross-rank tests use), so that the planner spreads or splits it over the two ranks."""


def nccl_parts(py: str, log_dir: str) -> List[Part]:
    """The NCCL parts, 2 GPUs each; their limits add up to 660 s."""
    def log(name: str) -> str:
        return os.path.join(log_dir, f"{name}.jsonl")

    tree = os.path.join(log_dir, "one-tree.jsonl")
    one_tree = ["--data", tree, "--micro-batch-tokens", "64"]
    ckpt = os.path.join(log_dir, "dist-ckpt")
    return [
        Part("nccl-tp2", 90, _train(py, log("nccl-tp2"), "--tensor-model-parallel-size", "2"), "training",
             "2 bf16 steps, TP = 2 over NCCL", gpus=2, log_json=log("nccl-tp2"), iterations=2),
        Part("nccl-dp2-cross-rank", 180,
             _train(py, log("nccl-dp2-transfer"), *one_tree, "--placement", "whole-tree", "--cross-group-prefix",
                    "transfer", iters=1), "training",
             "DP = 2: one tree over both ranks with its prefix K/V exchanged, then a tree split between "
             "the ranks with its shared prefix sent from one to the other (head transfer)", gpus=2,
             before=[[py, "-c", ONE_TREE.format(path=tree)],
                     _train(py, log("nccl-dp2-exchange"), *one_tree, "--placement", "cross-rank", iters=1)],
             log_json=log("nccl-dp2-transfer"), iterations=1,
             check=_both(_positive_in(log("nccl-dp2-exchange"), "exchanged_bytes", "prefix K/V exchange"),
                         _positive("transferred_bytes", "head transfer"))),
        Part("nccl-pp2", 90, _train(py, log("nccl-pp2"), "--pipeline-model-parallel-size", "2"), "training",
             "2 bf16 steps, PP = 2 over NCCL", gpus=2, log_json=log("nccl-pp2"), iterations=2),
        Part("nccl-ep2", 120, _train(py, log("nccl-ep2"), "--expert-model-parallel-size", "2",
                                     "--moe-token-dispatcher-type", "alltoall", model="debug-qwen3-moe"),
             "training", "2 bf16 steps of a tiny MoE, EP = 2 (alltoall) over NCCL", gpus=2,
             log_json=log("nccl-ep2"), iterations=2),
        Part("nccl-dist-ckpt", 180, _train(py, log("nccl-dist-ckpt"), "--load", ckpt,
                                           "--pipeline-model-parallel-size", "2"), "training",
             "torch_dist saved with TP = 2, loaded with PP = 2, one more step", gpus=2,
             before=[_train(py, log("nccl-dist-ckpt-save"), "--tensor-model-parallel-size", "2", "--save", ckpt,
                            "--ckpt-format", "torch_dist", iters=1)],
             log_json=log("nccl-dist-ckpt"), iterations=1, check=_resumed_at(2)),
    ]


def multi_gpu_parts(py: str, log_dir: str) -> List[Part]:
    """The 4- and 8-GPU parts: each runs first on gloo / CPU in fp32 with as many ranks (the
    reference), then on the GPUs in bf16, and its losses and gradient norms must agree with the
    reference's (:data:`AGREEMENT`), beyond finishing."""
    def log(name: str) -> str:
        return os.path.join(log_dir, f"{name}.jsonl")

    tree = os.path.join(log_dir, "one-tree.jsonl")
    one_tree = ["--data", tree, "--micro-batch-tokens", "64"]
    write_tree = [py, "-c", ONE_TREE.format(path=tree)]

    def compared(name: str, limit_s: int, gpus: int, what: str, *flags: str, model: str = "tiny-llama",
                 before: Sequence[List[str]] = (), check=None) -> Part:
        reference = log(f"{name}-cpu")
        agrees = _agrees_with(reference)
        return Part(name, limit_s, _train(py, log(name), *flags, model=model, nproc=gpus), "training", what,
                    gpus=gpus, before=[*before, _train(py, reference, *flags, model=model, nproc=gpus, device="cpu")],
                    log_json=log(name), iterations=2, check=_both(agrees, check) if check else agrees)

    return [
        compared("nccl-cp2-dp2", 360, 4, "CP = 2 x DP = 2: one tree's fragments over each CP pair with their prefix "
                 "K/V exchanged, its parts split between the pairs with the shared head sent; against gloo",
                 "--context-parallel-size", "2", *one_tree, "--cross-group-prefix", "transfer",
                 before=[write_tree], check=_positive("exchanged_bytes", "prefix K/V exchange")),
        compared("nccl-tp2-dp4", 360, 8, "TP = 2 x DP = 4, 2 bf16 steps against gloo", "--tensor-model-parallel-size", "2"),
        compared("nccl-ep4", 360, 4, "a tiny MoE with EP = 4 (alltoall), 2 bf16 steps against gloo",
                 "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall",
                 model="debug-qwen3-moe"),
    ]


def _positive_in(path: str, key: str, what: str) -> Callable[[List[Dict]], Optional[str]]:
    """:func:`_positive` on the records of another run's log (a ``before`` command's)."""
    def check(_records: List[Dict]) -> Optional[str]:
        records = read_log_json(path)
        return _positive(key, what)(records) if records else f"no iteration logged in {os.path.basename(path)}"
    return check


def _both(*checks: Callable[[List[Dict]], Optional[str]]) -> Callable[[List[Dict]], Optional[str]]:
    def check(records: List[Dict]) -> Optional[str]:
        problems = [p for p in (c(records) for c in checks) if p]
        return "; ".join(problems) or None
    return check


def read_log_json(path: Optional[str]) -> List[Dict]:
    """The records of a ``--log-json`` file (none if it does not exist)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_command(command: List[str], limit_s: float) -> Tuple[str, int]:
    """``(output, exit status)`` of one command (124 when killed at ``limit_s``). It runs in a
    session of its own, and at the limit the whole process group goes (torchrun's ranks with
    it: a rank left behind would hold its GPU through the next part)."""
    if limit_s <= 0:
        return "", 124
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit_s)
        return output, proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return output or "", 124


def _classify(part: Part, output: str, code: int) -> Tuple[str, str]:
    if part.classify == "pytest":
        return classify_pytest(output, code)
    if part.classify == "training":
        return classify_training(output, code, read_log_json(part.log_json), part.iterations, part.check)
    return classify_lines(output, code)


def run_part(part: Part, log_dir: str) -> PartResult:
    log = os.path.join(log_dir, f"{part.name}.log")
    t0 = time.monotonic()
    outputs, code = [], 0
    for command in [*part.before, part.command]:  # one time limit for them all; stop at a failure
        output, code = _run_command(command, part.limit_s - (time.monotonic() - t0))
        outputs.append(f"$ {' '.join(command)}\n{output}")
        if code != 0:
            break
    output = "\n".join(outputs)
    seconds = time.monotonic() - t0
    with open(log, "w") as f:
        f.write(output)
    status, detail = _classify(part, output, code)
    data = {}
    for arg in part.command:  # the sub-parts' own JSON, when they wrote one
        if arg.endswith(".json") and os.path.exists(arg):
            with open(arg) as f:
                data = json.load(f)
    if part.log_json:
        data["records"] = read_log_json(part.log_json)
    result = PartResult(part.name, status, detail, round(seconds, 1), log, data)
    result.data["lines"] = [ln for ln in output.splitlines() if ln.split()[:1] in ([PASS], [FAIL], [SKIP])]
    return result


def print_result(r: PartResult) -> None:
    print(f"{r.status} {r.name}: {r.detail} ({r.seconds:.0f} s)", flush=True)
    for ln in r.data.get("lines", []):
        print(f"    {ln}")
    if r.status == FAIL and r.log:
        with open(r.log) as f:
            tail = f.read().splitlines()[-12:]
        print(f"    log: {r.log}")
        for ln in tail:
            print(f"    | {ln}")
    sys.stdout.flush()


def write_summary(path: str, results: Sequence[PartResult], meta: Dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "exit_status": verdict(results), "parts": [asdict(r) for r in results]}, f, indent=2)


def summary_line(results: Sequence[PartResult], path: str) -> str:
    """The run in one line: how many parts passed, failed, were skipped (or planned)."""
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP, PLAN)}
    shown = ", ".join(f"{n} {s}" for s, n in counts.items() if n or s in (PASS, FAIL, SKIP))
    return f"summary: {shown} (exit status {verdict(results)}) -> {path}"


def planned(selected: Sequence[Part], gpus: int) -> List[PartResult]:
    """``--dry-run``: every part as it would go on ``gpus`` GPUs, none run (PLAN or SKIP)."""
    results = []
    for part in selected:
        why = skip_reason(part, gpus)
        results.append(PartResult(part.name, SKIP if why else PLAN, why or f"{part.what} ({part.gpus} GPU"
                                  f"{'s' if part.gpus > 1 else ''}, limit {part.limit_s} s)"))
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--parts", nargs="+", default=None, help="run only these parts")
    p.add_argument("--log-dir", default=os.environ.get("GPU_ACCEPTANCE_LOGS", "runs/gpu_acceptance"))
    p.add_argument("--summary", default=None, help="the JSON summary (default: LOG_DIR/summary.json)")
    p.add_argument("--gpus", type=int, default=None, help=f"use at most this many GPUs (1 to {MAX_GPUS}); with "
                                                          "--dry-run: plan for this many")
    p.add_argument("--dry-run", action="store_true", help="plan the parts (PLAN / SKIP with the reason), run none")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="run the parts most telling first while their time limits fit this many seconds (600: one "
                        "GPU lent for 10 minutes); the rest SKIP, saying so")
    args = p.parse_args(argv)
    log_dir = os.path.join(REPO_ROOT, args.log_dir) if not os.path.isabs(args.log_dir) else args.log_dir
    os.makedirs(log_dir, exist_ok=True)
    summary = args.summary or os.path.join(log_dir, "summary.json")
    py = sys.executable
    selected = [part for part in parts(py, log_dir) if not args.parts or part.name in args.parts]
    import torch

    cuda = torch.cuda.is_available()
    detected = min(torch.cuda.device_count(), MAX_GPUS) if cuda else 0
    gpus = (args.gpus if args.dry_run else min(args.gpus, detected)) if args.gpus is not None else detected
    meta = {"torch": torch.__version__, "cuda": cuda, "gpus": gpus, "dry_run": args.dry_run,
            "budget_seconds": args.budget_seconds}
    over_budget: Dict[str, str] = {}
    if args.budget_seconds is not None:
        chosen, over_budget = within_budget(selected, gpus, args.budget_seconds)
        selected = chosen + [p for p in selected if p not in chosen]  # (the rest, to say why they do not run)
    if args.dry_run or not cuda:
        results = [PartResult(r.name, SKIP, over_budget[r.name]) if r.name in over_budget else r
                   for r in planned(selected, gpus)]
        for r in results:
            print(f"{r.status} {r.name}: {r.detail}")
        write_summary(summary, results, meta)
        print(summary_line(results, summary))
        return verdict(results)
    meta.update(device=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda,
                cudnn=torch.backends.cudnn.version())
    print(f"device: {gpus} x {meta['device']} | torch {torch.__version__} | CUDA {meta['cuda_version']} | "
          f"cuDNN {meta['cudnn']}", flush=True)
    results = []
    for part in selected:
        why = skip_reason(part, gpus) or over_budget.get(part.name)
        results.append(PartResult(part.name, SKIP, why) if why else run_part(part, log_dir))
        print_result(results[-1])
        write_summary(summary, results, meta)  # after every part: a killed run keeps what it had
    print(summary_line(results, summary))
    return verdict(results)


# ---------------------------------------------------------------------- memory and bench (CUDA)
@dataclass
class Target:
    """Where the memory and bench parts run: the acceptance run's CUDA and 1.5B shape, or a
    tiny model on CPU (``--device cpu --model tiny-llama``: a dry run of the same code)."""

    device: str = "cuda"
    model: str = SHAPE


def _engine(target: Target, backend: str, micro_batch_tokens: int):
    from megatron_psrl.checkpoint import ModelSource
    from megatron_psrl.engine.builder import build_engine
    from megatron_psrl.engine.config import ActorConfig

    return build_engine(ModelSource(tiny=target.model), ActorConfig(
        device=target.device, dtype="bfloat16", seed=0, micro_batch_tokens=micro_batch_tokens,
        kv_cache_budget=48 << 30, attention_backend=backend, memory_tracking="ops"), for_training=False)


def _backend_problem(target: Target, backend: str) -> Optional[str]:
    import torch

    from megatron_psrl.attention.backends import attention_backend_problem, kernel_facts

    return attention_backend_problem(backend, kernel_facts(target.device, torch.bfloat16))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _planned(engine, batch, mode: str, backend: str):
    """The step's tree, rank plan and memory plan (``None`` without cached prefixes), as the
    engine plans them: the arithmetic of a step, nothing run."""
    from megatron_psrl.attention.backends import READS_CACHED_PREFIXES
    from megatron_psrl.schedule.memory import add_segment_shapes, plan_memory
    from megatron_psrl.schedule.planner import plan_step
    from megatron_psrl.tree import build_prefix_tree

    tree = build_prefix_tree(batch)
    plan = plan_step(tree, engine.planner_config(mode))
    rank, varlen = plan.ranks[0], engine.varlen_charge
    if varlen is not None:  # flash / te: the gathered K/V follow the segments
        add_segment_shapes(plan.index, rank)
    memory = plan_memory(rank, engine.plan_geometry, engine.config.kv_cache_budget, engine.act_bytes,
                         gathers_in_backward=backend in READS_CACHED_PREFIXES, head_bytes=engine.head_bytes, varlen=varlen) \
        if rank.sources else None
    return tree, plan, memory


def _plan_peak(engine, rank, memory) -> int:
    """The memory plan's prediction of a rank's step peak (``schedule.memory.step_peak_bytes``)."""
    from megatron_psrl.schedule.memory import step_peak_bytes

    return int(step_peak_bytes(rank, memory, engine.act_bytes, engine.head_bytes, engine.varlen_charge))


def predicted_peak_bytes(engine, batch, mode: str, backend: str) -> int:
    """The plan's prediction of the step's peak, planned but not run."""
    _, plan, memory = _planned(engine, batch, mode, backend)
    return _plan_peak(engine, plan.ranks[0], memory)


def _step(engine, runner, batch, mode: str, backend: str, measure: bool = False) -> Dict:
    """One update step (tree build, plan, memory plan, forward + backward of every micro-batch;
    no optimizer), the way the engine runs one; returns its time, loss and, with ``measure``,
    its measured peak and the plan's prediction of it."""
    from megatron_psrl.engine.memory import PeakMemory
    from megatron_psrl.rl.loss import LossConfig

    # Gradients stay allocated between steps (set_to_none=False after the first): the peak is
    # then the step's own memory, what the plan predicts, not the weights' gradient buffers.
    for p in engine.model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    device = engine.layout.device
    _sync(device)
    with PeakMemory(device, enabled=measure) as mem:
        t0 = time.perf_counter()
        tree, plan, memory = _planned(engine, batch, mode, backend)
        rank = plan.ranks[0]
        out = runner.train(plan, 0, LossConfig(loss_agg="token-mean"), memory)
        _sync(device)
        seconds = time.perf_counter() - t0
    row = {"seconds": seconds, "loss": float(out.loss), "tokens": int(out.tokens_computed),
           "micro_batches": int(out.num_micro_batches), "tree_tokens": int(tree.num_tree_tokens),
           "mechanism2": bool(rank.sources)}
    if measure:
        row["measured_bytes"] = int(mem.peak_bytes - mem.start_bytes)
        row["predicted_bytes"] = _plan_peak(engine, rank, memory)
    return row


SYNC_WARNING = "synchronizing CUDA operation"
"""What ``torch.cuda.set_sync_debug_mode("warn")`` says at every operation that makes the host
wait for the device."""


def _host_syncs(engine, batch, backend: str) -> int:
    """Host syncs of one update step: the warnings ``torch.cuda.set_sync_debug_mode("warn")``
    raises, counted (the design is one, where the step's sums are read; not yet measured)."""
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(engine, engine.runner, batch, "tree", backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def _workloads(vocab: int) -> Dict:
    from megatron_psrl.data import make_grpo, make_stepwise

    return {
        # GRPO: long prompts shared by 8 responses; more tokens than a micro-batch (mechanism 2)
        "grpo": make_grpo(num_prompts=2, group_size=8, prompt_len=(1536, 3072), response_len=(128, 512),
                          vocab_size=vocab, seed=1),
        # step-wise: one long chain of turns (mechanism 2 across micro-batches)
        "stepwise": make_stepwise(num_trajectories=1, turns=(10, 14), obs_len=(200, 600), action_len=(20, 80),
                                  system_len=500, task_len=(200, 400), vocab_size=vocab, seed=1),
    }


def _causal_batch(num_tokens: int, longest: int, vocab: int):
    """``num_tokens`` random tokens as causal sequences of at most ``longest`` tokens, every
    token trained: plain causal training on as many tokens as the tree has unique ones."""
    import numpy as np

    from megatron_psrl.data.loader import samples_from_dicts

    rng = np.random.default_rng(0)
    records, left = [], num_tokens
    while left > 1:
        n = min(left, longest)
        records.append({"id": f"c{len(records)}", "tokens": rng.integers(0, vocab, n).tolist(),
                        "loss_mask": [0] + [1] * (n - 1), "advantage": 1.0})
        left -= n
    return samples_from_dicts(records, source="causal-floor")


def memory_part(out_path: str, target: Target) -> int:
    """``memory``: per backend, two steps per workload (the first warms the allocator and the
    gradient buffers); the second's measured peak must not exceed the plan's prediction."""
    import torch

    if target.device == "cuda" and not torch.cuda.is_available():
        print("SKIP memory: no CUDA device")
        return 0
    rows, failed = [], False
    for backend in BACKENDS:
        problem = _backend_problem(target, backend)
        if problem:
            print(f"SKIP memory {backend}: {problem}", flush=True)
            rows.append({"backend": backend, "status": SKIP, "reason": problem})
            continue
        engine = _engine(target, backend, micro_batch_tokens=4096)
        for name, batch in _workloads(engine.arch.vocab_size).items():
            _step(engine, engine.runner, batch, "tree", backend)
            row = _step(engine, engine.runner, batch, "tree", backend, measure=True)
            row["host_syncs"] = _host_syncs(engine, batch, backend) if target.device == "cuda" else None
            ratio = row["measured_bytes"] / max(row["predicted_bytes"], 1)
            ok = row["measured_bytes"] <= MEMORY_MARGIN * row["predicted_bytes"] + WORKSPACE_BYTES and row["mechanism2"]
            failed |= not ok
            row.update(backend=backend, workload=name, ratio=ratio, status=PASS if ok else FAIL,
                       transformer_impl=engine.transformer_impl)
            rows.append(row)
            print(f"{PASS if ok else FAIL} memory {backend} {name}: measured {row['measured_bytes'] / 2**30:.2f} GiB, "
                  f"plan {row['predicted_bytes'] / 2**30:.2f} GiB (measured / plan {ratio:.2f}; allowed: the plan + "
                  f"{WORKSPACE_BYTES >> 20} MiB of kernel workspaces), "
                  f"{row['micro_batches']} micro-batches, mechanism 2 {'on' if row['mechanism2'] else 'OFF'}, "
                  f"layers {engine.transformer_impl}, host syncs in one step {row['host_syncs']}", flush=True)
        del engine
        if target.device == "cuda":
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"model": target.model, "device": target.device, "rows": rows}, f, indent=2)
    return 1 if failed else 0


def bench_part(out_path: str, target: Target, repeats: int = 3) -> int:
    """``bench``: the fastest available kernel on the 1.5B shape; median of ``repeats``
    interleaved steps per variant after a warm-up. Fails if a variant fails or the loss with
    sharing differs from the loss without."""
    import torch

    if target.device == "cuda" and not torch.cuda.is_available():
        print("SKIP bench: no CUDA device")
        return 0
    backend = next(b for b in ("flash", "te", "torch") if _backend_problem(target, b) is None)
    mbt = 16384
    engine = _engine(target, backend, micro_batch_tokens=mbt)
    rows, failed = [], False
    from megatron_psrl.tree import build_prefix_tree

    for name, batch in _workloads(engine.arch.vocab_size).items():
        tree = build_prefix_tree(batch)
        longest = int((batch.offsets[1:] - batch.offsets[:-1]).max())
        variants = {"shared": (batch, "tree"), "none": (batch, "none"),
                    "causal": (_causal_batch(tree.num_tree_tokens, min(longest, mbt), engine.arch.vocab_size), "none")}
        times: Dict[str, List[float]] = {v: [] for v in variants}
        first = {v: _step(engine, engine.runner, b, m, backend) for v, (b, m) in variants.items()}  # warm-up
        for _ in range(repeats):
            for v, (b, m) in variants.items():
                times[v].append(_step(engine, engine.runner, b, m, backend)["seconds"])
        med = {v: statistics.median(t) for v, t in times.items()}
        rel = abs(first["shared"]["loss"] - first["none"]["loss"]) / max(abs(first["none"]["loss"]), 1e-12)
        ok = rel <= LOSS_TOLERANCE
        failed |= not ok
        ideal = engine.flop_model.ideal_speedup(tree)
        row = {"workload": name, "backend": backend, "tokens": int(batch.num_tokens),
               "tree_tokens": int(tree.num_tree_tokens), "ideal_speedup": ideal,
               **{f"step_s_{v}": s for v, s in med.items()}, "speedup": med["none"] / med["shared"],
               "shared_over_causal": med["shared"] / med["causal"], "loss_rel_diff": rel,
               "tokens_per_s_shared": tree.num_tree_tokens / med["shared"], "status": PASS if ok else FAIL}
        rows.append(row)
        print(f"{PASS if ok else FAIL} bench {name} ({backend}): shared {med['shared']:.3f} s, none {med['none']:.3f} s "
              f"(speedup {row['speedup']:.2f}x, ideal {ideal:.2f}x), one causal pass {med['causal']:.3f} s "
              f"(shared / causal {row['shared_over_causal']:.2f}), loss rel diff {rel:.1e} (<= {LOSS_TOLERANCE:g})",
              flush=True)
    with open(out_path, "w") as f:
        json.dump({"model": target.model, "device": target.device, "micro_batch_tokens": mbt, "repeats": repeats,
                   "rows": rows}, f, indent=2)
    return 1 if failed else 0


def _sub_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["_memory", "_bench"])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=SHAPE)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    target = Target(args.device, args.model)
    sys.path.insert(0, REPO_ROOT)
    from megatron_psrl.compat import quiet_expected_import_warnings

    quiet_expected_import_warnings()
    return memory_part(args.out, target) if args.part == "_memory" else bench_part(args.out, target, args.repeats)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_memory", "_bench"):
        sys.exit(_sub_main(sys.argv[1:]))
    sys.exit(main())
