"""Relaxing the plan without a budget: the search ran at one price of state for the whole model;
here whole families of groups (a group with its namesakes in every alike layer) are flipped, one
family at a time and then two or more together, wherever the step gets faster (or as fast with
less state) and the state per rank stays within the bound (`budget.least_comm`). Steps are compared
as the plan will run: with its reductions settled (`State.reduce_early`)."""
from __future__ import annotations

import itertools
import math

from ..capture.repeats import layer_key
from ..runtime.placements import REPLICATE, Partial, Shard
from .held import group_bytes, memory_term
from .problem import INF
from .partners import gathered_families
from .search import anchor_nodes, first_layers_alike, windows
from .settle import (gather_weights, gathered_at, run_whole, scatter_early, settle_splits, split_gathers,
                     sum_grads_late, sum_late)
from .siblings import read_split, read_together
from .vocabulary import vocabulary_heads

PAIRED = 8             # flips over the bound that `_pairs` tries with each flip freeing bytes
PAIR_COMBOS = 3 ** 4   # choices of families enumerated together at most (`PAIR_COMBOS2` of two)
PAIR_COMBOS2 = 12 ** 2
PASSED = 3             # ops of one input (a dtype cast, a dropout) a family's output is followed through


def families(prob) -> list:
    """The decision groups as families flipped together: a group with its namesakes of the same shapes
    in every other numbered layer (`capture.repeats.layer_key`; alike layers stay alike: one block
    graph, one compile), a group outside numbered layers alone. (ConvNeXt's stages, 32 and 64 wide,
    are not alike: a flip may pay in one.)"""
    by_key: dict = {}
    for g, grp in enumerate(prob.groups):
        key = layer_key(grp.names[0])
        shapes = tuple(tuple(prob.param_obj[k].shape) for k in grp.params)
        by_key.setdefault(g if key is None else (key[0], shapes), []).append(g)
    out = []
    for fam in by_key.values():
        if len({len(prob.groups[g].choices) for g in fam}) == 1:
            out.append(fam)
        else:
            out.extend([g] for g in fam)
    return out


def _settled(prob, state, move, trial, alike=frozenset(), cache=None, split=False, early=True) -> tuple:
    """(how much faster the step of `state` gets with `move` ({group: choice}) made (its `trial`:
    delta and overlay), the state so changed and settled): both with their split outputs settled
    (`settle_splits`: gathered at once, or kept split together, where that pays) and their reductions settled (`State.reduce_early`, as
    every plan is built) over the nodes the move changes, their readers and the Partial or split
    chains above them: elsewhere the two settle alike. The settled state is what `relax` commits
    (committed unsettled, a later move compared settled states from another labelling, and
    Persimmon's MLP flipped to the optimum's layout and back). INF where the move sets apart the first layer of a run in `alike`
    (`search.first_layers_alike`: alike layers stay one block graph, one compile). `cache`: {anchors:
    `state` with their early gathers settled}, kept while `state` is unchanged (a family's every choice
    settles the same state before it). Residual sums of a split and a Partial tensor are settled too
    (`settle.scatter_early`); with `split` (a move reading a tensor split, `siblings.read_split`), also
    what then runs whole (`settle.run_whole`) or gathers a split input (`settle.split_gathers`). Without
    `early`, the move's split outputs are not settled (a move that runs them split: `_run_split`)."""
    delta, overlay = trial
    if overlay is None:
        return 0.0, None
    changed = state.copy()
    changed.commit(delta, overlay)
    if alike and not alike <= first_layers_alike(changed):
        return INF, None
    anchors = {a for g in move for a in prob.groups[g].anchors}
    if any(all(pl == REPLICATE for pl in prob.groups[g].choices[c]) for g, c in move.items()):
        anchors |= _feeding(prob, state, anchors)       # (made whole: it may read what feeds it whole)
    hit = None if cache is None else cache.get(frozenset(anchors))
    if hit is None:
        base = state.copy()
        hit = base, settle_splits(prob, base, anchors)
        if cache is not None:
            cache[frozenset(anchors)] = hit
    before = hit[0].copy()
    gathered = hit[1] | (settle_splits(prob, changed, anchors) if early else set())
    region, todo = set(), [*overlay[2], *overlay[3], *overlay[4], *gathered, *(u for i in overlay[2] for u in prob.users[i])]
    while todo:
        i = todo.pop()
        if i not in region:
            region.add(i)
            todo += [j for j in prob.ins[i] if prob.kind[j] == "op"
                     and (isinstance(state.place[j], (Partial, Shard)) or isinstance(changed.place[j], (Partial, Shard)))]
    sums = {u for i in (*overlay[2], *overlay[3], *gathered) for u in prob.users[i]}     # (readers of what moved)
    for settled in (before, changed):
        extra = scatter_early(prob, settled, region) | \
            (run_whole(prob, settled, region) | split_gathers(prob, settled, region) if split else set())
        settled.reduce_early(region | extra | sum_late(prob, settled, sums))
    held = sum(memory_term(prob, prob.groups[g].params, prob.groups[g].choices[c]) -
               memory_term(prob, prob.groups[g].params, prob.groups[g].choices[state.choice[g]]) for g, c in move.items())
    return changed.total - before.total - held, changed


def _feeding(prob, state, anchors, depth: int = 8) -> set:
    """Anchors whose split output reaches `anchors` carried split (through at most `depth` ops): a
    norm's weight made whole lets the norm read the split embedding feeding it whole at once
    (`State.gather_early` at the embedding)."""
    owners = anchor_nodes(prob)
    out, todo, seen = set(), [(a, 0) for a in anchors], set(anchors)
    for i, d in todo:
        for j in prob.ins[i]:
            if j in seen or prob.kind[j] != "op" or not isinstance(state.place[j], Shard):
                continue
            seen.add(j)
            if j in owners:
                out.add(j)
            elif d < depth:
                todo.append((j, d + 1))
    return out


def relax(prob, state, bound, held) -> None:
    """`_relax`, then the split outputs settled (`settle_splits`), as the relaxing step compared its moves;
    where that settling changed the plan, `_relax` once more (OLMo's output projection at 8 ranks pays
    only once the last layer's gathers are settled: 1.04x the optimum's step without); then what gathers
    run split (`_run_split`)."""
    anchors = anchor_nodes(prob)
    held = _relax(prob, state, bound, held)
    if settle_splits(prob, state, anchors):
        held = _relax(prob, state, bound, held)
        settle_splits(prob, state, anchors)
    _run_split(prob, state, bound, held)
    if sum_grads_late(prob, state, range(len(prob.nodes))) | gather_weights(prob, state):
        state.reduce_early()


def _run_split(prob, state, bound, held) -> None:
    """The best move of `partners.gathered_families` (a family whose output is gathered at once flipped,
    what then gathers below it run split, its partners chosen again: `_descend`, no early gathers
    settled, which would gather it again), adopted where the step gets faster. Tried once the relaxing
    step and its settling are done: among the relaxing moves, it took a step the settling would have
    made better (a small DeBERTa-like model: 1.07x the optimum's step, 1.005x without it)."""
    fams = _free_families(prob, state)
    found = _descend(prob, state, gathered_families(prob, state, fams), fams, held, bound, first_layers_alike(state),
                     {}, early=False)
    best = min(found, key=lambda f: f[0], default=None)
    if best is not None and best[0] < -1e-12 * max(1.0, abs(state.total)):
        state.adopt(best[2])


def _free_families(prob, state) -> list:
    """`families` less those of heads tied to an embedding and split on the vocabulary, which the
    relaxing moves keep so (`vocabulary.vocabulary_heads`)."""
    kept = vocabulary_heads(prob, state)
    return [fam for fam in families(prob) if not kept.intersection(fam)]


def _relax(prob, state, bound, held) -> float:
    """Flip one family of groups at a time (`families`) where the step gets faster (or as fast with
    less state) and the state stays within `bound`: the prices move whole kinds of layers at once,
    the bound is per byte. Where no single flip pays, two at once (`_pairs`). Steps are compared as
    the plan will run, reductions settled (`_settled`): a flip can pay only then (ConvNeXt's layer
    scale kept whole: the row layer's output it scales is then all-reduced at once, where a split
    scale passed it on Partial and reduced it later too). With them, siblings read their tensor whole
    together (`siblings.read_together`: a parallel block's two norms). Returns the state then held."""
    fams = _free_families(prob, state)
    rejected: dict = {}          # (family, choice) -> nodes its last trial read or wrote, while unchanged since
    cache: dict = {}             # `_settled`'s states before a move, while `state` is unchanged
    for _ in range(4):
        tol = 1e-12 * max(1.0, abs(state.total))
        alike = first_layers_alike(state)
        improved, over, freeing = False, [], []
        for f, fam in enumerate(fams):
            now = [state.choice[g] for g in fam]
            old_b = _family_bytes(prob, state, fam)
            best = None
            for c in range(len(prob.groups[fam[0]].choices)):
                if all(n == c for n in now):
                    continue
                added = _family_bytes(prob, state, fam, c) - old_b
                if added < 0:
                    freeing.append((fam, c, added))
                if held + added > bound:
                    over.append((fam, c, added))      # (tried in `_pairs` where another flip frees enough)
                    continue
                if (f, c) in rejected:
                    continue
                move = {g: c for g in fam if state.choice[g] != c}
                d, ov = state.trial(move)
                step, settled = _settled(prob, state, move, (d, ov), alike, cache)
                if settled is not None and (step < -tol or (step <= tol and added < 0)):
                    if best is None or (step, added) < best[:2]:
                        best = step, added, settled
                else:
                    rejected[f, c] = _touched(prob, ov, move)
            if best is not None:
                _commit(prob, state, best, rejected, cache)
                held += best[1]
                improved = True
        if not improved:
            best = None
            for move, added, forced in [*((m, a, None) for m, a in _pairs(prob, state, fams, over, freeing, held, bound,
                                                                          alike, cache)),
                                        *_together_read(prob, state, fams, held, bound)]:
                step, settled = _settled(prob, state, move, state.trial(move, forced), alike, cache)
                if settled is not None and step < -tol and (best is None or step < best[0]):
                    best = step, added, settled
            for found in _descend(prob, state, read_split(prob, state, fams), fams, held, bound, alike, cache):
                if found[0] < -tol and (best is None or found[0] < best[0]):
                    best = found
            if best is None:
                return held
            _commit(prob, state, best, rejected, cache)
            held += best[1]
    return held


def _together_read(prob, state, fams, held, bound) -> list:
    """(move, bytes added, forced strategies) of `siblings.read_together` within the bound."""
    out = []
    for chosen, forced in read_together(prob, state, fams):
        added = _added(prob, state, fams, chosen)
        if held + added <= bound:
            out.append((_move(state, fams, chosen), added, forced))
    return out


def _descend(prob, state, moves, fams, held, bound, alike, cache, early=True) -> list:
    """(step, bytes added, the state settled) of each move ({family: choice}, {op: strategy} or None,
    [family]) within the bound, the families it names chosen again one after another, each at its best
    given those before: the families below siblings read split (`siblings.read_split`; DeepSeek-V2 at 8
    ranks: its K/V norm and up projection whole and its output projection unchunked, none of which pays
    alone) and a gathered family's partners (`partners.gathered_families`). `early`: as `_settled`'s."""
    out = []
    for chosen, forced, below in moves:
        best = None
        for f in (None, *below):
            base = chosen if best is None else best[3]
            for c in (None,) if f is None else range(len(prob.groups[fams[f][0]].choices)):
                if f is not None and all(state.choice[g] == c for g in fams[f]):
                    continue                          # (as the move before it)
                tried = base if f is None else {**base, f: c}
                added = _added(prob, state, fams, tried)
                if held + added > bound:
                    continue
                move = _move(state, fams, tried)
                step, settled = _settled(prob, state, move, state.trial(move, forced), alike, cache,
                                         split=True, early=early)
                if settled is not None and (best is None or step < best[0]):
                    best = step, added, settled, tried
        if best is not None:
            out.append(best[:3])
    return out


def _added(prob, state, fams, chosen) -> float:
    """Bytes a rank holds more with families at the choices of `chosen` ({family: choice})."""
    return sum(_family_bytes(prob, state, fams[f], c) - _family_bytes(prob, state, fams[f]) for f, c in chosen.items())


def _move(state, fams, chosen) -> dict:
    """{group: choice} of `chosen` ({family: choice}) where a group is not there yet."""
    return {g: c for f, c in chosen.items() for g in fams[f] if state.choice[g] != c}


def _touched(prob, overlay, move) -> frozenset:
    """The nodes a trial changed, the tensors they read and their readers, and the flipped groups'
    anchors: while none of them changes, the trial would come out the same."""
    out = {a for g in move for a in prob.groups[g].anchors}
    if overlay is not None:
        for i in {*overlay[2], *overlay[3], *overlay[4]}:
            out.add(i)
            out.update(prob.ins[i])
            out.update(prob.users[i])
    return frozenset(out)


def _commit(prob, state, best, rejected, cache) -> None:
    """Commit `best` (step, bytes added, the state settled), forgetting the rejections it may undo and
    the states `_settled` kept from before it."""
    cache.clear()
    changed = state.adopt(best[2])
    for key in [k for k, nodes in rejected.items() if not nodes.isdisjoint(changed)]:
        del rejected[key]


def _family_bytes(prob, state, fam, c=None) -> float:
    """Bytes a rank holds of a family's groups: as they are, or at choice `c`."""
    memo = prob.search_memo.setdefault("group bytes", {})
    total = 0.0
    for g in fam:
        key = g, state.choice[g] if c is None else c
        if key not in memo:
            memo[key] = group_bytes(prob, prob.groups[g].params, prob.groups[g].choices[key[1]])
        total += memo[key]
    return total


def _pairs(prob, state, every, over, freeing, held, bound, alike, cache):
    """(move, bytes added) of two or more family flips at once, for `relax` where no single flip
    pays: every choice of families whose outputs one op reads (GPT-2's token and position
    embeddings, summed: split on features both, or on rows both), and of the families of each joint
    window (`search.windows`: a layer scale or a norm with the layers reading its output); then a
    flip or such a choice that pays but exceeds the bound with one flip that frees the bytes (a
    stage's layer scale kept whole, its downsampling split on outputs, bias and all; an attention's
    output projection split on inputs with the scale it feeds whole, the input layer split)."""
    tol = 1e-12 * max(1.0, abs(state.total))
    least = min((ay for _, _, ay in freeing), default=0.0)
    family_of = {g: f for f, fam in enumerate(every) for g in fam}
    crowded = [({g: cx for g in fx if state.choice[g] != cx}, ax) for fx, cx, ax in over]
    found = _together(prob, every, family_of)
    for together in found + _siblings(prob, every, family_of, found) + _across_gathers(prob, state, family_of):
        chosen = [every[f] for f in together]
        sizes = [len(prob.groups[fam[0]].choices) for fam in chosen]
        now = sum(_family_bytes(prob, state, fam) for fam in chosen)
        combos = itertools.product(*(range(n) for n in sizes)) \
            if math.prod(sizes) <= (PAIR_COMBOS2 if len(sizes) == 2 else PAIR_COMBOS) else \
            _uniform(prob, chosen)
        for combo in combos:
            move = {g: c for fam, c in zip(chosen, combo) for g in fam if c is not None and state.choice[g] != c}
            if len({family_of[g] for g in move}) < 2:
                continue                      # (a single flip: `relax` tried it)
            added = sum(_family_bytes(prob, state, fam, c) for fam, c in zip(chosen, combo)) - now
            if held + added <= bound:
                yield move, added
            else:
                crowded.append((move, added))
    paying = []
    for move, added in crowded:
        if held + added + least <= bound:       # (one flip could free enough: does this one pay alone?)
            step, _ = _settled(prob, state, move, state.trial(move), alike, cache)
            if step < -tol:
                paying.append((step, len(paying), move, added))
    for _, _, move, added in sorted(paying, key=lambda o: o[:2])[:PAIRED]:
        mine = {family_of[g] for g in move}
        for fy, cy, ay in freeing:
            if family_of[fy[0]] not in mine and held + added + ay <= bound:
                yield {**move, **{g: cy for g in fy if state.choice[g] != cy}}, added + ay


def _across_gathers(prob, state, family_of, depth: int = 16) -> list:
    """Pairs of families where one's split output is gathered (`settle.gathered_at`) on its way to the
    other's anchors, within `depth` ops past the gather: an attention run whole (fewer heads than ranks)
    between its input projection, split and gathered, and its output projection. The optimum flips both
    (the fused projection split in thirds, the output projection split on outputs: MPT's at 8 ranks,
    1.08x its step with the greedy's, and each flipped alone costs more)."""
    owner = {a: family_of[g] for g, grp in enumerate(prob.groups) if g in family_of for a in grp.anchors}
    out = set()
    for a, f in owner.items():
        if not isinstance(state.place[a], Shard):
            continue
        for u in gathered_at(prob, state, {a}):
            todo, seen = [(u, 0)], {u}
            for i, d in todo:
                if owner.get(i, f) != f:
                    out.add(tuple(sorted((f, owner[i]))))
                    continue
                for v in prob.users[i] if d < depth else ():
                    if v not in seen:
                        seen.add(v)
                        todo.append((v, d + 1))
    return sorted(out)


def _siblings(prob, every, family_of, found) -> list:
    """Sets of three or more families whose anchors read one tensor (an attention's q, k and v), each
    with the families fed by one of them (`found` pairs: OLMo-2's q and k with the norms of their
    outputs)."""
    readers: dict = {}
    for g, grp in enumerate(prob.groups):
        for a in grp.anchors:
            if g in family_of:
                for j in prob.ins[a]:
                    if prob.kind[j] != "param":
                        readers.setdefault(j, set()).add(family_of[g])
    out = set()
    for fams in readers.values():
        if len(fams) >= 3:
            fed = {f for pair in found if len(pair) == 2 and fams.intersection(pair) for f in pair}
            out.add(tuple(sorted(fams | fed)))
    return sorted(out)


def _uniform(prob, chosen) -> list:
    """Choices of families too many to enumerate (`PAIR_COMBOS`), each family taking the layout of the
    same first placement where it has one (all split on outputs: Shard(0)), else kept as it is (None)."""
    firsts = [[ch[0] for ch in prob.groups[fam[0]].choices] for fam in chosen]
    kinds = dict.fromkeys(pl for fs in firsts for pl in fs)
    return [tuple(fs.index(pl) if pl in fs else None for fs in firsts) for pl in kinds]


def _together(prob, every, family_of) -> list:
    """Tuples of family indices flipped together by `_pairs`: those whose outputs (through ops of one
    input: a dtype cast, a scale) one op sums, each such op's and each connected set of them (BERT's
    word, position and token-type embeddings; Pegasus's shared embedding with the encoder's and the
    decoder's positions), those a layer reads so with its own (an MLP's up and down projections,
    Persimmon's through its squared ReLU), and those of each joint window with a group no alike layer
    repeats (a stage's scale and the head it feeds)."""
    owner, passed = {}, {}           # node -> the families whose outputs it is or sums; ops passed through
    for f, fam in enumerate(every):
        for g in fam:
            for a in prob.groups[g].anchors:
                owner[a], passed[a] = frozenset((f,)), 0
    found, parent = set(), {}

    def root(f):
        while parent.get(f, f) != f:
            f = parent[f]
        return f
    for u in range(len(prob.nodes)):            # (in the graph's order: inputs first)
        if u in owner:                           # an anchor (the others are reached once, here)
            fed = [owner[j] for j in prob.ins[u] if j in owner and owner[j] != owner[u]]
            if fed:
                found.add(tuple(sorted(owner[u].union(*fed))))
            continue
        if prob.kind[u] != "op":
            continue
        srcs = [j for j in prob.ins[u] if prob.kind[j] == "op"]
        if not srcs or any(j not in owner for j in srcs) or (len(srcs) == 1 and passed[srcs[0]] >= PASSED):
            continue
        owner[u] = frozenset().union(*(owner[j] for j in srcs))
        passed[u] = passed[srcs[0]] + 1 if len(srcs) == 1 else 0
        if len(owner[u]) > 1:
            found.add(tuple(sorted(owner[u])))
            first, *rest = sorted(owner[u])
            for f in rest:
                parent[root(f)] = root(first)
    sets: dict = {}
    for f in {f for fams in found for f in fams}:
        sets.setdefault(root(f), set()).add(f)
    found |= {tuple(sorted(fams)) for fams in sets.values()}
    for win in windows(prob)[1].values():
        fams = tuple(sorted({family_of.get(g) for g in win}, key=lambda f: -1 if f is None else f))
        if None not in fams and len(fams) > 1 and any(len(every[f]) == 1 for f in fams):
            found.add(fams)      # (alike layers' own joint windows the search enumerated layer by layer)
    return sorted(found)
