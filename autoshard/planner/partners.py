"""A family whose split output its readers gather at once, flipped to a layout they read as it is, with
its partners (the families whose outputs meet its own, and those below it) chosen again after it. Each
flip alone keeps the gathers the others make, so none pays: DeBERTa's fused q/k/v projection split in
chunks that its heads' view cannot read, with its query and value biases, the relative-position
projections and the output layer, is run by heads only all together (`planner.relax`).
"""
from __future__ import annotations

import torch

from ..runtime.placements import REPLICATE, Replicate, Shard
from .settle import split_chain

PARTNERS = 6     # families chosen again after a gathered family's flip, nearest first
REACH = 16       # ops below a family's anchors where a partner's outputs may meet them
MEET = 6         # ops below a partner's anchors within which its outputs meet those


def gathered_families(prob, state, families) -> list:
    """({family: choice}, {op: strategy}, [partner family]) for each family an op reads the split output
    of whole (a gather right after it) and each other layout of it that is not whole, what then gathers
    below it run split (`settle.split_chain`): the caller tries the flip and chooses its partners
    (`partners`) again one after another, each given those before."""
    family_of = {g: f for f, fam in enumerate(families) for g in fam}
    out = []
    for f, fam in enumerate(families):
        anchors = [a for g in fam for a in prob.groups[g].anchors]
        if not any(_gathered(prob, state, a) for a in anchors):
            continue
        now, choices = state.choice[fam[0]], prob.groups[fam[0]].choices
        found = None
        for c, ch in enumerate(choices):
            if c == now or all(pl == REPLICATE for pl in ch):
                continue
            if found is None:
                found = partners(prob, f, anchors, family_of)[:PARTNERS]
            out.append(({f: c}, split_chain(prob, state, {g: c for g in fam}, {}), found))
    return out


def _gathered(prob, state, a) -> bool:
    """Whether a reader of anchor a's split output reads it whole."""
    if not isinstance(state.place[a], Shard):
        return False
    for u in prob.users[a]:
        if prob.kind[u] == "op" and prob.strats[u]:
            s = prob.strats[u][state.sidx[u]]
            if any(j == a and isinstance(r, Replicate) for j, r in zip(prob.ins[u], s.inputs)):
                return True
    return False


def partners(prob, f, anchors, family_of) -> list:
    """Families other than f with an anchor whose output meets (within `MEET` ops) an op below f's
    anchors (within `REACH`), nearest meeting first (a bias added to its output, a projection its
    output is multiplied with, then the layer reading what it makes)."""
    below, stop = _reach(prob, anchors, REACH), set(anchors)
    near: dict = {}
    for g, grp in enumerate(prob.groups):
        h = family_of.get(g)
        if h is None or h == f:
            continue
        for a in grp.anchors:
            met = [below[i] for i in (a, *_reach(prob, [a], MEET, stop)) if i in below]
            if met and min(met) < near.get(h, (REACH + 1, 0))[0]:
                near[h] = min(met), a
    return sorted(near, key=near.__getitem__)


def _reach(prob, starts, depth: int, stop=frozenset()) -> dict:
    """{op: its distance} for the ops below `starts` within `depth` ops (the starts not included) through
    tensors (not sizes: an index made from a tensor's length is not its value), not past those in `stop`
    (a partner's outputs meet f's below f's anchors, not through them)."""
    out, todo = {}, [(a, 0) for a in starts]
    for i, d in todo:
        if d >= depth or i in stop:
            continue
        for u in prob.users[i]:
            if u not in out and prob.kind[u] != "output" and isinstance(prob.val[u], (torch.Tensor, tuple, list)):
                out[u] = d + 1
                todo.append((u, d + 1))
    return out
