"""Plans under a memory budget: the fastest plan whose predicted peak per rank fits (`planner.memory`).

The trades: the search is run at several prices of training-state memory (`memory_weight` from 0,
where a small layer stays whole and Gemma's K/V weights are replicated whenever that moves fewer
bytes, up to prices where every layer that can split does and K/V are gathered), each plan's peak
is predicted, and the fastest (communication + compute, `CostModel`) that fits is taken. Where none
fits, blocks are recomputed in backward (activation checkpointing, applied by `parallelize`):
added one at a time, the one that lowers the peak most first, each costing its forward again
(its compute and its forward collectives). A budget that nothing meets is a `MemoryBudgetError`
with the smallest peak reachable and what holds it. Each plan's sequence-parallel twin
(`planner.sequence`: the stream split on tokens, the same bytes) is a candidate too where the
caller leaves it open, priced as the plan, so it is taken only where no plan as fast fits without it.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import MemoryBudgetError
from .cost import flops
from .memory import memory_of
from .sequence import with_sequence_parallel

# prices of a byte of training state (seconds) the search is run at; the cost model's own is added
WEIGHTS = (0.0, 1e-12, 1e-10, 1e-8, 1e-6, 1e-3)


def _fmt(n: float) -> str:
    if n < 2 ** 20:
        return f"{n / 2 ** 10:.1f} KiB"
    return f"{n / 2 ** 20:.1f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.2f} GiB"


def step_seconds(prob, state) -> float:
    """Predicted seconds of a step under `state`: its objective without the memory term."""
    return state.total - sum(prob.param_cost(k, state.placement_of_param(k)) for k in prob.param_obj)


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
    always, None as a candidate beside each plan, priced as that plan (it sends the same bytes) and
    taken only where the plan itself does not fit."""
    budget = cost.memory_budget
    candidates, seen, saved = [], set(), None
    for weight in dict.fromkeys((cost.memory_weight, *WEIGHTS)):
        prob = make_problem(replace(cost, memory_weight=weight))
        prob.saved = saved
        state = run(prob)
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
        split = [(seconds, True, state, tokens) for seconds, _, _, plain, _ in candidates
                 if (state := with_sequence_parallel(plain, tokens)) is not None]
        split = [(seconds, sp, memory_of(prob, state), state, prob) for seconds, sp, state, prob in split]
        candidates = split + (candidates if sequence_parallel is None or not split else [])
    fits = [c for c in candidates if c[2].peak <= budget]
    if fits:
        _, _, _, state, prob = min(fits, key=lambda c: (c[0], c[1], c[2].peak))
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
