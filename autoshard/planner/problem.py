"""The planning problem: a captured graph as arrays the search evaluates quickly.

Every node's strategies (from the rules, shared between identical nodes), costs of node
strategies, consumer edges and tensors (one redistribution per required placement, its
backward dual, one all-reduce of Partial gradients), which tensors carry a gradient, and the
decision groups (`decisions`: parameters that must take one layout together, pins applied).

A tensor and its views (reshapes, `contiguous`, a `to` of the same dtype: `aliases`) are
one tensor for communication: made whole for several consumers, it is made whole once (the
topmost one that needs it; the others re-apply their view ops to it), and their costs are
counted together, on the class's root. What the graph's output needs of a tensor follows
`outputs`: whole ("full"), or as it is when it is an ordinary shard ("sharded": returned as a
DTensor, no collective); the outputs at the positions `held` names are returned as each rank holds
them whatever `outputs` says (a key/value cache kept split by heads, autoshard.io.generate).
"""
from __future__ import annotations

import operator
from dataclasses import replace
import math

import torch
import torch.fx as fx
import torch.nn as nn

from ..capture.ops import is_loss
from ..capture.shapes import fetch_attr
from ..runtime.placements import (REPLICATE, Partial, Replicate, Shard, cover_cut, dtensor_boundaries, held_by_groups,
                                  held_by_readers, is_even, local_numel, shares)
from ..runtime.transitions import fused_backward, grad_fix, grad_of, partial_grad_edge, redistribute
from . import rules
from .aliases import ViewClasses
from .classes import Classes, structure
from .cost import CostModel, flops
from .decisions import decision_groups, fix_layouts
from .inference import cache_chain, free_cut, held_nodes, held_share, projected
from .rules.registry import NodeInfo, OpStrategy, group_sizes, reader_counts

INF = math.inf
# the weight of the largest rank's excess state over the ranks' mean in the memory term: small, so
# that a split in whole heads is priced by what it saves in communication, not by its largest rank
IMBALANCE = 0.01
aten = torch.ops.aten

def _tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if _tensor(v) else 0


class Problem:
    """A captured graph as arrays the search can evaluate quickly."""

    def __init__(self, gm: fx.GraphModule, world_size: int, cost: CostModel, chunk_candidates=(), unit_candidates=(),
                 pins: dict | None = None, layouts: dict | None = None, outputs: str = "full", part_candidates=(),
                 held: frozenset = frozenset(), tokens: bool = False, inference: bool = False,
                 held_inputs: dict | None = None, free_cuts: bool = True, gathers: bool = True):
        self.gm, self.p, self.cost, self.outputs = gm, world_size, cost, outputs
        self.gathers = gathers        # split outputs gathered at once where that pays (`State.gather_early`)
        self.tokens = tokens          # sequence parallelism: ops may split the token dim (planner.sequence)
        self.inference = inference    # no backward (a generation step): whole K and V cut by heads (`free_cut`)
        self.free_cuts = inference and free_cuts
        self.nodes = list(gm.graph.nodes)
        self.idx = {n: i for i, n in enumerate(self.nodes)}
        modules = dict(gm.named_modules())
        self.losses = [i for i, n in enumerate(self.nodes) if is_loss(n, modules)]    # cross entropies
        self.ins = [[self.idx[a] for a in n.all_input_nodes] for n in self.nodes]
        self.users: list[list[int]] = [[] for _ in self.nodes]
        for i, ins in enumerate(self.ins):
            for j in dict.fromkeys(ins):
                self.users[j].append(i)
        self.val = [n.meta.get("val") for n in self.nodes]
        self.nbytes = [_nbytes(v) for v in self.val]
        self.kind, self.strats, self.unsupported = [], [], []
        self.param_key: dict[int, int] = {}          # node index -> param key
        self.param_obj: dict[int, nn.Parameter] = {}
        self.param_names: dict[int, list] = {}
        memo: dict = {}           # identical nodes (every block of a stack) share their strategies
        replica_candidates = group_sizes(self.nodes, self.val, unit_candidates, part_candidates, world_size)
        cover_candidates = reader_counts(self.nodes, self.val, unit_candidates, world_size)
        for i, n in enumerate(self.nodes):
            self.strats.append([])
            if n.op == "placeholder":
                self.kind.append("input")
            elif n.op == "output":
                self.kind.append("output")
                self.strats[i] = [OpStrategy("output", None, tuple(REPLICATE if _tensor(self.val[j]) else None
                                                                   for j in self.ins[i]))]
            elif n.op == "get_attr":
                obj = fetch_attr(gm, n.target)
                if isinstance(obj, nn.Parameter):
                    self.kind.append("param")
                    self.param_key[i] = id(obj)
                    self.param_obj[id(obj)] = obj
                    self.param_names.setdefault(id(obj), []).append(n.target)
                else:
                    self.kind.append("buffer")
            elif n.op == "call_function" and n.target is operator.getitem and \
                    isinstance(self.val[self.ins[i][0]] if self.ins[i] else None, (tuple, list)):
                self.kind.append("select")
            else:
                self.kind.append("op")
                module = modules.get(n.target) if n.op == "call_module" else None
                key = structure(n, module)
                hit = memo.get(key) if key is not None else None
                if hit is None:
                    hit = rules.strategies(NodeInfo(n, world_size, module, tuple(chunk_candidates),
                                                    unit_candidates=tuple(unit_candidates),
                                                    part_candidates=tuple(part_candidates),
                                                    replica_candidates=replica_candidates,
                                                    cover_candidates=cover_candidates, tokens=tokens,
                                                    inference=inference))
                    if key is not None:
                        memo[key] = hit
                found, covered = hit
                self.strats[i] = found
                if not covered:
                    self.unsupported.append(n.name)
        for name, obj in gm.named_parameters(remove_duplicate=False):    # tied aliases (head.weight)
            if id(obj) in self.param_names and name not in self.param_names[id(obj)]:
                self.param_names[id(obj)].append(name)
        self.param_nodes: dict[int, list] = {}
        for i, key in self.param_key.items():
            self.param_nodes.setdefault(key, []).append(i)
        self.held = held_nodes(self.nodes, self.idx, held)    # node indices returned as they are held
        # inputs that come in as the ranks hold them (a decode step's cache, as the prefill returned
        # it): ops read them in that placement only (`assignment.State`)
        held_inputs = held_inputs or {}
        self.held_inputs = {i: held_inputs[n.target] for i, n in enumerate(self.nodes)
                            if n.op == "placeholder" and n.target in held_inputs}
        self.needs_grad = self._needs_grad()
        views = ViewClasses.of(self.nodes, self.idx, self.users,
                               returned={j for i, k in enumerate(self.kind) if k == "output" for j in self.ins[i]})
        self.view_parent, self.root, self.members = views.parent, views.root, views.members
        self.returned_above, self.reread = views.returned_above, views.reread
        self.cache_chain = cache_chain(self)      # (no gradient to price there: a step without backward)
        self.projected = projected(self)
        self.needs_grad = [g and j not in self.cache_chain for j, g in enumerate(self.needs_grad)]
        self.node_cost = [[self._node_cost(i, s) for s in ss] for i, ss in enumerate(self.strats)]
        self._edge_cache: dict = {}
        self.best_memo: dict = {}        # (node class, its inputs' placements, ...) -> strategy (`State._best`)
        self.classes = Classes(self)     # alike nodes and tensors share memo entries
        self.tensor_memo, self._param_memo, self.comms_memo = {}, {}, {}
        self.trial_memo: dict = {}       # (labelling, changes) -> a trial without its memory term (`State.path`)
        self.paths: dict = {}            # (labelling, changes) -> the labelling committing them makes
        self.search_memo: dict = {}      # what the search derives of the graph alone: windows' regions (`search`)
        self.state_price = None          # seconds per byte of state; None: the cost model's (`price_state`)
        self.groups = decision_groups(self, pins or {})
        if layouts is not None:
            self.groups = fix_layouts(self, layouts)
        self.group_of_param = {k: g for g, grp in enumerate(self.groups) for k in grp.params}

    def _needs_grad(self) -> list[bool]:
        """Whether a gradient flows into each node's output in backward."""
        out = []
        for i, n in enumerate(self.nodes):
            if self.kind[i] == "param":
                out.append(bool(self.param_obj[self.param_key[i]].requires_grad))
            elif self.kind[i] == "input":          # as the example input: x.requires_grad_() counts
                out.append(bool(getattr(self.val[i], "requires_grad", False)))
            elif self.kind[i] in ("buffer", "output"):
                out.append(False)
            else:
                v = self.val[i]
                vals = v if isinstance(v, (tuple, list)) else (v,)
                floating = any(_tensor(x) and x.is_floating_point() for x in vals)
                own = n.op == "call_module" and any(   # a leaf module's own weights (LayerNorm)
                    q.requires_grad for q in self.gm.get_submodule(n.target).parameters())
                out.append(floating and (own or any(out[j] for j in self.ins[i])))
        return out

    # ---------------------------------------------------------------- costs
    def _node_cost(self, i: int, s: OpStrategy) -> float:
        c = self.cost.compute_time(flops(self.nodes[i], s) * held_share(self, i, s))
        for kind, nb in s.comm:
            c += self.cost.comm_time(kind, nb, self.p)
        return c

    def whole_anyway(self, j: int, place) -> bool:
        """Whether the graph's output makes tensor j, or a view ancestor of it, whole with a
        collective anyway (outputs="full", or a strided / Partial output): another consumer
        that needs j whole then shares that collective (class_comms)."""
        for a in self.returned_above[j]:
            src = place[a]
            if isinstance(self.returned(src, self.val[a].shape, a), Replicate) and isinstance(src, (Shard, Partial)):
                return True
        return False

    def even(self, j: int, *placements) -> bool:
        """Whether tensor j's shards are of equal sizes under every one of `placements`."""
        v = self.val[j]
        return not _tensor(v) or all(is_even(v.shape, pl, self.p) for pl in placements)

    def nested(self, j: int, src: Shard, req: Shard) -> bool:
        """Whether tensor j's pieces under `req` are its groups' pieces under `src` (a shard held by
        groups of m ranks) cut over the groups' m ranks each: what a slice within the group makes
        (`Shard(d, nest=m)`, or an even split)."""
        n, p, m = int(self.val[j].shape[src.dim]), self.p, src.replicas
        groups = shares(n, replace(src, replicas=1), p // m)
        return groups is not None and groups == shares(n, replace(req, nest=1), p // m) and \
            shares(n, req, p) == shares(n, replace(req, nest=m), p)

    def redistribution(self, j: int, src, req):
        """`transitions.redistribute` for tensor j: an all-to-all needs equal blocks, so between shards of
        unequal sizes it is a gather and a cut (as the rewrite moves them)."""
        if j in self.held_inputs and isinstance(src, Replicate) and held_by_groups(req) and req.chunks == 1:
            return (), ()            # a held cache cut to its group's piece (the rank's own: no collective)
        if src != req and any(isinstance(q, Shard) and q.groups > 1 for q in (src, req)):
            return None              # grouped blocks are only read as they are (by `regroup`)
        r = redistribute(src, req)
        if r == ((), ()) and held_by_groups(src) and src != req and not self.nested(j, src, req):
            return None
        if r == ((), ()) and held_by_readers(src) and src != req and \
                cover_cut(int(self.val[j].shape[src.dim]), src, req, self.p) is None:
            return None              # a rank's piece of `req` must lie inside the heads it holds
        if free_cut(self, j, src, req):
            return (), ()            # a step without backward: K or V cut by heads (planner.inference)
        if held_by_readers(req) and not held_by_readers(src) and self.kind[j] != "input":
            return None              # made only by K/V projections, or cut from an input (a held cache)
        if r == (("all_to_all",), ("all_to_all",)) and not self.even(j, src, req):
            return ("all_gather",), ("all_gather",)
        return r

    def edge_cost(self, j: int, src, req, grad, shared: bool = False) -> float:
        """Cost of one consumer edge from tensor j (before de-duplication across consumers);
        `shared`: j is made whole anyway (`whole_anyway`), so an edge needing it whole pays no
        forward collective."""
        if self.kind[j] == "param" and isinstance(src, Shard) and src != req:
            return INF       # a sharded parameter is used as stored (no ZeRO-style gathers)
        shared = shared and isinstance(req, Replicate)
        param = self.kind[j] == "param"
        key = (src, req, grad, self.nbytes[j], self.needs_grad[j], shared, param, self.even(j, src, req),
               int(self.val[j].shape[src.dim]) if held_by_groups(src) or held_by_readers(src) else None)   # (`nested`)
        c = self._edge_cache.get(key)
        if c is None:
            rp = partial_grad_edge(src, req, grad, param)
            if rp is not NotImplemented:
                c = INF if rp is None else sum(self.cost.comm_time(k, self.nbytes[j], self.p)
                                               for k in rp[0] + (rp[1] if self.needs_grad[j] else ()))
            elif (r := self.redistribution(j, src, req)) is None:
                c = INF
            else:
                back = ("reduce_scatter",) if not shared and fused_backward(r[0], grad, req) else \
                    r[1] + grad_fix(grad, grad_of(req))
                kinds = (() if shared else r[0]) + (back if self.needs_grad[j] else ())
                if r[0] == ("reduce_scatter",) and not shared:
                    # a reduce-scatter only looks cheaper than an all-reduce until the shard is
                    # gathered again; a following node cannot see that, so charge the gather here
                    kinds += ("all_gather",)
                c = sum(self.cost.comm_time(k, self.nbytes[j], self.p) for k in kinds)
            self._edge_cache[key] = c
        return c

    def tensor_cost(self, j: int, place, sidx) -> float:
        """Communication for tensor j: one redistribution per distinct required placement, and
        one backward fix per distinct (placement, gradient) pair, however many consumers. A
        tensor with views counts for the whole class on its root (its views count 0)."""
        if not self.nbytes[j] or self.root[j] != j:
            return 0.0
        key = (self.classes.tensor(j), *self._read(j, place, sidx))     # (alike tensors share the entry)
        if (hit := self.tensor_memo.get(key)) is None:
            hit = self.tensor_memo[key] = self._tensor_cost(j, place, sidx)
        return hit

    def _read(self, r: int, place, sidx) -> tuple:
        """What the communication of root r's class reads of a labelling: its members' placements and
        their readers' strategies."""
        members = self.members.get(r, (r,))
        return (*[place[m] for m in members], *[sidx[c] for m in members for c in self.users[m]])

    def _tensor_cost(self, j: int, place, sidx) -> float:
        if j not in self.members:
            comms = self.own_comms(j, place[j], sidx)
            if comms is None:
                return INF
            return sum(self.cost.comm_time(k, self.nbytes[j], self.p) for _, _, f, b, _, _ in comms for k in f + b)
        comms = self.class_comms(j, place, sidx)
        if comms is None:
            return INF
        return sum(self.cost.comm_time(k, self.nbytes[m], self.p) for m, _, _, f, b, _, _ in comms for k in f + b)

    def returned(self, src, shape, j: int | None = None):
        """The placement the graph's output takes of a tensor of `shape` held as `src` (node j):
        whole, or with outputs="sharded" a shard at DTensor's boundaries as it is (a strided
        shard, one in whole heads or a balanced one, which a DTensor's Shard cannot describe, is
        gathered; a Partial one all-reduced); any shard as it is where j is `held`, a piece held by
        its readers cut to the rank's even share inside it (Falcon's cache of expanded K/V); a shard
        of a held tensor's last dim (a head's features: no decode step reads a cache so) whole."""
        if j in self.held and isinstance(src, Shard) and src.dim != len(shape) - 1:
            if held_by_readers(src) and cover_cut(int(shape[src.dim]), src, Shard(src.dim), self.p) is not None:
                return Shard(src.dim)
            return src
        if self.outputs == "sharded" and dtensor_boundaries(shape, src, self.p):
            return src
        return REPLICATE

    def class_comms(self, r: int, place, sidx):
        """tensor_comms of every member of root r's class as (member, required, gradient,
        forward, backward, consumers, via): a member made whole while a view parent above it is
        takes that one's (`via`, the topmost such member), with no forward collective of its
        own. None if a consumer cannot be served."""
        out, whole_from, fused = [], {}, set()
        for m in self.members[r]:
            comms = self.tensor_comms(m, place[m], sidx)
            if comms is None:
                return None
            parent = self.view_parent[m]
            above = whole_from.get(parent) if parent is not None else None
            collective, mine = bool((gathers := redistribute(place[m], REPLICATE)) and gathers[0]), None
            made_whole = any(isinstance(c[0], Replicate) for c in comms)
            # a gather whose backward reduce-scatters takes Partial gradients only: a whole one would be
            # counted once per rank, so a member read whole with one gathers on its own
            joins = above is not None and not (above in fused and self.needs_grad[m] and any(
                isinstance(c[0], Replicate) and not isinstance(c[1], Partial) for c in comms))
            for req, g, fwd, bwd, consumers in comms:
                via = None
                whole = above if above is not None else (m if collective and made_whole else None)
                if self.sliced_from_whole(place[m], req, fwd, whole):
                    via, fwd = whole, ()
                elif collective and isinstance(req, Replicate):
                    if joins:
                        if above in fused and bwd:   # its backward reduce-scatters: a Partial gradient joins
                            bwd = ()
                        elif bwd == ("reduce_scatter",) and fused_backward(fwd, g, req):
                            bwd = ("all_reduce",)        # another's gather serves it: reduce, then slice
                        via, fwd = above, ()
                    elif above is None:
                        mine = m
                out.append((m, req, g, fwd, bwd, consumers, via))
            whole_from[m] = above if above is not None else mine
            if mine == m and [c[3] for c in comms if isinstance(c[0], Replicate)] == [("reduce_scatter",)]:
                fused.add(m)                # (the rewrite fuses its gather with that backward)
        return out

    def comms_of(self, j: int, place, sidx):
        """(required, gradient, forward, backward, consumers, via) of tensor j under a labelling (via: the
        node index whose made-whole tensor j reuses, or None); memoised by what it reads, as `tensor_cost`."""
        r = self.root[j]
        key = (j, *self._read(r, place, sidx))
        if (hit := self.comms_memo.get(key)) is None:
            hit = self.comms_memo[key] = tuple(self.own_comms(j, place[j], sidx) or ()) if r not in self.members else \
                tuple(c[1:] for c in (self.class_comms(r, place, sidx) or ()) if c[0] == j)
        return hit

    @staticmethod
    def sliced_from_whole(src, req, fwd, whole) -> bool:
        """A Partial tensor also all-reduced whole (`whole`: that one's node index) serves a
        consumer that needs a shard by slicing the sum, not by a reduce-scatter of its own (the
        embedding output read whole by a norm's statistics and split by the residual stream)."""
        return whole is not None and isinstance(src, Partial) and isinstance(req, Shard) and fwd == ("reduce_scatter",)

    def own_comms(self, j: int, src, sidx):
        """tensor_comms of a tensor with no views, with `via` (see comms_of): a shard sliced from
        its own all-reduced sum names itself."""
        comms = self.tensor_comms(j, src, sidx)
        if comms is None:
            return None
        whole = j if any(isinstance(c[0], Replicate) and c[2] == ("all_reduce",) for c in comms) else None
        return [(req, g, (), bwd, cons, j) if self.sliced_from_whole(src, req, fwd, whole) else
                (req, g, fwd, bwd, cons, None) for req, g, fwd, bwd, cons in comms]

    def tensor_comms(self, j: int, src, sidx):
        """[(required placement, gradient placement, forward kinds, backward kinds, consumers)]
        for tensor j held as `src`, or None if a consumer's placement cannot be reached.

        One forward redistribution (and its backward dual) per required placement; consumers
        that send back Partial gradients share one backward all-reduce (Megatron's copy), the
        others take the tensor as it is. Backward collectives only where a gradient flows
        (parameters and what they feed, not data inputs or indices)."""
        by_req: dict = {}
        for c in self.users[j]:
            if not self.strats[c]:
                continue
            s = self.strats[c][sidx[c]]
            for slot, k in enumerate(self.ins[c]):
                if k == j and s.inputs[slot] is not None:
                    req, grad = s.inputs[slot], s.grad(slot)
                    if self.kind[c] == "output":         # its gradient comes back as it is returned
                        req = grad = self.returned(src, self.val[j].shape, j)
                    consumers = by_req.setdefault(req, {}).setdefault(grad, [])
                    if c not in consumers:
                        consumers.append(c)
        out = []
        param = self.kind[j] == "param"
        for req, per_grad in by_req.items():
            r = self.redistribution(j, src, req)
            if r is None:
                return None
            fwd, dual = r
            grad_flows = self.needs_grad[j]
            for n, (g, consumers) in enumerate(sorted(per_grad.items(), key=lambda kv: str(kv[0]))):
                first = n == 0
                rp = partial_grad_edge(src, req, g, param)
                if rp is None:
                    return None
                if rp is not NotImplemented:          # whole with a Partial gradient: see transitions.partial_grad_edge
                    out.append((req, g, rp[0] if first else (), rp[1] if grad_flows else (), consumers))
                    continue
                fix = grad_fix(g, grad_of(req)) if grad_flows else ()
                back = (dual if first and grad_flows else ()) + fix
                if grad_flows and len(per_grad) == 1 and fused_backward(fwd, g, req):
                    back = ("reduce_scatter",)
                out.append((req, g, fwd if first else (), back, consumers))
        return out

    def param_cost(self, key: int, placement) -> float:
        """The memory term of a parameter held as `placement`: its state's mean over the ranks
        (the whole tensor, or 1/p of it for any split), plus IMBALANCE of the largest rank's
        excess over it. Shards of unequal sizes (heads that do not divide) cost about what the
        ranks hold together, so their communication decides, and of two splits the more even
        one wins a tie; the largest rank's state is what `memory_budget` and the report check."""
        hit = self._param_memo.get((key, placement))
        if hit is None:
            obj = self.param_obj[key]
            mean = obj.numel() / (self.p if isinstance(placement, Shard) else 1)
            largest = local_numel(obj.shape, placement, self.p)
            nb = (mean + IMBALANCE * (largest - mean)) * obj.element_size()
            hit = self._param_memo[(key, placement)] = self.cost.memory_cost(nb, self.state_price)
        return hit

    def price_state(self, price: float | None) -> None:
        """Search this problem again at another price of a byte of state (`budget.least_comm`):
        only the parameters' memory term changes; States made before keep their totals."""
        self.state_price = price
        self._param_memo.clear()

    def path_after(self, path: int, changes) -> int:
        """The number naming the labelling that committing `changes` to labelling `path` makes
        (`State.path`; 0: State(prob)'s). A trial's propagation does not read the price of state, so
        the searches at several prices (`budget.least_comm`) share theirs while their commits agree."""
        return self.paths.setdefault((path, changes), len(self.paths) + 1)


class Overlay:
    """A list seen through a dict of changes (copy-on-write for trials)."""

    __slots__ = ("base", "new")

    def __init__(self, base, new):
        self.base, self.new = base, new

    def __getitem__(self, i):
        return self.new[i] if i in self.new else self.base[i]

    def get(self, k, default=None):
        if k in self.new:
            return self.new[k]
        return self.base.get(k, default)
