"""Alike nodes and tensors (the same op in every block of a stack) share work: the rules' strategies
(`structure`: equal keys, equal strategies), and a class number (`Classes`) by which the search's
memos (`State._best`, `Problem.tensor_cost`) answer for all of them at once, so an 80-layer stack
costs little more to search than its first layers. A class holds all that those answers read of a
node or tensor but its placements, so equal classes compute equal answers."""
from __future__ import annotations

import torch
import torch.fx as fx

from ..capture.dynamic import DYNAMIC
from .rules.registry import regroup_readers


class Classes:
    """Class numbers of a Problem's nodes (`node`) and tensors (`tensor`), made on first use."""

    def __init__(self, prob):
        self.prob = prob
        self.nodes: list = [None] * len(prob.nodes)
        self.tensors: list = [None] * len(prob.nodes)
        self.ids: dict = {}

    def node(self, i: int) -> int:
        """Node i's class for its locally cheapest strategy: the same strategies (the rules' shared
        list) and costs, an output of the same kind, and inputs alike (`_input`)."""
        c = self.nodes[i]
        if c is None:
            prob = self.prob
            key = (id(prob.strats[i]), tuple(prob.node_cost[i]), isinstance(prob.val[i], torch.Tensor),
                   tuple(self._input(j) for j in prob.ins[i]))
            c = self.nodes[i] = self.ids.setdefault(key, len(self.ids))
        return c

    def tensor(self, j: int) -> int:
        """Tensor j's class for its communication: alike tensors read by the same strategies in the
        same slots; for a tensor with views, its views alike and in the same order."""
        c = self.tensors[j]
        if c is None:
            prob = self.prob
            members = prob.members.get(j)
            if members is None:
                key = self._readers(j)
            else:
                pos = {m: k for k, m in enumerate(members)}
                key = ("views", tuple((self._readers(m), pos.get(prob.view_parent[m])) for m in members))
            c = self.tensors[j] = self.ids.setdefault(key, len(self.ids))
        return c

    def _readers(self, j: int) -> tuple:
        prob = self.prob
        return (self._input(j), j in prob.held,
                tuple((id(prob.strats[c]), tuple(k for k, x in enumerate(prob.ins[c]) if x == j), prob.kind[c])
                      for c in prob.users[j]))

    def _input(self, j: int) -> tuple:
        """What an edge's cost and `Problem.whole_anyway` read of tensor j, but its placements."""
        prob = self.prob
        v = prob.val[j]
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        return (prob.nbytes[j], prob.needs_grad[j], prob.kind[j], shape, prob.nodes[j].meta.get(DYNAMIC),
                prob.held_inputs.get(j), j in prob.projected, j in prob.cache_chain,
                tuple((a in prob.held, tuple(prob.val[a].shape)) for a in prob.returned_above[j]))


def structure(n: fx.Node, module) -> tuple | None:
    """What a rule can see of a node, with inputs replaced by (position, shape, dtype): equal
    keys give equal strategies (they refer to inputs by position). None when not hashable."""
    inputs = n.all_input_nodes

    def norm(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return ("in", inputs.index(a), tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__,
                    str(v.dtype) if isinstance(v, torch.Tensor) else None, a.meta.get(DYNAMIC))
        if isinstance(a, (tuple, list)):
            return tuple(norm(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, norm(x)) for k, x in a.items()))
        return a if isinstance(a, (int, float, str, bool, type(None), torch.dtype, slice)) else repr(a)

    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        out = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in v)
    else:
        out = tuple(v.shape) if isinstance(v, torch.Tensor) else None
    target = type(module) if module is not None else n.target
    extra = module.extra_repr() if module is not None else None
    try:
        key = (n.op, target, extra, norm(n.args), norm(n.kwargs), out, n.meta.get(DYNAMIC),
               regroup_readers(n))     # (`NodeInfo.group_shards` reads them)
        hash(key)
    except TypeError:
        return None
    return key
