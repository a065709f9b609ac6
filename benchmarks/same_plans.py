"""Does a change to the search keep its plans? The greedy's plan of every model zoo architecture and
public configuration (the cases of benchmarks/optimality.py) at 2, 4 and 8 ranks, recorded, and two
records compared: layouts, bytes, group choices and predicted step of each case, and search seconds.

    python benchmarks/same_plans.py record before.jsonl      # at the commit before (~15 min, 1 core)
    python benchmarks/same_plans.py record after.jsonl       # at the commit after
    python benchmarks/same_plans.py compare before.jsonl after.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

import torch  # noqa: E402

from optimality import cases, greedy  # noqa: E402
from autoshard.capture import capture  # noqa: E402
from autoshard.planner import search as S  # noqa: E402
from autoshard.planner.budget import least_comm, step_seconds  # noqa: E402
from autoshard.planner.build import build_plan, chunk_candidates, part_candidates, unit_candidates  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402


def record(out: str, only=(), degrees=(2, 4, 8)) -> None:
    torch.set_num_threads(1)
    with open(out, "w") as f:
        for p in degrees:
            for kind, name, make in cases(set(only)):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        model, example = make()
                        cap = capture(model, example, tracer="auto", tokens=512, once=True)
                        gm = cap.gm
                        prob = S.Problem(gm, p, CostModel(), chunk_candidates(gm), unit_candidates(gm),
                                         part_candidates=part_candidates(gm))
                        t0 = time.perf_counter()
                        state = least_comm(prob, greedy)
                        state.reduce_early()
                        seconds = time.perf_counter() - t0
                        plan = build_plan(prob, state, tracer=cap.tracer, search="greedy", seconds=seconds,
                                          memory_now=False)
                    layouts = str(sorted((k, str(v)) for k, v in plan.layouts.items()))
                    rec = dict(kind=kind, name=name, p=p, step=step_seconds(prob, state), bytes=plan.comm_bytes,
                               choice=list(state.choice), s=seconds,
                               layouts=hashlib.sha256(layouts.encode()).hexdigest()[:16])
                except Exception as exc:                # noqa: BLE001 - recorded, compared like a plan
                    rec = dict(kind=kind, name=name, p=p, error=f"{type(exc).__name__}: {exc}"[:200])
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(kind, name, p, rec.get("bytes", rec.get("error")), flush=True)


def compare(a_path: str, b_path: str) -> int:
    """Prints every case whose plan differs; returns how many do."""
    key = lambda r: (r["kind"], r["name"], r["p"])      # noqa: E731
    a = {key(r): r for r in map(json.loads, open(a_path))}
    b = {key(r): r for r in map(json.loads, open(b_path))}
    same, differ, sa, sb = 0, 0, 0.0, 0.0
    for k in sorted(a.keys() & b.keys()):
        ra, rb = a[k], b[k]
        if "error" in ra or "error" in rb:
            ok = ra.get("error") == rb.get("error")
        else:
            sa, sb = sa + ra["s"], sb + rb["s"]
            ok = (ra["layouts"], ra["bytes"], ra["choice"]) == (rb["layouts"], rb["bytes"], rb["choice"]) and \
                abs(ra["step"] - rb["step"]) <= 1e-9 * abs(ra["step"])
        same += ok
        differ += not ok
        if not ok:
            print("differs:", k, {f: (ra.get(f), rb.get(f)) for f in ("bytes", "step", "layouts", "error")})
    print(f"{same} cases plan alike, {differ} differ, {len(a.keys() ^ b.keys())} in one record only; "
          f"greedy search seconds {sa:.1f} -> {sb:.1f}")
    return differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--only", nargs="*", default=())
    r.add_argument("--degrees", nargs="*", type=int, default=[2, 4, 8])
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.out, args.only, args.degrees)
        return 0
    return 1 if compare(args.a, args.b) else 0


if __name__ == "__main__":
    sys.exit(main())
