"""The package's import graph: a library that never imports its apps, no import cycle, imports at module level.

Layers: the LIBRARY (options, validate, rotation, codebooks, quantizers/, dsa/, outlier/, core/, config, codecs/,
cache/, compat/, attention/, integration, model_shape, the package ``__init__``) and the APPS built on it (cli,
server, eval/, models/, distributed, blas, ``__main__``; benchmarks/ lives outside the package). The graph is read
from the source with `ast`, without importing anything:

- every ``import`` / ``from ... import`` statement, at module level or inside a function, relative ones resolved;
  ``from pkg import name`` counts the submodule ``pkg.name`` when there is one, else ``pkg`` itself;
- the lazy export tables (``_EXPORTS = {"Name": "veloxquant_mlx.module", ...}`` resolved by ``__getattr__``) count
  as imports of the modules they name;
- imports under ``if TYPE_CHECKING:`` are not run and do not count.

Checks: (a) no cycle among the package's modules; (b) no library module imports an app module; (c) no function
imports anything but an optional third-party dependency (`OPTIONAL`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "veloxquant_mlx"
APPS = ("cli", "launcher", "server", "eval", "models", "distributed", "blas", "__main__")
# Third-party packages a function may import: optional dependencies, not installed with the library
# (pyproject's extras: "plot"; nanobind: only to build the compiled kernel, attention/build_kernel.py).
OPTIONAL = frozenset({"matplotlib", "nanobind"})


@dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a module of the package, or the top-level name of an outside module
    line: int
    in_function: bool
    internal: bool

    def where(self) -> str:
        return f"{module_path(self.source)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> str:
    base = ROOT.joinpath(*name.split("."))
    return str((base / "__init__.py" if base.is_dir() else base.with_suffix(".py")).relative_to(ROOT))


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def is_app(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == PACKAGE and parts[1] in APPS


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """``(node, in_function)`` for every import statement that runs, walking into functions and classes."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    yield from walk_one(sub, in_function)
                continue
            yield from walk_one(child, in_function)

    def walk_one(node, in_function):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        yield from walk(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from walk(tree, False)


def _export_tables(tree: ast.Module):
    """``(line, module)`` of every string value of a module-level ``_EXPORTS`` dict."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
            node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and isinstance(node.value, ast.Dict):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.lineno, value.value


def edges_of(name: str, path: Path, known: Set[str]) -> List[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def add(target: str, line: int, in_function: bool):
        internal = target == PACKAGE or target.startswith(PACKAGE + ".")
        if internal and target not in known:
            raise AssertionError(f"{module_path(name)}:{line} imports {target}, which is not a module of the package")
        out.append(Edge(name, target if internal else target.split(".")[0], line, in_function, internal))

    for node, in_function in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, in_function)
            continue
        if node.level:
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        if source == "__future__":
            continue
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            add(sub if sub in known else source, node.lineno, in_function)
    for line, target in _export_tables(tree):
        add(target, line, False)
    return out


def graph() -> List[Edge]:
    mods = modules()
    known = set(mods)
    return [e for name, path in mods.items() for e in edges_of(name, path, known)]


def _internal_successors(edges: List[Edge]) -> Dict[str, List[Edge]]:
    succ: Dict[str, List[Edge]] = {}
    for e in edges:
        if e.internal and e.target != e.source:
            succ.setdefault(e.source, []).append(e)
    return succ


def find_cycle(edges: List[Edge]) -> Optional[List[Edge]]:
    """One cycle among the package's modules (its edges in order), or None."""
    succ = _internal_successors(edges)
    state: Dict[str, int] = {}  # 1: on the stack, 2: done
    stack: List[Edge] = []

    def visit(node: str) -> Optional[List[Edge]]:
        state[node] = 1
        for e in succ.get(node, []):
            if state.get(e.target) == 1:
                start = next((i for i, s in enumerate(stack) if s.source == e.target), len(stack))
                return stack[start:] + [e]
            if e.target not in state:
                stack.append(e)
                found = visit(e.target)
                if found:
                    return found
                stack.pop()
        state[node] = 2
        return None

    for node in sorted(succ):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def find_cycles(edges: List[Edge]) -> List[List[Edge]]:
    """One cycle per group of mutually dependent modules (strongly connected component), so that every tangle is
    reported at once, not only the first one met."""
    succ = _internal_successors(edges)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[Set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's algorithm (the graph is small: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in succ.get(v, []):
            w = e.target
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(succ):
        if v not in index:
            strongconnect(v)
    return [find_cycle([e for e in edges if e.source in comp and e.target in comp]) for comp in components]


def describe(cycle: List[Edge]) -> str:
    return " -> ".join(f"{e.source} ({e.where()}{', in a function' if e.in_function else ''})"
                       for e in cycle) + f" -> {cycle[-1].target}"


def test_graph_is_read():
    edges = graph()
    names = modules()
    assert "veloxquant_mlx.integration" in names and "veloxquant_mlx.cli" in names
    # the export table of the package counts: the package imports integration through it
    assert any(e.source == PACKAGE and e.target == "veloxquant_mlx.integration" for e in edges)
    # function-level imports are seen (the CLI imports its commands' modules lazily or not: either way it is read)
    assert any(e.source == "veloxquant_mlx.cli" for e in edges)


def test_cycle_finder_reports_a_cycle():
    edges = [Edge("a", "b", 1, False, True), Edge("b", "c", 2, True, True), Edge("c", "a", 3, False, True),
             Edge("c", "d", 4, False, True)]
    cycle = find_cycle(edges)
    assert cycle is not None and [e.source for e in cycle] == ["a", "b", "c"] and cycle[-1].target == "a"
    assert find_cycle(edges[:2]) is None
    two = edges + [Edge("x", "y", 5, False, True), Edge("y", "x", 6, True, True)]
    assert sorted(sorted(e.source for e in c) for c in find_cycles(two)) == [["a", "b", "c"], ["x", "y"]]
    assert find_cycles(edges[:2]) == []


def test_no_import_cycle():
    cycles = find_cycles(graph())
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(f"  {describe(c)}" for c in cycles)


def test_library_never_imports_an_app():
    bad = sorted({(e.where(), e.source, e.target) for e in graph()
                  if e.internal and not is_app(e.source) and is_app(e.target)})
    assert not bad, "library modules importing app modules:\n" + "\n".join(
        f"  {where}: {source} -> {target}" for where, source, target in bad)


def test_function_level_imports_only_for_optional_dependencies():
    bad = sorted({(e.where(), e.target) for e in graph() if e.in_function and (e.internal or e.target not in OPTIONAL)},
                 key=lambda b: (b[0].rpartition(":")[0], int(b[0].rpartition(":")[2]), b[1]))
    assert not bad, f"{len(bad)} imports inside functions (move them to the top of the module):\n" + "\n".join(
        f"  {where}: {target}" for where, target in bad)
