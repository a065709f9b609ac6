"""A tensor's communication as a table over what it depends on: the factors of `search="optimal"`'s
program (`optimal.solve`).

`Problem.tensor_cost` depends on the placements a tensor's view class is made in and on the readers
only through the set of (member, placement, gradient) they read, so each class is a table over maker
classes x reachable reader sets, each entry costed by `tensor_cost` itself on a representative
labelling (`factor`). A class too large to enumerate is tabled with its views reading their parents
as held (`held_combos`, walked depth first), plus the combinations of any plans given as hints.
"""
from __future__ import annotations

import itertools
import math

from ..runtime.placements import REPLICATE
from .problem import INF, Problem

COMBOS = 200_000          # combinations one tensor's factor may hold
RAW = 2_000_000           # combinations enumerated to find them, views read as held


def _param_of_group(prob: Problem) -> dict:
    """param key -> (group, position in its choices)."""
    return {k: (g, n) for g, grp in enumerate(prob.groups) for n, k in enumerate(grp.params)}


class Deciders:
    """The program's decisions: ("g", group) over its choices, ("s", op) over its strategies. A node's
    output placement is a function of one decider, or a constant."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.of_param = _param_of_group(prob)

    def domain(self, d) -> int:
        kind, i = d
        return len(self.prob.groups[i].choices) if kind == "g" else len(self.prob.strats[i])

    def source(self, i: int):
        """(decider, value -> placement) of node i's output, or (None, constant)."""
        prob = self.prob
        kind = prob.kind[i]
        if kind == "param":
            at = self.of_param.get(prob.param_key[i])
            if at is None:
                return None, REPLICATE
            g, n = at
            return ("g", g), (lambda c, g=g, n=n: prob.groups[g].choices[c][n])
        if kind == "op":
            if len(prob.strats[i]) == 1:
                return None, prob.strats[i][0].output
            return ("s", i), (lambda s, i=i: prob.strats[i][s].output)
        if kind == "select":
            d, f = self.source(prob.ins[i][0])
            k = prob.nodes[i].args[1]
            tensor = REPLICATE if hasattr(prob.val[i], "shape") else None

            def pick(src):
                return src[k] if isinstance(src, tuple) else tensor
            if d is None:
                return None, pick(f)
            return d, (lambda v, f=f: pick(f(v)))
        return None, (REPLICATE if hasattr(prob.val[i], "shape") else None)


def factor(prob: Problem, dec: Deciders, r: int, place, sidx, hints=()):
    """Tensor class r's communication as a table over what it depends on: the placements its members
    are made in (`makers`: decider -> value classes, values alike where they make the same placements)
    and the set of (member, placement, gradient) its readers read them in (`reads`: reader decider ->
    {value: that reader's features}). `tensor_cost` depends on the readers only through that set (one
    redistribution per distinct placement, one backward fix per distinct pair), so the table is over
    maker classes x reachable sets: {(maker classes..., feature set): cost}, with a representative
    labelling per entry costed by `tensor_cost` itself; entries no redistribution serves are left out.
    `hints`: labellings ((group choices, op strategies), e.g. the greedy's plan) whose entries a class
    tabled as held also gets, so the program holds those plans whatever redistributions they make."""
    members = prob.members.get(r, (r,))
    mset = set(members)
    makes: dict = {}                 # decider -> [(member, value -> placement)]
    for m in members:
        d, f = dec.source(m)
        if d is None:
            place[m] = f
        else:
            makes.setdefault(d, []).append((m, f))
    reads: dict = {}                 # reader decider -> {value: frozenset of (member, placement, gradient)}
    for m in members:
        for c in prob.users[m]:
            if prob.strats[c] and len(prob.strats[c]) > 1:
                reads[("s", c)] = {v: _features(prob, c, s, mset) for v, s in enumerate(prob.strats[c])}
            elif prob.strats[c]:
                sidx[c] = 0
    makers = sorted(makes)
    classes = []
    for d in makers:
        by_place: dict = {}
        for v in range(dec.domain(d)):
            by_place.setdefault(repr([f(v) for _, f in makes[d]]), []).append(v)
        classes.append(list(by_place.values()))
    reach = {frozenset(): {}}        # feature set -> {reader decider: a value giving it}
    for d, feats in sorted(reads.items()):
        options: dict = {}
        for v, fs in feats.items():
            options.setdefault(fs, v)
        grown: dict = {}
        for S, assign in reach.items():
            for fs, v in options.items():
                grown[S | fs] = {**assign, d: v}
            if len(grown) > COMBOS:      # (too many: the table is made over the deciders instead)
                break
        reach = grown
        if len(reach) > COMBOS:
            break
    n = math.prod(len(c) for c in classes) * len(reach)
    joint = _joint_classes(dec, sorted(set(makes) | set(reads)), makes, reads)
    held = n > COMBOS
    if held or math.prod(len(c) for c in joint) <= n:       # as few entries with every decision's values apart
        makers, classes, reach = sorted(set(makes) | set(reads)), joint, {frozenset(): {}}
        makes = {d: [(m, (lambda v, f=f, d=d: f(v))) for m, f in makes.get(d, ())] +
                 ([(None, (lambda v, d=d: sidx.__setitem__(d[1], v)))] if d in reads else []) for d in makers}
        reads = {}
        n = math.prod(len(c) for c in classes)
    if n > COMBOS and not held:
        raise ValueError(f"search='optimal': the communication of %{prob.nodes[r].name} depends on "
                         f"{len(makers)} placements and {len(reads)} readers with {n} combinations (> {COMBOS})")
    table = {}
    for combo in (held_combos(prob, r, makers, classes, makes, mset, place) if held else
                  itertools.product(*(range(len(c)) for c in classes))):
        if not held:
            for d, k, cls in zip(makers, combo, classes):
                _make(makes[d], cls[k][0], place)
        for S, assign in reach.items():
            for d, v in assign.items():
                sidx[d[1]] = v
            cost = _entry(prob, r, members, place, sidx)
            if cost is not None:
                table[(*combo, S)] = cost
    if held:
        for choice, strategies in hints:
            combo = []
            for d, cls in zip(makers, classes):
                v = choice[d[1]] if d[0] == "g" else strategies[d[1]]
                _make(makes[d], v, place)
                combo.append(next(k for k, c in enumerate(cls) if v in c))
            cost = _entry(prob, r, members, place, sidx)
            if cost is not None:
                table.setdefault((*combo, frozenset()), cost)
    if len(table) > COMBOS:
        raise ValueError(f"search='optimal': the communication of %{prob.nodes[r].name} has {len(table)} "
                         f"combinations of placements and readers (> {COMBOS}), views read as held")
    return makers, classes, reads, table, held


def _entry(prob: Problem, r: int, members, place, sidx):
    """Class r's communication in the labelling `place` / `sidx`, or None where no redistribution serves it."""
    if not all(_servable(prob, m, place, sidx) for m in members):
        return None
    cost = prob.tensor_cost(r, place, sidx)
    return None if cost == INF or math.isnan(cost) else cost


def _make(makes, v, place) -> None:
    """Set what one decider's value `v` makes: its members' placements (a reader's strategy by its setter)."""
    for m, f in makes:
        if m is None:
            f(v)
        else:
            place[m] = f(v)


def held_combos(prob: Problem, r: int, makers, classes, makes, mset, place):
    """The combinations of the makers' classes (their placements made in `place` as each is yielded) in
    which every view in the class reads the member it views in the placement that member is held in (no
    redistribution inside the class): the restriction a class too large to enumerate is solved under
    (`optimal.Solved.held_classes` counts them). Depth first in the graph's order (makers sorted: groups, then
    ops by node), a view's classes tried only where its own read holds: the combinations that hold, not
    all of them filtered (DeBERTa's mask, viewed 7 times: 2.5 million combinations). At most `RAW` tried."""
    combo, tried = [0] * len(makers), 0

    def holds(d, v) -> bool:
        if d[0] != "s" or d[1] not in mset:
            return True
        st = prob.strats[d[1]][v]
        return all(not (j in mset and st.inputs[slot] is not None and st.inputs[slot] != place[j])
                   for slot, j in enumerate(prob.ins[d[1]]))

    def walk(n):
        nonlocal tried
        if n == len(makers):
            yield tuple(combo)
            return
        for k, cls in enumerate(classes[n]):
            tried += 1
            if tried > RAW:
                raise ValueError(f"search='optimal': the communication of %{prob.nodes[r].name} depends on "
                                 f"{len(makers)} placements with over {RAW} combinations, views read as held")
            _make(makes[makers[n]], cls[0], place)
            if holds(makers[n], cls[0]):
                combo[n] = k
                yield from walk(n + 1)
    return walk(0)


def _joint_classes(dec: Deciders, deciders, makes, reads) -> list:
    """Per decider, its values grouped where they make the same placements and read alike."""
    out = []
    for d in deciders:
        by: dict = {}
        for v in range(dec.domain(d)):
            by.setdefault(repr(([f(v) for _, f in makes.get(d, ())], sorted(map(repr, reads.get(d, {}).get(v, ()))))),
                          []).append(v)
        out.append(list(by.values()))
    return out


def _features(prob: Problem, c: int, s, mset) -> frozenset:
    """(member, placement, gradient) of each slot of strategy `s` of op c that reads a member."""
    return frozenset((k, s.inputs[slot], s.grad(slot)) for slot, k in enumerate(prob.ins[c])
                     if k in mset and s.inputs[slot] is not None)


def _servable(prob: Problem, m: int, place, sidx) -> bool:
    """Whether every op reading tensor m reads it in a placement an edge reaches (`Problem.edge_cost`
    finite): what the greedy's propagation keeps to and `tensor_cost` does not ask (a split parameter
    is read as it is stored, never gathered)."""
    for c in prob.users[m]:
        if prob.kind[c] != "op" or not prob.strats[c]:
            continue
        s = prob.strats[c][sidx[c]]
        for slot, k in enumerate(prob.ins[c]):
            if k == m and s.inputs[slot] is not None and \
                    prob.edge_cost(m, place[m], s.inputs[slot], s.grad(slot)) == INF:
                return False
    return True
