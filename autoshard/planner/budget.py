"""Plans under a memory budget, and without one.

Without a budget or a price (`least_comm`): the fastest plan (communication, then compute) whose
training state per rank exceeds the least reachable by at most `cost.STATE_TOLERANCE` of the
model's state, of those the smallest. With a budget: the fastest plan whose predicted peak per
rank fits (`planner.memory`).

The trades: the plan without a budget is a candidate (`least_comm`'s, or the search at the user's
price), and the search is run at several prices of training-state memory (`memory_weight` from 0,
where a small layer stays whole and Gemma's K/V weights are replicated whenever that moves fewer
bytes, up to prices where every layer that can split does and K/V are gathered), each plan's peak
is predicted, and the fastest (communication + compute, `CostModel`) that fits is taken. Where none
fits, blocks are recomputed in backward (activation checkpointing, applied by `parallelize`):
added one at a time, the one that lowers the peak most first, each costing its forward again
(its compute and its forward collectives). A budget that nothing meets is a `MemoryBudgetError`
with the smallest peak reachable and what holds it. Each plan's sequence-parallel twin
(`planner.sequence`: the stream split on tokens, the same bytes but for the column layers' inputs
gathered again in backward) is a candidate too where the caller leaves it open, priced as the plan
plus those gathers, so it is taken only where no plan as fast fits without it.
"""
from __future__ import annotations

import copy
from dataclasses import replace

from ..errors import MemoryBudgetError
from ..runtime.counters import ring_bytes
from ..runtime.placements import REPLICATE, Replicate, Shard
from .cost import STATE_TOLERANCE, TIE_PRICE, flops
from .memory import memory_of
from .held import least_state, param_bytes, state_bytes, step_seconds
from .relax import families, relax
from .search import uniform_layers
from .sequence import (EPS, activation_bytes, held_chains, regather_seconds, relabel, token_dim,
                       with_sequence_parallel)

# prices of a byte of training state (seconds) the search is run at; the cost model's own is added
WEIGHTS = (0.0, 1e-12, 1e-10, 1e-8, 1e-6, 1e-3)
# without a budget: the prices tried in turn, cheapest first, until a plan's state is within the tolerance
PRICES = (TIE_PRICE, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-6, 1e-3)
# ... and this one searched as well, its plan taken where within the bound and faster
ANCHOR_PRICE = 1e-9
# a chain of readers kept split into an op that makes its result whole itself (`sequence.held_chains`)
# may add that op's own collectives up to this share of the bytes of activations it saves (a loss over
# a vocabulary of 256 at 2 ranks: 0.023)
CHAIN_SHARE = 0.1
# peaks this close are as high (each item's bytes are rounded to whole bytes)
PEAK_SLACK = 1e-6


def _fmt(n: float) -> str:
    if n < 2 ** 20:
        return f"{n / 2 ** 10:.1f} KiB"
    return f"{n / 2 ** 20:.1f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.2f} GiB"


def least_comm(prob, run):
    """The plan without a budget or a price: the fastest (`step_seconds`) whose state per rank is at most
    the least reachable plus STATE_TOLERANCE of the whole model's, then the smallest. `run(prob)`
    searches at the problem's price of state: run at PRICES in turn up to the first plan within the
    bound, and at ANCHOR_PRICE too (the greedy search at the lowest prices can end slower, with no less
    state, than at a GB ~ 1 s), the fastest within the bound then relaxed group by group (`relax.relax`: a
    layer made whole where that is faster and the bound still holds). So the plan is never slower
    than the anchor price's where that one is within the bound. Where no price reaches the bound,
    the plan of least state. Alike layers are then made one graph again (`search.uniform_layers`)."""
    whole = sum(param_bytes(prob, k, REPLICATE) for k in prob.param_obj)
    bound = least_state(prob) + STATE_TOLERANCE * whole
    found = []                             # (within the bound, step seconds, state held, price, state)

    def search(price):
        prob.price_state(price)
        state = run(prob)
        held = state_bytes(prob, state)
        found.append((held > bound, step_seconds(prob, state), held, price, state))
        return held <= bound

    for price in PRICES:
        if search(price):
            break
    if ANCHOR_PRICE not in [f[3] for f in found]:
        search(ANCHOR_PRICE)
    if not any(not f[0] for f in found):   # none within: the least state
        found.sort(key=lambda f: f[2])
    else:
        found.sort(key=lambda f: f[:3])
    _, _, held, price, state = found[0]
    prob.price_state(price)               # the plan's objective is the one it was found at
    relax(prob, state, max(bound, held), held)
    uniform_layers(state)                 # a flip of the embedding alone may have set layer 0 apart again
    return state


def _faster_within(prob, state, seconds: float, budget: float):
    """`state` with families of groups (`relax.families`) flipped one at a time where the step gets faster
    and the predicted peak still fits `budget`: the prices searched move whole kinds of layers at
    once, so a plan that keeps one pair whole (BERT's tied embedding and masked-LM decoder: fewer
    bytes, more memory) is found by none of them although it fits and is faster."""
    fams = families(prob)
    for _ in range(len(fams)):       # (each round commits the best flip; a family flips back seldom)
        best = None
        for fam in fams:
            now = [state.choice[g] for g in fam]
            for c in range(len(prob.groups[fam[0]].choices)):
                if all(n == c for n in now):
                    continue
                trial = state.copy()
                trial.set_choices({g: c for g in fam})
                trial.reduce_early()          # (compared as it will run: `relax._settled`)
                t = step_seconds(prob, trial)
                if t < seconds * (1 - 1e-9) and (best is None or t < best[0]) and memory_of(prob, trial).peak <= budget:
                    best = t, trial
        if best is None:
            return state
        seconds, state = best
    return state


def _gathering_groups(twin) -> list:
    """The decision groups of the layers that gather a token-split tensor of `twin` whole (a small
    column layer after the stream: BERT's masked-LM transform), in graph order."""
    prob = twin.prob
    group_of = {k: g for g, grp in enumerate(prob.groups) for k in grp.params}
    out = []
    for j in range(len(prob.nodes)):
        d = token_dim(prob.val[j])
        if d is None or prob.kind[j] == "param" or twin.place[j] != Shard(d):
            continue
        for u in prob.users[j]:
            if prob.kind[u] != "op" or not prob.strats[u]:
                continue
            s = prob.strats[u][twin.sidx[u]]
            if not any(k == j and isinstance(req, Replicate) for req, k in zip(s.inputs, prob.ins[u])):
                continue
            for k in prob.ins[u]:
                g = group_of.get(prob.param_key.get(k))
                if g is not None and g not in out:
                    out.append(g)
    return out


def sequence_twin(state, tokens):
    """`state` with sequence parallelism (`sequence.with_sequence_parallel` on `tokens`, the graph's
    Problem with token splits), or None where nothing moves. Then each layer that gathers the
    token-split stream whole is tried whole (its weight replicated, run on each rank's tokens), the
    move made again: kept where the activations move no more bytes and the predicted peak is lower
    (or as high, with fewer bytes of activations); a layer of a numbered stack with its namesakes in
    every other (`relax.families`: one try, not one per layer, and alike layers stay alike).
    Megatron's sequence-parallel BERT runs its masked-LM transform so, where the plan without
    sequence parallelism splits it (less compute there) and gathers its output whole. Like the
    norms', the weight's gradient is then all-reduced (a sum over each rank's tokens)."""
    twin = with_sequence_parallel(state, tokens)
    if twin is None:
        return None
    def held(t):
        mem = memory_of(tokens, t)
        return mem.peak, mem.activations

    sent, peak = activation_bytes(twin), held(twin)
    gathering = _gathering_groups(twin)
    family = {g: fam for fam in families(state.prob) for g in fam}
    for fam in dict.fromkeys(tuple(g for g in family[h] if g in gathering) for h in gathering):
        for c in range(len(state.prob.groups[fam[0]].choices)):
            if all(state.choice[g] == c for g in fam) or not all(
                    type(pl) is Replicate for g in fam for pl in state.prob.groups[g].choices[c]):
                continue
            trial = state.copy()
            trial.set_choices({g: c for g in fam})
            other = with_sequence_parallel(trial, tokens)
            if other is None:
                continue
            b, mem = activation_bytes(other), held(other)
            if b <= sent * (1 + EPS) and _lower(mem, peak):
                twin, state, sent, peak = other, trial, b, mem
    for place, sidx in held_chains(tokens, twin.place, twin.sidx):
        other = copy.copy(twin)
        relabel(other, place, sidx)
        b, mem = activation_bytes(other), held(other)
        own = _own_bytes(tokens, sidx) - _own_bytes(tokens, twin.sidx)
        if b <= sent * (1 + EPS) and _lower(mem, peak) and own <= CHAIN_SHARE * (peak[1] - mem[1]):
            twin, sent, peak = other, b, mem
    return twin


def _lower(mem: tuple, than: tuple) -> bool:
    """(peak, activations) `mem` below `than`: a lower peak, or one as high (within the bytes each
    item's share rounds off) with fewer bytes of activations."""
    if abs(mem[0] - than[0]) <= PEAK_SLACK * than[0]:
        return mem[1] < than[1]
    return mem[0] < than[0]


def _own_bytes(prob, sidx) -> float:
    """Ring bytes a rank sends a step in the collectives ops run themselves (a vocabulary-parallel loss's)."""
    return sum(ring_bytes(k, nb, prob.p) for i in range(len(prob.nodes)) if prob.strats[i]
               for k, nb in prob.strats[i][sidx[i]].comm)


def _block_nodes(prob, blocks) -> dict:
    from .decisions import module_of
    out = {b: [] for b in blocks}
    for i, k in enumerate(prob.kind):
        if k == "op":
            mod = module_of(prob, i)
            for b in blocks:
                if mod == b or mod.startswith(b + "."):
                    out[b].append(i)
    return {b: ns for b, ns in out.items() if ns}


def recompute_seconds(prob, state, nodes) -> float:
    """A block's forward run again in backward: a third of its fwd + bwd compute, and its forward collectives."""
    seconds = 0.0
    for i in nodes:
        s = prob.strats[i][state.sidx[i]]
        seconds += prob.cost.compute_time(flops(prob.nodes[i], s) * s.compute) / 3
        seconds += sum(prob.cost.comm_time(k, nb, prob.p) for k, nb in s.comm)
        for j in prob.ins[i]:
            if prob.nbytes[j] and prob.kind[j] in ("op", "select"):
                for req, _, fwd, _, consumers, _ in prob.comms_of(j, state.place, state.sidx):
                    if i in consumers:
                        seconds += sum(prob.cost.comm_time(k, prob.nbytes[j], prob.p) for k in fwd)
    return seconds


def _with_recompute(prob, state, budget, blocks):
    """(seconds, memory, checkpointed) of `state` with blocks recomputed until its peak fits
    (every block where nothing fits)."""
    nodes = _block_nodes(prob, blocks)
    base = memory_of(prob, state)
    gain = {b: base.peak - memory_of(prob, state, (b,)).peak for b in nodes}
    chosen, mem = [], base
    for b in sorted(nodes, key=lambda b: -gain[b]):
        if mem.peak <= budget:
            break
        chosen.append(b)
        mem = memory_of(prob, state, tuple(chosen))
    seconds = step_seconds(prob, state) + sum(recompute_seconds(prob, state, nodes[b]) for b in chosen)
    return seconds, mem, tuple(chosen)


def fit_budget(make_problem, run, cost, blocks=(), sequence_parallel=False):
    """(state, problem, checkpointed blocks) of the fastest plan whose predicted peak is at most
    `cost.memory_budget`; `make_problem(cost, tokens=False)` builds a Problem (`tokens`: one whose ops
    may split the token dim), `run(problem)` searches it. `sequence_parallel`: False never, True
    always, None as a candidate beside each plan, priced as that plan plus its backward re-gathers
    (`sequence.regather_seconds`) and taken only where the plan itself does not fit."""
    budget = cost.memory_budget
    candidates, seen, saved = [], set(), None
    # the plan without a budget first (the default objective's, or the user's price), then the prices
    own = (None,) if cost.memory_weight is None else (cost.memory_weight,)
    for weight in dict.fromkeys((*own, TIE_PRICE, *WEIGHTS)):
        prob = make_problem(replace(cost, memory_weight=weight))
        prob.saved = saved
        state = run(prob) if weight is not None else least_comm(prob, run)
        mem = memory_of(prob, state)          # reads the saved tensors once, kept for the next problems
        saved = prob.saved
        layout = tuple(sorted((k, str(state.placement_of_param(k))) for k in prob.param_obj))
        if layout in seen:
            continue
        seen.add(layout)
        candidates.append((step_seconds(prob, state), False, mem, state, prob))
    if sequence_parallel is not False:
        tokens = make_problem(cost, tokens=True)
        tokens.saved = saved
        split = [(seconds + regather_seconds(tokens, state), True, state, tokens)
                 for seconds, _, _, plain, _ in candidates
                 if (state := sequence_twin(plain, tokens)) is not None]
        split = [(seconds, sp, memory_of(prob, state), state, prob) for seconds, sp, state, prob in split]
        candidates = split + (candidates if sequence_parallel is None or not split else [])
    fits = [c for c in candidates if c[2].peak <= budget]
    if fits:
        seconds, sp, mem, state, prob = min(fits, key=lambda c: (c[0], c[1], c[2].peak))
        if not sp:
            state = _faster_within(prob, state, seconds, budget)
        return state, prob, ()
    best, smallest = None, None
    for _, _, _, state, prob in candidates:
        seconds, mem, chosen = _with_recompute(prob, state, budget, blocks)
        if mem.peak <= budget and (best is None or seconds < best[0]):
            best = (seconds, state, prob, chosen)
        if smallest is None or mem.peak < smallest.peak:
            smallest = mem
    if best is not None:
        return best[1], best[2], best[3]
    held = ", ".join(f"{what} {_fmt(nb)}" for what, nb in smallest.largest)
    raise MemoryBudgetError(
        f"no plan at world size {candidates[0][4].p} fits memory_budget={_fmt(budget)} per rank: the smallest "
        f"peak reachable is {_fmt(smallest.peak)}{' with every block recomputed' if blocks else ''}, at the "
        f"{smallest.peak_at}; largest there: {held}. Use more ranks, a smaller batch or sequence, or a "
        f"lower-precision dtype")


