#!/usr/bin/env python
"""GPU acceptance: the first thing a lent GPU runs. One command, under 8 minutes on one H200.

    bash benchmarks/gpu_acceptance.sh                 (from the repository root, its venv active)
    python benchmarks/gpu_acceptance.py [--parts kernels memory] [--summary PATH]

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

A part passes only when something in it passed and nothing failed: a part whose tests were all
skipped (no kernel package, say) is ``SKIP``, never ``PASS``. Without CUDA every part is
``SKIP`` and the exit status is 0; otherwise it is 1 when a part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
TIMEOUT_CODES = (124, 137, -9)
"""Exit codes of a part killed at its time limit (``timeout``'s, SIGKILL's, subprocess's)."""

SHAPE = "qwen2.5-1.5b-shape"
"""The model of the memory and bench parts: Qwen2.5-1.5B's architecture, random weights."""

BACKENDS = ("torch", "flash", "te")
MEMORY_MARGIN = 1.0
"""The plan is an upper bound: the measured peak must not exceed the prediction."""

LOSS_TOLERANCE = 2e-2
"""bench: relative difference of the loss with and without sharing (bf16)."""


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


def verdict(results: Sequence[PartResult]) -> int:
    """Exit status: 1 if a part failed, else 0 (skips do not fail the run)."""
    return 1 if any(r.status == FAIL for r in results) else 0


# ---------------------------------------------------------------------- the parts
@dataclass
class Part:
    name: str
    limit_s: int
    command: List[str]
    classify: str  # "pytest" or "lines"
    what: str


def parts(py: str, log_dir: str) -> List[Part]:
    """The parts in their order; their limits add up to 470 s, under 8 minutes with start-up."""
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
    ]


def run_part(part: Part, log_dir: str) -> PartResult:
    log = os.path.join(log_dir, f"{part.name}.log")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(part.command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=part.limit_s)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        code = 124
    seconds = time.monotonic() - t0
    with open(log, "w") as f:
        f.write(output)
    status, detail = (classify_pytest if part.classify == "pytest" else classify_lines)(output, code)
    data = {}
    for arg in part.command:  # the sub-parts' own JSON, when they wrote one
        if arg.endswith(".json") and os.path.exists(arg):
            with open(arg) as f:
                data = json.load(f)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--parts", nargs="+", default=None, help="run only these parts")
    p.add_argument("--log-dir", default=os.environ.get("GPU_ACCEPTANCE_LOGS", "runs/gpu_acceptance"))
    p.add_argument("--summary", default=None, help="the JSON summary (default: LOG_DIR/summary.json)")
    args = p.parse_args(argv)
    log_dir = os.path.join(REPO_ROOT, args.log_dir) if not os.path.isabs(args.log_dir) else args.log_dir
    os.makedirs(log_dir, exist_ok=True)
    summary = args.summary or os.path.join(log_dir, "summary.json")
    py = sys.executable
    selected = [part for part in parts(py, log_dir) if not args.parts or part.name in args.parts]
    import torch

    meta = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        results = [PartResult(part.name, SKIP, "no CUDA device") for part in selected]
        for r in results:
            print(f"SKIP {r.name}: no CUDA device")
        write_summary(summary, results, meta)
        return 0
    meta.update(device=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda,
                cudnn=torch.backends.cudnn.version())
    print(f"device: {meta['device']} | torch {torch.__version__} | CUDA {meta['cuda_version']} | "
          f"cuDNN {meta['cudnn']}", flush=True)
    results = []
    for part in selected:
        results.append(run_part(part, log_dir))
        print_result(results[-1])
        write_summary(summary, results, meta)  # after every part: a killed run keeps what it had
    print(f"summary: {summary}")
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


def _step(engine, runner, batch, mode: str, backend: str, measure: bool = False) -> Dict:
    """One update step (tree build, plan, memory plan, forward + backward of every micro-batch;
    no optimizer), the way the engine runs one; returns its time, loss and, with ``measure``,
    its measured peak and the plan's prediction of it."""
    from megatron_psrl.engine.memory import PeakMemory
    from megatron_psrl.rl.loss import LossConfig
    from megatron_psrl.schedule.memory import add_segment_shapes, plan_memory, step_peak_bytes
    from megatron_psrl.schedule.planner import plan_step
    from megatron_psrl.tree import build_prefix_tree

    # Gradients stay allocated between steps (set_to_none=False after the first): the peak is
    # then the step's own memory, what the plan predicts, not the weights' gradient buffers.
    for p in engine.model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    device = engine.layout.device
    _sync(device)
    with PeakMemory(device, enabled=measure) as mem:
        t0 = time.perf_counter()
        tree = build_prefix_tree(batch)
        plan = plan_step(tree, engine.planner_config(mode))
        rank, varlen = plan.ranks[0], engine.varlen_charge
        if varlen is not None:  # flash / te: the gathered K/V follow the segments
            add_segment_shapes(plan.index, rank)
        memory = plan_memory(rank, engine.plan_geometry, engine.config.kv_cache_budget, engine.act_bytes,
                             gathers_in_backward=backend == "torch", head_bytes=engine.head_bytes, varlen=varlen) \
            if rank.sources else None
        out = runner.train(plan, 0, LossConfig(loss_agg="token-mean"), memory)
        _sync(device)
        seconds = time.perf_counter() - t0
    row = {"seconds": seconds, "loss": float(out.loss), "tokens": int(out.tokens_computed),
           "micro_batches": int(out.num_micro_batches), "tree_tokens": int(tree.num_tree_tokens),
           "mechanism2": bool(rank.sources)}
    if measure:
        row["measured_bytes"] = int(mem.peak_bytes - mem.start_bytes)
        row["predicted_bytes"] = int(step_peak_bytes(rank, memory, engine.act_bytes, engine.head_bytes, varlen))
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
            ok = ratio <= MEMORY_MARGIN and row["mechanism2"]
            failed |= not ok
            row.update(backend=backend, workload=name, ratio=ratio, status=PASS if ok else FAIL,
                       transformer_impl=engine.transformer_impl)
            rows.append(row)
            print(f"{PASS if ok else FAIL} memory {backend} {name}: measured {row['measured_bytes'] / 2**30:.2f} GiB, "
                  f"plan {row['predicted_bytes'] / 2**30:.2f} GiB (measured / plan {ratio:.2f}, <= {MEMORY_MARGIN}), "
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
