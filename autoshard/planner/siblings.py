"""Sibling anchors: decision groups' anchors two or more of which read one tensor (an attention's query,
key and value projections; the two norms of a parallel block reading its stream). What the per-node
choice decides for each alone, these moves decide for all of them at once (`planner.relax`).
"""
from __future__ import annotations

import itertools

from ..runtime.placements import REPLICATE, Partial, Replicate, Shard

COMBOS = 3 ** 3        # strategy combinations of one set of siblings tried together at most
BELOW = 3              # families below siblings read split that `read_split` offers to choose again


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


def read_split(prob, state, families, depth: int = 8) -> list:
    """({family: choice}, {op: strategy}, [family below]) moves that have siblings reading a tensor made
    whole above them read it split together: the ops above that gather it or all-reduce it
    (`_made_whole`) keep it split (reduce-scattered), each sibling reads it split with its family in the
    layout that does (a row layer's), all sets at the same places of alike layers at once; the families
    below them (`_below`) are for the caller to choose again given the move (`relax`).

    Apart, each such flip keeps the gather above (the other siblings still read whole) and no op above
    is revisited: DeepSeek-V2's MLA projections read its stream split on features, normed split, the
    stream never gathered (the optimum's step; the greedy's gathered it, 1.014x at 4 ranks)."""
    family_of = {g: f for f, fam in enumerate(families) for g in fam}
    group_of = {a: g for g, grp in enumerate(prob.groups) for a in grp.anchors}
    by_families: dict = {}
    for j, sibs in sibling_sets(prob):
        if isinstance(state.place[j], Replicate) and all(group_of[a] in family_of for a in sibs) and \
                all(_whole_at(prob, a, j, prob.strats[a][state.sidx[a]]) for a in sibs):
            fams = tuple(sorted({family_of[group_of[a]] for a in sibs}))
            if len(fams) > 1:
                by_families.setdefault(fams, []).append((j, sorted(sibs)))
    out = []
    for sets in by_families.values():
        chosen, forced = {}, {}
        if all(_set_read_split(prob, state, j, sibs, chosen, forced, family_of, group_of, depth)
               for j, sibs in sets):
            out.append((chosen, forced, _below(prob, [a for _, sibs in sets for a in sibs], chosen, family_of,
                                               group_of)[:BELOW]))
    return out


def _below(prob, sibs, chosen, family_of, group_of, reach: int = 16) -> list:
    """Families other than `chosen` whose anchors the siblings' outputs reach (within `reach` ops), nearest
    first: once the siblings' Partial outputs are reduced whole, they may take another layout
    (DeepSeek-V2's K/V norm and up projection run whole, its output projection unchunked)."""
    out, todo, seen = [], [(a, 0) for a in sibs], set(sibs)
    for i, d in todo:
        f = family_of.get(group_of.get(i))
        if f is not None and f not in chosen and f not in out:
            out.append(f)
        for u in prob.users[i] if d < reach else ():
            if u not in seen and prob.kind[u] != "output":
                seen.add(u)
                todo.append((u, d + 1))
    return out


def _set_read_split(prob, state, j, sibs, chosen, forced, family_of, group_of, depth) -> bool:
    """Add to `chosen` ({family: choice}) and `forced` ({op: strategy}) what has siblings `sibs` read tensor
    j split (`read_split`); whether they can."""
    points = _made_whole(prob, state, j, depth)
    for t in points:
        si = split_strategy(prob, state, t)
        if si is None:
            return False
        forced[t] = si
    for a in sibs:
        row = _row(prob, a, j, group_of[a])
        if row is None or chosen.setdefault(family_of[group_of[a]], row[1]) != row[1]:
            return False
        forced[a] = row[0]
    return bool(points)


def split_strategy(prob, state, t):
    """The cheapest strategy of op t with a split output that keeps every input it reads split: a split
    one read as it is, a Partial one reduce-scattered, a whole one sliced; None where there is none."""
    place = state.place
    keep = [si for si, s in enumerate(prob.strats[t]) if isinstance(s.output, Shard) and
            all(r is None or prob.kind[i] != "op" or
                (r == place[i] if isinstance(place[i], Shard) else isinstance(r, Shard))
                for i, r in zip(prob.ins[t], s.inputs)) and state.servable(t, s)]
    return min(keep, key=prob.node_cost[t].__getitem__) if keep else None


def _made_whole(prob, state, j, depth: int = 8) -> list:
    """The ops at or above tensor j, through whole tensors (within `depth` ops), that read a split or
    Partial input whole (a gather, an all-reduce)."""
    out, todo, seen = [], [(j, 0)], {j}
    for t, d in todo:
        if prob.kind[t] != "op" or not prob.strats[t]:
            continue
        now = prob.strats[t][state.sidx[t]].inputs
        if any(isinstance(state.place[i], (Shard, Partial)) and isinstance(r, Replicate)
               for i, r in zip(prob.ins[t], now) if prob.kind[i] == "op"):
            out.append(t)
            continue
        for i in prob.ins[t] if d < depth else ():
            if prob.kind[i] == "op" and i not in seen and isinstance(state.place[i], Replicate):
                seen.add(i)
                todo.append((i, d + 1))
    return out


def _row(prob, a, j, g):
    """(strategy, choice of group g) of the cheapest strategy of anchor a reading tensor j split, its
    parameters as a choice of g holds them; None where there is none."""
    grp, best = prob.groups[g], None
    for si, s in enumerate(prob.strats[a]):
        if not all(isinstance(s.inputs[k], Shard) for k, i in enumerate(prob.ins[a]) if i == j):
            continue
        want = {prob.param_key[i]: s.inputs[k] for k, i in enumerate(prob.ins[a]) if i in prob.param_key}
        c = next((c for c, ch in enumerate(grp.choices) if all(want.get(p, pl) == pl for p, pl in zip(grp.params, ch))),
                 None)
        if c is not None and (best is None or prob.node_cost[a][si] < prob.node_cost[a][best[0]]):
            best = si, c
    return best


def _summed(prob, a, j, s) -> bool:
    """Whether strategy `s` of op a reads its input j whole and, where j needs a gradient, sends back
    a summand of it (Partial): readers that do share one reduction of the summed gradient."""
    slots = [k for k, i in enumerate(prob.ins[a]) if i == j]
    return all(s.inputs[k] == REPLICATE and (not prob.needs_grad[j] or isinstance(s.grad(k), Partial)) for k in slots)


def _whole_at(prob, a, j, s) -> bool:
    """Whether strategy `s` of op a reads its input j whole (every slot of it)."""
    return all(s.inputs[k] == REPLICATE for k, i in enumerate(prob.ins[a]) if i == j)
