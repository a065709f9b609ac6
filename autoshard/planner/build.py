"""Planning a captured graph: Problem -> search -> Plan (beside the search, below the entry points).

`plan_graph(gm, p, cost)` builds the Problem of a graph whose nodes carry shapes, runs the
search (greedy, or exact for tests and benchmarks; with a memory budget, the fastest plan whose
predicted peak fits: `budget`), and `build_plan` freezes the chosen State into a Plan.
"""
from __future__ import annotations

import functools

import math
import operator
import time
from types import MappingProxyType

import torch
import torch.fx as fx

from ..capture.dynamic import dynamic_dims
from ..capture.ops import sliced_dim, sliced_range
from ..errors import ShardingError
from ..plan import Lazy, NodeDecision, Plan, Redistribution, check_outputs
from ..runtime.counters import ring_bytes
from ..runtime.placements import Replicate, Shard, local_numel, padded, splits
from ..runtime.sequence import REGATHERED
from . import search as _search
from . import sequence as _sequence
from .cost import CostModel, flops
from .decisions import module_of
from .budget import fit_budget, least_comm, sequence_twin
from .memory import memory_of
from .settle import settle_splits
from .rules.registry import PARALLEL_LAYERS, family_of
from .rules.shape import view_groups


def chunk_candidates(gm: fx.GraphModule) -> tuple:
    """Numbers of equal pieces tensors are split into (a fused q/k/v gives 3) or joined from (cat)."""
    ks = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and n.target in (torch.cat, torch.concat, torch.ops.aten.cat.default):
            pieces = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            if len(pieces) > 1:
                ks.add(len(pieces))          # a cat of equal shards is a strided shard of that many
            continue
        if n.op == "call_function" and n.target in (torch.ops.aten.slice.Tensor, operator.getitem):
            src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
            cut = sliced_dim(n, src.dim()) if isinstance(src, torch.Tensor) and isinstance(v, torch.Tensor) else None
            if cut is not None and v.shape[cut[0]] and src.shape[cut[0]] % v.shape[cut[0]] == 0 \
                    and v.shape[cut[0]] < src.shape[cut[0]]:
                ks.add(src.shape[cut[0]] // v.shape[cut[0]])     # a fused tensor sliced into equal parts
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if n.op == "output" or not any(w in name for w in ("split", "chunk")):
            continue                 # only splits unfuse (not a model's outputs, not (cos, sin))
        if isinstance(v, (tuple, list)) and len(v) > 1 and all(isinstance(t, torch.Tensor) for t in v):
            if len({(tuple(t.shape), t.dtype) for t in v}) == 1:     # not (values, indices), (out, mask)
                ks.add(len(v))
    return tuple(sorted(ks))


def part_candidates(gm: fx.GraphModule) -> tuple:
    """Sizes of the unequal parts a tensor's dim is cut into: by slices whose bounds cut it (a
    grouped q/k/v projection sliced into q, k and v: (q, kv, kv) features), or by a split with
    unequal sizes. A strided shard in blocks of those sizes keeps every part split."""
    cuts, found = {}, set()
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        if n.target in (torch.ops.aten.slice.Tensor, operator.getitem) and isinstance(n.args[0], fx.Node):
            src = n.args[0].meta.get("val")
            cut = sliced_range(n, src.shape) if isinstance(src, torch.Tensor) else None
            if cut is not None and 0 < cut[2] - cut[1] < src.shape[cut[0]]:
                cuts.setdefault((n.args[0], cut[0]), {0, int(src.shape[cut[0]])}).update(cut[1:])
        elif n.target in (torch.split, torch.ops.aten.split_with_sizes.default, "split") and len(n.args) > 1 \
                and isinstance(n.args[1], (list, tuple)) and all(isinstance(q, int) for q in n.args[1]):
            if len(set(n.args[1])) > 1:
                found.add(tuple(n.args[1]))
    for c in cuts.values():
        c = sorted(c)
        parts = tuple(b - a for a, b in zip(c, c[1:]))
        if len(parts) > 1 and len(set(parts)) > 1:
            found.add(parts)
    return tuple(sorted(found))


def unit_candidates(gm: fx.GraphModule) -> tuple:
    """Sizes of the units reshapes cut a dim into or merge from (a head's features: [.., 896] <->
    [.., 14, 64] gives 64): where those units do not divide over the ranks, a split in whole
    units (`Shard(d, unit=u)`) is what keeps heads whole."""
    us = set()
    for n in gm.graph.nodes:
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if n.op not in ("call_function", "call_method") or not any(w in name for w in ("view", "reshape", "flatten")):
            continue
        src = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], fx.Node) else None
        v = n.meta.get("val")
        if not isinstance(src, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue
        a, b = tuple(int(s) for s in src.shape), tuple(int(s) for s in v.shape)
        dyn_a, dyn_b = dynamic_dims(n.args[0]), dynamic_dims(n)
        for ga, gb in view_groups(a, b) or ():
            if any(d in dyn_a for d in ga) or any(d in dyn_b for d in gb):
                continue                 # batch x sequence flattened: tokens, not heads
            ia, ib = [d for d in ga if a[d] > 1], [d for d in gb if b[d] > 1]
            for one, many, sizes in ((ia, ib, b), (ib, ia, a)):
                if len(one) == 1 and len(many) > 1:
                    us.add(math.prod(sizes[d] for d in many[1:]))
    return tuple(sorted(us))


def plan_graph(gm: fx.GraphModule, world_size: int, cost: CostModel, *, pin=None, search="greedy",
               tracer="fx", notes=(), example=((), {}), layouts=None, outputs="full", blocks=(),
               held=frozenset(), sequence_parallel=False, inference=False, held_inputs=None,
               autocast=(), memory_with=False) -> Plan:
    """Plan an already captured graph (shapes in node.meta['val']); `layouts` (parameter name ->
    placement) fixes the parameters' layouts, leaving the search only the activations; with
    `cost.memory_budget`, the fastest plan that fits (`budget`; `blocks`: the modules it may recompute);
    `outputs` ("full" or "sharded") is what the graph's output needs of the tensors it returns;
    `held`: positions of the flat outputs returned as each rank holds them (no collective);
    `held_inputs`: {placeholder: placement} of inputs that come in as the ranks hold them (read so);
    `inference`: the graph runs without backward (a generation step), so rules may offer
    strategies whose gradients would not be placed right;
    `sequence_parallel` (True, False, or None: where a memory budget needs it) holds the stream
    between row and column layers split on tokens (`planner.sequence`); `autocast`: the
    torch.autocast the graph was captured under (it runs under it only); `memory_with`: the Plan
    keeps its Problem to answer `plan.memory_with(...)` (other recomputation, another device)."""
    check_outputs(outputs)
    if sequence_parallel not in (True, False, None):
        raise ValueError(f"sequence_parallel must be True, False or None, got {sequence_parallel!r}")
    t0 = time.perf_counter()
    budgeted = cost.memory_budget is not None and layouts is None

    def make(c, tokens=False, free_cuts=True, gathers=True):
        return _search.Problem(gm, world_size, c, chunk_candidates(gm), unit_candidates(gm), pins=pin or {},
                               outputs=outputs, part_candidates=part_candidates(gm), tokens=tokens, inference=inference,
                               free_cuts=free_cuts, gathers=gathers,
                               **({} if budgeted else {"layouts": layouts, "held": held, "held_inputs": held_inputs}))

    def searched(prob):
        if layouts is None and cost.memory_weight is None and search == "optimal":
            from . import optimal       # least_comm's bound on the state as a constraint of the program
            state = optimal.fastest_within(prob)
        elif layouts is None and cost.memory_weight is None:
            state = least_comm(prob, lambda pr: _run(pr, search))
        else:             # (a price, or the layouts of a plan made: settled as `least_comm` settles)
            state = _run(prob, search)
            settle_splits(prob, state, {a for grp in prob.groups for a in grp.anchors})
        state.reduce_early()
        return state
    prob = make(cost)
    if not prob.param_obj:
        raise ShardingError(f"{type(gm).__name__} has no parameters: nothing to shard")
    checkpointed = ()
    if not budgeted:
        state = searched(prob)
        if inference and unserved(prob, state) is not None:
            # a K or V cut by heads for nothing (planner.inference) that a later op cannot read so
            # (a node-by-node choice cannot see it): searched again without such cuts
            prob = make(cost, free_cuts=False)
            state = searched(prob)
        if sequence_parallel is True:
            moved = sequence_twin(state, make(cost, tokens=True))
            if moved is None:
                # an embedding split on features and gathered at once (`State.gather_early`) leaves
                # the stream no token split at the same bytes (Cohere, OLMo): searched again without
                moved = sequence_twin(searched(make(cost, gathers=False)), make(cost, tokens=True, gathers=False))
            if moved is None:
                notes = (*notes, "sequence_parallel: no activation between row and column layers can be split on "
                                 "tokens at the same bytes; planned without")
            else:
                state, prob = moved, moved.prob
    else:
        state, prob, checkpointed = fit_budget(make, lambda pr: _run(pr, search), cost, blocks, sequence_parallel)
    seconds = time.perf_counter() - t0
    notes = list(notes) + _divisibility_notes(prob, world_size)
    if getattr(state, "solved", None) is not None:
        notes.append(state.solved.note())          # search="optimal": the solver's status, gap and time
    return build_plan(prob, state, tracer=tracer, search=search, seconds=seconds, notes=notes, example=example,
                      checkpointed=checkpointed, memory_now=layouts is None, autocast=autocast,
                      memory_with=memory_with)


def _searched(prob, search):
    if search == "optimal":
        from . import optimal           # the extra (scipy): only this search imports it
        return optimal.solve(prob)
    return _search.exact(prob) if search == "exact" else _search.greedy(prob)


def _run(prob, search):
    state = _searched(prob, search)
    state.reduce_early()
    return state


def _divisibility_notes(prob, p) -> list:
    notes = []
    grouped = {k for g in prob.groups for k in g.params}
    for key, obj in prob.param_obj.items():
        if key in grouped or obj.dim() < 2:
            continue
        consumers = [u for i, kk in prob.param_key.items() if kk == key for u in prob.users[i]]
        if any(prob.kind[c] == "op" for c in consumers):
            names = prob.param_names[key][0]
            if not any(splits(obj.shape, Shard(d), p) for d in range(obj.dim())):
                notes.append(f"{names} {list(obj.shape)} stays replicated: its dims do not divide by {p} "
                             f"without leaving a rank empty")
            elif any(s % p for s in obj.shape):
                notes.append(f"{names} {list(obj.shape)} stays replicated: its dims do not divide by {p}, and "
                             f"an op using it has no rule for shards of unequal sizes")
    return notes


def op_name(n: fx.Node, gm) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    if n.op == "call_method":
        return f".{n.target}"
    return getattr(n.target, "__name__", str(n.target))


def _parallel_layer(n: fx.Node) -> bool:
    """A linear / addmm / matmul / embedding / convolution op: a TorchShard parallel layer, listed
    in Plan.dims (None when it stays whole)."""
    return family_of(n) in PARALLEL_LAYERS


def unserved(prob, state) -> str | None:
    """What makes a searched plan unable to run, or None: a tensor that some op's strategy cannot
    read as it is held (no redistribution reaches the placement it needs: an infinite cost). Such
    a plan must never reach the rewrite. (The graph's output is not asked: it reads a held K/V
    cache of a multi-query model, `Rp`, at an infinite price the rewrite serves.)"""
    for r in range(len(prob.nodes)):
        if prob.root[r] != r or prob.tensor_cost(r, state.place, state.sidx) != _search.INF:
            continue
        for j in prob.members.get(r, (r,)):
            for c in prob.users[j]:
                if prob.kind[c] != "op" or not prob.strats[c]:
                    continue
                s = prob.strats[c][state.sidx[c]]
                for slot, k in enumerate(prob.ins[c]):
                    req = s.inputs[slot]
                    if k == j and req is not None and \
                            prob.edge_cost(j, state.place[j], req, s.grad(slot)) == _search.INF:
                        return (f"%{prob.nodes[j].name} (shape {list(prob.val[j].shape)}) is held as "
                                f"{state.place[j]}, and %{prob.nodes[c].name} ({s.name}) needs it as {req}, "
                                f"which no redistribution makes")
    return None


def build_plan(prob, state, *, tracer: str, search: str, seconds: float, notes=(), example=((), {}),
               checkpointed=(), memory_now=True, autocast=(), memory_with=False) -> Plan:
    """Freeze a search State into a Plan. Its memory is worked out now (`memory_now`: the Problem
    holds the model's own weights, which a plan must not keep alive) or on first use (the plans of
    other call signatures, captured on a meta copy: most are never asked)."""
    why = unserved(prob, state)
    if why is not None:
        raise ShardingError(f"no plan found that runs on {prob.p} ranks: {why}")
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
        nodes[n.name] = NodeDecision(n.name, op_name(n, prob.gm), s.name, s.output, s.inputs,
                                     tuple(s.grad(k) for k in range(len(s.inputs))), s.dim, s.comm,
                                     module_of(prob, i))
        for kind, nb in s.comm:
            count(kind, nb)
    regathered = _sequence.regathered(prob, state)   # gathered again in backward for linear layers
    for j, n in enumerate(prob.nodes):
        if not prob.nbytes[j]:
            continue
        for req, grad, fwd, bwd, consumers, via in prob.comms_of(j, state.place, state.sidx):
            if regathered.get(j) == tuple(consumers):
                bwd = REGATHERED
            if fwd or bwd or req != state.place[j]:       # a local split moves no bytes but must happen
                names = tuple(prob.nodes[c].name for c in consumers)
                # shards of unequal sizes travel padded to the largest (the search ignores those < p rows)
                shape, src = prob.val[j].shape, state.place[j]
                nbytes = max(padded(prob.nbytes[j], shape, pl, p) for pl in (src, req))
                r = Redistribution(n.name, src, req, grad, fwd, bwd, nbytes, names,
                                   None if via is None else prob.nodes[via].name)
                redists.append(r)
                for kind in fwd + bwd:
                    count(kind, r.nbytes)
    returned = {}                                   # how the graph's output returns each tensor it reads
    for i, n in enumerate(prob.nodes):
        if prob.kind[i] == "output":
            for j in prob.ins[i]:
                if isinstance(prob.val[j], torch.Tensor):
                    returned[prob.nodes[j].name] = prob.returned(state.place[j], prob.val[j].shape, j)
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
            per_rank += local_numel(obj.shape, pl, p)
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
            compute += prob.cost.compute_time(flops(n, s) * s.compute)
    memory = Lazy(lambda: memory_of(prob, state, checkpointed))
    if memory_now:
        memory()
    fingerprint = tuple(sorted((name, tuple(prob.param_obj[k].shape)) for k in prob.param_obj
                               for name in prob.param_names[k]))
    bad = set(prob.unsupported)
    unsupported = tuple(f"{n.name}: {op_name(n, prob.gm)}" for n in prob.nodes if n.name in bad)
    return Plan(
        world_size=p, tracer=tracer, nodes=MappingProxyType(nodes), redistributions=tuple(redists),
        layouts=MappingProxyType(layouts), dims=MappingProxyType(dims),
        comm_bytes=sum(v[1] for v in comm_kind.values()),
        comm_by_kind=MappingProxyType({k: (v[0], v[1]) for k, v in comm_kind.items()}),
        comm_time=comm_time, compute_time=compute, params_total=total, params_per_rank=per_rank,
        unsupported=unsupported, notes=tuple(notes), fingerprint=fingerprint, cost_model=prob.cost,
        search=search, search_seconds=seconds, objective=state.total, graph_module=prob.gm, example=example,
        outputs=prob.outputs, output_placements=MappingProxyType(returned),
        checkpointed=tuple(checkpointed), memory_model=memory, sequence_parallel=_sequence.split_ops(prob, state),
        autocast=tuple(autocast), memory_with=functools.partial(memory_of, prob, state) if memory_with else None)
