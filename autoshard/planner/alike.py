"""Alike layers as one: nodes named by their place in a run of repeated layers, so that what the
search learned in one layer (a trial that did not pay, and the labels around it) answers the same
trial in every other.

`saved.Repeats` finds the run (from the second layer on, each layer the second's nodes again: the
same ops on the same shapes, reading the layer before or values from before the run). A node of
those layers is named (layers from the trial's, position in its layer); a value from before the
run (the mask, the rotary embeddings), by itself. Anything else (the first layer, which may read
differently, and what follows the run) has no such name: a memo through it stays with its node.
"""
from __future__ import annotations

from .saved import Repeats


class AlikeLayers:
    """Translates node sets between alike layers (`relative` in one layer, `absolute` in another)."""

    def __init__(self, prob):
        reps = Repeats.of(prob)
        self.layers = [] if reps is None else reps.layers
        self.at = {} if reps is None else {i: at for i, at in reps.at.items() if at[0] >= 1}
        self.run = frozenset(() if reps is None else reps.at)
        self.start = min((i for nodes in self.layers for i in nodes if prob.kind[i] == "op"), default=-1)

    @classmethod
    def of(cls, prob) -> "AlikeLayers":
        """The problem's translation, made once and kept in its search memo."""
        if "alike layers" not in prob.search_memo:
            prob.search_memo["alike layers"] = cls(prob)
        return prob.search_memo["alike layers"]

    def recall(self, memo: dict, what, u) -> tuple | None:
        """((ops, parameters), their labels) that `remember` noted for `what` at node u, or at u's place in
        an alike layer (the nodes then named around u's layer)."""
        at = self.at.get(u)
        hit = None if at is None else memo.get((("at", at[1]), what))
        if hit is not None:
            nodes = tuple(self.absolute(rel, at[0]) for rel in hit[0])
            if None not in nodes:
                return nodes, hit[1]
        return memo.get((u, what))

    def remember(self, memo: dict, what, u, nodes: tuple, labels) -> None:
        """Note the nodes (ops, parameters) a trial `what` at node u read, and their `labels`: for every
        alike layer where they all have names relative to u's, else for u alone."""
        at = self.at.get(u)
        rel = (None,) if at is None else tuple(self.relative(group, at[0]) for group in nodes)
        if None not in rel:
            memo[("at", at[1]), what] = rel, labels
        else:
            memo[u, what] = nodes, labels

    def relative(self, nodes, layer: int) -> tuple | None:
        """`nodes` named relative to `layer`; None where one has no such name."""
        out = []
        for i in nodes:
            a = self.at.get(i)
            if a is not None:
                out.append((a[0] - layer, a[1]))
            elif i < self.start and i not in self.run:
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
