"""The package's layout rules, read from the import graph and the source (not from a list of names):

- no import cycle among the modules of ``dsa_triton``, ``tuner``, ``tuning_db`` and ``model_runner`` (an import inside
  a function and ``import_module`` count as much as one at the top of a module);
- ``tuning_db`` imports nothing of ``dsa_triton``; an op module imports no registry entry (``*_spec``);
- ``import dsa_triton`` loads no measuring module (the bench, its reports, the timing harness) and no tuner; no module
  under ``dsa_triton/attention``, ``dsa_triton/moe`` or ``dsa_triton/linear`` imports one;
- one name per op: every registered kernel is a public function of its op module, named as the kernel;
- code says what it is: no figures with time or throughput units and no dates in package code (measurements belong
  in results/, design history in docs/design/);
- results/ holds at most 80 tracked files.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dsa_triton", "tuner", "tuning_db", "model_runner")
MEASURING = ("dsa_triton.bench", "tuner")
OP_PACKAGES = ("dsa_triton.attention", "dsa_triton.moe", "dsa_triton.linear")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, anywhere in it: ``import a.b``, ``from a import b`` (the
    submodule ``a.b`` when there is one, else ``a``), ``from . import b``, and ``import_module("a.b")`` or
    ``import_module(".b", __package__)`` with a literal name."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def absolute(target: str, level: int) -> str:
        if not level:
            return target
        anchor = package.split(".")[: len(package.split(".")) - level + 1]
        return ".".join(anchor + ([target] if target else []))

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module or "", node.level)
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found |= subs or {base}
            if len(subs) < len(node.names):
                found.add(base)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                text = node.args[0].value
                level = len(text) - len(text.lstrip("."))
                found.add(absolute(text.lstrip("."), level))
            elif node.args:
                found.add(f"<dynamic import_module in {name}>")
    return {m for m in found if m in modules or m.startswith("<dynamic")} - {name}


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = [p for folder in packages for p in (root / folder).rglob("*.py")]
    modules = {module_name(p, root): p for p in files}
    return {m: imports_of(p, set(modules), root) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


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


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100
    dynamic = [(m, d) for m, deps in graph.items() for d in deps if d.startswith("<dynamic")]
    assert not [m for m, _ in dynamic if not measuring({m})], dynamic  # a name from data: only where measuring
    assert cycles(graph) == []


def test_the_cycle_check_can_fail(tmp_path):
    """Two modules that import each other (one through ``import_module``, inside a function) are a cycle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "op.py").write_text("from . import helper\n")
    (package / "helper.py").write_text("def f():\n    from importlib import import_module\n"
                                       "    return import_module('.op', __package__)\n")
    (package / "leaf.py").write_text("import os\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.helper", "pkg.op"]]


def test_tuning_db_is_a_leaf_and_ops_import_no_spec():
    graph = import_graph()
    assert not [m for m in reachable(graph, "tuning_db") if m.startswith("dsa_triton")]
    ops = [m for m in graph if m.startswith(tuple(p + "." for p in OP_PACKAGES)) and not m.endswith("_spec")]
    assert len(ops) > 30
    for op in ops:
        assert not [m for m in graph[op] if m.endswith("_spec")], op


def test_ops_never_import_measuring_code():
    graph = import_graph()
    ops = [m for m in graph if m.startswith(OP_PACKAGES)]
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


def test_every_kernel_is_named_as_its_op_function():
    """Registry name, public function and file stem agree: the kernel is a function of its launch space's module,
    whose stem is the name or, for a module of several ops (``sparse_attention``, ``mxfp4``), its prefix."""
    import dsa_triton as dt

    for spec in dt.registry.kernels():
        module = sys.modules[spec.launch.default.__module__]
        stem = module.__name__.rpartition(".")[2]
        assert callable(getattr(module, spec.name, None)), f"{spec.name}: no such function in {module.__name__}"
        assert spec.name.startswith(stem), f"{spec.name} lives in {module.__name__}"
        assert getattr(dt, spec.name) is getattr(module, spec.name), f"dt.{spec.name} is not the op"


FIGURE = re.compile(r"\d(?:\.\d+)?\s*(?:us|µs|ms|ns|TFLOP/s|GFLOP/s|TB/s|GB/s|MB/s|tok/s|tokens/s)\b"
                    r"|\b20\d\d-[01]\d-[0-3]\d\b|session [0-9]", re.IGNORECASE)


def figures(paths) -> list[str]:
    return [f"{p}:{i}: {line.strip()}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if FIGURE.search(line)]


def test_no_timings_or_dates_in_package_code():
    assert figures(p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py")) == []


@pytest.mark.parametrize("line", ["takes 108.8 us on the H200", "about 3 ms", "at 2.2 TB/s", "687 TFLOP/s",
                                  "measured 2026-12-01", "see session 14"])
def test_the_figure_check_can_fail(tmp_path, line):
    path = tmp_path / "probe.py"
    path.write_text(f'"""{line}"""\n')
    assert figures([path])


def test_results_hold_at_most_80_tracked_files():
    out = subprocess.run(["git", "ls-files", "results"], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        pytest.skip("not a git checkout")
    assert 0 < len(out.stdout.split()) <= 80
