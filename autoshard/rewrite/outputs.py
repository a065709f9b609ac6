"""What the graph's output and the views of gathered tensors take from the rewrite.

A view of a tensor made whole anyway (`Redistribution.via`: a reshape, `contiguous`, a `to` of the
same dtype) is made whole by applying its view ops again to that tensor made whole (`view_of`), so
the pair moves its bytes once; with outputs="sharded", each tensor the output returns split becomes
a DTensor over the group (`wrap_outputs`: no collective).
"""
from __future__ import annotations

import torch.fx as fx

from ..runtime import collectives as C
from ..runtime.placements import Shard


class Outputs:
    """Mixin of `rewriter.Rewriter` (it uses the rewriter's plan, graph, `old`, `call`, `key` and
    `uneven_size`)."""

    def view_of(self, whole: fx.Node, top: str, name: str, nodes: dict) -> fx.Node:
        """Tensor `name` whole, from `whole` (its view ancestor `top` whole): the view ops from
        `top` down to it (as captured) copied onto `whole`, with their captured (global) sizes."""
        chain, n = [], self.old[name]
        while n.name != top:
            chain.append(nodes[n.name])
            n = n.args[0]
        out = whole
        for n in reversed(chain):
            out_node = self.graph.node_copy(n, lambda a: a)
            out_node.args = (out, *n.args[1:])
            out = out_node
        return out

    def wrap_outputs(self):
        """outputs="sharded": each tensor the output returns split (an ordinary Shard, which the
        plan left as it is) becomes a DTensor over the group (`to_dtensor`: no collective)."""
        if self.plan.outputs != "sharded":
            return
        out = next(n for n in self.graph.nodes if n.op == "output")
        nodes = {n.name: n for n in self.graph.nodes}
        for name, pl in self.plan.output_placements.items():
            x = nodes.get(name)
            if isinstance(pl, Shard) and x is not None and x in out.all_input_nodes:
                size = self.uneven_size(name, pl)
                with self.graph.inserting_before(out):
                    dt = self.call(C.to_dtensor, (x, pl.dim), {"group": self.key, **({"size": size} if size else {})},
                                   name=f"{name}_dtensor")
                out.replace_input_with(x, dt)
