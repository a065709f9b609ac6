"""autoshard's import graph runs one way: from the entry points down to data, no loops.

Every module of `autoshard/` is read with `ast` (nothing is imported), every import of an
autoshard module is an edge, function-level imports included. The package's folders are its
pipeline stages; the layers below are that map (docs/design.md shows the same one): a module may
import from its own package (or top-level module) and the layers under it, never from one above;
the only exceptions are the Plan's hand-overs to the views that draw and print it, made inside
its methods. There is no import loop, even inside a package, and no module uses another's private
name. The folder stays readable: few modules at the top, none over MAX_LINES lines, and each
package's `__init__` says what it takes and what it hands on.
"""
from __future__ import annotations

import ast
import os

import networkx as nx
import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autoshard")

# Bottom to top, by package (a folder of autoshard/) or top-level module. A unit may import from
# itself and from any layer before it.
LAYERS = [
    ("errors", ["errors"]),
    ("runtime: placements, groups, collectives, random streams, state dicts", ["runtime"]),
    ("the Plan (frozen data)", ["plan"]),
    ("TorchShard's layers and names, mixed precision", ["nn", "distributed", "amp"]),
    ("capture", ["capture"]),
    ("planner and its rules", ["planner"]),
    ("rewrite", ["rewrite"]),
    ("io: loading, Hugging Face, checkpoints", ["io"]),
    ("views of a plan", ["views"]),
    ("entry points", ["api", "pipe", "checkpoint", "advise", "cli", "demo", "__main__", ""]),
]
# (importer, imported unit): allowed upward, and only from inside a function (a lazy hand-over).
HAND_OVERS = {("plan", "views")}
MAX_TOP_MODULES = 10        # modules directly in autoshard/, besides __init__ and __main__
MAX_LINES = 450


def _modules() -> dict[str, str]:
    """Module name relative to autoshard ('' for the package itself) -> path."""
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                name = rel[:-len("__init__")].rstrip(".") if rel.endswith("__init__") else rel
                out[name] = path
    return out


MODULES = _modules()


def _package(name: str) -> str:
    """The package a module's relative imports start from."""
    return name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The autoshard-relative module an ImportFrom names ('' = autoshard), or None outside."""
    if node.level:
        parts = _package(name).split(".") if _package(name) else []
        parts = parts[:len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))
    mod = node.module or ""
    if mod == "autoshard" or mod.startswith("autoshard."):
        return mod[len("autoshard."):] if mod != "autoshard" else ""
    return None


def _imports(name: str):
    """(target module, imported names or None, inside a function?, line) for each autoshard import
    in module `name`; a `from pkg import sub` of a submodule counts as importing the submodule."""
    tree = ast.parse(open(MODULES[name]).read())
    in_function = set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        nested = id(node) in in_function
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "autoshard" or a.name.startswith("autoshard."):
                    yield a.name[len("autoshard."):] if a.name != "autoshard" else "", None, nested, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, node)
            if base is None:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if sub in MODULES:
                    yield sub, None, nested, node.lineno
                else:
                    yield base, a.name, nested, node.lineno


def _ancestor(a: str, b: str) -> bool:
    """Whether package `b` contains module `a` (Python imports it first anyway)."""
    return b == "" or a.startswith(b + ".")


def _edges():
    for name in MODULES:
        for target, what, nested, line in _imports(name):
            if target != name and not _ancestor(name, target):
                yield name, target, what, nested, line


LAYER = {u: i for i, (_, units) in enumerate(LAYERS) for u in units}


def _unit(name: str) -> str:
    """The package (first folder) a module belongs to, or the top-level module itself."""
    first = name.partition(".")[0]
    return first if name == "" or "." in name or MODULES[name].endswith("__init__.py") else name


def test_every_module_has_a_layer():
    units = {_unit(m) for m in MODULES}
    missing = sorted(units - set(LAYER))
    stale = sorted(set(LAYER) - units)
    assert not missing, f"packages or modules with no layer in tests/test_imports.py LAYERS (place them): {missing}"
    assert not stale, f"LAYERS names packages or modules that do not exist: {stale}"


def test_no_import_loops():
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    g.add_edges_from((a, b) for a, b, *_ in _edges())
    loops = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not loops, f"modules that import each other in a loop: {loops}"


def test_imports_run_downward():
    bad = []
    for a, b, what, nested, line in _edges():
        ua, ub = _unit(a), _unit(b)
        if LAYER[ub] <= LAYER[ua]:
            continue
        if (ua, ub) in HAND_OVERS and nested:
            continue
        bad.append(f"{os.path.relpath(MODULES[a], os.path.dirname(ROOT))}:{line} ({LAYERS[LAYER[ua]][0]}) imports "
                   f"{b or 'autoshard'} ({LAYERS[LAYER[ub]][0]}), a layer above it")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    bad = []
    for name in MODULES:
        tree = ast.parse(open(MODULES[name]).read())
        aliases = {}          # local name -> autoshard module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (base := _absolute(name, node)) is not None:
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    if sub in MODULES:
                        aliases[a.asname or a.name] = sub
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{name}:{node.lineno} imports {base}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("autoshard.") and a.asname:
                        aliases[a.asname] = a.name[len("autoshard."):]
        for target in list(aliases.values()):
            if target.rpartition(".")[2].startswith("_") and target.rpartition(".")[2] != "__main__":
                bad.append(f"{name} imports the private module {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, complaint", [
    ("from ..api import parallelize\n", "imports api"),
    ("def f():\n    from ..views.draw import draw\n", "imports views.draw"),
    ("from ..planner import cost\n", "imports planner.cost"),
])
def test_the_check_catches_an_upward_import(tmp_path, monkeypatch, source, complaint):
    """The walker sees module-level and function-level imports, and a package's module importing
    a later stage (a check that cannot fail is none)."""
    path = tmp_path / "trace.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "capture.trace", str(path))
    with pytest.raises(AssertionError, match=complaint):
        test_imports_run_downward()


def test_the_folder_reads_as_the_pipeline():
    """Few modules at the top (what users call or import), one folder per stage, each folder's
    `__init__` saying in its docstring what the stage takes and what it hands on."""
    top = sorted(n for n, path in MODULES.items() if n and "." not in n and not path.endswith("__init__.py")
                 and n != "__main__")
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in autoshard/: {top}"
    for name, path in MODULES.items():
        if path.endswith("__init__.py") and name and "." not in name:
            doc = ast.get_docstring(ast.parse(open(path).read()))
            assert doc and "takes" in doc.lower() and "hands on" in doc.lower(), \
                f"autoshard/{name}/__init__.py: its docstring should say what the stage takes and hands on"


def test_no_module_is_too_long():
    long = {os.path.relpath(p, ROOT): n for p in MODULES.values() if (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"
