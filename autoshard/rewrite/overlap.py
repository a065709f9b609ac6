"""Fuse a collective with the linear layers that read it into one autograd function, standing where
the first layer stood.

`fuse_column_linears`: each copy_to into `runtime.overlap.column_linears` (parallelize(...,
overlap=True)): Megatron's input-gradient all-reduce overlapped with the weight gradients, only
where every reader of the copy is a linear layer taking it as its input, with weights and biases
the graph holds as tensors (`get_attr`). `fuse_gathered_linears`: each all-gather of a
sequence-parallel input the plan gathers again in backward into `runtime.sequence.gathered_linears`
(the layers save the rank's tokens only)."""
from __future__ import annotations

import operator

import torch.fx as fx

from ..capture.repeats import STACK
from ..errors import ShardingError
from ..runtime import collectives as C
from ..runtime.overlap import column_linears
from ..runtime.sequence import column_readers, gathered_linears, linear_parts


def _linear_parts(n: fx.Node, x: fx.Node):
    """(weight, bias) of an F.linear / aten.linear node reading `x` as its input, else None."""
    found = linear_parts(n, x)
    return found[:2] if found is not None and found[2] == "linear" else None


def _fuse(graph: fx.Graph, node: fx.Node, readers, parts, fn, args, kwargs) -> None:
    """Replace `node` and its `readers` (linear layers of `parts`' (weight, bias)) by one call of
    `fn(*args, w1, b1, w2, b2, ..., **kwargs)` at the first layer, its items read in their place."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(readers, key=order.__getitem__)
    for w, b in parts:                          # tensors first: the fused call stands at the first layer
        for t in (w, b):
            if t is not None and order[t] > order[first]:
                first.prepend(t)
    with graph.inserting_before(first):
        call = graph.call_function(fn, (*args, *[t for wb in parts for t in wb]), kwargs)
        if STACK in first.meta:
            call.meta[STACK] = first.meta[STACK]          # in the layers' block (autoshard.rewrite.blocks)
        for k, r in enumerate(readers):
            item = graph.call_function(operator.getitem, (call, k))
            item.meta = dict(r.meta)
            r.replace_all_uses_with(item)
    for r in readers:
        graph.erase_node(r)
    graph.erase_node(node)


def fuse_column_linears(gm: fx.GraphModule) -> int:
    """Fuse every copy_to whose readers are all linear layers (`_linear_parts`); how many."""
    graph, fused = gm.graph, 0
    for copy in [n for n in graph.nodes if n.op == "call_function" and n.target is C.copy_to]:
        readers = list(copy.users)
        parts = [_linear_parts(r, copy) for r in readers]
        if not readers or any(p is None for p in parts):
            continue
        _fuse(graph, copy, readers, parts, column_linears, (copy.args[0],), {"group": copy.kwargs.get("group")})
        fused += 1
    return fused


def fuse_gathered_linears(gm: fx.GraphModule, gathers) -> None:
    """Fuse each of `gathers` (collectives.all_gather nodes the plan gathers again in backward) with
    its readers, linear layers by the planner's test (`runtime.sequence.column_readers`)."""
    for g in gathers:
        found = column_readers(g, g.users, g.args[0].meta.get("val"))       # (the gathered tensor's whole value)
        if found is None:
            raise ShardingError(f"the plan gathers {g.args[0].name} again in backward for linear layers, but its "
                                f"readers are {[r.format_node() for r in g.users]}")
        layers, parts, flat = found
        view = next(iter(g.users)) if flat else None
        kwargs = {k: v for k, v in g.kwargs.items() if k in ("group", "size", "unit", "parts", "nest")}
        _fuse(gm.graph, view or g, layers, [(w, b) for w, b, _ in parts], gathered_linears, (g.args[0], g.args[1]),
              {**kwargs, "forms": tuple(f for _, _, f in parts), "flat": flat})
        if view is not None:
            gm.graph.erase_node(g)
