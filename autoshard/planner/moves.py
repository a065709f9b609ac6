"""Moves of the greedy search beyond its windows (`search.greedy` runs them after its single flips).

`improve_entry`: the decision groups at the graph's entry (an op of theirs with no other group's op upstream:
a token embedding, a position embedding, a token-type embedding, a patch embedding) whose outputs
meet within a few ops (summed into the stream) are tried together, every combination of their
choices. Each alone cannot move: a token embedding split on features next to a position embedding
split on the vocabulary pays a gather that the pair split alike does not, so no single flip from
the vocabulary-parallel pair reaches the feature-split one (GPT-2's and BERT's embeddings at 2 and
4 ranks: 3.8-4.4% of the step, found by the ILP oracle, `planner.optimal`).
"""
from __future__ import annotations

import itertools
import math

MEET_DEPTH = 3        # ops from an entry group's op to where its output meets another's
MEET_COMBOS = 256     # combinations a meeting set is tried with at most


def entry_meetings(prob) -> list[tuple]:
    """Sets of entry groups (see the module docstring) whose ops' outputs meet at one op within
    MEET_DEPTH ops, each set sorted, largest first."""
    anchor_group = {}
    for g, grp in enumerate(prob.groups):
        for a in grp.anchors:
            anchor_group.setdefault(a, g)
    upstream: list[frozenset] = [frozenset()] * len(prob.nodes)     # groups whose anchors lie above node i
    for i in range(len(prob.nodes)):
        above = frozenset().union(*(upstream[j] for j in prob.ins[i])) if prob.ins[i] else frozenset()
        upstream[i] = above | ({anchor_group[i]} if i in anchor_group else frozenset())
    def first(a, g):            # an op of group g with no other group's op upstream
        return not any(upstream[j] - {g} for j in prob.ins[a])

    starts = {g: [a for a in grp.anchors if first(a, g)] for g, grp in enumerate(prob.groups)}
    entry = [g for g, at in starts.items() if at]
    reached: dict[int, set] = {}
    for g in entry:
        depth = {a: 0 for a in starts[g]}
        frontier = list(depth)
        while frontier:
            nxt = []
            for i in frontier:
                if depth[i] >= MEET_DEPTH:
                    continue
                for u in prob.users[i]:
                    if u not in depth and prob.kind[u] == "op":
                        depth[u] = depth[i] + 1
                        nxt.append(u)
            frontier = nxt
        for i in depth:
            reached.setdefault(i, set()).add(g)
    sets = {tuple(sorted(gs)) for gs in reached.values() if len(gs) > 1}
    return sorted(sets, key=lambda s: (-len(s), s))


def improve_entry(state) -> bool:
    """Try every combination of each meeting set of entry groups (`entry_meetings`) where they are
    at most MEET_COMBOS; commit the best where the total drops. Returns whether anything changed."""
    prob = state.prob
    changed = False
    for gs in entry_meetings(prob):
        sizes = [len(prob.groups[g].choices) for g in gs]
        if math.prod(sizes) > MEET_COMBOS:
            continue
        best = None
        for combo in itertools.product(*(range(n) for n in sizes)):
            move = {g: c for g, c in zip(gs, combo) if c != state.choice[g]}
            if not move:
                continue
            d, ov = state.trial(move)
            if best is None or d < best[0]:
                best = d, ov
        if best is not None and best[0] < -1e-12 * max(1.0, abs(state.total)):
            state.commit(*best)
            changed = True
    return changed
