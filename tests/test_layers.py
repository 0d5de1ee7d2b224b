"""docs/design.md's architecture against the sources: the import graph (module-level and
function-level imports, read with ``ast``) keeps the runtime off the offline side and the helpers
at the bottom, and every module of the package is named in the design's module table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ("yggtree.errors", "yggtree.files", "yggtree.progress", "yggtree.streaming", "yggtree.shapes")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """yggtree module -> the yggtree modules it imports anywhere in its file."""
    modules = {module_name(p, root): p for p in (root / "yggtree").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # "from . import b" imports module b; "from .a import f" imports module a
                subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
                out |= subs or ({base} & modules.keys())
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names} & modules.keys()
        graph[name] = out - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_import_graph_reads_a_small_tree(tmp_path):
    pkg = tmp_path / "yggtree"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "a.py").write_text("from ..errors import X\nfrom . import b\n")
    (pkg / "runtime" / "b.py").write_text("def f():\n    from .a import g\n")
    g = import_graph(tmp_path)
    assert g["yggtree.runtime.a"] == {"yggtree.errors", "yggtree.runtime.b"}
    assert g["yggtree.runtime.b"] == {"yggtree.runtime.a"}
    assert import_cycles(g) == [["yggtree.runtime.a", "yggtree.runtime.b"]]


# cycles that exist and are to go (docs/design.md section 1); a new one fails the test
KNOWN_CYCLES: list[list[str]] = []


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The package's import graph, read once for the tests below (parsing every source was each
    one's time)."""
    return import_graph()


def test_no_new_import_cycles(graph):
    assert [c for c in import_cycles(graph) if c not in KNOWN_CYCLES] == []


PLANS = ("yggtree.plan", "yggtree.compiled", "yggtree.tuned")  # plans, their artifacts checked, tuned plans


def test_runtime_never_imports_offline(graph):
    """The run side (runtime/ and the plan modules) imports neither the offline side nor the tools
    above it."""
    above = ("yggtree.offline", "yggtree.bench", "yggtree.measure", "yggtree.data", "yggtree.cli",
             "yggtree.run_cmd", "yggtree.quickstart")
    bad = [(a, b) for a, bs in graph.items() for b in bs
           if (a.startswith("yggtree.runtime") or a in PLANS) and b.startswith(above)]
    assert bad == []


def test_runtime_imports_only_helpers_from_above(graph):
    """The runtime imports no module of the package's top level but the helpers: not the plan
    modules (a plan reaches it as an object; what it reads of one, the padding its profile
    measured and the compiled directory, is the runtime's own), so that they may import it."""
    bad = [(a, b) for a, bs in graph.items() for b in bs
           if a.startswith("yggtree.runtime") and not b.startswith("yggtree.runtime") and b not in HELPERS]
    assert bad == []


def test_nothing_imports_the_cli(graph):
    """Only the console entry point (``yggtree.launch``: the allocator first, then the CLI)."""
    assert [a for a, bs in graph.items() if "yggtree.cli" in bs] == ["yggtree.launch"]


def test_helpers_import_only_errors(graph):
    g = graph
    assert {h: g[h] - {"yggtree.errors"} for h in HELPERS if h in g} == {h: set() for h in HELPERS if h in g}


def test_every_module_is_in_the_design():
    design = (ROOT / "docs" / "design.md").read_text()
    files = [p.relative_to(ROOT / "yggtree").as_posix() for p in (ROOT / "yggtree").rglob("*.py")
             if p.name != "__init__.py"]
    missing = sorted(f for f in files if f"`{f}`" not in design and f", `{f}`" not in design)
    assert missing == [], "name these modules in docs/design.md's module table"
