"""The step path reads the device from the host only where it must: once per step by design
(the step's loss and metric sums, ``DeviceSums.read``), plus the places listed in ``ALLOWED``
with their reasons. On CUDA each ``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()`` of a device
tensor or ``synchronize()`` makes the host wait for every queued kernel; on the CPU nothing
shows it, so a CPU suite would not notice a new one inside a micro-batch loop.

An AST check of the modules a step runs, by enclosing function (a call on a host array, e.g.
a numpy plan's ``.tolist()``, is allowed by name with that reason). It cannot see ``float(t)``
or ``int(t)`` of a device tensor, which also wait; the forms above are how the package wrote
its reads."""

import ast
import os

from helpers.torchrun import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "megatron_psrl")
STEP_PATH = ("attention", "kvcache", "model", "rl", "engine", "distributed")
"""Subpackages whose code runs inside a step."""

READS = ("item", "cpu", "tolist", "numpy", "synchronize")

ALLOWED = {
    ("attention/core_attention.py", "PrefixSharingAttention.forward"):
        "megatron's packed-sequence path (cu_seqlens, no tree metadata): not a prefix-shared step",
    ("attention/backends/blockwise.py", "_segments"): "the attention plan's numpy arrays (host data)",
    ("attention/backends/blockwise.py", "_blocks"): "the attention plan's numpy arrays (host data)",
    ("rl/sharing_check.py", "choose_samples"): "a numpy permutation (host data)",
    ("rl/sharing_check.py", "check_sharing"):
        "the prefix sharing check's comparison, once per checked step, before the step (--check-sharing-every)",
    ("model/moe.py", "expert_load_summary"): "expert-load diagnostics after the step, when asked for",
    ("distributed/kv_exchange.py", "BlockedTime.seconds"):
        "a benchmark's reading of exposed exchange time, and a pipeline step's transfer waits, after the step",
    ("engine/calibration.py", "drain"):
        "start-up cost measurement; and the end of a train_step, once, after the optimizer (its time)",
    ("engine/calibration.py", "measure_costs"): "start-up cost measurement, before any step",
    ("engine/engine.py", "Engine.reduce"): "the step's metric reductions, after its last backward",
    ("engine/head_sends.py", "HeadSends._post_heads"):
        "plans that send heads between groups: whether an importer of another group wants a head "
        "decides what is sent (this rank does not plan the other groups); once per head, after its forward",
    ("engine/optimizer.py", "TrainingOptimizer.loss_scale"):
        "once per step, before its first kernel (fp16's dynamic loss scale is a device tensor)",
    ("engine/pipeline.py", "_settle"):
        "a pipeline step's device time (its bubble's denominator), drained at its start and end",
    ("engine/step.py", "ComputedLogprobs.arrays"): "the step's log-probs, read once at its end",
    ("engine/step.py", "ComputedLogprobs.entropy_array"): "the step's entropies, read once at its end",
    ("engine/step.py", "StepRunner.sequence_sums"): "a sequence loss's per-sample sums, read once after the pass",
}
"""(module, function) -> why its host reads are not a per-micro-batch wait."""


def _reads(tree: ast.AST):
    """``(line, enclosing function's qualified name, method)`` of every host-read call."""
    out = []

    def visit(node, scope: str):
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in READS):
                out.append((child.lineno, scope, child.func.attr))
            visit(child, name)

    visit(tree, "")
    return out


def _step_path_reads():
    found, seen = [], set()
    for sub in STEP_PATH:
        for folder, _, files in os.walk(os.path.join(PACKAGE, sub)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, PACKAGE)
                for line, scope, method in _reads(ast.parse(open(path, encoding="utf-8").read(), path)):
                    seen.add((rel, scope))
                    if (rel, scope) not in ALLOWED:
                        found.append(f"megatron_psrl/{rel}:{line} .{method}() in {scope or '<module>'}")
    return found, seen


def test_the_step_path_reads_the_device_only_where_allowed():
    found, _ = _step_path_reads()
    assert not found, ("host reads of device data on the step path (move them out of the loop, or add "
                       "them to ALLOWED with the reason):\n" + "\n".join(found))


def test_every_allowed_read_still_exists():
    """An allowance whose read is gone is removed, not kept for a read that may come back."""
    _, seen = _step_path_reads()
    assert not set(ALLOWED) - seen, sorted(set(ALLOWED) - seen)


def test_the_check_sees_each_form():
    snippet = ("class A:\n    def f(self, t):\n        a = t.item()\n        b = t.cpu()\n        c = t.tolist()\n"
               "        d = t.numpy()\n        torch.cuda.synchronize()\n        ok = t.to(x)\n")
    assert [(line, scope, m) for line, scope, m in _reads(ast.parse(snippet))] == [
        (3, "A.f", "item"), (4, "A.f", "cpu"), (5, "A.f", "tolist"), (6, "A.f", "numpy"), (7, "A.f", "synchronize")]
