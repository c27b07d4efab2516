"""Every host-to-device copy of the step path goes through :func:`megatron_psrl.host_copy.host_to_device`
(pinned memory and ``non_blocking`` on CUDA): a copy from pageable memory makes the host wait for
the device, a host sync no CPU test would notice.

An AST check of the modules a step runs: it refuses the forms that copy host data to a device,
``torch.from_numpy(...).to(...)``, ``torch.tensor(..., device=...)`` / ``torch.as_tensor(...,
device=...)`` / ``torch.from_numpy(...).cuda()``, any ``.cuda()`` or ``.pin_memory()``, and
``non_blocking=`` outside the helper. It cannot follow a host tensor through a variable; the
forms above are how the package wrote its copies before the helper existed."""

import ast
import os

from helpers.torchrun import REPO_ROOT

from megatron_psrl.host_copy import host_to_device

PACKAGE = os.path.join(REPO_ROOT, "megatron_psrl")
STEP_PATH = ("attention", "kvcache", "model", "rl", "engine", "distributed")
"""Subpackages whose code runs inside a step (some modules of them do not: see ALLOWED)."""

ALLOWED = {
    "engine/calibration.py": "start-up measurement of costs, before any step; not timed through these copies",
    "engine/weights.py": "weight loading and streaming between steps, not a step's inputs",
    "model/builder.py": "moves the model to its device once, at build time",
    "model/architecture.py": "RoPE frequencies built on the host at model build time",
    "distributed/setup.py": "process-group set-up, before any step",
    "distributed/monitor.py": "a watchdog's heartbeat, outside the step's stream",
    "distributed/worker_group.py": "launching ranks, before any step",
}
"""Modules of those subpackages whose copies are not on the step path, and why."""


def _host_tensor_call(node) -> bool:
    """``torch.from_numpy(...)``, ``torch.tensor(...)`` or ``torch.as_tensor(...)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("from_numpy", "tensor", "as_tensor")
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")


def _copies(tree: ast.AST):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        keywords = {k.arg for k in node.keywords}
        if isinstance(func, ast.Attribute) and func.attr in ("to", "cuda") and _host_tensor_call(func.value):
            yield node.lineno, f"torch.{func.value.func.attr}(...).{func.attr}(...)"
        elif _host_tensor_call(node) and "device" in keywords:
            yield node.lineno, f"torch.{func.attr}(..., device=...)"
        elif isinstance(func, ast.Attribute) and func.attr in ("cuda", "pin_memory"):
            yield node.lineno, f".{func.attr}()"
        elif "non_blocking" in keywords:
            yield node.lineno, "non_blocking="


def _step_path_copies():
    found = []
    for sub in STEP_PATH:
        for folder, _, files in os.walk(os.path.join(PACKAGE, sub)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, PACKAGE)
                if name.endswith(".py") and rel not in ALLOWED:
                    tree = ast.parse(open(path, encoding="utf-8").read(), path)
                    found += [f"megatron_psrl/{rel}:{line} {form}" for line, form in _copies(tree)]
    return found


def test_step_path_copies_host_data_only_through_the_helper():
    found = _step_path_copies()
    assert not found, "host-to-device copies outside megatron_psrl.host_copy.host_to_device:\n" + "\n".join(found)


def test_the_check_sees_each_form():
    """The check is not vacuous: each refused form is found in a snippet."""
    snippet = ("a = torch.from_numpy(x).to(d)\nb = torch.tensor(x, device=d)\nc = torch.as_tensor(x, device=d)\n"
               "e = y.cuda()\nf = y.pin_memory()\ng = y.to(d, non_blocking=True)\nh = torch.from_numpy(x).cuda()\n"
               "ok = torch.zeros(3, device=d)\nok2 = y.to(torch.float32)\n")
    assert sorted(line for line, _ in _copies(ast.parse(snippet))) == [1, 2, 3, 4, 5, 6, 7]


def test_every_allowed_module_exists():
    for rel in ALLOWED:
        assert os.path.exists(os.path.join(PACKAGE, rel)), rel


def test_helper_copies_with_the_requested_dtype_on_cpu():
    import numpy as np
    import torch

    t = host_to_device([1, 2, 3], torch.device("cpu"), np.int32)
    assert t.dtype == torch.int32 and t.tolist() == [1, 2, 3]
