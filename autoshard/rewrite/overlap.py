"""Fuse each copy_to with the linear layers that read it into `runtime.overlap.column_linears`
(parallelize(..., overlap=True)): Megatron's input-gradient all-reduce overlapped with the
weight gradients. Only where the graph allows it: every reader of the copy is a linear layer
taking it as its input, with weights and biases the graph holds as tensors (`get_attr`), so that
the fused call can stand where the first layer stood."""
from __future__ import annotations

import operator

import torch.fx as fx

from ..capture.repeats import STACK
from ..runtime import collectives as C
from ..runtime.overlap import column_linears
from .local_ops import LINEAR_OPS, target_of


def _linear_parts(n: fx.Node, x: fx.Node):
    """(weight, bias) of a linear node reading `x` as its input, else None."""
    if n.op != "call_function" or target_of(n) not in LINEAR_OPS or not n.args or n.args[0] is not x:
        return None
    weight = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    tensors = [t for t in (weight, bias) if t is not None]
    if weight is None or not all(isinstance(t, fx.Node) and t.op == "get_attr" for t in tensors):
        return None
    return weight, bias


def fuse_column_linears(gm: fx.GraphModule) -> int:
    """Fuse every copy_to whose readers are all linear layers (`_linear_parts`); how many."""
    graph, fused = gm.graph, 0
    for copy in [n for n in graph.nodes if n.op == "call_function" and n.target is C.copy_to]:
        readers = list(copy.users)
        parts = [_linear_parts(r, copy) for r in readers]
        if not readers or any(p is None for p in parts):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        readers.sort(key=order.__getitem__)
        parts = [_linear_parts(r, copy) for r in readers]
        first = readers[0]
        for w, b in parts:                          # tensors first: the fused call stands at the first layer
            for t in (w, b):
                if t is not None and order[t] > order[first]:
                    first.prepend(t)
        with graph.inserting_before(first):
            flat = [t for wb in parts for t in wb]
            call = graph.call_function(column_linears, (copy.args[0], *flat), {"group": copy.kwargs.get("group")})
            if STACK in first.meta:
                call.meta[STACK] = first.meta[STACK]          # in the layers' block (autoshard.rewrite.blocks)
            for k, r in enumerate(readers):
                item = graph.call_function(operator.getitem, (call, k))
                item.meta = dict(r.meta)
                r.replace_all_uses_with(item)
        for r in readers:
            graph.erase_node(r)
        graph.erase_node(copy)
        fused += 1
    return fused
