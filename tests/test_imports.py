"""The package's import graph has no cycle.

Every module of ``llamatrace`` is read with :mod:`ast` (nothing is imported or run); each
``import a.b`` and ``from a.b import c`` adds an edge from the module to ``a.b.c`` when that is a
module of the package, else to ``a.b``; relative imports are resolved against the module's
package first. Which imports count:

- every one, wherever it stands: at module level, under ``if TYPE_CHECKING:``, and inside
  functions (the lazy imports that keep Numba, Ray or matplotlib out of a command that does not
  need them). A lazy import delays a cycle, it does not remove it: the two modules still
  cannot be understood or moved one without the other, and a lazy import that becomes a
  module-level one turns it into an ``ImportError``. So a cycle through a lazy import is
  reported like any other;
- not the import of a module's own parent packages, implicit (``import a.b.c`` runs
  ``a/__init__`` and ``a/b/__init__`` first) or explicit (``from llamatrace import
  __version__``): a parent's ``__init__`` has run, or is running, whenever the module runs, so
  such an edge orders nothing. A package's ``__init__`` may import its own modules, as
  ``llamatrace.kernels`` imports the quant types so that importing it declares them (and
  ``llamatrace`` serves ``Llama`` lazily); a cycle through one shows as its other edges.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import llamatrace

PACKAGE = Path(llamatrace.__file__).parent


def module_name(path: Path, root: Path) -> str:
    """``a.b.c`` for ``<root's parent>/a/b/c.py`` (``a.b`` for ``a/b/__init__.py``)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` for every ``.py`` file below ``root``."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets if t in files and t != name and t not in parents}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path
    ``[a, b, …, a]`` through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path(graph, set(c)) for c in components]


def _path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_a_cycle_through_a_lazy_or_type_checking_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import VERSION\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\nfrom pkg import a as _, VERSION\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    assert graph["pkg.sub"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]



ROOMS_BELOW = {
    "llamatrace.machine": ("llamatrace.machine", "llamatrace.errors", "llamatrace.gguf.fetch"),
    "llamatrace.kernels": ("llamatrace.kernels", "llamatrace.machine", "llamatrace.errors", "llamatrace.gguf.fetch"),
}
"""What the machine and the kernel rooms may import: themselves and what lies below them (the
machine's ``runtime`` and the AMX decision file find the user cache through ``gguf.fetch``, which
imports nothing of llamatrace's but ``errors``); never the model, the views or the CLI above them."""


def test_the_kernels_and_the_machine_import_nothing_above_them():
    graph = import_graph()
    found = [f"{module} -> {target}" for module, targets in sorted(graph.items()) for room, allowed in
             ROOMS_BELOW.items() if module == room or module.startswith(room + ".")
             for target in sorted(targets) if not any(target == a or target.startswith(a + ".") for a in allowed)]
    assert not found, "imports from above:\n" + "\n".join(found)


def test_the_cli_starts_without_the_model_its_views_or_their_libraries():
    # `llamatrace --help` or `info` must not pay for the kernels, graphviz or tiktoken (a diagram
    # import at module level once made every start 0.5 s slower): commands import them when they run
    heavy = ("llamatrace.kernels", "llamatrace.model", "llamatrace.views", "graphviz", "tiktoken", "matplotlib")
    code = ("import sys, llamatrace.cli; print('\\n'.join(m for m in sys.modules if m.startswith(%r)))" % (heavy,))
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", "imported at start:\n" + proc.stdout
