"""Trials that did not pay, remembered with the labels of what they read, so that a search does not
propagate them again while those labels stand: in the node's own place, and in every alike layer.

A trial (ops forced to strategies, `State.tried`) reads the labels of the nodes it changed or costed,
their readers and inputs (`read_by`); while those are as they were, it comes out the same. Nodes of a
run of repeated layers (`saved.Repeats`: from the second layer on, each the second's nodes again, the
same ops on the same shapes) are named by their place in it (`AlikeLayers`), so what one layer learned
answers the same trial in every other: an 80-layer plan tries each early gather once, not 80 times.
"""
from __future__ import annotations

from ..runtime.placements import Partial, Replicate, Shard
from .saved import Repeats


class AlikeLayers:
    """Node sets named relative to a layer of the run (`relative`) and named again around another
    (`absolute`). A value from before the run (the mask, the rotary embeddings) is named by itself; the
    first layer (which may read differently) and what follows the run have no such names."""

    def __init__(self, prob):
        reps = Repeats.of(prob)
        self.layers = [] if reps is None else reps.layers
        self.at = {} if reps is None else {i: at for i, at in reps.at.items() if at[0] >= 1}
        self.start = min((i for nodes in self.layers for i in nodes if prob.kind[i] == "op"), default=-1)
        self.layer_of = {} if reps is None else {i: at[0] for i, at in reps.at.items()}
        self.nodes = [frozenset(nodes) for nodes in self.layers]
        self.groups: list = [[] for _ in self.layers]           # each layer's decision groups
        for g, grp in enumerate(prob.groups):
            for j in sorted({self.layer_of[a] for a in grp.anchors if a in self.layer_of}):
                self.groups[j].append(g)

    def signature(self, state, j: int) -> tuple:
        """The labels of layers j - 1 and j (every node's strategy, every group's choice): all that a walk
        within layer j reads, and its ops' inputs."""
        return (tuple(state.sidx[i] for k in (j - 1, j) for i in self.layers[k]),
                tuple(state.choice[g] for k in (j - 1, j) for g in self.groups[k]))

    def relative(self, nodes, layer: int) -> tuple | None:
        """`nodes` named relative to `layer`; None where one has no such name."""
        out = []
        for i in nodes:
            a = self.at.get(i)
            if a is not None:
                out.append((a[0] - layer, a[1]))
            elif i < self.start and i not in self.layer_of:
                out.append(i)
            else:
                return None
        return tuple(out)

    def absolute(self, rel, layer: int) -> tuple | None:
        """The nodes `rel` (from `relative`) names around `layer`; None where a layer is missing."""
        out = []
        for r in rel:
            if isinstance(r, tuple):
                j = layer + r[0]
                if not 1 <= j < len(self.layers):
                    return None
                out.append(self.layers[j][r[1]])
            else:
                out.append(r)
        return tuple(out)


class Tried:
    """A problem's trials that did not pay: (trial, node) -> (the nodes it read, their labels)."""

    def __init__(self, prob):
        self.prob, self.alike, self.memo = prob, AlikeLayers(prob), {}

    @classmethod
    def of(cls, prob) -> "Tried":
        """The problem's memo, made once and kept in its search memo."""
        if "tried" not in prob.search_memo:
            prob.search_memo["tried"] = cls(prob)
        return prob.search_memo["tried"]

    def name(self, u, nodes) -> tuple:
        """`nodes` named around node u's place in alike layers (part of a trial's name), or as they are."""
        at = self.alike.at.get(u)
        rel = None if at is None else self.alike.relative(nodes, at[0])
        return tuple(nodes) if rel is None else ("at", rel)

    def failed(self, state, what, u) -> bool:
        """Whether trial `what` at node u did not pay, here or at u's place in an alike layer, with the labels
        it read as they are in `state` now."""
        at = self.alike.at.get(u)
        hit = None if at is None else self.memo.get((("at", at[1]), what))
        if hit is not None:
            nodes = tuple(self.alike.absolute(rel, at[0]) for rel in hit[0])
            if None not in nodes:
                return _labels(state, nodes) == hit[1]
        hit = self.memo.get((u, what))
        return hit is not None and _labels(state, hit[0]) == hit[1]

    def note(self, state, what, u, overlay) -> None:
        """Note that trial `what` at node u (its `overlay`) did not pay in `state`: for every alike layer where
        what it read has names relative to u's, else for u alone."""
        nodes = read_by(self.prob, state.place, overlay, u)
        at = self.alike.at.get(u)
        rel = (None,) if at is None else tuple(self.alike.relative(group, at[0]) for group in nodes)
        if None not in rel:
            self.memo[("at", at[1]), what] = rel, _labels(state, nodes)
        else:
            self.memo[u, what] = nodes, _labels(state, nodes)


def _labels(state, nodes) -> tuple:
    ops, params = nodes
    return tuple(map(state.sidx.__getitem__, ops)), tuple(map(state.place.__getitem__, params))


def read_by(prob, place, overlay, u) -> tuple:
    """(ops, parameters) whose labels a trial at node u read: those it changed or costed (with their view
    classes), their readers, inputs and the inputs' other readers where they count (`State._read_before`),
    and the inputs of the readers of what changed placement (whose choice a change there alters). Not the
    readers of what costs nothing however read (a size, the rotary's cos: whole, without a gradient), nor ops
    of one strategy (no choice to note)."""
    free = {r for r in overlay[4] if not prob.nbytes[r] or all(
        type(place[m]) is Replicate and not prob.needs_grad[m] for m in prob.members.get(r, (r,)))}
    base = {u, *overlay[2], *overlay[3], *(m for r in set(overlay[4]) - free for m in (r, *prob.members.get(r, ())))}
    out = base | free
    for w in {w for i in (u, *overlay[2]) for w in prob.users[i]}:    # where the propagation stopped
        out.update(prob.ins[w])
    for i in base:
        out.update(prob.users[i])
        for j in prob.ins[i]:
            out.add(j)
            if prob.needs_grad[j] or isinstance(place[j], (Shard, Partial)):
                out.update(prob.users[j])
    return tuple(i for i in out if prob.kind[i] != "param" and len(prob.strats[i]) > 1), \
        tuple(i for i in out if prob.kind[i] == "param")
