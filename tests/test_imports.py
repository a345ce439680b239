"""The house's import rules across pd/, read from the source (no imports run).

- No import cycle between pd's modules. Every import counts as an arrow: at the top, inside a
  function, under `if TYPE_CHECKING:`. `from P import name` is an arrow to P itself (its
  `__init__` runs first) and to the module P.name where there is one, so a cycle through a
  package's `__init__` is a cycle too (`import P.name as name` is an arrow to P.name alone).
- Packages in layers, arrows only downward: pd's own modules, pd.protocol, pd.kvcache and pd.sim
  at the bottom; pd.transfer; pd.worker and pd.router (neither imports the other); pd.bench on
  top; pd.planner beside the worker and the router (it reads what they export over HTTP). So
  pd/sim is a library below the worker: it imports nothing from pd.worker, pd.router or
  pd.bench.
- A function-level `pd.*` import is for an optional or heavy module: at most 10 in the runtime
  (pd/ without pd/bench/), each with a comment on the line above or its own line saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PD = ROOT / "pd"
MOST_FUNCTION_IMPORTS = 10


def _modules() -> dict[str, Path]:
    found = {}
    for path in PD.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The module an imported name lands in: the longest known prefix of `name`."""
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """module -> the pd modules it imports (every import, at any depth)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        arrows = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                package = _target(node.module) if node.module.startswith("pd") else None
                if package is not None and package != module:
                    arrows.add(package)
            for name in _imported(node):
                target = _target(name) if name.startswith("pd.") else None
                if target is not None and target != module:
                    arrows.add(target)
        graph[module] = arrows
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 300  # it reads the house
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_sim_is_a_library_below_the_worker():
    bad = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith("pd.sim")
        for target in targets
        if target.startswith(("pd.worker", "pd.router", "pd.bench"))
    ]
    assert not bad, "\n".join(bad)


# package -> its layer; a package imports only from lower layers (and itself)
LAYERS = {"base": 0, "pd.transfer": 1, "pd.worker": 2, "pd.router": 2, "pd.planner": 2, "pd.bench": 3}


def _package(module: str) -> str:
    top = ".".join(module.split(".")[:2])
    return top if top in LAYERS else "base"


def test_packages_import_only_from_lower_layers():
    bad = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if _package(target) != _package(module)
        and LAYERS[_package(target)] >= LAYERS[_package(module)]
    ]
    assert not bad, "\n".join(bad)


def _function_imports() -> list[tuple[Path, int, str]]:
    """(file, line, module) of each `pd.*` import inside a function in the runtime."""
    found = []
    for path in sorted(PD.rglob("*.py")):
        if path.is_relative_to(PD / "bench"):
            continue
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    for name in _imported(node):
                        if name.startswith("pd."):
                            found.append((path, node.lineno, name))
                            break
    return sorted(set(found))


def test_function_level_imports_are_few_and_say_why():
    found = _function_imports()
    assert len(found) <= MOST_FUNCTION_IMPORTS, [f"{p.relative_to(ROOT)}:{n}" for p, n, _ in found]
    unexplained = []
    for path, line, _ in found:
        lines = path.read_text().splitlines()
        at, above = lines[line - 1], lines[line - 2].strip() if line > 1 else ""
        # a comment of its own, or the import continues a block the comment opened
        block = [lines[i].strip() for i in range(line - 2, max(line - 6, -1), -1)]
        opened = next((b for b in block if not b.startswith("from pd.")), "")
        if "#" not in at and not above.startswith("#") and not opened.startswith("#"):
            unexplained.append(f"{path.relative_to(ROOT)}:{line}")
    assert not unexplained, f"function-level imports without a why: {unexplained}"
