"""How far the greedy is from the best plan: the greedy search against the integer linear program's
optimum (`search="optimal"`, autoshard.planner.optimal) under the same cost model, on every
architecture of the model zoo (tests/zoo.py, hidden 64, 2 layers) and every public configuration
(benchmarks/real_configs.py, 2 layers, 2 x 512 tokens) at 2, 4 and 8 ranks.

    python benchmarks/optimality.py                         # everything -> optimality.jsonl, the table
    python benchmarks/optimality.py --only bert bert-base --degrees 2 4
    python benchmarks/optimality.py --table optimality.jsonl  # the markdown table of earlier records

Both searches run on one captured graph and one Problem, with the default objective (no price of
state: the fastest plan whose state per rank is at most the least reachable plus
`cost.STATE_TOLERANCE` of the model's): the greedy through `budget.least_comm` as `autoshard.plan`
runs it, the program with that bound as a constraint. Per case: each one's predicted step seconds
(the objective less its memory term) and ring bytes per rank a step, the ratio greedy / optimum,
both search times, the solver's status and gap, and `free`: the optimum's own group choices with
every op's strategy propagated as the greedy does (locally cheapest), over the optimum: 1.0 where
the optimum needs no op strategy the greedy's propagation would not take. Where the greedy is
above the optimum, the groups whose choices differ (`differs`) point at the pattern.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from autoshard.capture import capture  # noqa: E402
from autoshard.planner import optimal, search as S  # noqa: E402
from autoshard.planner.budget import least_comm, state_bytes, step_seconds  # noqa: E402
from autoshard.planner.build import build_plan, chunk_candidates, part_candidates, unit_candidates  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402
from autoshard.planner.relax import families  # noqa: E402
from autoshard.planner.vocabulary import lookups, tied_heads  # noqa: E402

DEGREES = (2, 4, 8)


def greedy(prob):
    """The greedy search as `autoshard.plan` runs it at one price (`budget.least_comm`'s `run`)."""
    state = S.greedy(prob)
    state.reduce_early()
    return state


def _vocabulary_pins(prob) -> dict:
    """{embedding module: 0} of each weight tied between an embedding and a head (the modules running
    its lookups: T5's and BART's encoder and decoder embeddings of one shared weight): both searches
    then keep it split on the vocabulary, as the relaxing step of the default plan does (`--vocabulary`)."""
    return {m: 0 for g in tied_heads(prob) for m in lookups(prob, g)}


def compare(model, p: int, example, tokens: int = 512, optimum: dict | None = None, outputs: str = "full",
            vocabulary: bool = False, alike: bool = False) -> dict:
    """Greedy and optimum of one model at `p` ranks (see the module docstring); with `optimum` (an
    earlier record of the same case), the greedy only, against that record's optimum; with
    `vocabulary`, heads tied to an embedding pinned to the vocabulary split in both; with `alike`,
    the optimum among plans whose alike layers are alike (`relax.families` held together: the
    greedy's space, one block graph for a run of layers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        cap = capture(model, example, tracer="auto", tokens=tokens, once=True)
        gm = cap.gm

        def problem(pins=None):
            return S.Problem(gm, p, CostModel(), chunk_candidates(gm), unit_candidates(gm), pins=pins,
                             part_candidates=part_candidates(gm), outputs=outputs)
        prob = problem()
        if vocabulary:
            prob = problem(_vocabulary_pins(prob))
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = least_comm(prob, greedy)
        g.reduce_early()
        tg = time.perf_counter() - t0
        g_step, g_held = step_seconds(prob, g), state_bytes(prob, g)
        g_bytes = build_plan(prob, g, tracer=cap.tracer, search="greedy", seconds=tg, memory_now=False).comm_bytes
        if optimum is not None:
            keep = ("optimal_step", "optimal_bytes", "optimal_state", "optimal_s", "status", "gap", "solver_s",
                    "variables", "binaries", "free", "held_classes", "optimal_choice")
            o_choice = optimum.get("optimal_choice")
            return dict({k: optimum[k] for k in keep if k in optimum}, p=p, nodes=len(prob.nodes),
                        groups=len(prob.groups), greedy_step=g_step, ratio=g_step / optimum["optimal_step"],
                        greedy_bytes=g_bytes, greedy_state=g_held, greedy_s=tg, problem_s=built,
                        differs=optimum.get("differs", []) if o_choice is None else _differs(prob, g.choice, o_choice))
        t0 = time.perf_counter()
        o = optimal.fastest_within(prob, together=families(prob) if alike else (), hints=(g,))
        o.reduce_early()
        to = time.perf_counter() - t0
        o_step, o_held = step_seconds(prob, o), state_bytes(prob, o)
        o_bytes = build_plan(prob, o, tracer=cap.tracer, search="optimal", seconds=to, memory_now=False).comm_bytes
        prop = S.State(prob)              # the optimum's group choices, every op propagated as the greedy does
        prop.set_choices(dict(enumerate(o.choice)))
        prop.reduce_early()
        free = step_seconds(prob, prop) / o_step if o_step else 1.0
    differs = _differs(prob, g.choice, o.choice)
    s = o.solved
    return dict(p=p, nodes=len(prob.nodes), groups=len(prob.groups), greedy_step=g_step, optimal_step=o_step,
                ratio=g_step / o_step if o_step else 1.0, greedy_bytes=g_bytes, optimal_bytes=o_bytes,
                greedy_state=g_held, optimal_state=o_held, greedy_s=tg, optimal_s=to, problem_s=built,
                status=s.status, gap=s.gap, solver_s=s.seconds, variables=s.variables, binaries=s.integers,
                free=free, held_classes=s.held_classes, differs=differs[:12], optimal_choice=list(o.choice))


def _differs(prob, mine, best) -> list:
    return [f"{prob.groups[k].names[0]}: {_choice(prob, k, mine[k])} -> {_choice(prob, k, best[k])}"
            for k in range(len(prob.groups)) if mine[k] != best[k]][:12]


def _choice(prob, g, c) -> str:
    return ",".join(str(pl) for pl in prob.groups[g].choices[c])


def cases(only=()):
    """(kind, name, builder) of every zoo architecture and public configuration; `builder()` ->
    (model, example inputs)."""
    from zoo import ZOO
    import real_configs as R
    for name, arch in ZOO.items():
        if not only or name in only:
            yield "zoo", name, arch.build
    for name, spec in R.CONFIGS.items():
        if not only or name in only:
            def make(spec=spec):
                _, model = R.build(spec, R.LAYERS)
                ids = torch.zeros(R.BATCH, R.SEQ, dtype=torch.long, device="meta")
                return model, {"input_ids": ids, "labels": ids}
            yield "config", name, make


def run(only, degrees, out, done=frozenset(), log=print, optima=None, outputs="full", vocabulary=False,
        alike=False):
    """Every case at the first degree, then at the next (a partial run covers every model); records
    (kind, name, p) in `done` are skipped."""
    for p in degrees:
        for kind, name, make in cases(only):
            if (kind, name, p) in done or (optima is not None and (kind, name, p) not in optima):
                continue
            try:
                model, example = make()
                rec = dict(kind=kind, name=name, **compare(model, p, example,
                                                           optimum=None if optima is None else optima[kind, name, p],
                                                           outputs=outputs, vocabulary=vocabulary, alike=alike),
                           outputs=outputs, vocabulary=vocabulary, alike=alike)
            except Exception as exc:               # noqa: BLE001 - recorded, never fatal
                rec = dict(kind=kind, name=name, p=p, error=f"{type(exc).__name__}: {exc}"[:300])
            out.write(json.dumps(rec) + "\n")
            out.flush()
            log(_line(rec))


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['kind']:6} {r['name']:20} p={r.get('p', '-')}: {r['error']}"
    return (f"{r['kind']:6} {r['name']:20} p={r['p']}: greedy/opt {r['ratio']:.4f}  bytes {r['greedy_bytes']:.0f} / "
            f"{r['optimal_bytes']:.0f}  time {r['greedy_s']:.2f}s / {r['optimal_s']:.2f}s ({r['status']}, gap "
            f"{r['gap']:.1e}, {r['binaries']} bin)  free {r['free']:.4f}")


def table(records: list) -> str:
    """The markdown table of docs/benchmarks.md's section 18."""
    rows = ["| kind | model | p | greedy / optimum (step s) | greedy bytes | optimum bytes | greedy s | optimal s "
            "| solver | propagated / optimum |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['kind']} | {r['name']} | {r.get('p', '')} | error: {r['error'][:80]} | | | | | | |")
            continue
        rows.append(f"| {r['kind']} | {r['name']} | {r['p']} | {r['ratio']:.4f} | {r['greedy_bytes']:,.0f} | "
                    f"{r['optimal_bytes']:,.0f} | {r['greedy_s']:.2f} | {r['optimal_s']:.2f} | {r['status']}, gap "
                    f"{r['gap']:.0e} | {r['free']:.4f} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=())
    ap.add_argument("--degrees", nargs="*", type=int, default=list(DEGREES))
    ap.add_argument("--out", default="optimality.jsonl")
    ap.add_argument("--outputs", default="full", choices=("full", "sharded"))
    ap.add_argument("--vocabulary", action="store_true",
                    help="heads tied to an embedding kept split on the vocabulary in both searches")
    ap.add_argument("--alike", action="store_true",
                    help="the optimum with alike layers alike, as the greedy keeps them (one block graph a run)")
    ap.add_argument("--table", default=None, help="print the table of a records file and stop")
    ap.add_argument("--greedy-against", default=None,
                    help="a records file: run the greedy only, against the optima recorded there")
    args = ap.parse_args(argv)
    if args.table:
        print(table([json.loads(x) for x in open(args.table)]))
        return
    torch.set_num_threads(1)
    done = set()
    if Path(args.out).exists():
        done = {(r["kind"], r["name"], r.get("p")) for r in map(json.loads, open(args.out))}
    optima = None
    if args.greedy_against:
        optima = {(r["kind"], r["name"], r["p"]): r for r in map(json.loads, open(args.greedy_against)) if "error" not in r}
    with open(args.out, "a") as out:
        run(set(args.only), args.degrees, out, done, optima=optima, outputs=args.outputs, vocabulary=args.vocabulary,
            alike=args.alike)


if __name__ == "__main__":
    main()
