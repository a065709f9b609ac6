"""The Plan: the only thing the search hands to the rewriter and the report (frozen).

For every node: the strategy it runs and the placement it produces; for every tensor that
changes placement: one redistribution per distinct target, with its forward and backward
collectives; for every parameter name (tied aliases included): its layout; TorchShard dims per
module; predicted bytes and times.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch.fx as fx

from .cost import CostModel, ring_bytes
from .placements import Placement, Replicate, Shard
from .problem import _flops, module_of


@dataclass(frozen=True)
class NodeDecision:
    """How one node runs: its strategy, output placement, input requirements, TorchShard dim."""

    node: str
    op: str
    strategy: str
    output: Any
    inputs: tuple
    grads: tuple
    dim: int | None
    comm: tuple                  # collectives the op runs itself: (kind, full bytes)
    module: str = ""             # qualified name of the module that ran it (the key of Plan.dims)


@dataclass(frozen=True)
class Redistribution:
    """Tensor `node` goes from `src` to `dst` for `consumers`, which send back gradients placed
    as `grad`; `backward` includes the all-reduce of Partial gradients (Megatron's copy). Two
    entries for one (node, dst) share the forward collectives, listed on the first only."""

    node: str
    src: Placement
    dst: Placement
    grad: Placement
    forward: tuple
    backward: tuple
    nbytes: int
    consumers: tuple

    def ring_bytes(self, p: int) -> float:
        return sum(ring_bytes(k, self.nbytes, p) for k in self.forward + self.backward)


@dataclass(frozen=True)
class Plan:
    """A sharding plan for one model at one tensor-parallel degree."""

    world_size: int
    tracer: str
    nodes: Mapping[str, NodeDecision]
    redistributions: tuple
    layouts: Mapping[str, Placement]          # parameter name -> layout (every alias)
    dims: Mapping[str, int | None]            # module qualified name -> TorchShard dim
    comm_bytes: float                         # per rank per training step, forward + backward
    comm_by_kind: Mapping[str, tuple]         # kind -> (calls, bytes)
    comm_time: float
    compute_time: float
    params_total: int
    params_per_rank: int
    unsupported: tuple
    notes: tuple
    fingerprint: tuple                        # (name, shape) of every parameter: "made for this model"
    cost_model: CostModel
    search: str
    search_seconds: float
    objective: float
    graph_module: fx.GraphModule = field(compare=False, repr=False)
    example: tuple = field(compare=False, repr=False)

    @property
    def step_time(self) -> float:
        """Estimated seconds per training step (communication + compute, no overlap)."""
        return self.comm_time + self.compute_time

    def report(self) -> str:
        from .report import format_plan
        return format_plan(self)

    def __str__(self) -> str:
        return self.report()

    def to_networkx(self):
        """The captured graph with this plan's placements, bytes and collectives on its nodes and
        edges, as a networkx.DiGraph (autoshard.graph)."""
        from .graph import to_networkx
        return to_networkx(self)

    def draw(self, path, **options):
        """Write a picture of this plan to `path` (.svg or .png; needs matplotlib, the "draw"
        extra): repeated blocks folded, parameters colored by layout, collectives marked with
        their bytes (autoshard.draw)."""
        from .draw import draw
        return draw(self, path, **options)


def _op_name(n: fx.Node, gm) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    if n.op == "call_method":
        return f".{n.target}"
    return getattr(n.target, "__name__", str(n.target))


def _parallel_layer(n: fx.Node) -> bool:
    """A linear / addmm / matmul / embedding / convolution op: a TorchShard parallel layer, listed
    in Plan.dims (None when it stays whole)."""
    from .rules import conv, linear as L
    from .rules.registry import _RULES, op_key
    return n.op in ("call_function", "call_method") and \
        _RULES.get(op_key(n, {})) in (L._linear, L._addmm, L._matmul, L._embedding, L._aten_embedding, conv._conv)


def build_plan(prob, state, *, tracer: str, search: str, seconds: float, notes=(), example=((), {})) -> Plan:
    """Freeze a search State into a Plan."""
    p = prob.p
    nodes, redists = {}, []
    comm_kind: dict[str, list] = {}

    def count(kind, nb):
        c = comm_kind.setdefault(kind, [0, 0.0])
        c[0] += 1
        c[1] += ring_bytes(kind, nb, p)

    for i, n in enumerate(prob.nodes):
        if not prob.strats[i] or prob.kind[i] == "output":
            continue
        s = prob.strats[i][state.sidx[i]]
        nodes[n.name] = NodeDecision(n.name, _op_name(n, prob.gm), s.name, s.output, s.inputs,
                                     tuple(s.grad(k) for k in range(len(s.inputs))), s.dim, s.comm,
                                     module_of(prob, i))
        for kind, nb in s.comm:
            count(kind, nb)
    for j, n in enumerate(prob.nodes):
        if not prob.nbytes[j]:
            continue
        for req, grad, fwd, bwd, consumers in prob.tensor_comms(j, state.place[j], state.sidx):
            if fwd or bwd or req != state.place[j]:       # a local split moves no bytes but must happen
                names = tuple(prob.nodes[c].name for c in consumers)
                r = Redistribution(n.name, state.place[j], req, grad, fwd, bwd, prob.nbytes[j], names)
                redists.append(r)
                for kind in fwd + bwd:
                    count(kind, r.nbytes)
    layouts, total, per_rank, seen = {}, 0, 0, set()
    for key, obj in prob.param_obj.items():
        pl = state.placement_of_param(key)
        for name in prob.param_names[key]:
            layouts[name] = pl
    for name, obj in prob.gm.named_parameters(remove_duplicate=False):
        pl = layouts.setdefault(name, layouts.get(next(iter(prob.param_names.get(id(obj), [])), None), Replicate()))
        if id(obj) not in seen:       # parameters inside leaf modules (LayerNorm) count too
            seen.add(id(obj))
            total += obj.numel()
            per_rank += obj.numel() // p if isinstance(pl, Shard) else obj.numel()
    dims = {}
    for g, grp in enumerate(prob.groups):
        for c in grp.anchors:
            if any(x.dim is not None for x in prob.strats[c]):      # linear / embedding, not a norm
                dims.setdefault(module_of(prob, c), prob.strats[c][state.sidx[c]].dim)
    for i, n in enumerate(prob.nodes):               # a linear / embedding left whole (sizes do not divide)
        if prob.kind[i] == "op" and any(k in prob.param_key for k in prob.ins[i]) and _parallel_layer(n):
            dims.setdefault(module_of(prob, i), prob.strats[i][state.sidx[i]].dim)
    for i, n in enumerate(prob.nodes):               # losses and other ops with a TorchShard dim
        if prob.kind[i] == "op" and any(x.dim is not None for x in prob.strats[i]) and \
                not any(k in prob.param_key for k in prob.ins[i]):
            dims.setdefault(module_of(prob, i), prob.strats[i][state.sidx[i]].dim)
    comm_time = sum(prob.cost.comm_time(k, r.nbytes, p) for r in redists for k in r.forward + r.backward)
    comm_time += sum(prob.cost.comm_time(k, nb, p) for d in nodes.values() for k, nb in d.comm)
    compute = 0.0
    for i, n in enumerate(prob.nodes):
        if prob.strats[i] and prob.kind[i] == "op":
            s = prob.strats[i][state.sidx[i]]
            compute += prob.cost.compute_time(_flops(n, s) * s.compute)
    fingerprint = tuple(sorted((name, tuple(prob.param_obj[k].shape)) for k in prob.param_obj
                               for name in prob.param_names[k]))
    bad = set(prob.unsupported)
    unsupported = tuple(f"{n.name}: {_op_name(n, prob.gm)}" for n in prob.nodes if n.name in bad)
    return Plan(
        world_size=p, tracer=tracer, nodes=MappingProxyType(nodes), redistributions=tuple(redists),
        layouts=MappingProxyType(layouts), dims=MappingProxyType(dims),
        comm_bytes=sum(v[1] for v in comm_kind.values()),
        comm_by_kind=MappingProxyType({k: (v[0], v[1]) for k, v in comm_kind.items()}),
        comm_time=comm_time, compute_time=compute, params_total=total, params_per_rank=per_rank,
        unsupported=unsupported, notes=tuple(notes), fingerprint=fingerprint, cost_model=prob.cost,
        search=search, search_seconds=seconds, objective=state.total, graph_module=prob.gm, example=example)
