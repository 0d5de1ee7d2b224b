"""Code size and structure of a checkout (docs/design.md, "Code size and structure"): README lines,
the largest modules, classes and functions of the package (lines, read with ``ast``), functions over
100 lines, imports inside functions, import cycles (the import graph of tests/test_layers.py), the
runtime's imports of top-level modules other than the helpers (back-edges) and,
where the ``duplicates`` command is on PATH, its pair and file counts for yggtree/ and tests/.

    python scripts/code_stats.py [CHECKOUT ...]     # default: this checkout; one column each
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
from test_layers import HELPERS, import_cycles, import_graph  # noqa: E402


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _duplicates(folder: Path) -> str:
    if shutil.which("duplicates") is None:
        return "n/a"
    out = subprocess.run(["duplicates", "--repo", str(folder), "--seconds", "120"],
                         capture_output=True, text=True).stdout
    m = re.match(r"(\d+) pairs? of places \((\d+) files read\)", out) or \
        re.match(r"no duplicates \((\d+) files read\)", out)
    if m is None:
        return "?"
    return f"{m[1]} pairs / {m[2]} files" if m.re.groups == 2 else f"0 pairs / {m[1]} files"


def stats(root: Path) -> dict[str, str]:
    files = sorted((root / "yggtree").rglob("*.py"))
    modules, classes, funcs, nested_imports = [], [], [], set()
    for f in files:
        text = f.read_text()
        rel = f.relative_to(root / "yggtree").as_posix()
        modules.append((len(text.splitlines()), rel))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((_span(node), node.name))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((_span(node), node.name))
                nested_imports |= {(rel, n.lineno) for n in ast.walk(node)
                                   if isinstance(n, (ast.Import, ast.ImportFrom))}
    top = lambda rows, n=3: ", ".join(f"{name} {size}" for size, name in sorted(rows, reverse=True)[:n])  # noqa: E731
    long = sorted((r for r in funcs if r[0] > 100), reverse=True)
    graph = import_graph(root)
    cycles = import_cycles(graph)
    # the runtime reaching above itself: imports of a top-level module other than the helpers
    up = sorted(f"{a[8:]}->{b[8:]}" for a, bs in graph.items() if a.startswith("yggtree.runtime") for b in bs
                if not b.startswith("yggtree.runtime") and b not in HELPERS)
    return {
        "README.md lines": str(len((root / "README.md").read_text().splitlines())),
        "package: files, lines": f"{len(files)}, {sum(m[0] for m in modules)}",
        "largest modules (lines)": top(modules),
        "largest classes (lines)": top(classes),
        "largest functions (lines)": top(funcs),
        "functions over 100 lines": f"{len(long)}" + (f" ({top(long, len(long))})" if long else ""),
        "imports inside functions": str(len(nested_imports)),
        "import cycles": str(len(cycles)) + "".join(f" [{' <-> '.join(c)}]" for c in cycles),
        "runtime imports from above": str(len(up)) + (f" ({', '.join(up)})" if up else ""),
        "duplicates yggtree/": _duplicates(root / "yggtree"),
        "duplicates tests/": _duplicates(root / "tests"),
    }


def main(argv: list[str]) -> int:
    roots = [Path(a).resolve() for a in argv] or [HERE]
    cols = [stats(r) for r in roots]
    print("| measure | " + " | ".join(str(r) for r in roots) + " |")
    print("|---|" + "---|" * len(roots))
    for k in cols[0]:
        print(f"| {k} | " + " | ".join(c[k] for c in cols) + " |")
    return 0


if __name__ == "__main__":
    from yggtree.errors import run_reporting

    sys.exit(run_reporting("code_stats", main, sys.argv[1:]))
