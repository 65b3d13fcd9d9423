"""model_runner's modules import one another without a cycle (read statically: an import at module level or inside a
function both count; ``from . import x`` imports the package ``model_runner`` and ``model_runner.x``)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "model_runner"


def module_name(path: Path) -> str:
    return "model_runner" if path.stem == "__init__" else f"model_runner.{path.stem}"


def imports(path: Path, modules: set[str]) -> set[str]:
    """The model_runner modules that ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "model_runner" if node.level else ""
            base = ".".join(filter(None, [base, node.module]))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
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


def test_cycle_finder():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_runner_modules():
    files = sorted(PACKAGE.glob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {module_name(f): imports(f, modules) for f in files}
    assert graph["model_runner"] and graph["model_runner.__main__"]  # the reader sees relative imports
    assert cycle(graph) is None, " -> ".join(cycle(graph))
