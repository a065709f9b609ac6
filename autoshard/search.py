"""Search: choose a placement for every node so the cost model's total is smallest.

Decisions live on parameters only: a group of parameters that must agree (a linear's weight and
bias, a weight tied between an embedding and a head) takes one of the layouts its consumers
offer. Every other node follows: given its inputs' placements it takes its locally cheapest
strategy, so a plan is evaluated by one forward propagation, and a change is evaluated by
re-propagating only the nodes whose inputs changed.

`greedy` visits windows (a group, the groups meeting it within a few ops, the groups it feeds),
tries every combination in the window and keeps the best, sweeping until nothing improves;
windows with the same structure and boundary reuse their answer (identical blocks solve once).
`exact` enumerates every combination of every group: the reference for tests and benchmarks.
"""
from __future__ import annotations

import heapq
import itertools
import math
import re

import torch

from .placements import REPLICATE, Partial, Replicate, ReplicatePartialGrad, Shard, held_by_groups
from .decisions import transposed
from .problem import INF, Problem  # noqa: F401  (search.Problem is what callers build)

WINDOW_DEPTH = 10        # ops a window looks ahead of its anchors
WINDOW_GROUPS = 4        # groups a window enumerates at most (q, k, v and the out-projection)
WINDOW_COMBOS = 3 ** 4   # combinations a window enumerates at most
SIGNATURE_DEPTH = 6      # ops past a window's anchors that its cached answer depends on



def _whole_in_group(placement) -> bool:
    """Rp (whole on every rank) or a shard held by groups of ranks: a tensor every rank of a group
    holds whole, its gradient a summand per rank."""
    return isinstance(placement, ReplicatePartialGrad) or held_by_groups(placement)

class State:
    """A labelling: the group choices and every node's strategy and output placement."""

    def __init__(self, prob: Problem):
        self.prob = prob
        n = len(prob.nodes)
        self.choice = [0] * len(prob.groups)
        self.param_place: dict[int, object] = {}
        for grp in prob.groups:       # choice 0: all-Replicate, unless a pin removed that option
            for key, pl in zip(grp.params, grp.choices[0]):
                if not isinstance(pl, Replicate):
                    self.param_place[key] = pl
        self.sidx = [0] * n
        self.place = [None] * n
        for i in range(n):
            self._assign(i, self.place, self.sidx)
        # communication cost of every tensor under this labelling, kept current by commit()
        self.tcost = [prob.tensor_cost(j, self.place, self.sidx) for j in range(n)]
        self.total = self.evaluate()

    # ---------------------------------------------------------------- propagation
    def placement_of_param(self, key):
        return self.param_place.get(key, REPLICATE)

    def _whole_before(self, i, j, place) -> bool:
        """Whether a consumer of tensor j decided before node i already makes j whole with a
        collective (a norm's statistics all-reduce its Partial input: the norm's product may
        read it whole too, for nothing more)."""
        if not isinstance(place[j], (Shard, Partial)):
            return False
        prob, sidx = self.prob, self.sidx
        for u in prob.users[j]:
            if u < i and prob.strats[u] and prob.kind[u] == "op":
                s = prob.strats[u][sidx[u]]
                if any(k == j and isinstance(s.inputs[slot], Replicate) for slot, k in enumerate(prob.ins[u])):
                    return True
        return False

    def _best(self, i, place) -> int:
        """The locally cheapest strategy of node i given its inputs' placements (memoised)."""
        prob = self.prob
        before = tuple(self._whole_before(i, j, place) for j in prob.ins[i])
        key = (i, *[place[j] for j in prob.ins[i]], *[place[a] for j in prob.ins[i] for a in prob.returned_above[j]],
               before)
        hit = prob.best_memo.get(key)
        if hit is None:
            hit = prob.best_memo[key] = self._best_uncached(i, place, before)
        return hit

    def _best_uncached(self, i, place, before) -> int:
        prob = self.prob
        best, best_c = 0, INF
        # an Rp input (replicated K/V) is sliced only where it meets an input split already (the
        # query heads): slicing it on its own is locally free but starts a split whose cost
        # shows only later, which a node-by-node choice cannot see
        # (so is a shard held by groups of ranks, cut to each rank's own piece)
        rp = any(_whole_in_group(place[j]) for j in prob.ins[i])
        split_in = rp and any(isinstance(place[j], Shard) and not held_by_groups(place[j]) for j in prob.ins[i])
        for si, s in enumerate(prob.strats[i]):
            if rp and not split_in and any(_whole_in_group(place[j]) and isinstance(s.inputs[slot], Shard) and
                                           s.inputs[slot] != place[j] for slot, j in enumerate(prob.ins[i])):
                continue
            c = prob.node_cost[i][si]
            for slot, j in enumerate(prob.ins[i]):
                req = s.inputs[slot]
                if req is None:
                    continue
                c += prob.edge_cost(j, place[j], req, s.grad(slot), before[slot] or prob.whole_anyway(j, place))
                if c >= best_c:
                    break
            if c < best_c:
                best, best_c = si, c
        return best

    def _out(self, i, si, place):
        prob = self.prob
        kind = prob.kind[i]
        if kind == "input" or kind == "buffer":
            return REPLICATE if isinstance(prob.val[i], torch.Tensor) else None
        if kind == "param":
            return self.placement_of_param(prob.param_key[i])
        if kind == "select":
            src = place[prob.ins[i][0]]
            k = prob.nodes[i].args[1]
            return src[k] if isinstance(src, tuple) else (REPLICATE if isinstance(prob.val[i], torch.Tensor) else None)
        if kind == "output":
            return None
        return prob.strats[i][si].output

    def _assign(self, i, place, sidx):
        si = self._best(i, place) if self.prob.kind[i] == "op" else 0
        sidx[i] = si
        place[i] = self._out(i, si, place)

    def evaluate(self, place=None, sidx=None, param_place=None) -> float:
        """Total cost of a labelling (defaults: this state's)."""
        prob = self.prob
        place = self.place if place is None else place
        sidx = self.sidx if sidx is None else sidx
        pp = self.param_place if param_place is None else param_place
        total = 0.0
        for i in range(len(prob.nodes)):
            if prob.strats[i]:
                total += prob.node_cost[i][sidx[i]]
            total += prob.tensor_cost(i, place, sidx)
        for key in prob.param_obj:
            total += prob.param_cost(key, pp.get(key, REPLICATE))
        return total

    # ---------------------------------------------------------------- incremental change
    def trial(self, changes: dict[int, int]):
        """Cost delta of setting group -> choice in `changes`, and the overlay that does it.

        Re-propagates in place from the changed parameters (in topological order) and undoes
        the change before returning; old tensor costs come from `tcost`, not recomputed."""
        prob = self.prob
        new_pp = {}
        heap = []
        for g, ch in changes.items():
            grp = prob.groups[g]
            for key, pl in zip(grp.params, grp.choices[ch]):
                if pl != self.placement_of_param(key):
                    new_pp[key] = pl
        if not new_pp:
            return 0.0, None
        place, sidx, kind, users = self.place, self.sidx, prob.kind, prob.users
        old_place, old_sidx = {}, {}          # undo log: node -> value before the trial
        seen = set()
        saved, self.param_place = self.param_place, _Overlay(self.param_place, new_pp)
        try:
            for key, pl in new_pp.items():
                for i in prob.param_nodes[key]:
                    old_place.setdefault(i, place[i])
                    place[i] = pl
                    for u in users[i]:
                        heapq.heappush(heap, u)
            while heap:
                i = heapq.heappop(heap)
                if i in seen:
                    continue
                seen.add(i)
                si = self._best(i, place) if kind[i] == "op" else 0
                out = self._out(i, si, place)
                if si != sidx[i]:
                    old_sidx[i] = sidx[i]
                    sidx[i] = si
                    for j in prob.ins[i]:               # later readers of its split inputs: _whole_before
                        if isinstance(place[j], (Shard, Partial)):
                            for u in users[j]:
                                if u > i:
                                    heapq.heappush(heap, u)
                if out != place[i]:
                    old_place[i] = place[i]
                    place[i] = out
                    for u in users[i]:
                        heapq.heappush(heap, u)
                    for u in prob.reread.get(i, ()):     # their whole_anyway may change with it
                        heapq.heappush(heap, u)
            changed = set(old_sidx) | set(old_place)
            tensors = set(changed)
            for i in changed:
                tensors.update(prob.ins[i])
            tensors = {prob.root[j] for j in tensors}          # a view's cost is its class root's
            delta = 0.0
            for i in changed:
                if prob.strats[i]:
                    delta += prob.node_cost[i][sidx[i]] - prob.node_cost[i][old_sidx.get(i, sidx[i])]
            tcost, tnew = self.tcost, {}
            for j in tensors:
                c = tnew[j] = prob.tensor_cost(j, place, sidx)
                delta += c - tcost[j]
            place_new = {i: place[i] for i in old_place}
            sidx_new = {i: sidx[i] for i in old_sidx}
        finally:
            self.param_place = saved
            for i, v in old_place.items():
                place[i] = v
            for i, v in old_sidx.items():
                sidx[i] = v
        for key, pl in new_pp.items():
            delta += prob.param_cost(key, pl) - prob.param_cost(key, self.placement_of_param(key))
        if math.isnan(delta):
            delta = INF
        return delta, (changes, new_pp, place_new, sidx_new, tnew)

    def commit(self, delta, overlay):
        if overlay is None:
            return
        changes, new_pp, place_new, sidx_new, tnew = overlay
        for g, ch in changes.items():
            self.choice[g] = ch
        self.param_place.update(new_pp)
        for i, v in place_new.items():
            self.place[i] = v
        for i, v in sidx_new.items():
            self.sidx[i] = v
        for j, c in tnew.items():
            self.tcost[j] = c
        self.total += delta

    def reduce_early(self) -> None:
        """Settle a tie the per-node choice breaks late: an op that keeps Partial inputs Partial
        (a dropout of a row layer's output, a residual add of a whole or Partial tensor to it)
        while every reader of its result needs the sum whole takes its inputs whole instead, so the
        all-reduce comes before it, as in Megatron's row-parallel layer (whose fresh output is then
        summed in place), wherever that costs no more (never where it would reduce two summands
        apart: the two branches of a parallel block). A result some reader sums while Partial or
        reads split stays Partial."""
        prob, place, sidx = self.prob, self.place, self.sidx
        for i in reversed(range(len(prob.nodes))):      # readers first: a chain settles in one pass
            if prob.kind[i] != "op" or not isinstance(place[i], Partial) or not prob.strats[i] or sidx[i] == 0 \
                    or not isinstance(prob.strats[i][0].output, Replicate) or not prob.users[i]:
                continue
            ins = [r for r in prob.strats[i][sidx[i]].inputs if r is not None]
            if not any(isinstance(r, Partial) for r in ins) or not all(isinstance(r, (Partial, Replicate)) for r in ins):
                continue            # Partial inputs passed through or summed (a dropout, a residual add)
            if not all(self._reads_whole(u, i) for u in prob.users[i]):
                continue
            tensors = {prob.root[j] for j in (i, *prob.ins[i])}
            before = prob.node_cost[i][sidx[i]] + sum(prob.tensor_cost(j, place, sidx) for j in tensors)
            old = sidx[i], place[i]
            sidx[i], place[i] = 0, self._out(i, 0, place)
            new = {j: prob.tensor_cost(j, place, sidx) for j in tensors}
            after = prob.node_cost[i][0] + sum(new.values())
            if after > before + 1e-12 * max(1.0, abs(before)):
                sidx[i], place[i] = old
                continue
            self.total += after - before
            for j, c in new.items():
                self.tcost[j] = c

    def _reads_whole(self, u: int, i: int) -> bool:
        """Whether node u's strategy reads tensor i whole (Replicate) in every slot it reads it."""
        strats = self.prob.strats[u]
        return bool(strats) and all(isinstance(strats[self.sidx[u]].inputs[k], Replicate)
                                    for k, j in enumerate(self.prob.ins[u]) if j == i)

    def set_choices(self, choices: dict[int, int]) -> float:
        delta, ov = self.trial({g: c for g, c in choices.items() if c != self.choice[g]})
        self.commit(delta, ov)
        return delta


class _Overlay:
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


# -------------------------------------------------------------------- windows
def _reach(prob: Problem, anchors, anchor_set, limit: int = WINDOW_DEPTH) -> dict[int, int]:
    """Nodes reachable from `anchors` within `limit` ops, stopping at other anchors; never the
    graph's output node (no decision there, and its fan-in can be the whole graph)."""
    depth = {a: 0 for a in anchors}
    frontier = list(anchors)
    while frontier:
        nxt = []
        for i in frontier:
            if depth[i] >= limit:
                continue
            for u in prob.users[i]:
                if u not in depth and prob.kind[u] != "output":
                    depth[u] = depth[i] + 1
                    if u not in anchor_set:
                        nxt.append(u)
        frontier = nxt
    return depth


def acting(prob: Problem, grp) -> list[int]:
    """The nodes that use a group's parameters: its anchors, but for an anchor that only
    transposes its weight (`x @ self.weight.T`: Falcon's linears) the ops reading it."""
    return [u for a in grp.anchors for u in (prob.users[a] if transposed(prob, a) else (a,))]


def primary_groups(prob: Problem) -> set:
    """The groups whose ops name a TorchShard dim (linears, embeddings): those the windows are
    built around; the others (a norm's weight) are decided by flips."""
    return {g for g, grp in enumerate(prob.groups)
            if any(s.dim is not None for a in acting(prob, grp) for s in prob.strats[a])}


def windows(prob: Problem) -> list[tuple[int, ...]]:
    """For each group, the groups it is enumerated with: its siblings (anchors reading the same
    activation: q, k and v; fc1 and a gate), the groups it feeds before the next anchors (the
    out-projection after q/k/v, fc2 after fc1) and their siblings, nearest first."""
    anchor_group = {}
    for g, grp in enumerate(prob.groups):
        for a in acting(prob, grp):
            anchor_group.setdefault(a, g)
    anchor_set = set(anchor_group)
    readers: dict[int, set] = {}          # activation node -> groups whose anchors read it
    for a, g in anchor_group.items():
        for j in prob.ins[a]:
            if prob.kind[j] not in ("param", "buffer"):
                readers.setdefault(j, set()).add(g)

    def siblings(h):
        out = set()
        for a in acting(prob, prob.groups[h]):
            for j in prob.ins[a]:
                out |= readers.get(j, set())
        return out

    primary = primary_groups(prob)
    out = []
    for g, grp in enumerate(prob.groups):
        if g not in primary:       # e.g. a norm's weight: left to the single-flip pass
            out.append((g,))
            continue
        dist = {h: 0 for h in (siblings(g) | {g}) & primary}
        for i, d in _reach(prob, acting(prob, grp), anchor_set).items():
            if d > 0 and i in anchor_group and anchor_group[i] in primary:
                for h in (siblings(anchor_group[i]) | {anchor_group[i]}) & primary:
                    dist[h] = min(dist.get(h, INF), d)
        chosen, combos = [], 1
        for h in sorted(dist, key=lambda h: (h != g, dist[h], h)):
            unit = [u for u in sorted((siblings(h) | {h}) & primary) if u not in chosen]
            n = math.prod(len(prob.groups[u].choices) for u in unit)
            if h == g or (len(chosen) + len(unit) <= WINDOW_GROUPS and combos * n <= WINDOW_COMBOS):
                chosen += unit                # siblings enter a window together or not at all
                combos *= n
        out.append(tuple(sorted(chosen)))
    return out


def _window_shape(prob: Problem, win, reach_nodes):
    """The structure of a window's region (state-independent) and the outside nodes it reads,
    whose placements complete its signature."""
    region = sorted(reach_nodes)
    pos = {i: k for k, i in enumerate(region)}
    rows, boundary = [], []
    for i in region:
        n = prob.nodes[i]
        v = prob.val[i]
        refs = []
        for j in prob.ins[i]:
            if j in pos:
                refs.append(pos[j])
            else:
                refs.append(("x", tuple(prob.val[j].shape) if isinstance(prob.val[j], torch.Tensor) else None))
                boundary.append(j)
        if n.op == "call_module":
            tgt = type(prob.gm.get_submodule(n.target)).__name__
        elif n.op in ("call_method", "call_function"):
            tgt = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        else:
            tgt = n.op
        rows.append((n.op, str(tgt), tuple(v.shape) if isinstance(v, torch.Tensor) else None, tuple(refs)))
    groups = tuple(len(prob.groups[g].choices) for g in win)
    return (tuple(rows), groups), tuple(boundary)


def _signature(prob: Problem, win, reach_nodes, state: State):
    """Structure of a window's region plus its boundary placements: equal keys, equal answers."""
    shape, boundary = _window_shape(prob, win, reach_nodes)
    return shape, tuple(state.place[j] for j in boundary)


def greedy(prob: Problem, max_sweeps: int = 4) -> State:
    """Windowed greedy search from all-Replicate; see the module docstring."""
    state = State(prob)
    wins = windows(prob)
    anchor_set = {a for grp in prob.groups for a in grp.anchors}
    regions, shapes = {}, {}
    cache: dict = {}
    for sweep in range(max_sweeps):
        improved = False
        done = set()
        for win in wins:
            if win in done:
                continue
            done.add(win)
            if win not in regions:      # (structure id, boundary nodes): the structure is fixed
                nodes = set()
                for g in win:
                    nodes |= set(_reach(prob, prob.groups[g].anchors, anchor_set, SIGNATURE_DEPTH))
                shape, boundary = _window_shape(prob, win, nodes)
                regions[win] = (shapes.setdefault(shape, len(shapes)), boundary)
            shape_id, boundary = regions[win]
            key = (shape_id, tuple(state.place[j] for j in boundary))
            best = cache.get(key)
            if best is None:
                best, best_d = tuple(state.choice[g] for g in win), 0.0
                for combo in itertools.product(*(range(len(prob.groups[g].choices)) for g in win)):
                    d, _ = state.trial({g: c for g, c in zip(win, combo) if c != state.choice[g]})
                    if d < best_d - 1e-15:
                        best, best_d = combo, d
                cache[key] = best
            d, ov = state.trial({g: c for g, c in zip(win, best) if c != state.choice[g]})
            if d < -1e-12 * max(1.0, abs(state.total)):
                state.commit(d, ov)
                improved = True
        if not improved:
            break
    improve_single(state)
    if improve_by_layers(state):
        improve_single(state)
    return state


def _layer_key(name: str):
    """(the name with its first layer index blanked, that index), or None outside numbered layers."""
    m = re.search(r"\.(\d+)\.", name)
    return None if m is None else ((name[:m.start()], name[m.end():]), int(m.group(1)))


def improve_by_layers(state: State) -> bool:
    """Give a numbered layer the decisions of the layer after or before it, all at once, where the
    total drops: the windows decide a layer from what its neighbours hold, and the first layer,
    which reads the embedding's side, can settle on other choices than every later one (BLOOM's
    layer 0 and the embedding's norm kept split, no flip alone paying off), tried with each choice
    of the group just before and just after the layer. Returns whether anything changed."""
    prob = state.prob
    layers: dict = {}
    for g, grp in enumerate(prob.groups):
        key = _layer_key(grp.names[0])
        if key is not None:
            layers.setdefault(key[1], {})[key[0]] = g
    changed = False
    for i in sorted(layers):
        for j in (i + 1, i - 1):
            if j not in layers or set(layers[j]) != set(layers[i]):
                continue
            move = {}
            for key, g in layers[i].items():
                want = prob.groups[layers[j][key]].choices[state.choice[layers[j][key]]]
                if want in prob.groups[g].choices and prob.groups[g].choices.index(want) != state.choice[g]:
                    move[g] = prob.groups[g].choices.index(want)
            if not move:
                continue
            # with it, any choice of the group just before or after the layer (the embedding's norm)
            edges = [e for e in (min(layers[i].values()) - 1, max(layers[i].values()) + 1)
                     if 0 <= e < len(prob.groups) and e not in move]
            tries = [move] + [{**move, e: c} for e in edges for c in range(len(prob.groups[e].choices))
                              if c != state.choice[e]]
            d, ov = min((state.trial(t) for t in tries), key=lambda r: r[0])
            if d < -1e-12 * max(1.0, abs(state.total)):
                state.commit(d, ov)
                changed = True
    return changed


def improve_single(state: State) -> None:
    """Flip one group at a time while the total drops (a final polish after the windows)."""
    prob = state.prob
    for _ in range(3):
        improved = False
        for g in range(len(prob.groups)):
            for c in range(len(prob.groups[g].choices)):
                if c == state.choice[g]:
                    continue
                d, ov = state.trial({g: c})
                if d < -1e-12 * max(1.0, abs(state.total)):
                    state.commit(d, ov)
                    improved = True
        if not improved:
            return


def exact(prob: Problem, limit: int = 200_000) -> State:
    """Every combination of every group (the product must stay under `limit`)."""
    state = State(prob)
    sizes = [len(g.choices) for g in prob.groups]
    total = math.prod(sizes)
    if total > limit:
        raise ValueError(f"exact search over {len(sizes)} groups needs {total} evaluations (> {limit})")
    best, best_cost = tuple(state.choice), state.total
    for combo in itertools.product(*(range(n) for n in sizes)):
        state.set_choices(dict(enumerate(combo)))
        if state.total < best_cost - 1e-15:
            best, best_cost = combo, state.total
    state.set_choices(dict(enumerate(best)))
    state.total = state.evaluate()
    return state
