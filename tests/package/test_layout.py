"""Where things live: the prefix tree imports nothing of the planning, the engine or the model
above it; planning lives in ``schedule/`` and imports nothing of the engine; and no function of
the package grows past 80 lines (the argument parser, a flat list of flags, aside)."""

import ast
import os

import pytest
from helpers.torchrun import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "megatron_psrl")
MAX_FUNCTION_LINES = 80
LONG_BY_NATURE = {("training/arguments.py", "build_parser")}
"""Functions allowed past the limit: one flag after another, nothing to read top to bottom."""


def _modules(subpackage: str):
    folder = os.path.join(PACKAGE, subpackage)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            path = os.path.join(folder, name)
            yield path, ast.parse(open(path, encoding="utf-8").read(), path)


def _imported(tree: ast.AST):
    """Every module an import statement names (inside functions too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


@pytest.mark.parametrize("subpackage,forbidden", [
    ("tree", ("schedule", "engine", "kvcache", "model", "attention", "distributed", "rl", "training")),
    ("schedule", ("engine", "rl", "training", "integrations", "checkpoint")),
])
def test_lower_layers_import_nothing_above_them(subpackage, forbidden):
    bad = [f"{os.path.relpath(path, REPO_ROOT)} imports {m}" for path, tree in _modules(subpackage)
           for m in _imported(tree) if any(m == f"megatron_psrl.{f}" or m.startswith(f"megatron_psrl.{f}.")
                                           for f in forbidden)]
    assert not bad, "\n".join(bad)


def test_planning_lives_in_schedule():
    """The planner, the plan's types and checks, the memory plan, the cost model and the
    instruction stream are modules of ``schedule/``, and nothing of planning is left where it
    was before (``tree/``, ``kvcache/``, ``engine/``)."""
    present = set(os.listdir(os.path.join(PACKAGE, "schedule")))
    assert {"planner.py", "plan.py", "check.py", "memory.py", "cost.py", "rank_layout.py", "cross_rank.py",
            "group_split.py", "packing.py", "with_memory.py", "instructions.py"} <= present
    for gone in ("tree/planner.py", "tree/plan.py", "tree/cost.py", "tree/packing.py", "kvcache/memory_plan.py",
                 "engine/planning.py", "engine/checkpointing.py"):
        assert not os.path.exists(os.path.join(PACKAGE, gone)), gone


def test_no_function_is_longer_than_the_limit():
    long = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, PACKAGE)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES and (rel, node.name) not in LONG_BY_NATURE:
                        long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over the limit:\n" + "\n".join(long)
