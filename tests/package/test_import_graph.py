"""The package's shape: no import cycle between its modules (or the benchmarks'), counting
imports inside functions too (a lazy import that closes a cycle is still a cycle), and no
module imports another module's private (underscore) name."""

import ast
import os
from typing import Dict, List, Set, Tuple

import pytest
from helpers.torchrun import REPO_ROOT

ROOTS = ("megatron_psrl", "benchmarks")


def _modules() -> Dict[str, str]:
    out = {}
    for root in ROOTS:
        for folder, _, files in os.walk(os.path.join(REPO_ROOT, root)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                    out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, modules: Dict[str, str]) -> List[Tuple[str, List[str]]]:
    """``(imported module, [names taken from it])`` for every import statement of a module."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # ``from pkg import module`` imports the module
                sub = f"{base}.{a.name}"
                known = sub in modules or f"{name.partition('.')[0]}.{sub}" in modules
                out.append((sub, []) if known else (base, [a.name]))
    # scripts of one folder (benchmarks/) import each other by bare name (the folder on sys.path)
    folder = name.partition(".")[0]
    out = [(m if m in modules else f"{folder}.{m}", names) for m, names in out]
    return [(m, names) for m, names in out if m in modules]


def _graph() -> Tuple[Dict[str, Set[str]], Dict[str, List[Tuple[str, List[str]]]]]:
    modules = _modules()
    edges, imports = {}, {}
    for name, path in modules.items():
        imports[name] = _imports(name, path, modules)
        # a package's __init__ re-exporting its own modules is not a dependency of theirs
        edges[name] = {m for m, _ in imports[name] if m != name}
    return edges, imports


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _without_package_inits(edges: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """A module importing its own package's ``__init__`` (for re-exported names) and that
    ``__init__`` importing the module back is how packages re-export: count the module's real
    dependency (the defining module) instead."""
    packages = {m for m, path in _modules().items() if path.endswith("__init__.py")}
    return {m: {d for d in deps if not (d in packages and m.startswith(d + "."))} for m, deps in edges.items()}


def test_no_import_cycles():
    edges, _ = _graph()
    cycles = _cycles(_without_package_inits(edges))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_a_private_name_of_another():
    _, imports = _graph()
    bad = [f"{name} imports {m}.{n}" for name, imps in imports.items() for m, names in imps
           for n in names if n.startswith("_") and not n.startswith("__") and m != name]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("root", ROOTS)
def test_the_graph_sees_the_modules(root):
    """The checks above read real modules (guards against a walk that finds nothing)."""
    edges, _ = _graph()
    assert sum(m.startswith(root + ".") for m in edges) >= 5
