"""Settling a labelling where the per-node choice decides one op at a time: split outputs gathered at
once or kept split together (`settle_splits`), and summands reduced together (`sum_late`). The relaxing
step compares its moves settled so (`planner.relax`), and the plan is built settled.
"""
from __future__ import annotations

from ..capture.repeats import layer_key
from ..runtime.placements import REPLICATE, Partial, Replicate, ReplicatePartialGrad, Shard
from .siblings import sibling_sets, split_strategy, summed_sets
from .tried import Tried

SPLIT_ROUNDS = 8      # times `split_chain` adds the ops below that then gather a split input


def settle_splits(prob, state, anchors) -> set:
    """What the per-node choice leaves split, or gathers one reader at a time, settled at the `anchors`'
    outputs: gathered at once where that pays (`State.gather_early`; first at the ops that sum the
    anchors' outputs, `summed_sets`: summed split, the sum is gathered once, where each summand gathered
    apart is two), then sibling layers' kept split together where that pays (`keep_split`). The nodes
    changed are returned."""
    sums = {u for u, fed in summed_sets(prob) if not anchors.isdisjoint(fed)}
    return state.gather_early(sums) | state.gather_early(anchors) | keep_split(prob, state, anchors)


def keep_split(prob, state, anchors) -> set:
    """Sibling layers' split outputs (`sibling_sets`: the query, key and value projections) kept split
    together where the step then costs less: every op that reads one of them whole (`gather_points`)
    takes its cheapest strategy reading it as it is, all of a set's at once. The per-node choice gathers
    each alone for less: Qwen3's per-head norms of the queries and keys gather them (split, their
    weights' gradients are all-reduced) and the attention runs whole, where the three kept split run
    it by heads. The nodes changed are returned."""
    changed, memo, found = set(), Tried.of(prob), {}
    for _, sibs in sibling_sets(prob):
        if anchors.isdisjoint(sibs) or not (forced := _points(prob, state, sibs, memo.alike, found)):
            continue
        u, ops = min(sibs), sorted(forced)
        if _kept(state, *state.tried(forced, u, ("kept split", memo.name(u, ops), tuple(map(forced.get, ops)))),
                 changed):
            found.clear()
    return changed


def _points(prob, state, sibs, alike, found: dict) -> dict:
    """`gather_points` of a set of siblings, walked within their layer where they lie in a run of alike
    layers (`tried.AlikeLayers`); where the set at their place in another layer of the run found its
    points with the same labels around (that layer's and the one before: `signature`), those points
    named again here (`found`: kept while the state is unchanged)."""
    u = min(sibs)
    j = alike.layer_of.get(u)
    if j is None:
        return gather_points(prob, state, sibs)
    if j < 2:
        return gather_points(prob, state, sibs, alike.nodes[j])
    key = alike.at[u][1], alike.signature(state, j)
    if key not in found:
        found[key] = j, gather_points(prob, state, sibs, alike.nodes[j])
    k, forced = found[key]
    return forced if k == j else {alike.layers[j][alike.at[v][1]]: si for v, si in forced.items()}


def gather_points(prob, state, anchors, within=None) -> dict:
    """{op: strategy} for each op that gathers what the anchors' outputs reach split (`gathered_at`): the
    cheapest of its strategies that read every such input as it is."""
    forced = {}
    for u, slots in gathered_at(prob, state, anchors, within).items():
        keep = [si for si, s in enumerate(prob.strats[u])
                if all(s.inputs[k] == pl for k, pl in slots.items()) and state.servable(u, s)]
        if keep:
            forced[u] = min(keep, key=prob.node_cost[u].__getitem__)
    return forced


def gathered_at(prob, state, anchors, within=None, reach: int = 16) -> dict:
    """{op: {slot: placement}} of each op that reads whole a split tensor that the anchors' outputs reach
    split (within `reach` tensors of each, and the nodes `within` where given), and how it is split."""
    need: dict = {}                      # op -> {slot: the placement kept}
    sidx, place, strats, ins, users, kind = state.sidx, state.place, prob.strats, prob.ins, prob.users, prob.kind
    seen = set()
    for a in sorted(anchors):
        if not isinstance(place[a], Shard) or a in seen:
            continue
        todo, stop = [a], len(seen) + reach
        seen.add(a)
        for t in todo:
            pt = place[t]
            for u in users[t]:
                if within is not None and u not in within:
                    continue
                if kind[u] == "select" and isinstance(place[u], Shard) and u not in seen and len(seen) < stop:
                    seen.add(u)
                    todo.append(u)                               # (a piece of a split tuple: q of a fused q/k/v)
                if kind[u] != "op" or not strats[u]:
                    continue
                req = strats[u][sidx[u]].inputs
                slots = [k for k, j in enumerate(ins[u]) if j == t]
                if all(req[k] is pt or req[k] == pt for k in slots):
                    if u not in seen and len(seen) < stop and _split(place[u]):
                        seen.add(u)
                        todo.append(u)                           # (carried split)
                elif any(isinstance(req[k], Replicate) for k in slots):
                    need.setdefault(u, {}).update((k, pt) for k in slots)
    return need


def sum_late(prob, state, nodes) -> set:
    """Ops in `nodes` that sum a Partial with a tensor reduced from a fresh Partial one op before (an MLP's
    row output all-reduced by its dropout, then added to the attention's output, still Partial): the
    op that reduced it tried keeping it Partial instead, so both summands are reduced at once where
    the step then costs less (`reduce_early` never undoes a reduction). The per-node choice reduced
    it while the other summand was whole or split; a later move (the attention's output projection
    split on inputs: GPT-J's parallel block with its heads fewer than the ranks) leaves it reduced.
    The nodes changed are returned."""
    changed, place, sidx, strats = set(), state.place, state.sidx, prob.strats
    for u in sorted(_sums(prob).intersection(nodes)):
        if not any(isinstance(place[j], Partial) for j in prob.ins[u]):
            continue
        for j in prob.ins[u]:
            if prob.kind[j] != "op" or not strats[j] or isinstance(place[j], Partial) or \
                    not any(isinstance(place[k], Partial) and _fresh(prob, state, k) for k in prob.ins[j]):
                continue
            now = strats[j][sidx[j]]
            keep = [si for si, s in enumerate(strats[j]) if isinstance(s.output, Partial) and
                    all(r is None or r == q or isinstance(place[k], Partial) and isinstance(r, Partial)
                        for k, r, q in zip(prob.ins[j], s.inputs, now.inputs)) and state.servable(j, s)]
            if not keep:
                continue
            si = min(keep, key=prob.node_cost[j].__getitem__)
            _kept(state, *state.tried({j: si}, j, ("summed late", si)), changed)
    return changed


def run_whole(prob, state, nodes) -> set:
    """Ops in `nodes` that slice whole inputs to make a fresh Partial (a projection run on pieces of a whole
    input and a whole weight), each tried reading them whole, where the step then costs less: the per-node
    choice saves the product's compute and leaves the reduction to the reader (DeepSeek-V2's K/V up
    projection after its inputs' projection is read split: each reader of its output then all-reduces it).
    The nodes changed are returned."""
    changed, place, strats = set(), state.place, prob.strats
    for u in sorted(nodes):
        if prob.kind[u] != "op" or not strats[u] or not isinstance(place[u], Partial) or not _fresh(prob, state, u):
            continue
        now = strats[u][state.sidx[u]].inputs
        ops = [(r, place[j]) for j, r in zip(prob.ins[u], now) if r is not None and prob.kind[j] == "op"]
        if not ops or not all(isinstance(pl, Replicate) for _, pl in ops) or all(r == pl for r, pl in ops):
            continue
        keep = [si for si, s in enumerate(strats[u]) if isinstance(s.output, Replicate) and
                all(r is None or prob.kind[j] != "op" or r == place[j] for j, r in zip(prob.ins[u], s.inputs)) and
                state.servable(u, s)]
        if keep:
            si = min(keep, key=prob.node_cost[u].__getitem__)
            _kept(state, *state.tried({u: si}, u, ("run whole", si)), changed)
    return changed


def scatter_early(prob, state, nodes) -> set:
    """Ops in `nodes` that sum a split tensor with a Partial one and reduce it whole or keep the sum
    Partial, each tried reducing it scattered instead (their cheapest strategy with a split output,
    reading every split input as it is and every Partial one split), where the step then costs less: the
    stream kept split through a residual sum, a row layer's output reduce-scattered into it (latent
    attention's MLP; DeepSeek-V2's last layer, its final norm then run split). The per-node choice keeps
    the sum Partial, or reduces it whole, at the first layer to read the row layer's output split, and
    no later change revisits it. The nodes changed are returned."""
    changed, place, strats = set(), state.place, prob.strats
    for u in sorted(_sums(prob).intersection(nodes)):
        if isinstance(place[u], Shard):
            continue
        ins = [(j, r) for j, r in zip(prob.ins[u], strats[u][state.sidx[u]].inputs)
               if r is not None and prob.kind[j] == "op"]
        if not any(isinstance(place[j], Shard) for j, _ in ins) or not any(
                isinstance(place[j], Partial) and (isinstance(r, Replicate) or isinstance(place[u], Partial))
                for j, r in ins):
            continue
        si = split_strategy(prob, state, u)
        if si is not None:
            _kept(state, *state.tried({u: si}, u, ("scattered", si)), changed)
    return changed


def split_gathers(prob, state, nodes) -> set:
    """Ops in `nodes` that gather a split input to run whole, each tried running split instead (their
    cheapest strategy with a split output reading every split input as it is: `split_strategy`), and
    with it every op below that then gathers a split input (`split_chain`), where the step then costs
    less. Gathering a split input or slicing a whole one (its gradient gathered in backward) cost an op
    the same, and the per-node choice takes the gather, op after op: DeBERTa's attention run by heads,
    its queries plus a whole bias, its scores plus relative-position scores made whole, pays only all
    at once. The nodes changed are returned."""
    changed = set()
    for u in sorted(nodes):
        if _gathers_split(prob, state, u) and (si := split_strategy(prob, state, u)) is not None:
            forced = split_chain(prob, state, {}, {u: si})
            _kept(state, *state.tried(forced, u, ("split", tuple(sorted(forced.items())))), changed)
    return changed


def split_chain(prob, state, move, forced, rounds: int = SPLIT_ROUNDS) -> dict:
    """`forced` ({op: strategy}) grown by the ops that then gather a split input, each at its cheapest
    split strategy (`split_strategy`), with `move` ({group: choice}) made, until none is left or `rounds`
    times: what runs split below a layout that leaves its output split (`partners.gathered_families`)."""
    forced = dict(forced)
    for _ in range(rounds):
        delta, overlay = state.trial(move, forced)
        if overlay is None:
            break
        after = state.copy()
        after.commit(delta, overlay)
        below = sorted({v for i in (*overlay[2], *overlay[3]) for v in (i, *prob.users[i])} - set(forced))
        more = {v: sv for v in below if _gathers_split(prob, after, v) and
                (sv := split_strategy(prob, after, v)) is not None}
        if not more:
            break
        forced.update(more)
    return forced


def _gathers_split(prob, state, u) -> bool:
    """Whether op u reads a split op output whole (a gather) and is not split itself."""
    place, strats = state.place, prob.strats
    return prob.kind[u] == "op" and bool(strats[u]) and not isinstance(place[u], Shard) and any(
        isinstance(place[j], Shard) and isinstance(r, Replicate)
        for j, r in zip(prob.ins[u], strats[u][state.sidx[u]].inputs) if r is not None and prob.kind[j] == "op")


def _sums(prob) -> frozenset:
    """The ops that read two or more op outputs (memoised)."""
    sums = prob.search_memo.get("sums")
    if sums is None:
        sums = prob.search_memo["sums"] = frozenset(
            u for u in range(len(prob.nodes)) if prob.kind[u] == "op" and prob.strats[u] and
            sum(prob.kind[j] == "op" for j in prob.ins[u]) > 1)
    return sums


def _split(pl) -> bool:
    """Whether a placement is split, or a tuple (a chunk's pieces) holding a split piece."""
    return isinstance(pl, Shard) or isinstance(pl, tuple) and any(isinstance(x, Shard) for x in pl)


def _fresh(prob, state, k) -> bool:
    """Whether op k makes a Partial of inputs none of which it reads Partial (a row layer's product)."""
    return prob.kind[k] == "op" and bool(prob.strats[k]) and \
        not any(isinstance(r, Partial) for r in prob.strats[k][state.sidx[k]].inputs if r is not None)


def sum_grads_late(prob, state, nodes) -> set:
    """Whole regions below a gather or an all-reduce (ops of `nodes` reading a split or Partial input
    whole) whose ops send back whole gradients, each switched at once to sending back summands (`Rp`),
    the reduction left to the one edge that made them whole, where the step then costs less: one op at a
    time each costs more (a norm's pow, mean, rsqrt and product between a gather and the projections
    reading it whole). All regions are tried in one trial: region by region none pays (the summed
    embeddings' norm and the final norm). The nodes changed are returned."""
    changed, place, sidx, strats = set(), state.place, state.sidx, prob.strats
    done, forced = set(), {}
    for u in sorted(nodes):
        if u in done or prob.kind[u] != "op" or not strats[u] or place[u] != REPLICATE or \
                not any(isinstance(place[j], (Shard, Partial)) for j in prob.ins[u]):
            continue
        region, todo = [], [u]
        seen = {u}
        while todo:
            i = todo.pop()
            region.append(i)
            for v in prob.users[i]:
                if v not in seen and prob.kind[v] == "op" and strats[v] and place[v] == REPLICATE:
                    seen.add(v)
                    todo.append(v)
        done |= seen
        for i in region:
            now = strats[i][sidx[i]]
            alt = [si for si, s in enumerate(strats[i]) if type(s.output) is ReplicatePartialGrad and
                   s.output.cut == 1 and s.inputs == now.inputs and state.servable(i, s)]
            if alt:
                forced[i] = min(alt, key=prob.node_cost[i].__getitem__)
    if forced:
        _kept(state, *state.trial({}, forced), changed)
    return changed


def gather_weights(prob, state, steps: int = 3) -> set:
    """Ops that read a split weight through a view of it (`x @ w.T`: the transpose is an op, so the weight
    can be gathered there), each reading every input whole, the weights gathered and the layer run whole
    on every rank, where the step then costs less: first all of them at once, then those of each weight
    (namesakes in every layer at once). Where the weights are smaller than the activations (hidden 64
    over 8 ranks, 16 tokens: Falcon's ALiBi model of the zoo) the optimum does so; one op at a time, a
    gather of its activations follows it, so none pays (1.23x the optimum's step). The nodes changed are
    returned."""
    by_weight: dict = {}
    for u in range(len(prob.nodes)):
        if prob.kind[u] != "op" or not prob.strats[u]:
            continue
        now = prob.strats[u][state.sidx[u]].inputs
        names = {_weight_of(prob, j, steps) for j, r in zip(prob.ins[u], now)
                 if prob.kind[j] == "op" and r is not None and not isinstance(r, Replicate)}
        names.discard(None)
        keep = [si for si, s in enumerate(prob.strats[u]) if names and isinstance(s.output, Replicate) and
                all(r is None or r == REPLICATE for r in s.inputs) and state.servable(u, s)]
        if keep:
            si = min(keep, key=prob.node_cost[u].__getitem__)
            for name in names:
                key = layer_key(name)
                by_weight.setdefault(name if key is None else key[0], {})[u] = si
    changed = set()
    if by_weight and not _kept(state, *state.trial({}, {u: si for f in by_weight.values() for u, si in f.items()}),
                               changed):
        for forced in by_weight.values():
            _kept(state, *state.trial({}, forced), changed)
    return changed


def _weight_of(prob, j, steps):
    """The qualified name of the parameter op j views (through at most `steps` ops of one input), or None."""
    for _ in range(steps):
        ins = [i for i in prob.ins[j] if prob.kind[i] in ("op", "param")]
        if len(ins) != 1:
            return None
        j = ins[0]
        if prob.kind[j] == "param":
            return prob.param_names[prob.param_key[j]][0]
    return None


def _kept(state, delta, overlay, changed: set) -> bool:
    """Commit a trial of forced op strategies where the step then costs less, adding the nodes it
    changed to `changed`; whether it was kept."""
    if overlay is None or delta >= -1e-12 * max(1.0, abs(state.total)):
        return False
    state.commit(delta, overlay)
    state.path = None           # (no longer a function of the group choices alone)
    changed.update(overlay[2], overlay[3])
    return True
