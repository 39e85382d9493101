"""The package's import graph: layers in order, no import loop between packages or modules, a library that never
imports its apps, imports at module level.

Layers (`LAYERS`, lowest first): the LIBRARY (quant/, codecs/, compat/, attention/, cache/, integration/, with the
base modules and the package ``__init__``) and the APPS built on it (apps/ and ``__main__``; benchmarks/ lives
outside the package). The graph is read from the source with `ast`, without importing anything:

- every ``import`` / ``from ... import`` statement, at module level or inside a function, relative ones resolved;
  ``from pkg import name`` counts the submodule ``pkg.name`` when there is one, else ``pkg`` itself;
- the lazy export tables (``_EXPORTS = {"Name": "veloxquant_mlx.module", ...}`` resolved by ``__getattr__``) count
  as imports of the modules they name;
- imports under ``if TYPE_CHECKING:`` are not run and do not count;
- the one alias table (`veloxquant_mlx._aliases`: old paths and names, resolved only when one is used) holds
  module names as strings, which are not imports: it imports nothing of the package but ``_version``.

Checks: (a) no cycle among the package's modules; (b) no library module imports an app module; (c) no function
imports anything but an optional third-party dependency (`OPTIONAL`); (d) every top-level package or module of
the package sits in one of `LAYERS` and imports only its own layer or lower ones; (e) no import loop between
packages: package A importing package B (any module of A, any module of B, at module level or in a function)
while B imports A, even when no module cycle exists (`PACKAGE_LOOP_EXCEPTIONS` names the one edge still allowed,
with the change that removes it).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "veloxquant_mlx"
APPS = ("apps", "__main__")
# Third-party packages a function may import: optional dependencies, not installed with the library
# (pyproject's extras: "plot"; nanobind: only to build the compiled kernel, attention/build_kernel.py).
OPTIONAL = frozenset({"matplotlib", "nanobind"})

# The folders in layer order, lowest first (each imports its own layer or lower ones, never a higher one); the
# package's folders are exactly these (`test_the_package_is_its_layers`). "" is the package's own __init__ (the
# public facade: its lazy exports reach the integration).
LAYERS = (
    ("base", {"_version", "validate", "_aliases"}),  # the version, argument checks, the one alias table
    ("quant", {"quant"}),  # the maths: rotations, codebooks, bit packing, quantizers, encoded vectors
    ("codecs", {"codecs"}),  # one code layout per file behind one contract
    ("compat", {"compat"}),  # the seed pages' API and its own configuration (KVCacheConfig)
    ("attention", {"attention"}),  # attention on codes; the compiled kernel
    ("cache", {"cache"}),  # CacheOptions and the presets, the store (Rows), the mlx_lm-facing caches, saved states
    ("integration", {"integration", ""}),  # everything that touches mlx_lm; calibration measuring
    ("apps", set(APPS)),  # CLI, server, eval, models, distributed
)

# Module edges that still make a package-level loop, each with the change that removes it. The test fails when one
# is gone (delete its entry then), so the list only shrinks; any other loop fails the test.
PACKAGE_LOOP_EXCEPTIONS: set = set()


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


def _export_tables(tree: ast.Module, table: str = "_EXPORTS"):
    """``(line, module)`` of every string value of a module-level ``table`` dict (the facade's ``_EXPORTS``)."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
            node, "target", None)
        if isinstance(target, ast.Name) and target.id == table and isinstance(node.value, ast.Dict):
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
    """Every edge of the package."""
    mods = modules()
    known = set(mods)
    return [e for name, path in mods.items() for e in edges_of(name, path, known)]


def unit(name: str) -> str:
    """The top-level package or module of the package a module belongs to ("" for the package's own __init__)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(name: str) -> int:
    found = [i for i, (_, units) in enumerate(LAYERS) if unit(name) in units]
    if len(found) != 1:
        raise AssertionError(f"{module_path(name)}: the package or module {unit(name) or PACKAGE!r} must sit in "
                             f"exactly one of LAYERS (tests/project/test_layers.py), found in {len(found)}")
    return found[0]


def package_edges(edges: List[Edge]) -> List[Edge]:
    """The edges between different top-level packages (modules of one package importing each other do not count)."""
    return [e for e in edges if e.internal and unit(e.source) != unit(e.target)]


def find_package_loops(edges: List[Edge]) -> List[List[Edge]]:
    """One loop per group of mutually importing packages: the package graph's cycles, each edge the first module
    import that makes it (its module-level `where`)."""
    first: Dict[tuple, Edge] = {}
    for e in package_edges(edges):
        first.setdefault((unit(e.source), unit(e.target)), e)
    folded = [Edge(a or PACKAGE, b or PACKAGE, e.line, e.in_function, True) for (a, b), e in first.items()]
    loops = find_cycles(folded)
    return [[first[(unit_name(e.source), unit_name(e.target))] for e in loop] for loop in loops]


def two_way_pairs(edges: List[Edge]) -> List[tuple]:
    """``(a, b)`` for every two packages importing each other, each once."""
    pairs = {(unit(e.source) or PACKAGE, unit(e.target) or PACKAGE) for e in package_edges(edges)}
    return sorted((a, b) for a, b in pairs if a < b and (b, a) in pairs)


def unit_name(folded: str) -> str:
    return "" if folded == PACKAGE else folded


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
    assert "veloxquant_mlx.integration" in names and "veloxquant_mlx.apps.cli" in names
    # the export table of the package counts: the package imports integration through it
    assert any(e.source == PACKAGE and e.target == "veloxquant_mlx.integration.enabling" for e in edges)
    # function-level imports are seen (the CLI imports its commands' modules lazily or not: either way it is read)
    assert any(e.source == "veloxquant_mlx.apps.cli" for e in edges)


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


def test_every_package_has_a_layer():
    names = sorted(modules())
    for name in names:
        layer_of(name)  # raises naming the module when its package is in no layer or in two
    units = ("validate", "quant", "codecs", "compat", "attention", "cache", "integration", "apps")
    assert [layer_of(f"{PACKAGE}.{u}") for u in units] == list(range(len(LAYERS)))


def test_the_package_is_its_layers():
    """The package's top level holds exactly the folders and modules `LAYERS` names, one job each."""
    top = {p.stem for p in (ROOT / PACKAGE).glob("*.py") if p.stem != "__init__"} | {
        p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").is_file()}
    named = set().union(*(units for _, units in LAYERS)) - {""}
    assert top == named, f"on disk, not in LAYERS: {sorted(top - named)}; in LAYERS, not on disk: {sorted(named - top)}"


def test_layers_import_downward():
    bad = sorted({(e.where(), e.source, e.target) for e in package_edges(graph())
                  if layer_of(e.target) > layer_of(e.source)})
    assert not bad, "imports from a lower layer into a higher one (order: " + " -> ".join(
        n for n, _ in LAYERS) + "):\n" + "\n".join(
        f"  {where}: {source} ({LAYERS[layer_of(source)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for where, source, target in bad)


def test_package_loop_finder_sees_loops_without_module_cycles():
    # a.x -> b.y and b.z -> a.w: no module cycle, one package loop; the import in a function counts
    a = PACKAGE + ".calibration"
    b = PACKAGE + ".integration"
    edges = [Edge(f"{a}.measure", b, 24, False, True), Edge(b, f"{a}.file", 61, True, True),
             Edge(f"{a}.file", f"{a}.weights", 3, False, True)]
    assert find_cycles(edges) == []
    loops = find_package_loops(edges)
    assert len(loops) == 1 and {unit(e.source) for e in loops[0]} == {"calibration", "integration"}
    assert find_package_loops(edges[1:]) == []
    # the module-level package __init__ is a package of its own ("")
    assert find_package_loops([Edge(PACKAGE, b, 1, False, True), Edge(b, PACKAGE, 2, False, True)])


def test_no_package_level_import_loop():
    edges = graph()
    excepted = [e for e in edges if (e.source, e.target) in PACKAGE_LOOP_EXCEPTIONS]
    stale = PACKAGE_LOOP_EXCEPTIONS - {(e.source, e.target) for e in excepted}
    assert not stale, f"exceptions no longer needed (remove them from PACKAGE_LOOP_EXCEPTIONS): {sorted(stale)}"
    kept = [e for e in edges if (e.source, e.target) not in PACKAGE_LOOP_EXCEPTIONS]
    loops = find_package_loops(kept)
    assert not loops, f"{len(loops)} package-level import loop(s):\n" + "\n".join(
        "  " + " -> ".join(f"{unit(e.source) or PACKAGE} ({e.where()}: {e.target})" for e in loop) for loop in loops
    ) + "\npackages importing each other:\n" + "\n".join(f"  {a} <-> {b}" for a, b in two_way_pairs(kept))
    # each exception is still a loop (otherwise it would not need to be one): its packages import each other
    pairs = {(unit(e.source), unit(e.target)) for e in package_edges(edges)}
    for e in excepted:
        assert (unit(e.target), unit(e.source)) in pairs, f"{e.where()} -> {e.target} no longer makes a loop"


def _private(module: str) -> bool:
    return any(part.startswith("_") and part != "__init__" for part in module.split(".")[1:])


def test_no_package_imports_another_packages_private_module():
    """What another package needs is public in its package (a module without a leading underscore); the base
    modules at the top (``_version``, ``_aliases``) belong to the whole package."""
    bad = sorted(f"{e.where()}: {e.source} -> {e.target}" for e in package_edges(graph())
                 if _private(e.target) and unit(e.target) not in LAYERS[0][1])
    assert not bad, "imports of another package's private module:\n" + "\n".join(bad)


F401 = re.compile(r"noqa:[^\n]*\bF401\b")


def _module_sources():
    return {name: path.read_text(encoding="utf-8") for name, path in modules().items()}


def test_no_re_export_hubs():
    """Each name is imported from the module that defines it: no unused imports kept for others to read
    (``noqa: F401``) outside a package ``__init__`` that defines a public surface, and no module ``__getattr__``
    but the alias table's (`veloxquant_mlx._aliases.package_getattr`)."""
    hubs, getattrs = [], []
    for name, text in _module_sources().items():
        path = module_path(name)
        tree = ast.parse(text)
        noqa = {i + 1 for i, line in enumerate(text.splitlines())
                if F401.search(line)}
        if not path.endswith("__init__.py"):
            hubs += [f"{path}:{n}" for n in sorted(noqa)]
        else:  # a package's public surface: public names only
            hubs += [f"{path}:{node.lineno} re-exports private names" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.lineno in noqa
                     and any(a.name.startswith("_") for a in node.names)]
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and name != PACKAGE + "._aliases":
                getattrs.append(f"{path}:{node.lineno} defines __getattr__")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__getattr__"
                                                    for t in node.targets):
                call = node.value
                ok = (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                      and call.func.attr == "package_getattr")
                if not ok:
                    getattrs.append(f"{path}:{node.lineno} assigns __getattr__ not from the alias table")
    assert not hubs, "re-exports (noqa: F401) outside a package __init__:\n" + "\n".join(hubs)
    assert not getattrs, "\n".join(getattrs)


def test_the_alias_table_imports_only_the_version():
    edges = [e for e in graph() if e.source == PACKAGE + "._aliases" and e.internal]
    assert {e.target for e in edges} == {PACKAGE + "._version"}, edges
