"""model_runner's modules (its subpackages' too) import one another without a cycle (read statically: an import at
module level or inside a function both count; ``from . import x`` imports the package and its module ``x``; importing
a module of a subpackage runs that subpackage's ``__init__`` first, so it counts as importing it, unless the importer
is inside it)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "model_runner"


def module_name(path: Path) -> str:
    parts = ("model_runner", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str], source: str | None = None) -> set[str]:
    """The model_runner modules that ``path`` (holding ``source``, default its text) imports."""
    name = module_name(path)
    package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            base = ".".join(filter(None, [base, node.module]))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    found |= {".".join(m.split(".")[:i]) for m in found & modules for i in range(len(package) + 1, m.count(".") + 1)}
    return found & modules - {module_name(path)}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> imported modules), or None."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other, path + [other])):
                return found
        state[module] = "done"
        return None

    return next((found for m in sorted(graph) if m not in state and (found := visit(m, [m]))), None)


def test_a_subpackage_init_counts():
    modules = {"model_runner.families", "model_runner.families.mla_dsa", "model_runner.families.family"}
    text = "from .families.mla_dsa import dense_shapes\n"
    assert imports(PACKAGE / "outside.py", modules, text) == {"model_runner.families", "model_runner.families.mla_dsa"}
    assert imports(PACKAGE / "families" / "inside.py", modules, "from .family import Family\n") == {
        "model_runner.families.family"}


def test_cycle_finder():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_runner_modules():
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imports(f, modules) for f in files}
    assert graph["model_runner"] and graph["model_runner.__main__"]  # the reader sees relative imports
    assert cycle(graph) is None, " -> ".join(cycle(graph))
