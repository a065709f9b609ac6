#!/usr/bin/env python
"""DeepSpeed's AutoTP beside autoshard on the model zoo's families, 2 ranks, the same transport.

    pip install ".[peers]"        # deepspeed, pure Python: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu
    python benchmarks/deepspeed_autotp.py                      # every zoo entry (tests/zoo.py)
    python benchmarks/deepspeed_autotp.py --models llama,opt,bert --steps 5

Each model is run by `torchrun --nproc_per_node 2` (gloo, CPU; a launch holds several models, and
a model that hangs or kills its launch is reported and the next launch goes on after it). Both
sides run over gloo: DeepSpeed's shared-memory all-reduce op is turned off
(`deepspeed.comm.torch.build_shm_op` returns None, so `inference_all_reduce` takes
torch.distributed.all_reduce), and autoshard's collectives take c10d's path (its shared-memory
opt-in, AUTOSHARD_SHM, is unset). Per model, on each side:

- training: DeepSpeed `deepspeed.initialize(model, optimizer=SGD, config={"tensor_parallel":
  {"autotp_size": 2}, ...})`, one `engine(**kw)`, `engine.backward(loss)`, `engine.step()`;
  autoshard `autoshard.parallelize(model, 2, kw)`, forward, backward, SGD step. Whether it runs
  (else the first line of its error), whether its loss and logits equal one process's (1e-5 of
  scale; autoshard's gradients too, collected whole), the bytes one rank sends in a training step
  (ring bytes, `autoshard.runtime.collectives.ring_bytes`: DeepSpeed's counted by wrapping
  torch.distributed's collectives, autoshard's by its own counters) with the collectives' count,
  and the median step time over `--steps` steps (both sides in one process, so the same load).
- inference: DeepSpeed `deepspeed.init_inference(model, tensor_parallel={"tp_size": 2},
  dtype=float32)`, autoshard the same parallelized module under no_grad: whether it runs and
  equals one process's logits, and the median forward time.

Results: a table on stdout and benchmarks/results/deepspeed_autotp.json (one row a model).
`--at-deepspeed-memory` also runs autoshard with DeepSpeed's layout's predicted peak per rank as its
`memory_budget` (`deepspeed_pins`: the fastest plan within DeepSpeed's memory), exactness and bytes
counted as above, in a second table (results: deepspeed_autotp_same_memory.json). `--same-memory`
prints the plans alone (no launch, no DeepSpeed). `--least-bytes` prints, per model, the fewest
bytes any plan within the default's state bound sends (the integer program, bytes alone costing)
beside the default's and DeepSpeed's measured bytes (plans only).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
RESULTS = ROOT / "benchmarks" / "results" / "deepspeed_autotp.json"
LAUNCH_S = 900


# ----------------------------------------------------------------------------- worker (one rank)

@contextmanager
def counted(events: list):
    """Wrap torch.distributed's collectives: (kind, ring bytes, shape) of each call into `events`."""
    import torch.distributed as dist
    from autoshard.runtime.collectives import ring_bytes
    saved = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor", "all_gather",
                                           "reduce_scatter_tensor", "broadcast")}

    def wrap(name, kind, size):
        def call(*a, **k):
            group = k.get("group")
            p = dist.get_world_size(group)
            t = size(*a, **k)
            events.append((kind, ring_bytes(kind, t.nbytes, p), tuple(t.shape)))
            return saved[name](*a, **k)
        return call

    first = lambda *a, **k: a[0] if a else next(iter(k.values()))               # noqa: E731
    dist.all_reduce = wrap("all_reduce", "all_reduce", first)
    dist.all_gather_into_tensor = wrap("all_gather_into_tensor", "all_gather", first)
    dist.all_gather = wrap("all_gather", "all_gather", lambda out, *a, **k: __import__("torch").cat(out))
    dist.reduce_scatter_tensor = wrap("reduce_scatter_tensor", "reduce_scatter", lambda o, i, *a, **k: i)
    dist.broadcast = wrap("broadcast", "broadcast", first)
    try:
        yield events
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _close(a, b) -> bool:
    import torch
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return False
    scale = b.abs().max().item() if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale + 1e-7))


def _logits(out):
    t = getattr(out, "logits", None)
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _median_s(fn, steps: int) -> float:
    import torch.distributed as dist
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _same(out, ref_out, grads_ok=None) -> str:
    loss_ok = ref_out.loss is None or _close(out.loss, ref_out.loss)
    lg, rlg = _logits(out), _logits(ref_out)
    logits_ok = rlg is None or (lg is not None and _close(lg, rlg))
    if loss_ok and logits_ok and grads_ok in (None, True):
        return "exact"
    what = [w for w, ok in (("loss", loss_ok), ("logits", logits_ok), ("gradients", grads_ok)) if ok is False]
    return "differs: " + ", ".join(what)


def _deepspeed_train(model, kw, ref_out, steps):
    import deepspeed
    import torch
    from deepspeed.module_inject import layers
    layers.set_autotp_mode(training=True)
    m = copy.deepcopy(model).train()
    cfg = {"train_micro_batch_size_per_gpu": next(iter(kw.values())).shape[0], "gradient_accumulation_steps": 1,
           "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.0), config=cfg)
    events = []
    with counted(events):
        out = engine(**kw)
        engine.backward(out.loss)
        engine.step()
    row = {"train": _same(out, ref_out), "bytes": sum(e[1] for e in events), "calls": len(events),
           "events": [list(e) for e in events]}

    def step():
        engine.backward(engine(**kw).loss)
        engine.step()
    row["step_ms"] = 1e3 * _median_s(step, steps)
    return row


def _deepspeed_infer(model, kw, ref_out, steps):
    import deepspeed
    import torch
    from deepspeed.module_inject import layers
    layers.set_autotp_mode(training=False)
    engine = deepspeed.init_inference(copy.deepcopy(model), tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                      replace_with_kernel_inject=False)
    with torch.no_grad():
        out = engine(**kw)
        row = {"infer": _same(out, ref_out)}
        row["infer_ms"] = 1e3 * _median_s(lambda: engine(**kw), steps)
    return row


def _autoshard(model, kw, ref, ref_out, steps, **plan_options):
    import torch
    import autoshard
    import refs
    from autoshard.runtime.collectives import count_comm
    gm = autoshard.parallelize(copy.deepcopy(model), 2, kw, **plan_options)
    with count_comm() as c:
        out = gm(**kw)
        out.loss.backward()
    try:
        refs.grads_match(gm, ref, "autoshard")
        grads_ok = True
    except AssertionError:
        grads_ok = False
    row = {"train": _same(out, ref_out, grads_ok), "bytes": c.bytes, "calls": c.calls,
           "events": [[e.op, e.kind, e.direction, e.bytes] for e in c.events]}
    opt = torch.optim.SGD(gm.parameters(), lr=0.0)

    def step():
        opt.zero_grad(set_to_none=True)
        gm(**kw).loss.backward()
        opt.step()
    row["step_ms"] = 1e3 * _median_s(step, steps)
    with torch.no_grad():
        row["infer"] = _same(gm(**kw), ref_out)
        row["infer_ms"] = 1e3 * _median_s(lambda: gm(**kw), steps)
    return row


def _autoshard_at_deepspeed_memory(model, kw, ref, ref_out, steps):
    """`_autoshard` with DeepSpeed's layout's predicted peak per rank (`deepspeed_pins`) as its budget."""
    import autoshard
    budget = autoshard.plan(model, 2, kw, pin=deepspeed_pins(model)).memory.peak
    return dict(_autoshard(model, kw, ref, ref_out, steps, memory_budget=budget), budget=budget)


def _guarded(fn, *args) -> dict:
    from autoshard.errors import first_line
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result
        return {"error": f"{type(e).__name__}: {first_line(e, 200)}"}


def worker(names: list, out_path: str, steps: int, same_memory: bool = False) -> None:
    """One rank of a torchrun launch: each model in turn, a JSON line a model appended by rank 0.
    `same_memory`: autoshard run a second time, with DeepSpeed's layout's predicted peak as its
    `memory_budget` (`deepspeed_pins`)."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - the module (deepspeed.comm's attribute `torch` is torch itself)
    import torch
    import torch.distributed as dist
    from zoo import ZOO
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None     # its shared-memory all-reduce off: gloo
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for name in names:
        arch = ZOO[name]
        if rank == 0:
            with open(out_path + ".at", "w") as f:
                f.write(name)
        model, kw = arch.build()
        model.train()
        ref = copy.deepcopy(model)
        ref_out = ref(**kw)
        ref_out.loss.backward()
        with torch.no_grad():
            ref_eval = ref(**kw)
        row = {"model": name, "family": arch.family, "task": arch.task,
               "deepspeed": {**_guarded(_deepspeed_infer, model, kw, ref_eval, steps)},
               "autoshard": _guarded(_autoshard, model, kw, ref, ref_out, steps)}
        row["deepspeed_train"] = _guarded(_deepspeed_train, model, kw, ref_out, steps)
        if same_memory:
            row["autoshard_same_memory"] = _guarded(_autoshard_at_deepspeed_memory, model, kw, ref, ref_out, steps)
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        dist.barrier()


# ----------------------------------------------------------------------------- parent

def run(names: list, steps: int, per_launch: int, same_memory: bool = False) -> list:
    """Launch torchrun over `names` (`per_launch` a launch); a launch that dies or passes
    LAUNCH_S is reported on the model it was at, and the rest go on in a new launch."""
    rows, todo = [], list(names)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("AUTOSHARD_SHM", None)
    while todo:
        batch, todo = todo[:per_launch], todo[per_launch:]
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.jsonl")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   __file__, "--worker", ",".join(batch), "--out", out, "--steps", str(steps)] + \
                (["--at-deepspeed-memory"] if same_memory else [])
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_S)
                failure = None if proc.returncode == 0 else f"launch exited {proc.returncode}: " + \
                    next((ln for ln in reversed(proc.stderr.splitlines()) if "Error" in ln), proc.stderr[-200:])
            except subprocess.TimeoutExpired:
                failure = f"no result within {LAUNCH_S} s (hang)"
            done = [json.loads(ln) for ln in open(out)] if os.path.exists(out) else []
            rows += done
            if failure is not None and len(done) < len(batch):
                at = open(out + ".at").read() if os.path.exists(out + ".at") else batch[len(done)]
                rows.append({"model": at, "launch_failure": failure[:300]})
                todo = batch[batch.index(at) + 1:] + todo
        for r in rows[-len(batch):]:
            print(json.dumps(_brief(r)), flush=True)
    return rows


def _brief(r: dict) -> dict:
    return {k: ({kk: vv for kk, vv in v.items() if kk != "events"} if isinstance(v, dict) else v) for k, v in r.items()}


def _bytes(d: dict) -> str:
    """A row's bytes a training step and its collectives, '-' where it has none."""
    return f"{d['bytes']:,.0f} ({d['calls']})" if "bytes" in d else "-"


def _ratio(d: dict, to: dict) -> str:
    return f"{d['bytes'] / to['bytes']:.2f}" if "bytes" in d and to.get("bytes") else "-"


def _cell(d: dict, key: str) -> str:
    if "error" in d:
        return "fails"
    return d.get(key, "-")


def table(rows: list) -> str:
    lines = ["| model | DeepSpeed training | DeepSpeed inference | autoshard training / inference | bytes a step "
             "DeepSpeed (calls) | bytes a step autoshard (calls) | autoshard / DeepSpeed | step ms DeepSpeed | "
             "step ms autoshard | infer ms DeepSpeed | infer ms autoshard |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "launch_failure" in r:
            lines.append(f"| {r['model']} | {r['launch_failure']} |" + " - |" * 9)
            continue
        t, i, a = r["deepspeed_train"], r["deepspeed"], r["autoshard"]
        ms = lambda d, k: f"{d[k]:.1f}" if k in d else "-"        # noqa: E731
        err = lambda d, k: d.get(k, "") if "error" not in d else f"fails: {d['error']}"  # noqa: E731
        lines.append(f"| {r['model']} | {err(t, 'train')} | {err(i, 'infer')} | {err(a, 'train')} / "
                     f"{a.get('infer', '-')} | {_bytes(t)} | {_bytes(a)} | {_ratio(a, t)} | {ms(t, 'step_ms')} | {ms(a, 'step_ms')} | "
                     f"{ms(i, 'infer_ms')} | {ms(a, 'infer_ms')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- at DeepSpeed's memory
LAYER = re.compile(r"\.\d+\.")         # a module inside a numbered layer (model.layers.3.mlp.up_proj)


def deepspeed_pins(model) -> dict:
    """DeepSpeed AutoTP's layout as autoshard pins: every module owning parameters whole ({name: None})
    but the Linear layers inside numbered layers, the only ones AutoTP splits (embeddings, heads,
    norms, convolutions and layer scales stay replicated)."""
    import torch
    mods = dict(model.named_modules())
    owners = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
    return {o: None for o in sorted(owners)
            if not (isinstance(mods[o], torch.nn.Linear) and LAYER.search(f".{o}."))}


def same_memory_table(rows: list) -> str:
    """autoshard at DeepSpeed's memory (`--at-deepspeed-memory`) beside DeepSpeed and autoshard's default."""
    lines = ["| model | DeepSpeed: bytes (calls) | autoshard default: bytes (calls) | budget = DeepSpeed's layout's "
             "peak (KiB) | autoshard at that budget: training / inference | bytes (calls) | / DeepSpeed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, a, m = r.get("deepspeed_train", {}), r.get("autoshard", {}), r.get("autoshard_same_memory")
        if m is None:
            continue
        budget = f"{m['budget'] / 1024:.0f}" if "budget" in m else "-"
        lines.append(f"| {r['model']} | {_bytes(t)} | {_bytes(a)} | {budget} | "
                     f"{m.get('train', m.get('error', '-'))} / {m.get('infer', '-')} | {_bytes(m)} | {_ratio(m, t)} |")
    return "\n".join(lines)


def same_memory(names: list) -> str:
    """Per model, plans only (no DeepSpeed run, no process group): autoshard's default plan; the plan
    in DeepSpeed AutoTP's layout (`deepspeed_pins`); and autoshard's search with that plan's predicted
    peak per rank as `memory_budget` (the fastest plan within DeepSpeed's memory). Bytes: ring bytes a
    rank sends in a training step."""
    import autoshard
    from zoo import ZOO, build
    lines = ["| model | default: bytes (peak KiB) | DeepSpeed's layout: bytes (peak KiB) | "
             "budget = that peak: bytes (peak KiB) | budget / default bytes |", "|---|---|---|---|---|"]
    for name in names:
        model, kw = build(ZOO[name])
        plans = [autoshard.plan(model, 2, kw), autoshard.plan(model, 2, kw, pin=deepspeed_pins(model))]
        plans.append(autoshard.plan(model, 2, kw, memory_budget=plans[1].memory.peak))
        cells = [f"{int(p.comm_bytes):,} ({p.memory.peak / 1024:.0f})" for p in plans]
        lines.append(f"| {name} | {' | '.join(cells)} | {plans[2].comm_bytes / plans[0].comm_bytes:.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def least_bytes(names: list) -> str:
    """Per model, plans only: the bytes and training state per rank of autoshard's default plan, and
    the fewest bytes any plan within the same state bound sends (`search="optimal"`, the integer
    program, with a cost model where only bytes cost time: no latency, free compute; the default's
    bound, `budget.least_comm`'s, as its constraint), beside DeepSpeed's measured bytes where the
    `--at-deepspeed-memory` results hold them. Where that least is above DeepSpeed's, no plan
    holding the default's memory sends DeepSpeed's bytes: the gap is memory, not the search."""
    import autoshard
    from autoshard.planner.cost import CostModel
    from zoo import ZOO, build
    measured = RESULTS.with_name("deepspeed_autotp_same_memory.json")
    ds = {r["model"]: r.get("deepspeed_train", {}).get("bytes") for r in
          (json.loads(measured.read_text()) if measured.exists() else [])}
    bytes_only = CostModel(latency=0.0, flops=1e30)
    lines = ["| model | default: bytes (state a rank, elements) | fewest bytes within the default's state bound "
             "(state) | DeepSpeed AutoTP bytes (measured) | fewest / DeepSpeed | notes |", "|---|---|---|---|---|---|"]
    for name in names:
        model, kw = build(ZOO[name])
        default = autoshard.plan(model, 2, kw)
        least = autoshard.plan(model, 2, kw, search="optimal", cost_model=bytes_only)
        theirs = ds.get(name)
        solved = next(n for n in least.notes if n.startswith("search=optimal"))
        status = solved.split("HiGHS ", 1)[1].split(",")[0]
        held = solved.rpartition("; ")[2] if "read as held" in solved else ""
        lines.append(f"| {name} | {int(default.comm_bytes):,} ({default.params_per_rank:,}) | "
                     f"{int(least.comm_bytes):,} ({least.params_per_rank:,}) | "
                     f"{f'{int(theirs):,}' if theirs else '-'} | "
                     f"{f'{least.comm_bytes / theirs:.2f}' if theirs else '-'} | "
                     f"HiGHS {status}{'; ' + held if held else ''} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma-separated zoo names (default: the whole zoo)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--per-launch", type=int, default=8)
    ap.add_argument("--same-memory", action="store_true",
                    help="plans only: autoshard at the predicted peak of DeepSpeed's layout (no DeepSpeed needed)")
    ap.add_argument("--at-deepspeed-memory", action="store_true",
                    help="run autoshard a second time at the predicted peak of DeepSpeed's layout (a second table)")
    ap.add_argument("--least-bytes", action="store_true",
                    help="plans only: the fewest bytes any plan within the default's state bound sends (needs scipy)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker.split(","), a.out, a.steps, a.at_deepspeed_memory)
        return
    from zoo import ZOO
    names = a.models.split(",") if a.models else list(ZOO)
    if a.same_memory:
        print(same_memory(names))
        return
    if a.least_bytes:
        print(least_bytes(names))
        return
    rows = run(names, a.steps, a.per_launch, a.at_deepspeed_memory)
    out = RESULTS.with_name("deepspeed_autotp_same_memory.json") if a.at_deepspeed_memory else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    if a.at_deepspeed_memory:
        print("\n" + same_memory_table(rows))


if __name__ == "__main__":
    main()
