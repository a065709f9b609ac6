"""A Plan as a networkx.DiGraph: the captured graph with the plan's decisions on it.

One node per captured-graph node (keyed by its fx name), one edge per (input, user) pair, so a
plan can be queried with networkx: paths between two modules, the heaviest edges, the nodes
whose placement differs between two plans.

Node attributes: `kind` (input / param / buffer / op / select / output), `fx_op` and `target`
(the fx node's), `op` (the op's name, as the report prints it), `module`, `strategy`, `dim`
(TorchShard dim), `placement` (of the node's output: a parameter's layout, an op's output
placement; a tuple for tuple outputs; None for non-tensors), `shape`, `dtype`, `local_shape`
(what one rank holds), `bytes` and `local_bytes` (full and per-rank bytes of the output
tensor), `comm` (collectives the op runs itself, e.g. a row-parallel matmul's all-reduce:
((kind, full bytes), ...)) and `comm_bytes` (their ring bytes per rank; also counted on the
node's first out-edge, see below).

Edge attributes (u -> v: v reads u's output): `redistributions` (the plan's Redistribution
entries that feed v from u), `src` / `dst` / `grad` placements (the tensor as held, as v reads
it, the gradient v sends back), `forward` / `backward` collective kinds, `collectives` (a list of
(direction, kind, ring bytes per rank, origin) with origin "redistribution" or "op"), and
`bytes`. Every collective is counted once: a redistribution read by several users on the edge to
the first of them (the others have `shared=True`), an op's own collectives on its first
out-edge. So the edges' `bytes` sum to `plan.comm_bytes`.

Graph attributes: world_size, comm_bytes, comm_by_kind, params_total, params_per_rank,
param_bytes_per_rank, step_time, tracer, search.
"""
from __future__ import annotations

import math

import torch

from ..runtime.counters import ring_bytes
from ..runtime.placements import Partial, Replicate, Shard, maybe_local_shape


def _tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _node_kind(n, plan) -> str:
    if n.op == "placeholder":
        return "input"
    if n.op == "output":
        return "output"
    if n.op == "get_attr":
        return "param" if n.target in plan.layouts else "buffer"
    if n.name in plan.nodes:
        return "op"
    return "select"


def to_networkx(plan):
    """The captured graph of `plan` as a networkx.DiGraph (see the module docstring)."""
    import networkx as nx

    p, gm = plan.world_size, plan.graph_module
    G = nx.DiGraph(world_size=p, comm_bytes=plan.comm_bytes, comm_by_kind=dict(plan.comm_by_kind),
                   params_total=plan.params_total, params_per_rank=plan.params_per_rank,
                   param_bytes_per_rank=plan.memory["parameters"], step_time=plan.step_time,
                   tracer=plan.tracer, search=plan.search)
    place: dict[str, object] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        kind = _node_kind(n, plan)
        d = plan.nodes.get(n.name)
        attrs = dict(kind=kind, fx_op=n.op, target=n.target if isinstance(n.target, str) else "",
                     op=d.op if d else kind, module=d.module if d else "", strategy=d.strategy if d else "",
                     dim=d.dim if d else None, comm=tuple(d.comm) if d else (), comm_bytes=0.0)
        if kind == "input" or kind == "buffer":
            pl = Replicate() if _tensor(v) else None
        elif kind == "param":
            pl = plan.layouts[n.target]
            attrs.update(op="parameter", module=n.target.rpartition(".")[0])
        elif kind == "op":
            pl = d.output
        elif kind == "select":
            src = place.get(n.all_input_nodes[0].name) if n.all_input_nodes else None
            k = n.args[1] if len(n.args) > 1 else None
            pl = src[k] if isinstance(src, tuple) and isinstance(k, int) else (Replicate() if _tensor(v) else None)
            attrs["op"] = "getitem"
        else:
            pl = None
        place[n.name] = pl
        attrs["placement"] = pl
        if _tensor(v):
            ls = maybe_local_shape(v.shape, pl, p) if isinstance(pl, (Replicate, Shard, Partial)) else tuple(v.shape)
            attrs.update(shape=tuple(v.shape), dtype=v.dtype, local_shape=ls,
                         bytes=v.numel() * v.element_size(),
                         local_bytes=math.prod(ls) * v.element_size() if ls is not None else None)
        else:
            attrs.update(shape=None, dtype=None, local_shape=None, bytes=0, local_bytes=0)
        attrs["comm_bytes"] = sum(ring_bytes(k, nb, p) for k, nb in attrs["comm"])
        G.add_node(n.name, **attrs)
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            G.add_edge(a.name, n.name, redistributions=(), src=place[a.name], dst=place[a.name], grad=None,
                       forward=(), backward=(), collectives=[], bytes=0.0, shared=False)
    for r in plan.redistributions:
        for i, c in enumerate(r.consumers):
            e = G.edges[r.node, c]
            e["redistributions"] += (r,)
            e["dst"], e["grad"] = r.dst, r.grad
            e["forward"] += r.forward
            e["backward"] += r.backward
            if i:
                e["shared"] = True
                continue
            for direction, kinds in (("forward", r.forward), ("backward", r.backward)):
                for k in kinds:
                    e["collectives"].append((direction, k, ring_bytes(k, r.nbytes, p), "redistribution"))
            e["bytes"] += r.ring_bytes(p)
    for name, d in plan.nodes.items():
        if d.comm:
            out = next(iter(G.successors(name)), None)
            if out is None:          # an op nobody reads: its collectives stay on the node
                continue
            e = G.edges[name, out]
            e["collectives"] += [("op", k, ring_bytes(k, nb, p), "op") for k, nb in d.comm]
            e["bytes"] += G.nodes[name]["comm_bytes"]
    return G
