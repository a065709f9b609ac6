"""Computations written twice, made one node (`merge_duplicates`), a normal form of capture.

A pure op (no mutation, no random draw, not a module) on the same inputs in the same module is
one node. Cohere's LayerNorm computes `x - mean` once for the variance and once for its output;
its Partial input was made whole twice, one all-reduce per copy, and is now all-reduced once and
read by both. Nodes of different modules are not merged (alike layers' block graphs would differ),
nor a node an op may write into.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .repeats import module_paths

_PURE_NAMES = frozenset({
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "rsqrt", "sqrt", "exp", "mean", "sum", "to", "float",
    "view", "reshape", "transpose", "permute", "contiguous", "unsqueeze", "squeeze", "expand", "matmul",
    "softmax", "tanh", "sigmoid", "cos", "sin", "cat", "stack", "getitem", "type_as",
})


def _pure(n: fx.Node) -> bool:
    """Whether node n computes a value from its arguments alone: no mutation, no random draw, no
    aliasing op, not a module (a module may hold state: dropout)."""
    t = n.target
    if n.op == "call_method":
        return t in _PURE_NAMES
    if n.op != "call_function":
        return False
    if isinstance(t, torch._ops.OpOverload):
        return not t._schema.is_mutable and not ({torch.Tag.nondeterministic_seeded,
                                                  torch.Tag.maybe_aliasing_or_mutating} & set(t.tags))
    name = getattr(t, "__name__", None)
    return name in _PURE_NAMES and (t is getattr(operator, name, None) or t is getattr(torch, name, None))


_IN_PLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                                  operator.imatmul})


def _mutates(u: fx.Node) -> bool:
    """Whether node u may write into its inputs: a mutable aten op, an in-place method or function
    (`add_`, `x += y`), or a module (`nn.ReLU(inplace=True)`)."""
    t = u.target
    if u.op == "call_module":
        return True
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return t in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


def _frozen(a):
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *map(_frozen, a))
    if isinstance(a, dict):
        return ("dict", *sorted((k, _frozen(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice", _frozen(a.start), _frozen(a.stop), _frozen(a.step))
    return a


def merge_duplicates(gm: fx.GraphModule) -> int:
    """One node for each pure computation of tensors written twice on the same inputs: Cohere's
    LayerNorm computes `x - mean` once for the variance and again for its output. Two nodes
    made whole apart cost two collectives where the planner can make one whole and read it
    twice (a Partial stream all-reduced once a norm, as Megatron does). Values are the same; a
    node an op may write into is left alone (`_mutates`: it must stay a tensor of its own), and
    only nodes of one module merge (a layer reading another layer's node would make alike layers'
    block graphs differ: `rewrite.blocks`)."""
    seen: dict = {}
    merged = 0
    for n in list(gm.graph.nodes):
        if not _pure(n) or not n.all_input_nodes or not isinstance(n.meta.get("val"), torch.Tensor) or \
                any(_mutates(u) for u in n.users):
            continue
        key = (n.op, n.target, _frozen(n.args), _frozen(n.kwargs), tuple(module_paths(n)))
        try:
            other = seen.setdefault(key, n)
        except TypeError:                # an argument that cannot be compared (left alone)
            continue
        if other is not n:
            n.replace_all_uses_with(other)
            gm.graph.erase_node(n)
            merged += 1
    return merged
