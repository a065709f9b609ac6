"""View classes: tensors that are views of one another, one tensor for communication.

An op in VIEW_LIKE whose output has its one tensor input's elements in the same (row-major)
order, dtype and device is a view of it (`view_parent`): applied to the input made whole, it gives
the output whole. A chain of such views is a class, named by its root (the first tensor); the
planner makes a class whole once and counts its costs on the root (`planner.problem`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops whose output is their one tensor input with the same elements in the same (row-major)
# order, dtype and device: a view of it for communication (applied to the input made whole,
# they give the output whole)
VIEW_LIKE = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.flatten, torch.Tensor.flatten,
             torch.Tensor.unflatten, torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze,
             torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.to, torch.Tensor.float,
             aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints, aten.unflatten.int,
             aten.contiguous.default, aten.clone.default, aten.alias.default, aten.to.dtype,
             aten.to.dtype_layout, aten._to_copy.default}


def view_parent(n: fx.Node) -> fx.Node | None:
    """The tensor `n` is a view of (VIEW_LIKE, one tensor input, same number of elements, dtype
    and device), or None."""
    if n.op not in ("call_function", "call_method"):
        return None
    target = getattr(torch.Tensor, n.target, None) if n.op == "call_method" else n.target
    if target not in VIEW_LIKE:
        return None
    tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(tensors) != 1 or not n.args or n.args[0] is not tensors[0]:
        return None
    v, src = n.meta.get("val"), tensors[0].meta.get("val")
    if not isinstance(v, torch.Tensor) or v.numel() != src.numel() or v.dtype != src.dtype or v.device != src.device:
        return None
    return tensors[0]


@dataclass(frozen=True)
class ViewClasses:
    """The view classes of a graph's nodes, by node index.

    parent: each node's view parent (None where it is no view); root: its class's root;
    members: root -> its class in topological order (classes of 2+ only); returned_above: per
    node, itself and its view ancestors that the graph's output reads (their placements decide
    whether the output makes the tensor whole anyway); reread: returned node -> the readers of its
    views, to re-decide when its placement changes."""

    parent: list
    root: list
    members: dict
    returned_above: list
    reread: dict

    @classmethod
    def of(cls, nodes: list, idx: dict, users: list, returned: set) -> "ViewClasses":
        parent, root, members = [None] * len(nodes), list(range(len(nodes))), {}
        for i, n in enumerate(nodes):
            p = view_parent(n)
            if p is not None:
                j = parent[i] = idx[p]
                root[i] = root[j]
                members.setdefault(root[j], [root[j]]).append(i)
        returned_above = []
        for j in range(len(nodes)):
            chain, a = [], j
            while a is not None:
                if a in returned:
                    chain.append(a)
                a = parent[a]
            returned_above.append(tuple(chain))
        reread: dict[int, set] = {}
        for j, chain in enumerate(returned_above):
            for a in chain:
                if a != j:
                    reread.setdefault(a, set()).update(users[j])
        return cls(parent, root, members, returned_above, reread)
