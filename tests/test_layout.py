"""The package's layout rules, read from the import graph (not from a list of names):

- ``import dsa_triton`` loads no measuring module (the bench, its reports, the timing harness) and no tuner;
- no module under ``dsa_triton/attention`` or ``dsa_triton/moe`` imports one, directly or through another module;
- no code cites sessions or run dates (measurements belong in results/).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURING = ("dsa_triton.bench", "tuner")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from x import y`` counts x and x.y)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for folder in ("dsa_triton", "tuner", "tuning_db") for p in (ROOT / folder).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    return {m: {i for i in imports_of(p) if i in modules} for m, p in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Modules ``start`` loads: its imports, and the packages (``__init__``) above each, transitively."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        todo += graph[m]
        todo += [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
    return seen


def measuring(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in MEASURING))


def test_ops_never_import_measuring_code():
    graph = import_graph()
    ops = [m for m in graph if m.startswith(("dsa_triton.attention", "dsa_triton.moe"))]
    assert len(ops) > 20
    for op in ops:
        assert not measuring(reachable(graph, op)), f"{op} loads {measuring(reachable(graph, op))}"
    assert not measuring(reachable(graph, "dsa_triton"))


def test_the_graph_sees_a_measuring_import():
    """The check above can fail: the bench's own modules reach the harness through the same graph."""
    graph = import_graph()
    assert "dsa_triton.bench.harness" in measuring(reachable(graph, "dsa_triton.bench.run"))


def test_import_dsa_triton_loads_no_measuring_module():
    code = ("import sys, dsa_triton; "
            "print(sorted(m for m in sys.modules if m.startswith(('dsa_triton.bench', 'tuner', 'optuna'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_code_cites_sessions_or_run_dates():
    pattern = re.compile(r"session [0-9]|20261[12][0-9]{2}", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}" for folder in ("dsa_triton", "tuner", "tuning_db", "model_runner")
            for p in (ROOT / folder).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, hits
