"""Give each rank's attention its grouped K/V heads back: `sdpa(q, k, v, enable_gqa=True)`.

Capture writes a grouped-query sdpa in its explicit form (`capture.normalize.ungroup_kv_heads`: K
and V unsqueezed, expanded over each group and reshaped to q's heads) so that the planner's rules
see which query heads read which K/V heads. Run as written, that form copies K and V once per
query head and saves the copies for backward, whose gradients backward sums again. Where the
rewritten graph still feeds the sdpa straight from that form (no collective or cut in between:
the heads are split alike, or not at all), the local K and V are the local groups and the call is
grouped again: the same values, K and V held once.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture.normalize import UNGROUPED, repeat_chain
from .local_ops import local_size

aten = torch.ops.aten
# what the repeat's sizes are computed with: erased with it when nothing else reads them
_SIZE_OPS = {aten.unsqueeze.default, aten.expand.default, aten.sym_size.int, local_size, operator.mul,
             operator.floordiv, operator.add, operator.sub}


def _erase_unused(graph: fx.Graph, node: fx.Node, gone: set) -> None:
    """Erase `node` and then, recursively, the views and size computations only it read (`gone`:
    the nodes erased so far, which two readers may share)."""
    if node.users or node in gone:
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    gone.add(node)
    for a in inputs:
        if a.op == "call_function" and a.target in _SIZE_OPS:
            _erase_unused(graph, a, gone)


def regroup_kv_heads(gm: fx.GraphModule) -> int:
    """Call each marked sdpa (a function or autoshard's attention module standing for it) with its
    K and V as they were before the repeat, `enable_gqa=True`; returns how many."""
    done = 0
    for n in list(gm.graph.nodes):
        if not n.meta.get(UNGROUPED) or n.op not in ("call_function", "call_module") or len(n.args) < 3:
            continue
        chains = [repeat_chain(a) for a in n.args[1:3]]
        if None in chains:
            continue
        k, v = (c[-1] for c in chains)
        old = n.args[1:3]
        n.args = (n.args[0], k, v, *n.args[3:])
        n.kwargs = {**n.kwargs, "enable_gqa": True}
        gone = set()
        for r in old:
            _erase_unused(gm.graph, r, gone)
        done += 1
    return done
