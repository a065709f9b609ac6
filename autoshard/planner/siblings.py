"""Sibling anchors: decision groups' anchors two or more of which read one tensor (an attention's query,
key and value projections; the two norms of a parallel block reading its stream). What the per-node
choice decides for each alone, these moves decide for all of them at once (`planner.relax`).
"""
from __future__ import annotations

import itertools

from ..runtime.placements import REPLICATE, Partial

COMBOS = 3 ** 3        # strategy combinations of one set of siblings tried together at most


def sibling_sets(prob) -> list:
    """(tensor, the anchors reading it) for each tensor other than a parameter that anchors of two or
    more decision groups read, in the graph's order."""
    if "sibling anchors" not in prob.search_memo:
        readers: dict = {}
        for grp in prob.groups:
            for a in grp.anchors:
                for j in prob.ins[a]:
                    if prob.kind[j] != "param":
                        readers.setdefault(j, set()).add(a)
        prob.search_memo["sibling anchors"] = [(j, frozenset(s)) for j, s in sorted(readers.items()) if len(s) > 1]
    return prob.search_memo["sibling anchors"]


def summed_sets(prob) -> list:
    """(op, the anchors it reads) for each op reading the outputs of anchors of two or more decision
    groups (GPT-2's token and position embeddings, summed), in the graph's order: kept split together,
    they are summed split and the sum gathered once (`settle.settle_splits`)."""
    if "summed anchors" not in prob.search_memo:
        group_of = {a: g for g, grp in enumerate(prob.groups) for a in grp.anchors}
        out = []
        for u in range(len(prob.nodes)):
            if prob.kind[u] == "op":
                fed = frozenset(j for j in prob.ins[u] if j in group_of)
                if len({group_of[j] for j in fed}) > 1:
                    out.append((u, fed))
        prob.search_memo["summed anchors"] = out
    return prob.search_memo["summed anchors"]


def read_together(prob, state, families) -> list:
    """({family: choice}, {op: strategy}) moves that have siblings read their tensor whole together: each
    sibling that reads it split or Partial, or whole but wanting its whole gradient back, takes a
    strategy reading it whole, every one of a set at once, and its family (`relax.families`: the same
    group in every alike layer) the layout that holds it whole.

    Apart, each pays the whole gather and its weight would have to be gathered too, so the per-node
    choice keeps every one split: the two norms of a parallel block (GPT-NeoX, Falcon, GPT-J) each carry
    the split stream and gather their outputs, two all-gathers a layer where the stream read whole once
    by both is one; or both read it whole and each has its output's gradient all-reduced, where both
    sending back summands (Megatron's copy) have them summed and reduced once. Sets at the same places
    of alike layers move together, each sibling at the same strategy (`COMBOS` combinations at most)."""
    family_of = {g: f for f, fam in enumerate(families) for g in fam}
    group_of = {a: g for g, grp in enumerate(prob.groups) for a in grp.anchors}
    by_families: dict = {}
    for j, sibs in sibling_sets(prob):
        apart = [a for a in sibs if not _summed(prob, a, j, prob.strats[a][state.sidx[a]])]
        if len(apart) < 2 or any(group_of[a] not in family_of for a in apart):
            continue
        apart.sort(key=lambda a: family_of[group_of[a]])
        key = tuple(family_of[group_of[a]] for a in apart)
        by_families.setdefault(key, []).append((j, apart))
    out = []
    for key, sets in by_families.items():
        whole = {}
        for f in set(key):
            grp = prob.groups[families[f][0]]
            c = next((c for c, ch in enumerate(grp.choices) if all(pl == REPLICATE for pl in ch)), None)
            if c is None:
                break
            whole[f] = c
        else:
            j0, first = sets[0]
            options = [[s for s in prob.strats[a] if _whole_at(prob, a, j0, s)] for a in first]
            for combo in itertools.islice(itertools.product(*options), COMBOS):
                forced = {}
                for j, apart in sets:
                    for a, want in zip(apart, combo):
                        si = next((si for si, s in enumerate(prob.strats[a]) if _whole_at(prob, a, j, s) and
                                   s.inputs == want.inputs and s.output == want.output), None)
                        if si is not None:
                            forced[a] = si
                out.append((whole, forced))
    return out


def _summed(prob, a, j, s) -> bool:
    """Whether strategy `s` of op a reads its input j whole and, where j needs a gradient, sends back
    a summand of it (Partial): readers that do share one reduction of the summed gradient."""
    slots = [k for k, i in enumerate(prob.ins[a]) if i == j]
    return all(s.inputs[k] == REPLICATE and (not prob.needs_grad[j] or isinstance(s.grad(k), Partial)) for k in slots)


def _whole_at(prob, a, j, s) -> bool:
    """Whether strategy `s` of op a reads its input j whole (every slot of it)."""
    return all(s.inputs[k] == REPLICATE for k, i in enumerate(prob.ins[a]) if i == j)
