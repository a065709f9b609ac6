"""Search "optimal": the planning problem as an integer linear program, solved by HiGHS.

The same problem the greedy searches (`problem.Problem`), every term of the same objective
(`State.evaluate`: node costs, each tensor's redistributions, the parameters' memory term):

- a binary variable per decision group and choice, and per op and strategy (each op chooses its
  strategy freely here, where the greedy takes the locally cheapest given its inputs), one of each
  set chosen;
- a tensor's communication (`Problem.tensor_cost`) depends on the placements of its view class and
  the strategies of their readers, and only through a few features (the placement a producer
  leaves, what each reader requires and sends back): each tensor is a factor over those features,
  one continuous variable per combination of them (its cost computed by `tensor_cost` itself,
  combinations no redistribution serves left out), tied to the binaries by marginal constraints,
  so with the binaries integral it is the one combination they select;
- without a price of state (the default objective), the training state per rank is a constraint,
  as `budget.least_comm` bounds it, and the state is priced only to break ties.

An extra (`pip install autoshard[optimal]`): scipy is imported here only, by `search="optimal"`.
A test and benchmark oracle: it says how far the greedy is from the best plan under this cost
model; it is not the default, being slower on deep graphs (identical blocks are captured once, but
the program has every layer's variables).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..runtime.placements import REPLICATE
from .assignment import State
from .held import group_bytes, least_state, memory_term, state_bytes, step_seconds
from .cost import STATE_TOLERANCE, TIE_PRICE
from .factors import Deciders, factor
from .problem import INF, Problem

TIME_LIMIT = 600.0        # seconds HiGHS may run
GAP = 1e-7                # relative MIP gap asked of HiGHS


@dataclass(frozen=True)
class Solved:
    """What the solver reports of one program: HiGHS's status, the relative gap between the plan's
    objective and the best bound, seconds in the solver and in building, the program's size."""

    status: str
    gap: float
    seconds: float
    build_seconds: float
    variables: int
    integers: int
    constraints: int
    objective: float
    held_classes: int = 0     # tensor classes solved with their views reading as held (`factors.held_combos`)

    def note(self) -> str:
        return (f"search=optimal: HiGHS {self.status}, gap {self.gap:.2g}, {self.seconds:.2f} s solving + "
                f"{self.build_seconds:.2f} s building, {self.variables} variables ({self.integers} binary), "
                f"{self.constraints} constraints" +
                (f"; {self.held_classes} classes of views read as held" if self.held_classes else ""))


class _Program:
    """The variables, objective and constraints as lists scipy's milp takes."""

    def __init__(self):
        self.cost, self.upper, self.integer = [], [], []
        self.rows, self.lo, self.hi = [], [], []        # rows: {variable: coefficient}
        self.offset = 0.0                                # the objective's constant

    def var(self, cost: float, integer: bool = True, upper: float = 1.0) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, coefs: dict, lo: float, hi: float) -> None:
        self.rows.append(coefs)
        self.lo.append(lo)
        self.hi.append(hi)


def _add_factor(prog: _Program, var: dict, makers, classes, reads, table, scale: float) -> None:
    """A tensor's table in the program: one continuous variable per entry, its marginal on each maker's
    classes that maker's choice, and on each feature that feature's presence (a variable between the
    largest and the sum of the readers' indicators of it: their OR once they are integral). An entry
    over one decision, or none, goes onto that decision's variables."""
    keys = list(table)
    readers = sorted(reads)
    if not makers and not readers:
        prog.offset += scale * table[keys[0]]
        return
    if len(makers) + len(readers) == 1:
        d = (makers or readers)[0]
        for v in range(len(prog_values := _values(d, makers, classes, reads))):
            key = prog_values[v]
            x = var[d, v]
            if key in table:
                prog.cost[x] += scale * table[key]
            else:
                prog.upper[x] = 0.0
        return
    t = {key: prog.var(scale * c, integer=False) for key, c in table.items()}
    for n, d in enumerate(makers):
        for k, cls in enumerate(classes[n]):
            row = {x: 1.0 for key, x in t.items() if key[n] == k}
            for v in cls:
                row[var[d, v]] = -1.0
            prog.row(row, 0.0, 0.0)
    universe = sorted({f for fs in (fs for feats in reads.values() for fs in feats.values()) for f in fs}, key=repr)
    for f in universe:
        z = prog.var(0.0, integer=False)
        prog.row({**{x: 1.0 for key, x in t.items() if f in key[-1]}, z: -1.0}, 0.0, 0.0)
        total = {z: -1.0}
        for d in readers:
            has = {var[d, v]: 1.0 for v, fs in reads[d].items() if f in fs}
            if has:
                prog.row({**has, z: -1.0}, -math.inf, 0.0)          # z >= this reader's indicator
                total.update(has)
        prog.row(total, 0.0, math.inf)                                # z <= their sum


def _values(d, makers, classes, reads) -> list:
    """The table key each value of the factor's one decision `d` selects."""
    if makers:
        cls = classes[0]
        kth = {v: k for k, c in enumerate(cls) for v in c}
        feats = reads.get(d)
        return [(kth[v], feats[v] if feats else frozenset()) for v in range(len(kth))]
    return [(reads[d][v],) for v in range(len(reads[d]))]


def solve(prob: Problem, bound: float | None = None, time_limit: float = TIME_LIMIT, together=(),
          hints=()) -> State:
    """The State of least objective (`State.evaluate` at the problem's price of state); with `bound`,
    among those whose training state per rank (`budget.state_bytes`) is at most `bound` bytes;
    `together`: lists of groups held to one choice (alike layers alike, as the greedy keeps them:
    `relax.families`). `hints`: States (the greedy's plan) the program must hold: a class too large to
    enumerate is solved with its views read as held (`factors.held_combos`), which may leave a plan
    that redistributes inside one out; each hint's entries are added to those tables, so the optimum
    is never worse than a hint. The solver's report is `state.solved` (`Solved`)."""
    from scipy.optimize import Bounds, LinearConstraint, milp     # the extra: only this search needs scipy
    from scipy.sparse import coo_array

    t0 = time.perf_counter()
    dec = Deciders(prob)
    prog = _Program()
    scale = 1e6                                # seconds -> microseconds: the solver's tolerances are absolute
    var: dict = {}
    for g, grp in enumerate(prob.groups):
        for c, ch in enumerate(grp.choices):
            var[("g", g), c] = prog.var(scale * memory_term(prob, grp.params, ch))
    for i in range(len(prob.nodes)):
        if prob.kind[i] == "op" and prob.strats[i]:
            for s in range(len(prob.strats[i])):
                c = prob.node_cost[i][s]
                var[("s", i), s] = prog.var(scale * c if c != INF else 0.0, upper=0.0 if c == INF else 1.0)
            for j, pl in prob.held_inputs.items():        # a held input is read as it is held (`State._best`)
                for s, st in enumerate(prob.strats[i]):
                    if any(k == j and st.inputs[slot] not in (None, pl) for slot, k in enumerate(prob.ins[i])):
                        prog.upper[var[("s", i), s]] = 0.0
    deciders = sorted({d for d, _ in var})
    for d in deciders:
        prog.row({var[d, v]: 1.0 for v in range(dec.domain(d))}, 1.0, 1.0)
    for fam in together:
        for g in fam[1:]:
            if len(prob.groups[g].choices) != len(prob.groups[fam[0]].choices):
                raise ValueError(f"search='optimal': groups {fam[0]} and {g} held together have different choices")
            for c in range(len(prob.groups[g].choices)):
                prog.row({var[("g", g), c]: 1.0, var[("g", fam[0]), c]: -1.0}, 0.0, 0.0)
    constant = sum(prob.param_cost(k, REPLICATE) for k in prob.param_obj if k not in dec.of_param)
    constant += sum(prob.node_cost[i][0] for i in range(len(prob.nodes)) if prob.strats[i] and prob.kind[i] != "op")
    base = State(prob)
    factors, held_classes = [], 0
    place, sidx = list(base.place), list(base.sidx)
    labellings = [(h.choice, h.sidx) for h in hints]
    for r in range(len(prob.nodes)):
        if not prob.nbytes[r] or prob.root[r] != r:
            continue
        makers, classes, reads, table, held = factor(prob, dec, r, place, sidx, labellings)
        factors.append((r, makers, classes, reads, table))
        held_classes += held
        if not table:
            raise ValueError(f"search='optimal': no placement of %{prob.nodes[r].name} serves its readers")
        _add_factor(prog, var, makers, classes, reads, table, scale)
    if bound is not None:
        # in thousandths of the bound: the solver's feasibility tolerance (1e-6 of a row) is then a
        # billionth of it, where in GB it let a 118 KB model's plan exceed its bound by 323 bytes
        unit = max(bound, 1.0) / 1e3
        fixed = sum(group_bytes(prob, [k], [REPLICATE]) for k in prob.param_obj if k not in dec.of_param)
        prog.row({var[("g", g), c]: group_bytes(prob, grp.params, ch) / unit
                  for g, grp in enumerate(prob.groups) for c, ch in enumerate(grp.choices)},
                 -math.inf, (bound - fixed) / unit * (1 + 1e-9))
    data, ri, ci = [], [], []
    for n, row in enumerate(prog.rows):
        for x, a in row.items():
            ri.append(n)
            ci.append(x)
            data.append(a)
    A = coo_array((data, (ri, ci)), shape=(len(prog.rows), len(prog.cost))).tocsr()
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = milp(prog.cost, integrality=prog.integer, bounds=Bounds(0.0, prog.upper),
               constraints=LinearConstraint(A, prog.lo, prog.hi),
               options={"time_limit": time_limit, "mip_rel_gap": GAP, "presolve": True})
    solving = time.perf_counter() - t1
    if res.x is None:
        raise ValueError(f"search='optimal': HiGHS found no plan ({res.message})")
    x = res.x
    state = _state_of(prob, dec, var, x)
    gap = getattr(res, "mip_gap", None)
    objective = (res.fun + prog.offset) / scale + constant
    state.solved = Solved(_status(res), float(gap) if gap is not None else math.nan, solving, built,
                          len(prog.cost), sum(prog.integer), len(prog.rows), objective, held_classes)
    if abs(state.total - objective) > 1e-6 * max(abs(state.total), 1e-12) + 1e-15:
        raise AssertionError(f"search='optimal': the program's objective {objective!r} is not the plan's "
                             f"{state.total!r} as State.evaluate counts it; tensors counted otherwise: "
                             f"{_mismatch(prob, state, factors)}")
    if bound is not None and state_bytes(prob, state) > bound * (1 + 1e-6):
        raise AssertionError(f"search='optimal': the solver's plan holds {state_bytes(prob, state):.0f} bytes a rank, "
                             f"over the bound of {bound:.0f}")
    return state


def _mismatch(prob: Problem, state: State, factors) -> list:
    """The tensors whose table cost at the chosen decisions differs from `tensor_cost` (a feature the
    factor missed): for the message of a failed check."""
    out = []
    for r, makers, classes, reads, table in factors:
        combo = tuple(next(k for k, cls in enumerate(c) if _value(state, d) in cls) for d, c in zip(makers, classes))
        S = frozenset().union(*(reads[d][_value(state, d)] for d in reads))
        if table.get((*combo, S)) != state.tcost[r]:
            out.append((prob.nodes[r].name, table.get((*combo, S)), state.tcost[r]))
    return out[:5]


def _value(state: State, d) -> int:
    return state.choice[d[1]] if d[0] == "g" else state.sidx[d[1]]


def _status(res) -> str:
    return {0: "optimal", 1: "time or iteration limit", 2: "infeasible", 3: "unbounded", 4: "other"}.get(
        res.status, str(res.status))


def _state_of(prob: Problem, dec: Deciders, var: dict, x) -> State:
    """The program's solution as a State: group choices and every op's strategy as chosen (not
    re-propagated), placements following, the total as `State.evaluate` counts it."""
    def chosen(d):
        return max(range(dec.domain(d)), key=lambda v: x[var[d, v]])

    state = State(prob)
    state.choice = [chosen(("g", g)) for g in range(len(prob.groups))]
    state.param_place = {}
    for g, grp in enumerate(prob.groups):
        for k, pl in zip(grp.params, grp.choices[state.choice[g]]):
            if pl != REPLICATE:
                state.param_place[k] = pl
    for i in range(len(prob.nodes)):
        state.sidx[i] = chosen(("s", i)) if prob.kind[i] == "op" and prob.strats[i] else 0
        state.place[i] = state._out(i, state.sidx[i], state.place)
    state.tcost = [prob.tensor_cost(j, state.place, state.sidx) for j in range(len(prob.nodes))]
    state.total = state.evaluate()
    return state


def fastest_within(prob: Problem, time_limit: float = TIME_LIMIT, together=(), hints=()) -> State:
    """The default objective (`budget.least_comm`'s) solved outright: the fastest plan whose training
    state per rank is at most the least reachable plus STATE_TOLERANCE of the whole model's, state
    priced at TIE_PRICE to break ties (`together` and `hints` as in `solve`). The problem is left at that
    price."""
    whole = sum(group_bytes(prob, [k], [REPLICATE]) for k in prob.param_obj)
    prob.price_state(TIE_PRICE)
    return solve(prob, least_state(prob) + STATE_TOLERANCE * whole, time_limit, together, hints)


def seconds_of(prob: Problem, state: State) -> float:
    """Predicted step seconds of `state` (its objective less the memory term), for comparing searches."""
    return step_seconds(prob, state)
