"""An assignment of placements to a Problem's nodes and its cost (the search's state).

Decisions live on parameter groups; every other node takes its locally cheapest strategy given
its inputs' placements, so an assignment is evaluated by one forward propagation and a change by
re-propagating only the nodes whose inputs changed (`State.trial`, seen through `Overlay`
copies until committed). `reduce_early` settles the ties the per-node choice breaks late. The
search (`search.py`) decides which changes to try.
"""
from __future__ import annotations

import heapq
import math

import torch

from ..runtime.placements import (REPLICATE, Partial, Replicate, ReplicatePartialGrad, Shard, held_by_groups,
                                  held_by_readers)
from .problem import INF, Overlay, Problem
from .tried import Tried


def _whole_in_group(placement) -> bool:
    """Rp (whole on every rank) or a shard held by groups of ranks or by the ranks that read it: a
    tensor every rank of a group holds whole, its gradient a summand per rank."""
    return isinstance(placement, ReplicatePartialGrad) or held_by_groups(placement) or held_by_readers(placement)


class State:
    """A labelling: the group choices and every node's strategy and output placement."""

    def __init__(self, prob: Problem):
        self.prob = prob
        n = len(prob.nodes)
        self.choice = [0] * len(prob.groups)
        # choice 0: all-Replicate, unless a pin or a fixed layout removed that option (an Rp layout is a Replicate of its own)
        self.param_place: dict[int, object] = {key: pl for grp in prob.groups for key, pl in zip(grp.params, grp.choices[0])
                                               if pl != REPLICATE}
        self.sidx, self.place = [0] * n, [None] * n
        for i in range(n):
            self._assign(i, self.place, self.sidx)
        self.tcost = [prob.tensor_cost(j, self.place, self.sidx) for j in range(n)]   # every tensor's, kept by commit()
        self.total = self.evaluate()
        self.path = (prob, 0)       # the labelling, named by the commits since State(prob) (`trial`)

    # ---------------------------------------------------------------- propagation
    def placement_of_param(self, key):
        return self.param_place.get(key, REPLICATE)

    def _read_before(self, i, j, place) -> tuple:
        """How the consumers of tensor j decided before node i read it: (whether one makes a split j
        whole with a collective, the (required, gradient) pairs they read it as). A norm's statistics
        all-reduce its Partial input: the norm's product may read it whole too, for nothing more. An
        edge of a pair already read adds nothing (`Problem.tensor_comms`: one redistribution per
        required placement, one backward fix per pair): Falcon's parallel attention and MLP read one
        norm's output whole, their Partial gradients summed before one all-reduce."""
        prob, sidx = self.prob, self.sidx
        if not prob.needs_grad[j] and not isinstance(place[j], (Shard, Partial)):
            return False, frozenset()        # (whole without a gradient: no reader's edge costs anything)
        whole, pairs = False, set()
        for u in prob.users[j]:
            if u < i and prob.strats[u] and prob.kind[u] == "op":
                s = prob.strats[u][sidx[u]]
                for slot, k in enumerate(prob.ins[u]):
                    if k == j and s.inputs[slot] is not None:
                        whole = whole or isinstance(s.inputs[slot], Replicate)
                        pairs.add((s.inputs[slot], s.grad(slot)))
        return whole and isinstance(place[j], (Shard, Partial)), frozenset(pairs)

    def _best(self, i, place) -> int:
        """The locally cheapest strategy of node i given its inputs' placements (memoised)."""
        prob = self.prob
        before = tuple(self._read_before(i, j, place) for j in prob.ins[i])
        key = (prob.classes.node(i), *[place[j] for j in prob.ins[i]],
               *[place[a] for j in prob.ins[i] for a in prob.returned_above[j]], before)
        hit = prob.best_memo.get(key)
        if hit is None:
            hit = prob.best_memo[key] = self._best_uncached(i, place, before)
        return hit

    def _best_uncached(self, i, place, before, guard: bool = True) -> int:
        prob = self.prob
        best, best_c = 0, INF
        # an Rp input (replicated K/V) is sliced only where it meets an input split already (the
        # query heads): slicing it on its own is locally free but starts a split whose cost
        # shows only later, which a node-by-node choice cannot see
        # (so is a shard held by groups of ranks, cut to each rank's own piece); where that
        # leaves no finite way (a piece held by its readers cannot be read whole), it is cut
        rp = guard and any(_whole_in_group(place[j]) for j in prob.ins[i])
        split_in = rp and any(isinstance(place[j], Shard) and not _whole_in_group(place[j]) for j in prob.ins[i])
        for si, s in enumerate(prob.strats[i]):
            if rp and not split_in and any(_whole_in_group(place[j]) and isinstance(s.inputs[slot], Shard) and
                                           s.inputs[slot] != place[j] for slot, j in enumerate(prob.ins[i])):
                continue
            c = prob.node_cost[i][si]
            for slot, j in enumerate(prob.ins[i]):
                req = s.inputs[slot]
                if req is None:
                    continue
                if j in prob.held_inputs and req != prob.held_inputs[j] and isinstance(prob.val[i], torch.Tensor):
                    c = INF              # a held input (a decode step's cache) read as the prefill returned it
                    break
                if (req, s.grad(slot)) in before[slot][1]:
                    continue
                e = prob.edge_cost(j, place[j], req, s.grad(slot), before[slot][0] or prob.whole_anyway(j, place))
                if req == REPLICATE and place[j] == REPLICATE and 0.0 < e < INF:
                    e /= self._sharers(j, s.grad(slot))
                c += e
                if c >= best_c:
                    break
            if c < best_c:
                best, best_c = si, c
        if best_c == INF and rp:
            return self._best_uncached(i, place, before, guard=False)
        return best

    def _sharers(self, j, grad) -> int:
        """The ops that can read whole tensor j sending back `grad`: a whole tensor's readers that send
        back Partial gradients share one all-reduce (Megatron's copy), so each is charged its share
        until one has paid it (`_read_before`): a first reader charged the whole of it would rather
        gather its weight (Falcon's parallel attention and MLP, both reading one norm's output)."""
        memo = self.prob.search_memo.setdefault("sharers", {})
        if (j, grad) not in memo:
            prob = self.prob
            memo[j, grad] = max(1, sum(
                any(s.inputs[slot] == REPLICATE and s.grad(slot) == grad
                    for s in prob.strats[u] for slot, k in enumerate(prob.ins[u]) if k == j)
                for u in prob.users[j] if prob.kind[u] == "op"))
        return memo[j, grad]

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
    def trial(self, changes: dict[int, int], forced=None):
        """Cost delta of setting group -> choice in `changes`, and the overlay that does it; with
        `forced` ({op: strategy}), those ops take those strategies rather than their locally cheapest.

        Re-propagates in place from the changed parameters (in topological order) and undoes
        the change before returning; old tensor costs come from `tcost`, not recomputed."""
        prob = self.prob
        if forced:
            return self._priced(*self._propagated(changes, forced))
        memo = self.path is not None and self.path[0] is prob
        if memo:
            key = (self.path[1], tuple(changes.items()))
            hit = prob.trial_memo.get(key)
            if hit is not None:
                return self._priced(*hit)
        base, overlay = self._propagated(changes)
        if memo:
            prob.trial_memo[key] = base, overlay
        return self._priced(base, overlay)

    def _priced(self, base, overlay):
        """A trial's delta: its communication and compute (`base`) plus the parameters' memory term at
        the problem's price of state now."""
        if overlay is None:
            return base, None
        prob, delta = self.prob, base
        for key, pl in overlay[1].items():
            delta += prob.param_cost(key, pl) - prob.param_cost(key, self.placement_of_param(key))
        if math.isnan(delta):
            delta = INF
        return delta, overlay

    def _propagated(self, changes: dict[int, int], forced=None):
        """(communication and compute delta, overlay) of `changes`: `trial` without the memory term.
        `forced`: {op: strategy} taken as given, not chosen locally (`gather_early`)."""
        prob = self.prob
        forced = forced or {}
        new_pp = {}
        heap = sorted(forced)                 # a heap from the start: pops run in graph order
        for g, ch in changes.items():
            grp = prob.groups[g]
            for key, pl in zip(grp.params, grp.choices[ch]):
                if pl != self.placement_of_param(key):
                    new_pp[key] = pl
        if not new_pp and not forced:
            return 0.0, None
        place, sidx, kind, users = self.place, self.sidx, prob.kind, prob.users
        old_place, old_sidx = {}, {}          # undo log: node -> value before the trial
        seen = set()
        saved, self.param_place = self.param_place, Overlay(self.param_place, new_pp)
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
                si = forced[i] if i in forced else self._best(i, place) if kind[i] == "op" else 0
                out = self._out(i, si, place)
                if si != sidx[i]:
                    old_sidx[i] = sidx[i]
                    sidx[i] = si
                    for j in prob.ins[i]:               # later readers of its inputs: _read_before
                        if prob.needs_grad[j] or isinstance(place[j], (Shard, Partial)):
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
        if self.path is not None:
            self.path = (self.prob, self.prob.path_after(self.path[1], tuple(changes.items())))

    def reduce_early(self, nodes=None) -> None:
        """Settle the ties the per-node choice breaks late: an op that keeps Partial inputs Partial
        (a dropout of a row layer's output, a residual add of a whole or Partial tensor to it)
        while every reader of its result reads it in one other placement X (whole, or split)
        takes the strategy that outputs X instead, wherever that costs no more, so the reduction
        comes before it: as in Megatron's row-parallel layer, whose fresh output is all-reduced in
        place, and a residual add of a split stream (BLOOM's MLP adds its input, held split: the
        row layer's output is reduce-scattered to it, rather than the stream gathered whole to be
        added while Partial). Never where it would reduce two summands apart (the two branches
        of a parallel block: that costs more). A result some reader sums while Partial stays
        Partial, unless a reader applies a parameter to a fresh Partial and reading it whole at once makes
        the step cheaper (`_read_whole`: ConvNeXt's row layer times a whole layer scale, whose gradient
        is otherwise summed too; a chain no one op's change settles).
        With `nodes`, those alone are settled (a move's region: `planner.relax`)."""
        prob, place, sidx = self.prob, self.place, self.sidx
        order = reversed(range(len(prob.nodes))) if nodes is None else sorted(nodes, reverse=True)
        fresh = []
        for i in order:      # readers first: a chain settles in one pass
            if prob.kind[i] != "op" or not isinstance(place[i], Partial) or not prob.strats[i] or not prob.users[i]:
                continue
            ins = [r for r in prob.strats[i][sidx[i]].inputs if r is not None]
            if not any(isinstance(r, Partial) for r in ins):
                fresh.append(i)     # a fresh Partial (a row layer's product) is not a tie
                continue
            want = self._read_as(i)
            if want is None or isinstance(want, Partial):
                continue
            tensors = {prob.root[j] for j in (i, *prob.ins[i])}
            old = sidx[i], place[i]
            before = prob.node_cost[i][sidx[i]] + sum(self.tcost[j] for j in tensors)
            best = None
            for si, s in enumerate(prob.strats[i]):
                if s.output != want:
                    continue
                sidx[i], place[i] = si, self._out(i, si, place)
                new = {j: prob.tensor_cost(j, place, sidx) for j in tensors}
                after = prob.node_cost[i][si] + sum(new.values())
                if after <= before + 1e-12 * max(1.0, abs(before)) and (best is None or after < best[0]):
                    best = after, si, new
            sidx[i], place[i] = old
            if best is None:
                continue
            after, si, new = best
            sidx[i], place[i] = si, self._out(i, si, place)
            self.total += after - before
            for j, c in new.items():
                self.tcost[j] = c
        for i in (i for i in fresh if self._scaled(i)):   # (a scale's gradient summed too: reduced at once where that pays)
            self._read_whole(i)
        if nodes is not None:            # (no longer a function of the labelling alone)
            self.path = None
        elif self.path is not None:      # (a function of the labelling, as a commit is)
            self.path = (prob, prob.path_after(self.path[1], "reduce_early"))

    def _scaled(self, i, steps: int = 4) -> bool:
        """Whether a parameter is applied to Partial tensor i within `steps` ops of one other input each
        that keep it Partial or split (BEiT's row layer, its dropout, then its layer scale)."""
        prob = self.prob
        ins = {u: [j for j in prob.ins[u] if prob.kind[j] != "param"] for u in prob.users[i] if prob.kind[u] == "op"}
        return any(len(a) == 1 and isinstance(self.place[u], (Partial, Shard)) and
                   (len(a) < len(prob.ins[u]) or steps > 1 and self._scaled(u, steps - 1)) for u, a in ins.items())

    def gather_early(self, anchors) -> set:
        """Settle what the per-node choice passes on split for free: a reader of a split tensor (an
        anchor's output) that later ops would carry split (a dtype cast, a norm's statistics then
        all-reduced, the stream gathered after all) reads it whole at once wherever the step then
        costs less (LLaMA's embedding split on features, gathered before its first norm: half the
        bytes of the vocabulary-parallel all-reduce). The nodes changed are returned."""
        changed = set()
        if self.prob.gathers:
            for a in sorted(anchors):
                if isinstance(self.place[a], Shard) and not _whole_in_group(self.place[a]):
                    changed |= self._read_whole(a)
        return changed

    def _read_whole(self, a) -> set:
        """Each reader of node a that reads it split or Partial tried reading it whole, its output then
        propagated; the trial that lowers the step most committed. Returns the nodes changed."""
        prob, changed = self.prob, set()
        for u in sorted(prob.users[a]):
            if prob.kind[u] != "op" or len(prob.strats[u]) < 2:
                continue
            slots = [k for k, j in enumerate(prob.ins[u]) if j == a]
            if all(prob.strats[u][self.sidx[u]].inputs[k] == REPLICATE for k in slots):
                continue
            best = None
            for si, s in enumerate(prob.strats[u]):
                if si != self.sidx[u] and all(s.inputs[k] == REPLICATE for k in slots) and self.servable(u, s):
                    d, ov = self.tried({u: si}, u, si)
                    if d < -1e-12 * max(1.0, abs(self.total)) and (best is None or d < best[0]):
                        best = d, ov
            if best is not None:
                self.commit(*best)
                changed.update(best[1][2], best[1][3])
                self.path = None         # (no longer a function of the group choices alone)
        return changed

    def tried(self, forced: dict, u, what) -> tuple:
        """(delta, overlay) of ops taking the strategies of `forced` ({op: strategy}), as `trial` gives one;
        (0.0, None) without propagating where the same trial (`what` at node u) did not pay with the labels
        it read as they are (`tried.Tried`: here or in an alike layer). One that does not pay is noted."""
        memo = Tried.of(self.prob)
        if memo.failed(self, what, u):
            return 0.0, None
        delta, overlay = self._propagated({}, forced)
        if delta >= -1e-12 * max(1.0, abs(self.total)) and overlay is not None:
            memo.note(self, what, u, overlay)
        return delta, overlay

    def servable(self, i, s) -> bool:
        """Whether strategy `s` of node i can read its inputs as they are placed (a split parameter is
        read as stored, a held input as it is held: `_best` never takes such a strategy)."""
        prob = self.prob
        return all(req is None or (j not in prob.held_inputs or req == prob.held_inputs[j]) and
                   prob.edge_cost(j, self.place[j], req, s.grad(slot)) < INF
                   for slot, (j, req) in enumerate(zip(prob.ins[i], s.inputs)))

    def _read_as(self, i: int):
        """The one placement every reader's strategy reads tensor i in, or None if they differ."""
        seen = set()
        for u in self.prob.users[i]:
            strats = self.prob.strats[u]
            if not strats:
                return None
            s = strats[self.sidx[u]]
            seen.update(s.inputs[k] for k, j in enumerate(self.prob.ins[u]) if j == i)
        return seen.pop() if len(seen) == 1 else None

    def copy(self) -> "State":
        """An independent copy: a search refines it and keeps whichever of the two is cheaper."""
        new = object.__new__(State)
        new.prob, new.total, new.param_place = self.prob, self.total, dict(self.param_place)
        new.choice, new.sidx = list(self.choice), list(self.sidx)
        new.place, new.tcost = list(self.place), list(self.tcost)
        new.path = self.path
        return new

    def adopt(self, other: "State") -> set:
        """Take `other`'s labelling (a copy of this state, changed and settled: `relax`); returns the
        nodes whose label changed."""
        changed = {i for i, (a, b) in enumerate(zip(self.sidx, other.sidx)) if a != b or self.place[i] != other.place[i]}
        self.total, self.param_place, self.path = other.total, dict(other.param_place), other.path
        self.choice, self.sidx = list(other.choice), list(other.sidx)
        self.place, self.tcost = list(other.place), list(other.tcost)
        return changed

    def set_choices(self, choices: dict[int, int]) -> float:
        delta, ov = self.trial({g: c for g, c in choices.items() if c != self.choice[g]})
        self.commit(delta, ov)
        return delta
