"""autoshard's import graph runs one way: from the entry points down to data, no loops.

Every module of `autoshard/` is read with `ast` (nothing is imported), every import of an
autoshard module is an edge, function-level imports included. The layers below are the
package's map (docs/design.md shows the same one): a module may import from its own layer and
the layers under it, never from one above; the only exceptions are the Plan's hand-overs to the
views that draw and print it, made inside its methods. No module uses another's private name.
"""
from __future__ import annotations

import ast
import os

import networkx as nx
import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autoshard")

# Bottom to top. A module may import from its own layer and any layer before it.
LAYERS = [
    ("data", ["errors", "placements", "pieces"]),
    ("group registry", ["groups"]),
    ("random streams", ["rng"]),
    ("collectives", ["collectives"]),
    ("the Plan (frozen data)", ["plan"]),
    ("TorchShard attributes and state dicts", ["state_dict"]),
    ("TorchShard's layers and names", ["nn", "nn.common", "nn.cross_entropy", "nn.functional", "nn.init",
                                       "nn.layers", "nn.loss", "nn.norm", "nn.dropout", "distributed"]),
    ("capture", ["shapes", "repeats", "normalize", "capture"]),
    ("rules", ["rules", "rules.registry", "rules.attention", "rules.conv", "rules.linear", "rules.loss",
               "rules.norm", "rules.pointwise", "rules.shape"]),
    ("cost", ["cost"]),
    ("problem", ["decisions", "problem"]),
    ("search and planner", ["assignment", "search", "planner"]),
    ("rewrite", ["verify", "local_ops", "rewrite", "blocks"]),
    ("call signatures", ["signatures"]),
    ("loading and checkpoints", ["loading", "checkpoint", "checkpoint.checksums", "checkpoint.reader", "checkpoint.writer",
                                 "checkpoint.verify", "checkpoint.state",
                                 "checkpoint.storage", "hf"]),
    ("views of a plan", ["report", "graph", "draw"]),
    ("entry points", ["api", "cli", "demo", "__main__", ""]),
]
# (importer, imported): allowed upward, and only from inside a function (a lazy hand-over).
HAND_OVERS = {("plan", "report"), ("plan", "graph"), ("plan", "draw")}


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


LAYER = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def test_every_module_has_a_layer():
    missing = sorted(set(MODULES) - set(LAYER))
    stale = sorted(set(LAYER) - set(MODULES))
    assert not missing, f"modules with no layer in tests/test_imports.py LAYERS (place them): {missing}"
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_import_loops():
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    g.add_edges_from((a, b) for a, b, *_ in _edges())
    loops = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not loops, f"modules that import each other in a loop: {loops}"


def test_imports_run_downward():
    bad = []
    for a, b, what, nested, line in _edges():
        if LAYER[b] <= LAYER[a]:
            continue
        if (a, b) in HAND_OVERS and nested:
            continue
        bad.append(f"autoshard/{a.replace('.', '/')}.py:{line} ({LAYERS[LAYER[a]][0]}) imports "
                   f"{b or 'autoshard'} ({LAYERS[LAYER[b]][0]}), a layer above it")
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
    ("from .api import parallelize\n", "imports api"),
    ("def f():\n    from .draw import draw\n", "imports draw"),
])
def test_the_check_catches_an_upward_import(tmp_path, monkeypatch, source, complaint):
    """The walker sees module-level and function-level imports (a check that cannot fail is none)."""
    path = tmp_path / "capture.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "capture", str(path))
    with pytest.raises(AssertionError, match=complaint):
        test_imports_run_downward()
