#!/usr/bin/env python
"""torch.compile on tensor-parallel LLaMA: autoshard and PyTorch DTensor, eager and compiled.

A tiny Hugging Face ``LlamaForCausalLM`` (random weights from a ``LlamaConfig``: hidden 256,
intermediate 688, 4 layers, 8 query / 4 key-value heads, vocabulary 2048; the same seed on
every rank) is made tensor-parallel over 2 gloo ranks on CPU, one torch thread per rank, and
trained on one batch of ``input_ids`` = ``labels`` of shape 4 x 128 (the same on every rank).
Step = ``model(input_ids=..., labels=...).loss``, ``.backward()``, then
``zero_grad(set_to_none=True)`` (no optimizer). Variants, all built in the same run:

- ``autoshard eager``: ``autoshard.parallelize(copy.deepcopy(model), world, kw)``.
- ``autoshard compiled``: a second ``autoshard.parallelize`` module, each of whose blocks
  (``autoshard.blocks_of(gm)``: the decoder layers) is ``.compile(fullgraph=True)``-ed.
- ``dtensor eager``: PyTorch's hand plan, torchtitan style: ``parallelize_module`` of each
  ``model.model.layers[i]`` on a 1-D CPU DeviceMesh: ``self_attn.{q,k,v}_proj`` and
  ``mlp.{gate,up}_proj`` ``ColwiseParallel()``, ``self_attn.o_proj`` and ``mlp.down_proj``
  ``RowwiseParallel()``; embedding, norms and ``lm_head`` stay replicated. HF's LLaMA
  attention reshapes to ``(*shape, -1, head_dim)`` and reads ``num_key_value_groups`` (query
  heads / kv heads, the same ratio on every rank), so each rank runs its local heads without
  dividing ``config.num_attention_heads`` (the loss check below confirms it).
- ``dtensor compiled``: a second DTensor module with each ``model.model.layers[i]``
  ``.compile(fullgraph=True)``-ed.
- ``autoshard bf16 autocast``: the ``autoshard eager`` module stepped under
  ``torch.autocast("cpu", torch.bfloat16)`` (fp32 weights, backward outside the autocast
  block). If it raises, it is reported as ``unavailable: <first line of the error>`` and the
  run goes on.

Before anything is timed, each variant's first step is timed on its own (barrier, then the
maximum over ranks) and its loss is checked against the single-process model on the same
inputs: ``|diff| <= 1e-4`` for the fp32 variants (a mismatch is printed loudly and the
script exits with status 1) and a relative ``|diff| <= 5e-2`` for bf16, against the
single-process model under the same autocast. Then:

- steady step times: ``benchmarks.common.time_interleaved`` (warm-up steps, then rounds in
  which every variant runs one step in rotating order, barrier before each step, maximum
  over ranks); the medians, quartiles and the median of the per-round ratios are reported;
- compile time of a compiled variant: its first step minus its median steady step (the first
  eager step minus its median is shown for reference). Every compiled variant's first step
  runs in a fresh, empty inductor cache directory (``temporary_cache_dir``: on-disk and
  in-memory caches cleared), so each pays a cold compile; a throw-away compile of a tiny MLP
  first takes the process's one-time costs (imports, the compile worker pool), reported as
  ``compiler warm-up``;
- graph breaks (``torch._dynamo.utils.counters["graph_break"]``, summed) and dynamo graphs
  compiled (``counters["stats"]["unique_graphs"]``) during each compiled variant's first step,
  and any graphs compiled later (recompiles during the timed rounds); also the seconds spent in
  each of dynamo's and inductor's timed phases during that step
  (``torch._dynamo.utils.compilation_time_metrics``, nested: a phase includes those it calls);
- bytes each rank sends per step (ring bytes, ``autoshard.runtime.counters.ring_bytes``):
  autoshard's eager fp32 and bf16 steps with ``autoshard.runtime.collectives.count_comm``,
  DTensor's eager step with ``autoshard.runtime.counters.count_functional`` (both count eager
  runs; a compiled graph runs the same collectives but is not counted).

Transport: gloo for both sides by default (autoshard's small all-reduces and all-gathers are
c10d's own ops, in the compiled graph through its custom ops ``autoshard::all_reduce`` /
``all_gather``; DTensor's are PyTorch's functional collectives). ``AUTOSHARD_SHM=1`` sends
autoshard's small ones through its shared-memory segment instead (``autoshard.runtime.shm``: then
the two sides do not share a transport; the transport is printed and stored). Under
``--overlap`` the compiled variants use PyTorch's functional collectives, which inductor's passes
may reorder.

``--profile N``: after the timed rounds, N steps of each compiled variant under
``torch.profiler`` (CPU) on every rank: per collective op (c10d's, gloo's, the functional ones,
autoshard's custom ops, their waits) its calls a step and milliseconds a step, and the ops that
take the most self time, rank 0's and rank 1's (what stands between the two compiled steps).

``--overlap`` sets ``torch._inductor.config.reorder_for_compute_comm_overlap = True`` before
either compiled variant is built, and, since in torch 2.13 that flag runs only the passes listed in
``reorder_for_compute_comm_overlap_passes`` (empty by default: the flag alone only stops an
all-reduce's input copy from being fused), also the passes inductor's config recommends
(``OVERLAP_PASSES``); both are printed and stored. Results: a table on stdout and
``benchmarks/results/compile[_quick][_overlap].json``.

    python benchmarks/compile.py --quick            # 15 rounds: ~3 min on 2 cores (compiles dominate)
    python benchmarks/compile.py                    # 60 rounds: ~4 min on 2 quiet cores
    python benchmarks/compile.py --overlap          # + inductor's compute/communication reordering
    python benchmarks/compile.py --whole            # each whole module in one graph, not per layer
    python benchmarks/compile.py --outputs sharded  # autoshard's logits left split, the loss vocabulary-parallel
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):                                    # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import (note_load, env_info, fmt_bytes, launch, print_table, summarize, time_interleaved,
                               write_json)

VARIANTS = ("autoshard eager", "autoshard compiled", "dtensor eager", "dtensor compiled",
            "autoshard bf16 autocast")
COMPILED = ("autoshard compiled", "dtensor compiled")
BF16 = "autoshard bf16 autocast"
DT_BF16 = "dtensor eager, bf16 autocast"     # bytes only
LOSS_TOL = 1e-4                 # fp32 variants: absolute
BF16_REL_TOL = 5e-2             # bf16 variant: relative, against the single process under autocast
BATCH, SEQ = 4, 128
# compile phases printed per compiled variant (every phase is in the JSON)
PHASES = (("bytecode_tracing", "dynamo tracing"), ("create_aot_dispatcher_function", "AOT + inductor fwd"),
          ("compile_fx.<locals>.fw_compiler_base", "inductor fwd"),
          ("compile_fx.<locals>.bw_compiler", "inductor bwd (at the first backward)"),
          ("async_compile.wait", "of which waiting for C++ kernel builds"))
# inductor's recommended passes (torch/_inductor/config.py); the default list is empty, and with it
# reorder_for_compute_comm_overlap = True only keeps an all-reduce's input clone unfused
OVERLAP_PASSES = ("reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                  "reorder_communication_preserving_peak_memory")


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0] if text else type(e).__name__


def _llama(layers: int):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                                   max_position_embeddings=256, attention_dropout=0.0,
                                   tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().train()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, cfg, dict(input_ids=ids, labels=ids.clone())


def _dtensor(model, world: int):
    """PyTorch's hand plan (torchtitan's for LLaMA) on each decoder layer, in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
    return model


def _step_fn(model, kw, bf16: bool = False):
    """One training step of ``model``: returns the loss as a float."""
    def step() -> float:
        ctx = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = model(**kw).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach().float())
    return step


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"graph_breaks": int(sum(counters["graph_break"].values())),
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "break_reasons": sorted(str(k) for k in counters["graph_break"])}


def _compile_seconds() -> dict:
    """Seconds spent so far in each of dynamo's / inductor's timed compile phases (nested)."""
    from torch._dynamo.utils import compilation_time_metrics
    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


def _delta(after: dict, before: dict) -> dict:
    return {"graph_breaks": after["graph_breaks"] - before["graph_breaks"],
            "graphs": after["unique_graphs"] - before["unique_graphs"],
            "break_reasons": [r for r in after["break_reasons"] if r not in before["break_reasons"]]}


def _warm_compiler(tmp: Path) -> float:
    """Compile a tiny MLP forward + backward once (fresh cache): the process's one-time compile
    costs (imports, worker pool), so that neither compiled variant pays them."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    w1, w2 = (torch.randn(32, 32, requires_grad=True) for _ in range(2))

    @torch.compile(fullgraph=True)
    def mlp(x):
        return (torch.nn.functional.gelu(x @ w1) @ w2).sum()

    t0 = time.perf_counter()
    with temporary_cache_dir(str(tmp / "warmup")):
        mlp(torch.randn(8, 32)).backward()
    return time.perf_counter() - t0


def run(layers: int, warmup: int, rounds: int, budget_s: float, overlap: bool, whole: bool = False,
        outputs: str = "full", profile_steps: int = 0) -> dict:
    """On every rank: build, check, count and time all variants; rank 0's dict is returned."""
    import shutil
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix=f"autoshard_compile_bench_r{dist.get_rank()}_"))
    try:
        return _run(tmp, layers, warmup, rounds, budget_s, overlap, whole, outputs, profile_steps)
    finally:                            # the inductor caches: loaded already, not needed again
        shutil.rmtree(tmp, ignore_errors=True)


def _run(tmp: Path, layers: int, warmup: int, rounds: int, budget_s: float, overlap: bool, whole: bool,
         outputs: str, profile_steps: int = 0) -> dict:
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    import autoshard
    from autoshard.runtime.collectives import count_comm
    from autoshard.runtime.counters import count_functional

    world = dist.get_world_size()
    if overlap:
        inductor_config.reorder_for_compute_comm_overlap = True
        if not inductor_config.reorder_for_compute_comm_overlap_passes:    # empty: the flag reorders nothing
            inductor_config.reorder_for_compute_comm_overlap_passes = list(OVERLAP_PASSES)
    warm_s = _max_over_ranks(_warm_compiler(tmp))
    torch._dynamo.utils.counters.clear()

    model, cfg, kw = _llama(layers)
    with torch.no_grad():
        ref_loss = float(model(**kw).loss)
        with torch.autocast("cpu", torch.bfloat16):
            ref_bf16 = float(model(**kw).loss.float())

    status: dict[str, str] = {}
    errors: dict[str, str] = {}
    models: dict[str, torch.nn.Module] = {}
    steps: dict[str, callable] = {}

    def build(name, fn):
        try:
            models[name] = fn()
        except Exception as e:                                   # noqa: BLE001 - reported
            status[name] = f"unavailable: {_first_line(e)}"
            errors[name] = traceback.format_exc()

    t_build: dict[str, float] = {}
    for name, fn in (
            ("autoshard eager", lambda: autoshard.parallelize(copy.deepcopy(model), world, kw, outputs=outputs)),
            ("autoshard compiled", lambda: (
                _compile_whole(autoshard.parallelize(copy.deepcopy(model), world, kw, outputs=outputs))
                if whole else _autoshard_compiled(model, world, kw, outputs))),
            ("dtensor eager", lambda: _dtensor(copy.deepcopy(model), world)),
            ("dtensor compiled", lambda: (_compile_whole if whole else _compile_layers)(
                _dtensor(copy.deepcopy(model), world)))):
        t0 = time.perf_counter()
        build(name, fn)
        t_build[name] = time.perf_counter() - t0
    if "autoshard eager" in models:
        models[BF16] = models["autoshard eager"]                 # the same module, under autocast
    else:
        status[BF16] = status["autoshard eager"]
    for name, m in models.items():
        steps[name] = _step_fn(m, kw, bf16=(name == BF16))

    # first step of each variant, alone: the compile step of the compiled ones, and the loss check
    first_ms: dict[str, float] = {}
    losses: dict[str, float] = {}
    dynamo: dict[str, dict] = {}
    for name in VARIANTS:
        if name not in steps:
            continue
        cache = (temporary_cache_dir(str(tmp / name.replace(" ", "_"))) if name in COMPILED
                 else contextlib.nullcontext())
        before, phases = _dynamo_counts(), _compile_seconds()
        dist.barrier()
        t0 = time.perf_counter()
        try:
            with cache:
                losses[name] = steps[name]()
        except Exception as e:                                   # noqa: BLE001 - reported
            status[name] = f"unavailable: {_first_line(e)}"
            errors[name] = traceback.format_exc()
        elapsed = (time.perf_counter() - t0) * 1e3
        first_ms[name] = elapsed
        if name in COMPILED:
            dynamo[name] = _delta(_dynamo_counts(), before)
            now = _compile_seconds()
            dynamo[name]["phase_s"] = {k: round(now[k] - phases.get(k, 0.0), 3) for k in now
                                       if now[k] - phases.get(k, 0.0) >= 0.05}
        if name in status:
            continue
        ref, got = (ref_bf16, losses[name]) if name == BF16 else (ref_loss, losses[name])
        diff = abs(got - ref)
        if name == BF16:
            ok = diff <= BF16_REL_TOL * abs(ref)
            why = f"|diff| {diff:.3g} > {BF16_REL_TOL} x |{ref:.6f}|"
        else:
            ok = diff <= LOSS_TOL
            why = f"|diff| {diff:.3g} > {LOSS_TOL}"
        status[name] = "ok" if ok else f"incorrect: loss {got:.6f} vs single-process {ref:.6f} ({why})"

    # the ranks time the same set: a variant counts only if it is ok on every rank
    all_status = [None] * world
    dist.all_gather_object(all_status, status)
    for name in VARIANTS:
        bad = [s.get(name, "missing") for s in all_status if s.get(name, "missing") != "ok"]
        if bad:
            status[name] = bad[0]
    firsts = torch.tensor([first_ms.get(n, 0.0) for n in VARIANTS], dtype=torch.float64)
    dist.all_reduce(firsts, op=dist.ReduceOp.MAX)
    first_ms = {n: float(firsts[i]) for i, n in enumerate(VARIANTS) if n in first_ms}
    ok = [n for n in VARIANTS if status[n] == "ok"]

    # bytes each rank sends per step (eager runs: a compiled graph's collectives are not counted)
    comm: dict[str, dict] = {}
    for name, counter, step in (("autoshard eager", count_comm, steps.get("autoshard eager")),
                                (BF16, count_comm, steps.get(BF16)),
                                ("dtensor eager", count_functional, steps.get("dtensor eager")),
                                (DT_BF16, count_functional,     # for comparison: bytes only, not timed
                                 _step_fn(models["dtensor eager"], kw, bf16=True)
                                 if "dtensor eager" in ok else None)):
        if name in ok or (name == DT_BF16 and step is not None):
            with counter() as c:
                step()
            comm[name] = {"bytes": c.bytes, "calls": c.calls,
                          "by_kind": {k: list(v) for k, v in c.by_kind.items()}}

    graphs_before = _dynamo_counts()
    times = time_interleaved({n: steps[n] for n in ok}, warmup=warmup, rounds=rounds,
                             budget_s=budget_s, min_rounds=min(5, rounds))
    later = _delta(_dynamo_counts(), graphs_before)
    profiles = {}
    for name in COMPILED if profile_steps else ():
        if name in ok:
            mine = _profile(steps[name], profile_steps)
            both = [None] * world
            dist.all_gather_object(both, mine)
            profiles[name] = both

    variants = {}
    for name in VARIANTS:
        v = {"status": status[name], "loss": losses.get(name),
             "reference_loss": ref_bf16 if name == BF16 else ref_loss,
             "first_step_ms": first_ms.get(name)}
        if name in t_build:
            v["build_s"] = t_build[name]
        if name in errors:
            v["error"] = errors[name]
        if name in ok:
            s = summarize(times[name])
            v.update(s, times_ms=times[name])
            v["first_minus_median_s"] = (first_ms[name] - s["median_ms"]) / 1e3
        if name in dynamo:
            v["dynamo_first_step"] = dynamo[name]
        if name in comm:
            v["comm"] = comm[name]
        variants[name] = v

    def ratio(a, b):
        if a in times and b in times:
            return {"of_medians": statistics.median(times[a]) / statistics.median(times[b]),
                    "paired": statistics.median(x / y for x, y in zip(times[a], times[b]))}
        return None

    ratios = {
        "autoshard compiled / dtensor compiled (step)": ratio("autoshard compiled", "dtensor compiled"),
        "autoshard eager / dtensor eager (step)": ratio("autoshard eager", "dtensor eager"),
        "autoshard eager / autoshard compiled (compile speed-up)": ratio("autoshard eager", "autoshard compiled"),
        "dtensor eager / dtensor compiled (compile speed-up)": ratio("dtensor eager", "dtensor compiled"),
        "autoshard bf16 / autoshard fp32 (step)": ratio(BF16, "autoshard eager"),
    }
    ca = variants["autoshard compiled"].get("first_minus_median_s")
    cd = variants["dtensor compiled"].get("first_minus_median_s")
    ratios["autoshard / dtensor (compile time)"] = (
        {"of_medians": ca / cd, "paired": None} if ca is not None and cd else None)
    if BF16 in comm and "autoshard eager" in comm and comm["autoshard eager"]["bytes"]:
        ratios["autoshard bf16 / autoshard fp32 (bytes)"] = {
            "of_medians": comm[BF16]["bytes"] / comm["autoshard eager"]["bytes"], "paired": None}
    if DT_BF16 in comm and "dtensor eager" in comm and comm["dtensor eager"]["bytes"]:
        ratios["dtensor bf16 / dtensor fp32 (bytes)"] = {
            "of_medians": comm[DT_BF16]["bytes"] / comm["dtensor eager"]["bytes"], "paired": None}
    if "dtensor eager" in comm and "autoshard eager" in comm and comm["dtensor eager"]["bytes"]:
        ratios["autoshard fp32 / dtensor (bytes)"] = {
            "of_medians": comm["autoshard eager"]["bytes"] / comm["dtensor eager"]["bytes"], "paired": None}
    return {"config": {"layers": layers, "hidden": cfg.hidden_size,
                       "intermediate": cfg.intermediate_size, "heads": cfg.num_attention_heads,
                       "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
                       "batch": BATCH, "seq": SEQ, "world": world, "warmup": warmup,
                       "rounds": rounds, "budget_s": budget_s},
            "overlap": overlap, "whole_module": whole, "outputs": outputs,
            "inductor": {"reorder_for_compute_comm_overlap": bool(inductor_config.reorder_for_compute_comm_overlap),
                         "reorder_for_compute_comm_overlap_passes":
                             [str(p) for p in inductor_config.reorder_for_compute_comm_overlap_passes],
                         "compile_threads": inductor_config.compile_threads,
                         "cpp_threads": torch.get_num_threads()},
            "compiler_warmup_s": warm_s, "reference_loss": ref_loss, "reference_loss_bf16": ref_bf16,
            "variants": variants, "dtensor_bf16_comm": comm.get(DT_BF16), "ratios": ratios,
            "recompiles_during_timing": later, "profiles": profiles,
            "transport": "autoshard: shared memory (AUTOSHARD_SHM=1), DTensor: gloo"
            if os.environ.get("AUTOSHARD_SHM", "0").strip() == "1" else "gloo, both sides"}


_COMM_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "wait_tensor", "gloo",
               "c10d", "autoshard::")


def _profile(step, n: int) -> dict:
    """`n` steps under torch.profiler: the collective ops (calls and ms a step) and the ops with
    the most self time."""
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    wall = (time.perf_counter() - t0) * 1e3 / n
    rows = [(e.key, e.count / n, e.cpu_time_total / 1e3 / n, e.self_cpu_time_total / 1e3 / n)
            for e in prof.key_averages()]
    comm = sorted((r for r in rows if any(w in r[0].lower() for w in _COMM_WORDS)), key=lambda r: -r[2])
    top = sorted(rows, key=lambda r: -r[3])[:10]
    return {"steps": n, "wall_ms_per_step": wall, "collectives": comm[:12], "top_self": top}


def _autoshard_compiled(model, world: int, kw: dict, outputs: str = "full"):
    """A second autoshard module with each block compiled (fullgraph). blocks="auto" keeps the
    children of a ModuleList of two or more layers; with one layer, name it."""
    import autoshard
    gm = autoshard.parallelize(copy.deepcopy(model), world, kw, outputs=outputs)
    if not autoshard.blocks_of(gm):
        gm = autoshard.parallelize(copy.deepcopy(model), world, kw, outputs=outputs,
                                   blocks=[f"model.layers.{i}" for i in range(len(model.model.layers))])
    return _compile_blocks(gm)


def _compile_blocks(gm):
    import autoshard
    blocks = autoshard.blocks_of(gm)
    if not blocks:
        raise RuntimeError("autoshard.blocks_of(gm) is empty: nothing to compile")
    for b in blocks.values():
        b.compile(fullgraph=True)
    return gm


def _compile_whole(module):
    """--whole: the whole module in one graph, `torch.compile(module, fullgraph=True)`."""
    return torch.compile(module, fullgraph=True)


def _compile_layers(model):
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    return model


# ----------------------------------------------------------------------------- driver

def report(r: dict) -> None:
    c = r["config"]
    rows = []
    for name, v in r["variants"].items():
        if v["status"] != "ok":
            rows.append([name, v["status"]] + ["-"] * 7)
            continue
        dyn = v.get("dynamo_first_step")
        comm = v.get("comm")
        diff = abs(v["loss"] - v["reference_loss"])
        rows.append([name, "ok", f"{diff:.1e}", f"{v['first_step_ms']:.0f}", f"{v['median_ms']:.1f}",
                     f"{v['p25_ms']:.1f}-{v['p75_ms']:.1f}", f"{v['first_minus_median_s']:.1f}",
                     "-" if dyn is None else f"{dyn['graph_breaks']} / {dyn['graphs']}",
                     "-" if comm is None else f"{fmt_bytes(comm['bytes'])} ({comm['calls']} calls)"])
    n = max((v.get("n", 0) for v in r["variants"].values()), default=0)
    print_table(rows, ["variant", "status", "|loss diff|", "first step ms", "median ms", "p25-p75",
                       "first - median s", "breaks / graphs", "sent / rank / step"],
                title=f"\n== LLaMA L{c['layers']} h{c['hidden']} i{c['intermediate']} heads "
                      f"{c['heads']}/{c['kv_heads']} vocab {c['vocab']}, batch {c['batch']} x "
                      f"{c['seq']}, world {c['world']} (gloo, CPU, 1 thread/rank); {n} rounds; "
                      f"compiled: {'each whole module' if r.get('whole_module') else 'each decoder layer'}; "
                      f"autoshard outputs={r.get('outputs', 'full')}; "
                      f"reorder_for_compute_comm_overlap={r['inductor']['reorder_for_compute_comm_overlap']}"
                      f"{' with passes ' + ', '.join(r['inductor']['reorder_for_compute_comm_overlap_passes']) if r['overlap'] else ''}; "
                      f"reference loss {r['reference_loss']:.6f} (bf16 autocast "
                      f"{r['reference_loss_bf16']:.6f}); compiler warm-up {r['compiler_warmup_s']:.1f} s ==",
                floatfmt=["", "", ".1e", ".0f", ".1f", "", ".1f", "", ""])
    d = r.get("dtensor_bf16_comm")
    if d is not None:
        print(f"(bytes only, not timed) dtensor eager under bf16 autocast sends {fmt_bytes(d['bytes'])} "
              f"({d['calls']} calls) / rank / step")
    rows = [[k, "-" if v is None else f"{v['of_medians']:.3f}",
             "-" if v is None or v["paired"] is None else f"{v['paired']:.3f}"]
            for k, v in r["ratios"].items()]
    print_table(rows, ["ratio", "of medians", "paired (median of per-round ratios)"],
                title="\n== ratios ==", floatfmt=".3f")
    for name in COMPILED:
        phases = (r["variants"][name].get("dynamo_first_step") or {}).get("phase_s")
        if phases:
            print(f"{name}, compile phases on rank 0 (s): "
                  + ", ".join(f"{label} {phases.get(key, 0.0):.1f}" for key, label in PHASES))
    for name, ranks in (r.get("profiles") or {}).items():
        for rank, p in enumerate(ranks):
            print(f"\n{name}, rank {rank}: torch.profiler over {p['steps']} steps, {p['wall_ms_per_step']:.1f} ms "
                  "a step (profiled); collective ops: calls / step, total ms / step, self ms / step")
            for key, calls, total, own in p["collectives"]:
                print(f"  {key:<48} {calls:6.1f} {total:9.2f} {own:9.2f}")
            print("  most self time: " + ", ".join(f"{k} {own:.1f}" for k, _, _, own in p["top_self"][:6]))
    print(f"transport: {r.get('transport')}")
    later = r["recompiles_during_timing"]
    print(f"graphs compiled during the timed rounds (recompiles): {later['graphs']}; "
          f"graph breaks then: {later['graph_breaks']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (~2-3 min on 2 cores)")
    ap.add_argument("--rounds", type=int, help="timed rounds (upper bound; default 15 quick, 60 full)")
    ap.add_argument("--budget", type=float, help="seconds of timed rounds (default 30 quick, 150 full)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--overlap", action="store_true",
                    help="torch._inductor.config.reorder_for_compute_comm_overlap = True (and inductor's "
                         "recommended reorder passes) before compiling")
    ap.add_argument("--whole", action="store_true",
                    help="compile each whole module (torch.compile(module, fullgraph=True): embedding, head and "
                         "loss in the graph too) instead of each decoder layer")
    ap.add_argument("--outputs", choices=("full", "sharded"), default="full",
                    help="autoshard's outputs: full (default: the logits gathered, as the model returns them) "
                         "or sharded (the logits a DTensor split on vocabulary, the loss vocabulary-parallel; "
                         "what a training loop that reads only the loss can take)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, N steps of each compiled variant under torch.profiler (collectives' "
                         "calls and ms a step, top ops by self time, each rank)")
    ap.add_argument("--name", help="results file stem (default compile[_quick][_overlap][_whole][_sharded])")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    load0 = note_load()
    rounds = args.rounds if args.rounds is not None else (15 if args.quick else 60)
    budget = args.budget if args.budget is not None else (30.0 if args.quick else 150.0)
    warmup = 2 if args.quick else 3
    r = launch(run, args.world, args.layers, warmup, rounds, budget, args.overlap, args.whole, args.outputs,
               args.profile, timeout_s=1800.0, collective_timeout_s=600.0)
    report(r)
    name = args.name or ("compile" + ("_quick" if args.quick else "") + ("_overlap" if args.overlap else "")
                        + ("_whole" if args.whole else "") + ("_sharded" if args.outputs == "sharded" else ""))
    out = {"benchmark": "compile", "mode": "quick" if args.quick else "full", "env": env_info(),
           "timing": "first_step_ms: the first step alone (barrier, max over ranks): the compile "
                     "step of a compiled variant, in a fresh inductor cache; steady: median over "
                     "interleaved rounds of the per-step max over ranks; first_minus_median_s: "
                     "the compile time; ratios: of the medians, and paired (median over rounds of "
                     "the per-round ratio)",
           "bytes": "ring bytes one rank sends per step, eager runs (count_comm for autoshard, "
                    "count_functional for DTensor)",
           **r, "total_wall_s": time.perf_counter() - t0,
           "loadavg_1min": {"start": load0, "end": os.getloadavg()[0]}}
    js = write_json(name, out)
    print(f"\nwrote {js.relative_to(Path.cwd()) if js.is_relative_to(Path.cwd()) else js} "
          f"in {out['total_wall_s']:.1f} s")
    rc = 0
    for name_, v in r["variants"].items():
        if v.get("error"):
            print(f"\n--- {name_} failed (rank 0's traceback):\n{v['error']}", file=sys.stderr)
        if name_ == BF16:                       # reported, but not a failure of the run
            if v["status"].startswith("incorrect"):
                print(f"!!! {name_}: WRONG LOSS: {v['status']}", file=sys.stderr)
            continue
        if v["status"].startswith("incorrect"):
            print(f"!!! {name_}: WRONG LOSS: {v['status']}", file=sys.stderr)
            rc = 1
        elif v["status"] != "ok":
            print(f"!!! {name_}: {v['status']}", file=sys.stderr)
            rc = 1
    for name_, d in ((n, r["variants"][n].get("dynamo_first_step")) for n in COMPILED):
        if d and d["graph_breaks"]:
            print(f"!!! {name_}: {d['graph_breaks']} graph breaks: {d['break_reasons']}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
