#!/usr/bin/env python
"""autoshard's plans against hand and naive plans, measured on gloo / CPU.

For each model and tensor-parallel degree (2 and 4) six plans are made with
``autoshard.plan`` and run on that many ranks (one thread per rank):

- ``greedy``: ``autoshard.plan(model, p, example)`` (the default search);
- ``exact``: ``search="exact"``: every combination of every decision group. Only feasible for
  small graphs: the solver refuses more than 200,000 combinations, and the variant is then
  reported as ``skipped: <why>`` (the 1-block GPT case is there so that one table has it);
- ``megatron``: Megatron-LM's hand plan, pinned with ``pin=`` by module name patterns:
  q/k/v, fc1, gate, GPT-2's c_attn/c_fc, LLaMA's q/k/v/gate/up_proj, BERT's query/key/value
  and intermediate.dense column-parallel (-1); o, fc2, o_proj, down_proj, c_proj and BERT's
  (attention.)output.dense row-parallel (0); the LM head (head / lm_head / decoder) -1; the
  vocabulary embedding 0. Position / token-type embeddings and any other module are left to
  the search (Megatron keeps them replicated; the vocabulary split is what the plan is about);
- ``all-column``: every linear (nn.Linear, GPT-2's Conv1D) -1, every embedding 1;
- ``all-row``: every linear 0, every embedding 0;
- ``replicate``: every linear and embedding None.

The pins are derived from the keys of the greedy plan's ``plan.dims`` that name modules of the
model. A pin that cannot be satisfied raises ``autoshard.ShardingError``: that variant is shown
as ``infeasible: <message>`` (tied input/output embeddings make all-column and all-row
contradictory by construction). When Megatron's pins are refused, the plan is retried without
the pins on tied weights, shown as ``megatron*``, and the refusal is listed as an anomaly
(Megatron's plan is feasible for a tied model: the greedy search finds it).

Per feasible variant, on every rank: ``autoshard.parallelize(copy, p, example, plan=plan)``;
the loss is checked against the single-process model (relative 1e-4) before anything is timed
(a mismatch is a bug: flagged ``BUG`` in the table and the JSON, and still timed); then

- measured comm bytes per rank per step (fwd + bwd) with ``autoshard.runtime.collectives.count_comm``
  (ring bytes, the definition ``plan.comm_bytes`` uses), shown beside ``plan.comm_bytes`` with
  their ratio; and, independently, with ``CommDebugMode`` (benchmarks/common.py), whose
  payloads are converted to ring bytes per rank (all-reduce 2(p-1)/p n, all-gather and
  reduce-scatter (p-1)/p n of the full tensor, all-to-all (p-1)/p of the local tensor);
- step time: forward + loss + backward + zero_grad, median over interleaved rounds after
  warm-up (the order rotates each round; every step starts after a barrier; a round's time is
  the maximum over ranks), see ``benchmarks/common.time_interleaved``;
- parameters per rank: the sum of ``numel`` of the rank's module's parameters (each tensor
  once), beside ``plan.params_per_rank``;
- peak memory per rank: the peak of bytes held by torch's CPU allocator during one step,
  above its level at the start of the step (``torch.profiler`` memory events,
  ``benchmarks/common.step_peak_bytes``; not tracemalloc, which does not see tensor storage,
  and not ru_maxrss, which cannot be reset between variants); the maximum over ranks.

Models: ``tests/models.py``'s GPT (untied head by default so that every variant is feasible;
``--tied`` ties it) with vocab 4096, hidden 256, 4 heads, 2 blocks, batch 2 x 64 tokens, plus the
same with 1 block (where the exact solver fits); in ``--quick`` mode only a 1-block GPT with
vocab 1024, hidden 128, 2 x 32 tokens. In full mode, when ``transformers`` imports,
``tests/hf_models.py``'s GPT-2, LLaMA, BERT and Qwen2 (vocab 2048, 2 x 32 tokens, captured with
``tracer="export"``; LLaMA and Qwen2 get ``world_size=p`` so their kv heads divide).

    python benchmarks/compare_plans.py --quick     # < 2 min on 2 cores
    python benchmarks/compare_plans.py             # < 10 min on 2 cores

Results: tables on stdout, ``benchmarks/results/compare_plans[_quick].json`` and ``.png``.
Exit status 1 when a variant's loss does not match the single-process model.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):                                    # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.common import (REPO_ROOT, TrainStep, count_collectives, env_info, fmt_bytes,
                               launch, print_table, save_figure, step_peak_bytes, summarize,
                               time_interleaved, use_agg_backend, write_json)

VARIANTS = ("greedy", "exact", "megatron", "all-column", "all-row", "replicate")
LOSS_RTOL = 1e-4
BYTES_RTOL = 0.01
EXACT_LIMIT = 200_000

# Megatron's hand plan by module name: leaf names, then dotted suffixes
COLUMN_LEAVES = {"q", "k", "v", "fc1", "gate", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                 "c_attn", "c_fc", "query", "key", "value"}
COLUMN_SUFFIXES = ("intermediate.dense",)
ROW_LEAVES = {"o", "fc2", "o_proj", "down_proj", "c_proj"}
ROW_SUFFIXES = ("output.dense",)                 # BERT's attention.output.dense and output.dense
HEAD_LEAVES = {"head", "lm_head", "decoder"}


@dataclass(frozen=True)
class Case:
    """One model: ``kind`` "gpt" (tests/models.py GPT) or a tests/hf_models.py builder name."""
    name: str
    kind: str
    kwargs: dict = field(default_factory=dict)
    batch: int = 2
    seq: int = 64


# ----------------------------------------------------------------------------- models

def _load(name: str, path: Path):
    """Import a tests/ module under a private name (benchmarks/models.py is also "models")."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except Exception:                                            # noqa: BLE001
        return False


def build(case: Case, p: int):
    """(model, args, kwargs, tracer) for ``case`` at degree ``p``; deterministic."""
    if case.kind == "gpt":
        gpt = _load("_autoshard_tests_models", REPO_ROOT / "tests" / "models.py")
        torch.manual_seed(0)
        model = gpt.GPT(seq=case.seq, **case.kwargs)
        g = torch.Generator().manual_seed(1)
        vocab = case.kwargs["vocab"]
        idx = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
        tgt = torch.randint(0, vocab, (case.batch, case.seq), generator=g)
        return model, (idx, tgt), {}, "auto"
    hf = _load("_autoshard_tests_hf_models", REPO_ROOT / "tests" / "hf_models.py")
    kw = dict(case.kwargs, batch=case.batch, seq=case.seq)
    if case.kind in ("llama", "qwen2", "mistral"):
        kw["world_size"] = p
    model, kwargs = hf.BUILDERS[case.kind](**kw)
    return model, (), kwargs, "export"


class _Bound(nn.Module):
    """``forward()`` runs the wrapped module on fixed inputs and returns its scalar loss."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.module, self.args, self.kw = module, args, kwargs

    def forward(self):
        out = self.module(*self.args, **self.kw)
        return out if isinstance(out, torch.Tensor) else out.loss


# ----------------------------------------------------------------------------- pins

def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    wte = getattr(model, "wte", None)
    return wte.num_embeddings if isinstance(wte, nn.Embedding) else None


def _tied_owners(model: nn.Module) -> set:
    """Modules that own a parameter under more than one name."""
    names: dict[int, list] = {}
    for n, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(n.rpartition(".")[0])
    return {o for owners in names.values() if len(owners) > 1 for o in owners}


def make_pins(model: nn.Module, dims_keys) -> dict[str, dict]:
    """variant -> pin dict, over the keys of a plan's dims that name modules of ``model``."""
    mods = dict(model.named_modules())
    keys = [k for k in dims_keys if k in mods and k]
    linears = [k for k in keys if _is_linear(mods[k])]
    embeddings = [k for k in keys if isinstance(mods[k], nn.Embedding)]
    vocab = _vocab_size(model)
    megatron = {}
    for k in keys:
        leaf = _leaf(k)
        if k in linears and (leaf in HEAD_LEAVES or leaf in COLUMN_LEAVES or k.endswith(COLUMN_SUFFIXES)):
            megatron[k] = -1
        elif k in linears and (leaf in ROW_LEAVES or k.endswith(ROW_SUFFIXES)):
            megatron[k] = 0
        elif k in embeddings and mods[k].num_embeddings == vocab:
            megatron[k] = 0
    return {
        "megatron": megatron,
        "all-column": {**{k: -1 for k in linears}, **{k: 1 for k in embeddings}},
        "all-row": {**{k: 0 for k in linears}, **{k: 0 for k in embeddings}},
        "replicate": {k: None for k in linears + embeddings},
    }


def _short(e: BaseException, n: int = 300) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def _planner(model, p, example, tracer, reuse: bool):
    """``plan(**kw)`` for one model at degree ``p``.

    The first call is ``autoshard.plan(model, p, example, tracer=...)``. With ``reuse``, later
    calls plan the graph that call captured (``autoshard.planner.build.plan_graph`` on
    ``plan.graph_module``, which is what ``autoshard.plan`` runs after capturing; search and
    rewrite only read the graph), so the slow part (FakeTensor propagation, torch.export) runs
    once per model instead of once per variant. ``--no-reuse`` calls ``autoshard.plan`` every time.
    """
    import autoshard
    first = {}

    def make(**kw):
        if "plan" in first and reuse:
            try:
                from autoshard.planner.build import plan_graph
            except ImportError:
                plan_graph = None
            if plan_graph is not None:
                g = first["plan"]
                return plan_graph(g.graph_module, p, g.cost_model, tracer=g.tracer, example=g.example, **kw)
        pl = autoshard.plan(model, p, example, tracer=tracer, **kw)
        first.setdefault("plan", pl)
        return pl

    return make


def make_plans(model, p, args, kwargs, tracer, reuse: bool = True) -> tuple[dict, dict, list]:
    """(variant -> Plan, variant -> status/notes, anomalies). Status is "ok", "infeasible: ..",
    "skipped: ..", or "BUG: .."."""
    import autoshard
    make = _planner(model, p, kwargs if kwargs else args, tracer, reuse)
    plans, info, anomalies = {}, {}, []

    def attempt(name, **kw):
        t0 = time.perf_counter()
        try:
            plans[name] = make(**kw)
            info[name] = {"status": "ok"}
        except autoshard.ShardingError as e:
            info[name] = {"status": f"infeasible: {_short(e)}"}
        except ValueError as e:
            if kw.get("search") == "exact" and "exact search" in str(e):
                info[name] = {"status": f"skipped: {_short(e)}"}
            else:
                info[name] = {"status": f"BUG: plan raised {_short(e)}"}
        except Exception as e:                                   # noqa: BLE001
            info[name] = {"status": f"BUG: plan raised {_short(e)}",
                          "traceback": traceback.format_exc()}
        info[name]["plan_seconds"] = time.perf_counter() - t0

    attempt("greedy")
    if "greedy" not in plans:
        return plans, info, [f"greedy plan failed: {info['greedy']['status']}"]
    attempt("exact", search="exact")
    pins = make_pins(model, plans["greedy"].dims)
    for name in ("megatron", "all-column", "all-row", "replicate"):
        attempt(name, pin=pins[name])
        info[name]["pins"] = pins[name]
    if info["megatron"]["status"].startswith("infeasible"):
        tied = _tied_owners(model)
        anomalies.append(f"Megatron's pins were refused ({info['megatron']['status']}); "
                         f"tied modules: {sorted(tied)}")
        loose = {k: v for k, v in pins["megatron"].items() if k not in tied}
        if tied and loose != pins["megatron"]:
            attempt("megatron*", pin=loose)
            info["megatron*"]["pins"] = loose
            info["megatron*"]["note"] = f"Megatron's pins without those on tied modules {sorted(tied)}"
    for name, pl in plans.items():                 # a pinned plan must follow its pins
        want = info[name].get("pins") or {}
        off = {k: (v, pl.dims.get(k)) for k, v in want.items()
               if pl.dims.get(k) != v and not (v in (1, -1) and pl.dims.get(k) in (1, -1))}
        if off:
            anomalies.append(f"{name}: plan.dims differs from its pins (pin, got): {off}")
    order = [n for n in ("greedy", "exact", "megatron", "megatron*", "all-column", "all-row", "replicate")
             if n in info]
    return {n: plans[n] for n in order if n in plans}, {n: info[n] for n in order}, anomalies


# ----------------------------------------------------------------------------- per-rank run

def _ring_bytes_commdebug(bytes_by_phase: dict, p: int) -> float:
    """Ring bytes per rank from CommDebugMode payloads."""
    f = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
         "all_to_all": (p - 1) / p}
    return sum(f.get(k, 1.0) * n for ph in bytes_by_phase.values() for k, n in ph.items())


def _plan_summary(pl) -> dict:
    return {"dims": {k: v for k, v in pl.dims.items()}, "comm_bytes": pl.comm_bytes,
            "comm_by_kind": {k: list(v) for k, v in pl.comm_by_kind.items()},
            "params_per_rank": pl.params_per_rank, "params_total": pl.params_total,
            "step_time_ms": pl.step_time * 1e3, "objective": pl.objective,
            "search_seconds": pl.search_seconds, "notes": list(pl.notes),
            "unsupported": list(pl.unsupported)}


def run_case(case: Case, p: int, group, warmup: int, rounds: int, budget_s: float, reuse: bool) -> dict:
    """On every rank: plan every variant, parallelize, check, count, time. Rank 0's result."""
    import autoshard
    from autoshard.runtime.collectives import count_comm
    rank = dist.get_rank(group)
    t_case = time.perf_counter()
    model, args, kwargs, tracer = build(case, p)
    ref = _Bound(copy.deepcopy(model), args, kwargs)
    ref_loss = float(ref().item())
    plans, info, anomalies = make_plans(model, p, args, kwargs, tracer, reuse)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    t_plans = time.perf_counter() - t_case
    mods, steps = {}, {}
    for name, pl in plans.items():
        rec = info[name]
        rec.update(_plan_summary(pl))
        rec["params_not_in_plan"] = [n for n in names if n not in pl.layouts]
        rec["params_not_in_plan_numel"] = sum(t.numel() for n, t in model.named_parameters()
                                              if n in rec["params_not_in_plan"])
        try:
            gm = autoshard.parallelize(copy.deepcopy(model), p, kwargs if kwargs else args, plan=pl,
                                       group=group)
            bound = _Bound(gm, args, kwargs)
            loss = float(bound().item())
            gm.zero_grad(set_to_none=True)
            local = {"ok": True, "loss": loss,
                     "params": sum(t.numel() for t in gm.parameters())}
        except Exception as e:                                   # noqa: BLE001
            local = {"ok": False, "error": _short(e), "traceback": traceback.format_exc()}
        every = [None] * p
        dist.all_gather_object(every, local, group=group)
        if not all(x["ok"] for x in every):
            bad = next(x for x in every if not x["ok"])
            rec["status"] = f"BUG: parallelize/run raised {bad['error']}"
            rec["traceback"] = bad.get("traceback")
            continue
        losses = [x["loss"] for x in every]
        rel = max(abs(x - ref_loss) for x in losses) / max(abs(ref_loss), 1e-30)
        rec.update(loss=losses[0], ref_loss=ref_loss, loss_rel_err=rel,
                   loss_ok=rel <= LOSS_RTOL and len(set(losses)) == 1,
                   params_per_rank_measured=max(x["params"] for x in every),
                   params_per_rank_all=[x["params"] for x in every])
        if not rec["loss_ok"]:
            rec["status"] = (f"BUG: loss {losses} != single-process {ref_loss:.6g} "
                             f"(rel err {rel:.2e} > {LOSS_RTOL:g})")
        mods[name] = bound
        steps[name] = TrainStep(bound, ())
    # communication: autoshard's counter and CommDebugMode over the same step
    for name, step in steps.items():
        with count_comm() as c:
            coll = count_collectives(step)
        local = {"bytes": c.bytes, "calls": c.calls,
                 "by_kind": {k: list(v) for k, v in c.by_kind.items()},
                 "commdebug_bytes": _ring_bytes_commdebug(coll["bytes"], p),
                 "commdebug_calls": coll["n_total"], "commdebug_counts": coll["total"]}
        every = [None] * p
        dist.all_gather_object(every, local, group=group)
        rec = info[name]
        rec["measured"] = every[0]
        rec["measured_same_on_all_ranks"] = all(x["bytes"] == every[0]["bytes"] for x in every)
        rec["measured_bytes_max_rank"] = max(x["bytes"] for x in every)
    # memory
    for name, step in steps.items():
        peak = step_peak_bytes(step)
        every = [None] * p
        dist.all_gather_object(every, peak, group=group)
        info[name]["peak_bytes_per_rank"] = every
        info[name]["peak_bytes"] = max(every)
    # time (all variants interleaved)
    t0 = time.perf_counter()
    times = time_interleaved(steps, warmup=warmup, rounds=rounds, budget_s=budget_s,
                             group=group) if steps else {}
    for name, ms in times.items():
        info[name]["time"] = summarize(ms)
    # dims agree on every rank (each rank plans for itself)
    dims = {n: dict(pl.dims) for n, pl in plans.items()}
    every = [None] * p
    dist.all_gather_object(every, dims, group=group)
    if any(d != every[0] for d in every):
        anomalies.append("ranks planned different dims: " + repr(every))
    return {"case": asdict(case), "model": case.name, "p": p, "tracer": tracer, "ref_loss": ref_loss,
            "variants": info, "anomalies": anomalies, "plan_seconds": t_plans,
            "time_seconds": time.perf_counter() - t0, "case_seconds": time.perf_counter() - t_case,
            "rank": rank}


def run_all(cases: list, degrees: list, warmup: int, rounds: int, budget_s: float, reuse: bool) -> list:
    """On a world of max(degrees) ranks: for each degree p, ranks 0..p-1 form a group and run
    every case; the other ranks wait at a barrier (blocked in gloo, using no CPU: their CPU
    seconds during the phase are recorded). One launch serves every degree, so the slow start
    of a rank (importing torch, torch._dynamo) is paid once."""
    import warnings
    import autoshard  # noqa: F401
    import torch._dynamo  # noqa: F401  - imported by the first capture; do it on all ranks at once
    # CommDebugMode's module tracker hooks every module; HF modules return ModelOutputs / None
    warnings.filterwarnings("ignore", message="For backward hooks to be called")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except Exception:                                            # noqa: BLE001
        pass
    import resource
    rank = dist.get_rank()
    out = []
    for p in degrees:
        group = dist.new_group(list(range(p)))
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if rank < p:
            for case in cases:
                torch.manual_seed(0)
                out.append(run_case(case, p, group, warmup, rounds, budget_s, reuse))
        dist.barrier()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        idle = torch.tensor([0.0 if rank < p else (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime)])
        dist.all_reduce(idle, op=dist.ReduceOp.MAX)
        for r in out:
            if r["p"] == p:
                r["idle_rank_cpu_seconds"] = float(idle.item())
                r["degree_seconds"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- analysis / output

def analyse(res: dict) -> list[str]:
    """Anomalies of one (model, p) result: bytes off > 1%, greedy worse than exact, greedy !=
    Megatron, failed losses."""
    v, out = res["variants"], list(res["anomalies"])
    tag = f"{res['model']} p={res['p']}"
    for name, r in v.items():
        if r["status"].startswith("BUG"):
            out.append(f"{name}: {r['status']}")
        m = r.get("measured")
        if m is not None:
            pred, meas = r["comm_bytes"], m["bytes"]
            if abs(meas - pred) > BYTES_RTOL * max(pred, 1.0):
                out.append(f"{name}: measured {meas:.0f} B/step vs predicted {pred:.0f} B "
                           f"(ratio {meas / pred if pred else float('inf'):.3f}); by kind measured "
                           f"{m['by_kind']} predicted {r['comm_by_kind']}")
            if abs(m["commdebug_bytes"] - meas) > BYTES_RTOL * max(meas, 1.0):
                out.append(f"{name}: CommDebugMode ring bytes {m['commdebug_bytes']:.0f} != "
                           f"count_comm {meas:.0f} ({m['commdebug_counts']} vs {m['by_kind']})")
            if not r.get("measured_same_on_all_ranks", True):
                out.append(f"{name}: ranks moved different byte counts")
        if "params_per_rank_measured" in r:
            miss = r["params_per_rank_measured"] - r["params_per_rank"]
            if miss and miss != r.get("params_not_in_plan_numel"):
                out.append(f"{name}: {r['params_per_rank_measured']} params on a rank vs "
                           f"plan.params_per_rank {r['params_per_rank']}")
    missing = {n: r["params_not_in_plan_numel"] for n, r in v.items() if r.get("params_not_in_plan")}
    if missing:
        r0 = v[next(iter(missing))]
        out.append(f"plan.params_per_rank / params_total leave out {r0['params_not_in_plan_numel']:,} "
                   f"parameters (not in plan.layouts: {r0['params_not_in_plan'][:6]}"
                   f"{' ...' if len(r0['params_not_in_plan']) > 6 else ''}); the measured column counts them")
    g, e = v.get("greedy"), v.get("exact")
    if g and e and "objective" in g and "objective" in e:
        if g["objective"] > e["objective"] * (1 + 1e-9) + 1e-15:
            out.append(f"greedy objective {g['objective']:.6g} > exact {e['objective']:.6g}: "
                       f"dims differ at {_dims_diff(g['dims'], e['dims'])}")
    mg = v.get("megatron") if "objective" in v.get("megatron", {}) else v.get("megatron*")
    if g and mg and "dims" in g and "dims" in mg:
        diff = _dims_diff(g["dims"], mg["dims"])
        if diff:
            verdict = ("greedy's objective is lower" if g["objective"] < mg["objective"] else
                       "REGRESSION: Megatron's objective is lower" if g["objective"] > mg["objective"]
                       else "equal objectives")
            out.append(f"greedy differs from Megatron's plan at {diff} (greedy objective "
                       f"{g['objective']:.6g}, {g['comm_bytes']:.0f} B; Megatron "
                       f"{mg['objective']:.6g}, {mg['comm_bytes']:.0f} B: {verdict})")
    return [f"{tag}: {a}" for a in out]


def _dims_diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)}


def _fmt_ms(r):
    t = r.get("time")
    return f"{t['median_ms']:.1f} [{t['p25_ms']:.1f}-{t['p75_ms']:.1f}]" if t else "-"


def table(results: list[dict], model: str) -> str:
    rows = []
    for res in results:
        if res["model"] != model:
            continue
        for name, r in res["variants"].items():
            m = r.get("measured") or {}
            status = r["status"]
            if len(status) > 60:
                status = status[:57] + "..."
            pred = r.get("comm_bytes")
            ratio = (m["bytes"] / pred if pred else (1.0 if m.get("bytes") == 0 else float("inf"))) \
                if m else None
            rows.append([
                res["p"], name, status,
                fmt_bytes(pred) if pred is not None else "-",
                fmt_bytes(m.get("bytes")) if m else "-",
                f"{ratio:.3f}x" if ratio is not None else "-",
                f"{fmt_bytes(m['commdebug_bytes'])} / {m['commdebug_calls']}" if m else "-",
                _fmt_ms(r),
                f"{r['step_time_ms'] * 1e3:.1f} us" if "step_time_ms" in r else "-",
                f"{r['params_per_rank_measured']:,}" if "params_per_rank_measured" in r else
                (f"{r['params_per_rank']:,}" if "params_per_rank" in r else "-"),
                fmt_bytes(r.get("peak_bytes")),
                (("ok " if r["loss_ok"] else "BUG ") + f"{r['loss_rel_err']:.0e}") if "loss_rel_err" in r else "-",
            ])
    headers = ["p", "variant", "status", "pred comm/rank", "meas comm/rank", "meas/pred",
               "CommDebugMode bytes / calls", "step ms median [IQR]", "plan.step_time", "params/rank",
               "peak mem/rank", "loss vs 1 proc"]
    return print_table(rows, headers, title=f"\n== {model} ==")


def plot(results: list[dict], name: str, quick: bool):
    """Bars per model and variant, one column per degree: step time, measured comm (black ticks:
    predicted), parameters per rank relative to the replicated model, peak step memory."""
    use_agg_backend()
    import matplotlib.pyplot as plt
    degrees = sorted({r["p"] for r in results})
    models = list(dict.fromkeys(r["model"] for r in results))
    variants = list(dict.fromkeys(v for r in results for v in r["variants"]))

    def params_frac(r, res):
        rep = res["variants"].get("replicate", {}).get("params_per_rank_measured")
        return r["params_per_rank_measured"] / rep if rep and "params_per_rank_measured" in r else None

    metrics = [("step ms (median)", lambda r, res: r.get("time", {}).get("median_ms"), None),
               ("comm KiB / rank / step\n(bars measured, ticks predicted)",
                lambda r, res: r["measured"]["bytes"] / 1024 if r.get("measured") else None,
                lambda r, res: r["comm_bytes"] / 1024 if "comm_bytes" in r else None),
               ("params / rank\n(fraction of replicate)", params_frac, None),
               ("peak step memory / rank (MiB)",
                lambda r, res: r["peak_bytes"] / 2**20 if "peak_bytes" in r else None, None)]
    fig, axes = plt.subplots(len(metrics), len(degrees), figsize=(6.5 * len(degrees), 2.7 * len(metrics)),
                             squeeze=False)
    width = 0.8 / max(len(variants), 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, p in enumerate(degrees):
        for i, (label, get, tick) in enumerate(metrics):
            ax = axes[i][j]
            for k, v in enumerate(variants):
                xs, ys, ts = [], [], []
                for mi, m in enumerate(models):
                    res = next((r for r in results if r["model"] == m and r["p"] == p), None)
                    rv = res["variants"].get(v) if res else None
                    if not rv or rv["status"].startswith(("infeasible", "skipped")):
                        continue
                    y = get(rv, res)
                    if y is not None:
                        xs.append(mi + (k - (len(variants) - 1) / 2) * width)
                        ys.append(y)
                        ts.append(tick(rv, res) if tick else None)
                ax.bar(xs, ys, width, label=v, color=colors[k % len(colors)])
                if tick:
                    ax.scatter(xs, ts, marker="_", color="black", s=60, zorder=3)
            ax.set_xticks(range(len(models)))
            ax.set_xticklabels(models, fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            if i == 0:
                ax.set_title(f"tensor-parallel degree {p} (gloo, 1 thread / rank)", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=3)
    fig.suptitle("autoshard plans vs hand / naive plans" + (" (quick)" if quick else "") +
                 "; missing bars: infeasible or skipped", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, name)


def cases_for(args) -> list[Case]:
    tied = bool(args.tied)
    if args.quick:
        return [Case("gpt-1blk-small", "gpt", dict(vocab=1024, h=128, heads=4, blocks=1, tied=tied),
                     batch=2, seq=32)]
    out = [Case("gpt-2blk", "gpt", dict(vocab=4096, h=256, heads=4, blocks=2, tied=tied), batch=2, seq=64),
           Case("gpt-1blk", "gpt", dict(vocab=4096, h=256, heads=4, blocks=1, tied=tied), batch=2, seq=64)]
    if args.no_hf:
        return out
    if have_transformers():
        for hf in ("gpt2", "llama", "bert", "qwen2"):
            out.append(Case(f"hf-{hf}", hf, dict(vocab_size=2048), batch=2, seq=32))
    else:
        print("transformers does not import: the Hugging Face models are skipped", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one small 1-block GPT (< 2 min)")
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tied", action="store_true", help="tie the toy GPT's head to wte")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face models")
    ap.add_argument("--no-reuse", action="store_true",
                    help="call autoshard.plan for every variant (capture the model each time)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (cut to fit --budget)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timed rounds per case")
    args = ap.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    rounds = args.rounds if args.rounds is not None else (10 if args.quick else 20)
    budget = args.budget if args.budget is not None else (6.0 if args.quick else 12.0)
    cases = cases_for(args)
    name = "compare_plans_quick" if args.quick else "compare_plans"
    t0 = time.perf_counter()
    degrees = sorted(set(args.degrees))
    results = launch(run_all, max(degrees), cases, degrees, warmup, rounds, budget, not args.no_reuse,
                     timeout_s=1800, collective_timeout_s=1800)
    launch_seconds = time.perf_counter() - t0
    for p in degrees:
        rs = [r for r in results if r["p"] == p]
        print(f"degree {p}: {len(rs)} model(s) in {rs[0]['degree_seconds']:.1f} s "
              f"(planning {sum(r['plan_seconds'] for r in rs):.1f} s, timed rounds "
              f"{sum(r['time_seconds'] for r in rs):.1f} s; idle ranks used "
              f"{rs[0]['idle_rank_cpu_seconds']:.2f} CPU s)", flush=True)
    anomalies = [a for r in results for a in analyse(r)]
    for m in dict.fromkeys(r["model"] for r in results):
        table(results, m)
    print("\nstep = forward + loss + backward + zero_grad; median [quartiles] over interleaved rounds, "
          "max over ranks. comm = ring bytes per rank per step (fwd+bwd): 'pred' plan.comm_bytes, "
          "'meas' autoshard count_comm, CommDebugMode = c10d payloads converted to ring bytes. "
          "peak mem = torch.profiler allocator peak during one step above its start, max over ranks. "
          "params/rank = numel of the rank's parameters.")
    for r in results:
        for v, rec in r["variants"].items():
            if rec.get("note"):
                print(f"note: {r['model']} p={r['p']} {v}: {rec['note']}")
    print("\nanomalies:" if anomalies else "\nanomalies: none")
    for a in anomalies:
        print(f"  - {a}")
    total = time.perf_counter() - t0
    json_path = write_json(name, {"env": env_info(), "quick": args.quick, "degrees": args.degrees,
                                  "warmup": warmup, "rounds": rounds, "budget_s": budget,
                                  "memory_metric": "torch.profiler CPU allocator peak during one step, "
                                                   "above the level at its start; max over ranks",
                                  "cases": [asdict(c) for c in cases], "results": results,
                                  "anomalies": anomalies, "launch_seconds": launch_seconds,
                                  "total_seconds": total})
    png = plot(results, name, args.quick)
    print(f"\nwrote {json_path.relative_to(REPO_ROOT)} and {png.relative_to(REPO_ROOT)}; "
          f"total {total:.1f} s")
    bugs = [a for a in anomalies if "BUG" in a]
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
