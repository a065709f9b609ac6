"""Graph inputs that come in as each rank holds them: a key/value cache split by heads.

A decode step takes the cache its previous step returned; each rank keeps only its own heads of
it (autoshard.io.generate). The planner sees such an input as a whole tensor, which costs nothing
to cut to the heads its consumers need (a `scatter_to` / `slice_partial` / `slice_held` slice,
no collective); `localize` takes those slices out of the rank's graph, so the input is read as
the piece the rank already holds, and reports each input's placement (what the rank holds of
it). The rank's input check then expects that piece's local shape (`local_check`), in place of
torch.export's guards, which would check the whole shape.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import ShardingError
from ..runtime import collectives as C
from ..runtime.placements import Replicate, Shard, local_shape
from .rewriter import InputCheck

_SLICES = (C.scatter_to, C.slice_partial, C.slice_held)


def _slice_placement(plan, name: str):
    """The placement the plan cuts input `name` to (its Replicate -> Shard redistributions: one)."""
    found = {r.dst for r in plan.redistributions if r.node == name and isinstance(r.src, Replicate)}
    if len(found) > 1:
        raise ShardingError(f"input {name!r} is read under several placements {sorted(map(str, found))}; a held "
                            "input must be read as one piece")
    return next(iter(found), Replicate())


def localize(gm: fx.GraphModule, plan, names) -> dict:
    """Take the slices of the placeholders `names` out of rank module `gm` (they come in as the
    rank's pieces); returns {name: placement held}. Any other reader of such an input, or one
    that reads its split dim's size, is an error naming it (it would read a whole tensor)."""
    held = {}
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in names:
        x = placeholders[name]
        pl = _slice_placement(plan, name)
        held[name] = pl
        for user in list(x.users):
            if user.op == "call_function" and user.target in _SLICES:
                user.replace_all_uses_with(x)
                gm.graph.erase_node(user)
            elif _guards(gm, user):          # export's shape guards would see the piece: the input check does it
                gm.graph.erase_node(user)
            elif isinstance(pl, Shard) and _reads_size(user, pl.dim):
                raise ShardingError(f"input {name!r} is held split on dim {pl.dim}, but {user.name} reads its size "
                                    "there")
            elif isinstance(pl, Shard) and not _reads_size(user, None):
                raise ShardingError(f"input {name!r} is held as {pl}, but {user.name} ({user.target}) reads it whole")
    gm.graph.lint()
    gm.recompile()
    return held


def _guards(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether `n` calls torch.export's guard function (it checks the inputs' whole shapes)."""
    return n.op == "call_module" and not n.users and type(gm.get_submodule(n.target)).__name__ == "GuardsFn"


def _reads_size(n: fx.Node, dim) -> bool:
    """Whether `n` reads only a size of its input (dim `dim`, or any dim when None)."""
    if n.op != "call_function":
        return False
    if n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.size.int):
        return dim is None or n.args[1] == dim
    if n.target is operator.getattr or getattr(n.target, "__name__", "") == "size":
        return dim is None
    return False


def local_check(check: InputCheck, held: dict, p: int, rank: int) -> InputCheck:
    """`check` with each held input expected at the shape of its rank's piece."""
    specs = []
    for spec in check.specs:
        if spec is not None and spec[0] in held and isinstance(held[spec[0]], Shard):
            name, shape, free = spec
            spec = (name, tuple(local_shape(shape, held[name], p, rank)), free)
        specs.append(spec)
    return InputCheck(check.tracer, tuple(specs), check.placeholders)
