#!/usr/bin/env python
"""Planning time and memory against graph size: capture apart from search + cost.

    python benchmarks/plan_scaling.py            # full: GPT 6..96 blocks, random DAGs to ~20k nodes (< 10 min)
    python benchmarks/plan_scaling.py --quick    # GPT 6 and 48 blocks, DAGs to ~1k nodes (< 2 min)
    python benchmarks/plan_scaling.py --depth    # end-to-end plan time against depth, degree 8 (~3 min)

What is measured, per graph (one process, one thread, shapes only: models on the meta device):

- capture: `autoshard.capture.trace.capture(model, example, tracer=...)`, i.e. tracing plus FakeTensor
  shape propagation, for `symbolic_trace` and (GPT only) `torch.export`. Wall seconds of one run.
- plan: `autoshard.planner.build.plan_graph(gm, p, CostModel())` on the captured graph: sharding rules per
  node, cost tables, the greedy search and freezing the Plan, i.e. everything `autoshard.plan`
  does after capture. Best of `--repeats` runs (wall and CPU seconds; the CPU time is the more
  stable number on a shared machine), split into its stages: Problem (rules + cost tables),
  greedy, build_plan.
- exact: the exact solver's time (every combination of every decision group) where it finishes
  (at most 20,000 combinations: GPT with 1 block, small random DAGs), beside greedy's, with both
  objectives.
- memory: peak bytes Python allocates (tracemalloc) during capture (symbolic_trace; GPT up to 48
  blocks, 12 with --quick) and during plan, measured in separate runs (tracemalloc slows the search
  about 6x, so not on the timed runs); skipped for random DAGs above --mem-max-nodes nodes. The
  stage split (Problem / greedy / build_plan) is one more run, skipped above 6000 nodes.

Graphs: `tests/models.GPT(vocab 8192, hidden 256, 8 heads, L blocks, seq 64, tied)` with a loss,
inputs of shape (2, 64); `tests/factories.dag_size` random DAGs (Linear / gelu / relu / mul /
add / residual adds over 16..512 tokens). Degree 4, default cost model. The near-linear check is
time per node (plan seconds / graph nodes) and the slope of log(time) against log(nodes).

Results: a table on stdout, benchmarks/results/plan_scaling[_quick].json and .png.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from autoshard.planner import search as S  # noqa: E402
from autoshard.planner.build import chunk_candidates, plan_graph  # noqa: E402
from autoshard.capture.trace import capture  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402
from autoshard.planner.build import build_plan  # noqa: E402
from factories import dag_size, random_dag  # noqa: E402
from models import GPT  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VOCAB, HIDDEN, HEADS, SEQ, BATCH = 8192, 256, 8, 64, 2
EXACT_LIMIT = 20_000


def gpt(blocks: int):
    with torch.device("meta"):
        model = GPT(VOCAB, HIDDEN, HEADS, blocks, SEQ, tied=True)
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return model, (idx, idx)


def dag(steps: int):
    model = dag_size(steps, seed=1)
    return model, model.example()


def clock(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def peak(fn) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def stages(gm, p, cost) -> dict:
    """CPU seconds of plan_graph's stages, run one after the other as plan_graph runs them."""
    c0 = time.process_time()
    prob = S.Problem(gm, p, cost, chunk_candidates(gm))
    c1 = time.process_time()
    state = S.greedy(prob)
    c2 = time.process_time()
    build_plan(prob, state, tracer="fx", search="greedy", seconds=0.0)
    c3 = time.process_time()
    return {"problem_cpu": c1 - c0, "greedy_cpu": c2 - c1, "build_cpu": c3 - c2, "groups": len(prob.groups)}


def measure_plan(gm, p, repeats: int, memory: bool) -> dict:
    cost = CostModel()
    best = None
    for _ in range(repeats):
        plan, wall, cpu = clock(lambda: plan_graph(gm, p, cost))
        if best is None or cpu < best["plan_cpu"]:
            best = {"plan_wall": wall, "plan_cpu": cpu}
    best.update(stages(gm, p, cost) if len(gm.graph.nodes) <= 6000 else
                {"problem_cpu": None, "greedy_cpu": None, "build_cpu": None, "groups": None})
    best.update(objective=plan.objective, comm_bytes=plan.comm_bytes,
                all_reduces=plan.comm_by_kind.get("all_reduce", (0, 0))[0],
                other_collectives={k: v[0] for k, v in plan.comm_by_kind.items() if k != "all_reduce"})
    best["plan_peak_bytes"] = peak(lambda: plan_graph(gm, p, cost)) if memory else None
    return best


def measure_exact(gm, p) -> dict | None:
    prob = S.Problem(gm, p, CostModel(), chunk_candidates(gm))
    combos = math.prod(len(g.choices) for g in prob.groups)
    if combos > EXACT_LIMIT:
        return {"combinations": combos, "skipped": f"> {EXACT_LIMIT} combinations"}
    g, gw, gc_ = clock(lambda: S.greedy(S.Problem(gm, p, CostModel(), chunk_candidates(gm))))
    e, ew, ec = clock(lambda: S.exact(S.Problem(gm, p, CostModel(), chunk_candidates(gm)), limit=EXACT_LIMIT))
    return {"combinations": combos, "groups": len(prob.groups), "greedy_wall": gw, "greedy_cpu": gc_,
            "exact_wall": ew, "exact_cpu": ec, "greedy_objective": g.total, "exact_objective": e.total,
            "greedy_over_exact": g.total / e.total}


def run_case(kind: str, size: int, build, tracers, p: int, repeats: int, memory: bool, log,
             capture_memory: bool = True) -> dict:
    t0 = time.perf_counter()
    model, example = build(size)
    row = {"kind": kind, "size": size}
    gm = None
    for tracer in tracers:
        cap, wall, cpu = clock(lambda: capture(model, example, tracer=tracer))
        row[f"capture_{tracer}_wall"] = wall
        row[f"capture_{tracer}_cpu"] = cpu
        row[f"nodes_{tracer}"] = len(cap.gm.graph.nodes)
        if memory and capture_memory and tracer == "symbolic_trace":   # export under tracemalloc: minutes
            row[f"capture_{tracer}_peak_bytes"] = peak(lambda: capture(model, example, tracer=tracer))
        if gm is None:
            gm, row["tracer"] = cap.gm, tracer
        del cap
    row["nodes"] = len(gm.graph.nodes)
    row.update(measure_plan(gm, p, repeats, memory))
    row["us_per_node"] = row["plan_cpu"] / row["nodes"] * 1e6
    row["case_seconds"] = time.perf_counter() - t0
    log(row)
    return row, gm


def slope(rows, key="plan_cpu") -> float | None:
    pts = [(math.log(r["nodes"]), math.log(r[key])) for r in rows if r.get(key)]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def profile_top(gm, p, n=15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    plan_graph(gm, p, CostModel())
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(n)
    return buf.getvalue()


def fmt_s(x):
    return "-" if x is None else f"{x:.3f}"


def fmt_mb(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def env() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "load_avg": load,
            "git_commit": commit, "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    g, d = res["gpt"], res["dag"]
    a.loglog([r["nodes"] for r in g], [r["plan_cpu"] for r in g], "o-", label="GPT: search + cost (CPU s)")
    a.loglog([r["nodes"] for r in g], [r["capture_symbolic_trace_wall"] for r in g], "s--",
             label="GPT: capture, symbolic_trace")
    ex = [r for r in g if "capture_export_wall" in r]
    if ex:
        a.loglog([r["nodes"] for r in ex], [r["capture_export_wall"] for r in ex], "^--", label="GPT: capture, export")
    a.loglog([r["nodes"] for r in d], [r["plan_cpu"] for r in d], "o-", label="random DAG: search + cost (CPU s)")
    a.loglog([r["nodes"] for r in d], [r["capture_symbolic_trace_wall"] for r in d], "s:",
             label="random DAG: capture")
    ns = [r["nodes"] for r in g + d]
    if ns:
        lo, hi = min(ns), max(ns)
        ref = g[0]["plan_cpu"] / g[0]["nodes"] if g else d[0]["plan_cpu"] / d[0]["nodes"]
        a.loglog([lo, hi], [ref * lo, ref * hi], "k:", lw=0.8, label="linear")
    a.axhline(1.0, color="r", lw=0.6)
    a.set_xlabel("graph nodes")
    a.set_ylabel("seconds")
    a.set_title(f"planning time (degree {res['world_size']})")
    a.legend(fontsize=7)
    for rows, lab in ((g, "GPT"), (d, "random DAG")):
        pts = [(r["nodes"], r["plan_peak_bytes"]) for r in rows if r.get("plan_peak_bytes")]
        if pts:
            b.loglog(*zip(*pts), "o-", label=f"{lab}: plan")
        pts = [(r["nodes"], r["capture_symbolic_trace_peak_bytes"]) for r in rows
               if r.get("capture_symbolic_trace_peak_bytes")]
        if pts:
            b.loglog(*zip(*pts), "s--", label=f"{lab}: capture (symbolic_trace)")
    b.set_xlabel("graph nodes")
    b.set_ylabel("peak bytes (tracemalloc)")
    b.set_title("peak Python memory")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- depth: end to end
DEPTH_CASES = {
    # a Hugging Face LLaMA-3-70B config (hidden 8192, 64 heads, 8 K/V heads, vocab 128256), 2 x 512 tokens
    "llama": (2, 8, 32, 80),
    # the plain GPT of the issue (d 256, 8 heads, separate q/k/v, vocab 4000, 64 tokens, loss inside)
    "gpt": (2, 8, 32, 48, 80),
}


def _depth_model(kind: str, layers: int):
    if kind == "gpt":
        with torch.device("meta"):
            model = GPT(4000, 256, 8, layers, 64, tied=False)
        return model, (torch.Size([2, 64]),) * 2, {}
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                   num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256,
                                   max_position_embeddings=8192, rope_theta=500000.0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return model, {"input_ids": torch.Size([2, 512]), "labels": torch.Size([2, 512])}, {"tracer": "export"}


def depth_child(kind: str, layers: int, once: bool, p: int) -> None:
    """One cold end-to-end plan in this (fresh) process; prints one JSON line."""
    import autoshard
    model, example, kw = _depth_model(kind, layers)
    w, c = time.perf_counter(), time.process_time()
    plan = autoshard.plan(model, p, example, capture_once=once, **kw)
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    digest = sorted((k, str(v)) for k, v in plan.layouts.items())
    print(json.dumps({"kind": kind, "layers": layers, "once": once, "wall": wall, "cpu": cpu,
                      "search": plan.search_seconds, "comm_bytes": plan.comm_bytes,
                      "collectives": {k: v[0] for k, v in plan.comm_by_kind.items()},
                      "layouts": hashlib.sha256(str(digest).encode()).hexdigest()[:16]}))


def depth(p: int, whole_max: int) -> int:
    """End-to-end plan time against depth, each in a fresh process (as a user's first call),
    tracing repeated layers once (the default) and, up to `whole_max` layers, layer by layer."""
    rows = []
    for kind, depths in DEPTH_CASES.items():
        for layers in depths:
            for once in (True, False):
                if not once and layers > whole_max:
                    continue
                out = subprocess.run([sys.executable, __file__, "--depth-child", kind, str(layers), str(int(once)),
                                      str(p)], capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{kind:6s} {layers:3d} layers  {'once ' if once else 'whole'}  {row['wall']:6.2f} s wall  "
                      f"{row['cpu']:6.2f} s cpu  search {row['search']:.2f} s  comm {row['comm_bytes'] / 1e6:10.1f} MB  "
                      f"{row['collectives']}", flush=True)
    print("\n| model | layers | traced once: plan s (wall) | layer by layer | same plan |")
    print("|---|---|---|---|---|")
    for r in rows:
        if not r["once"]:
            continue
        w = next((x for x in rows if x["kind"] == r["kind"] and x["layers"] == r["layers"] and not x["once"]), None)
        same = "-" if w is None else ("yes" if (w["comm_bytes"], w["collectives"], w["layouts"]) ==
                                      (r["comm_bytes"], r["collectives"], r["layouts"]) else "NO")
        whole = "-" if w is None else f"{w['wall']:.2f}"
        print(f"| {r['kind']} | {r['layers']} | {r['wall']:.2f} | {whole} | {same} |")
    for kind in DEPTH_CASES:
        mine = {r["layers"]: r["wall"] for r in rows if r["kind"] == kind and r["once"]}
        lo, hi = min(mine), max(mine)
        print(f"{kind}: {hi} layers / {lo} layers = {mine[hi] / mine[lo]:.2f}x")
    (RESULTS).mkdir(parents=True, exist_ok=True)
    (RESULTS / "plan_depth.json").write_text(json.dumps({"env": env(), "world_size": p, "rows": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--depth-child":
        depth_child(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, < 2 minutes")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed plan runs per graph, the best kept (default 2 quick, 3 full)")
    ap.add_argument("--mem-max-nodes", type=int, default=None,
                    help="largest random DAG measured with tracemalloc (default 600 quick, 2000 full)")
    ap.add_argument("--profile", action="store_true", help="always print cProfile's top of the 48-block plan")
    ap.add_argument("--depth", action="store_true",
                    help="end-to-end plan time against depth (LLaMA-3-70B config, GPT; degree 8), fresh process each")
    ap.add_argument("--whole-max", type=int, default=32,
                    help="with --depth: also trace layer by layer up to this many layers")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    p = args.world_size
    if args.depth:
        return depth(8 if args.world_size == 4 and "--world-size" not in (argv or sys.argv) else args.world_size,
                     args.whole_max)
    args.repeats = args.repeats or (2 if args.quick else 3)
    blocks = (6, 48) if args.quick else (6, 12, 24, 48, 96)
    export_for = (48,) if args.quick else blocks
    steps = (300, 600) if args.quick else (300, 1000, 3000, 11500)
    mem_max = args.mem_max_nodes or (600 if args.quick else 2000)
    t_start = time.perf_counter()

    def log(r):
        caps = ", ".join(f"{k[8:-5]} {r[k]:.2f} s" for k in r if k.startswith("capture_") and k.endswith("_wall"))
        print(f"  {r['kind']} {r['size']:>6}: {r['nodes']:>6} nodes | capture {caps} | plan {r['plan_wall']:.3f} s "
              f"wall, {r['plan_cpu']:.3f} s CPU ({r['us_per_node']:.0f} us/node; problem {fmt_s(r['problem_cpu'])}, "
              f"greedy {fmt_s(r['greedy_cpu'])}, build {fmt_s(r['build_cpu'])}) | peak {fmt_mb(r['plan_peak_bytes'])} MiB "
              f"[{r['case_seconds']:.0f} s]",
              flush=True)

    res = {"env": env(), "world_size": p, "quick": args.quick, "gpt": [], "dag": [], "exact": [],
           "config": {"gpt": dict(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, seq=SEQ, batch=BATCH, tied=True,
                                  loss=True), "dag_seed": 1, "repeats": args.repeats, "exact_limit": EXACT_LIMIT}}
    print(f"GPT (vocab {VOCAB}, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, batch {BATCH}, tied, loss), degree {p}",
          flush=True)
    gm48 = None
    for L in blocks:
        tracers = ("symbolic_trace", "export") if L in export_for else ("symbolic_trace",)
        row, gm = run_case("gpt", L, gpt, tracers, p, args.repeats, True, log,
                           capture_memory=L <= (12 if args.quick else 48))
        row["blocks"] = L
        row["megatron_all_reduces"] = 4 * L + 2 + 2
        res["gpt"].append(row)
        if L == 48:
            gm48 = gm
    print("random DAGs (dag_size(steps), seed 1)", flush=True)
    for st in steps:
        row, _ = run_case("dag", st, dag, ("symbolic_trace",), p, 1 if st >= 1000 or args.quick else args.repeats,
                          st * 1.8 <= mem_max, log)
        res["dag"].append(row)

    print("exact solver beside greedy", flush=True)
    cases = [("gpt 1 block", lambda: gpt(1))] + [(f"random dag, {k} linears", lambda k=k: _small_dag(k))
                                               for k in ((3, 5, 7) if args.quick else (3, 5, 7, 9))]
    for name, build in cases:
        model, example = build()
        gm = capture(model, example, tracer="symbolic_trace").gm
        r = measure_exact(gm, p)
        r.update(case=name, nodes=len(gm.graph.nodes))
        res["exact"].append(r)
        if "skipped" in r:
            print(f"  {name}: {r['combinations']} combinations, skipped", flush=True)
        else:
            print(f"  {name}: {r['nodes']} nodes, {r['groups']} groups, {r['combinations']} combinations: greedy "
                  f"{r['greedy_cpu']:.3f} s, exact {r['exact_cpu']:.3f} s CPU; greedy/exact objective "
                  f"{r['greedy_over_exact']:.6f}", flush=True)

    row48 = next((r for r in res["gpt"] if r["blocks"] == 48), None)
    if gm48 is not None and (args.profile or row48["plan_cpu"] > 1.0):
        res["profile_48"] = profile_top(gm48, p)
        print("cProfile of plan_graph on the 48-block GPT (top by cumulative time):")
        print(res["profile_48"])

    res["slopes"] = {"gpt_plan_cpu": slope(res["gpt"]), "dag_plan_cpu": slope(res["dag"]),
                     "gpt_capture_symbolic_trace": slope(res["gpt"], "capture_symbolic_trace_wall"),
                     "dag_capture_symbolic_trace": slope(res["dag"], "capture_symbolic_trace_wall")}
    res["total_seconds"] = time.perf_counter() - t_start
    from tabulate import tabulate
    rows = []
    for r in res["gpt"] + res["dag"]:
        rows.append([f"{r['kind']} {r['size']}", r["nodes"], r.get("groups"),
                     r.get("capture_symbolic_trace_wall"), r.get("capture_export_wall"), r["plan_wall"],
                     r["plan_cpu"], r["problem_cpu"], r["greedy_cpu"], r["us_per_node"],
                     fmt_mb(r.get("capture_symbolic_trace_peak_bytes")), fmt_mb(r["plan_peak_bytes"])])
    print()
    print(tabulate(rows, headers=["graph (blocks / DAG steps)", "nodes", "groups", "capture fx s", "capture export s",
                                  "plan wall s", "plan CPU s", "problem CPU s", "greedy CPU s", "us/node",
                                  "capture peak MiB", "plan peak MiB"], floatfmt=".3f", tablefmt="github"))
    print("\nlog-log slopes (1 = linear): " + ", ".join(f"{k} {v:.2f}" for k, v in res["slopes"].items() if v))
    if row48:
        verdict = "under" if row48["plan_cpu"] < 1.0 else "OVER"
        print(f"48-block GPT ({row48['nodes']} nodes): search + cost {row48['plan_cpu']:.3f} s CPU / "
              f"{row48['plan_wall']:.3f} s wall ({verdict} 1 s); capture symbolic_trace "
              f"{row48['capture_symbolic_trace_wall']:.2f} s, torch.export {row48.get('capture_export_wall', float('nan')):.2f} s")
    print(f"load average {res['env']['load_avg']}; total {res['total_seconds']:.0f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "plan_scaling_quick" if args.quick else "plan_scaling"
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    plot(res, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} and .png")
    return 0


def _small_dag(linears: int):
    model = random_dag(17 + linears, linears=(linears, linears), tokens=(128,))
    return model, model.example()


if __name__ == "__main__":
    sys.exit(main())
