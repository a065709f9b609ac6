#!/usr/bin/env python
"""Pipeline stages (autoshard.pipeline): step time against tensor and data parallelism, the
measured bubble against the plan's, and the cuts of LLaMA-3-70B and GPT-3 175B.

    python benchmarks/pipeline.py                    # all three parts (~7 min on 2 busy cores)
    python benchmarks/pipeline.py --steps            # 1. step time, 4 ranks and 2 ranks
    python benchmarks/pipeline.py --bubble           # 2. calibration, then idle per rank, measured and predicted
    python benchmarks/pipeline.py --calibrate        # 2a. this machine's GEMM rate and gloo latency / bandwidth
    python benchmarks/pipeline.py --cuts             # 3. plan_pipeline on meta: LLaMA-3-70B, GPT-3 175B
    python benchmarks/pipeline.py --json out.json    # also write every figure to out.json

Ranks are processes spawned by benchmarks/common.launch (gloo on 127.0.0.1, one torch thread a
rank). The model of parts 1 and 2 is the GPT of tests/models.py (untied head, GPT-2's
initialisation), 8 blocks; its size is set by --vocab/--hidden/--heads/--blocks/--seq.

1. `--steps`: one step is forward + backward of the global batch (--batch x --seq tokens; no
   optimizer), then `zero_grad(set_to_none=True)`. At 4 ranks: pp 2 x tp 2 (1F1B, --microbatches
   microbatches; `autoshard.pipeline` over a ("pp", "tp") DeviceMesh), pp 4 (1F1B), pp 2 x dp 2
   (1F1B, the same microbatch size), tp 2 x dp 2 (`autoshard.parallelize` over mesh["tp"], each
   data-parallel replica half the batch, gradients averaged over mesh["dp"] by one flat
   all-reduce: DDP's arithmetic without its buckets) and tp 4. At 2 ranks: pp 2 (1F1B), tp 2 and
   dp 2 (the whole model on each rank, half the batch, the flat all-reduce). Every variant is built
   from the same seed and its first loss (mean over replicas) is checked against the others'.
   Timing: `common.time_interleaved` (--warmup untimed steps each, then rounds in which every
   variant runs one step in rotated order, each after a barrier; a step's time is the slowest
   rank's). Reported: median and quartiles, the CPU time of a step summed over the ranks, and the
   same-run ratios to the first variant (ratio of medians, median of per-round ratios).
   The machine has 2 cores: 4 ranks share them, 2 processes a core.

2. `--bubble`: first a calibration (2a; `--calibrate` runs it alone, `--no-calibrate` skips it): on 2
   ranks, one torch thread each, (i) every GEMM of one microbatch through the model (each linear's
   forward x @ W^T, input gradient dY @ W and weight gradient dY^T @ x, with autograd's transposed
   views), median of --cal-reps, on rank 0 alone and on both ranks at once; `flops` = their flops over
   their median seconds, each weighted by how often a step runs it (rank 0 alone); (ii) gloo isend /
   irecv ping-pong between the 2 ranks on 127.0.0.1 of 4 B, 64 KiB, the boundary tensor, 1 MiB and
   4 MiB, one-way = median round trip / 2 over --cal-tries; `latency` = the one-way time of 4 B,
   `bandwidth` = (4 MiB - 4 B) / (its one-way time - latency). These are the CostModel's knobs
   (`autoshard.pipeline(..., flops=, bandwidth=, latency=)` passes them to the plan).
   Then (2b) pp 2 on 2 ranks and pp 4 on 4 ranks, GPipe and 1F1B, M in {4, 8}, microbatches of
   --mb-size sequences (the batch grows with M), each pipeline planned with the calibrated cost
   model; rank 0 also plans the same pipeline with the default one (`autoshard.plan_pipeline`; the
   table says whether its cut is the same). The stage's compute is timed by wrapping
   torch.distributed.pipelining's `_PipelineStageBase.forward_one_chunk`, `backward_one_chunk`
   and `backward_weight_one_chunk`, the schedule by wrapping `_step_microbatches` of ScheduleGPipe
   / Schedule1F1B (what `Pipeline.step` runs between splitting the batch and finishing the
   gradients), and the point-to-point traffic by wrapping the schedules' `_batch_p2p` (posting
   isend / irecv) and `_wait_batch_p2p` (waiting on them). Per rank and step: busy = the sum of
   the wrapped compute; the window runs from the first rank entering the schedule to the last
   leaving it; idle fraction = 1 - busy / window (and, beside it, against the whole `pipe.step`,
   which adds the gradients' division and the loss's broadcast). Measured bubble: each step's
   mean over ranks, median over --bubble-steps steps (after --warmup). Overhead of a rank = its
   own span in the schedule - its compute - its waits on p2p, per F or B action (the schedule's
   Python, posting the p2p, being descheduled between actions).
   Predicted: `pipe.plan.bubble` with the default cost model (GPU-class) and with the calibrated
   one; then the calibrated plan's error taken apart by swapping one term at a time for its
   measurement in `autoshard.planner.stages.simulate`: (b) the measured mean forward and backward
   per stage with the calibrated send, (c) with the send measured in that run (gloo send/recv
   ping-pong of the boundary tensor between pp ranks 0 and 1, median of 20), (d) plus the pp
   size's median overhead on every action, spent on the rank but not computing, (e) instead each
   rank's mean overhead before its forwards added to its forwards, and before its backwards to its
   backwards (the time since the rank's previous action, or the schedule's start, less its p2p
   waits). The relative error is (predicted - measured) / measured; the measured bubble's
   quartiles over the steps are printed beside it.

3. `--cuts`: `autoshard.plan_pipeline` on models built on the meta device (nothing allocated):
   LLaMA-3-70B (hidden 8192, FFN 28672, 64 heads, 8 K/V heads, vocab 128256, 80 layers, untied;
   microbatch 1 x 4096 tokens) at pp 8 x tp 8, and GPT-3 175B (GPT2Config: hidden 12288, 96
   heads, 96 layers, vocab 50257, 2048 positions, tied; microbatch 1 x 2048 tokens) at pp 8 and
   pp 16 x tp 8 (Megatron-LM's published layout: TP 8 x PP 8 or 16); 1F1B, M = --cut-microbatches.
   Printed: the plan's table, the blocks a stage holds (whole blocks + the children of a block cut
   inside, and in units of the median block's time), the largest boundary's send, the slowest stage
   over the mean (`plan.balance`: the min-max cut over whole blocks, or over blocks' children where
   that is over 1% better), the head's (and loss's) cost in blocks, the predicted bubble, and the
   time of the call:
   wall and CPU seconds, and CPU seconds by phase (the tensor-parallel plan of one microbatch,
   `autoshard.plan`, and within it capture, the search at its prices (`least_comm`) and the fake
   run behind the predicted memory (`memory_of`); then the cut). LLaMA-3-70B is planned twice on
   the same model object (a cold and a warm call). Where its cold call takes over 10 s, the call
   is run once more under cProfile and its top 15 functions are printed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):                                    # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))     # tests/models.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import env_info, launch, note_load, print_table, summarize, time_interleaved  # noqa: E402

CORES_NOTE = (f"machine: {os.cpu_count()} CPU cores; 4-rank runs put 4 processes (one torch thread each) on "
              f"those cores, 2-rank runs 2")


# ----------------------------------------------------------------------------- model and data

def _gpt(a, seed: int = 0):
    from models import GPT
    torch.manual_seed(seed)
    model = GPT(vocab=a["vocab"], h=a["hidden"], heads=a["heads"], blocks=a["blocks"], seq=a["seq"], tied=False)
    for m in model.modules():                      # GPT-2's initialisation
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)
    return model


def _batch(a, batch: int):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, a["vocab"], (batch, a["seq"] + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _average_grads(module, group) -> None:
    """Average `module`'s gradients over `group` in one flat all-reduce (DDP's arithmetic)."""
    grads = [_local(p.grad) for p in dict.fromkeys(module.parameters()) if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


# ----------------------------------------------------------------------------- 1. step time

def _variants(world: int, a) -> list:
    """(name, kind, mesh shape, mesh names, microbatches) of the variants at `world` ranks."""
    m = a["microbatches"]
    if world == 4:
        return [("pp2 x tp2 (1F1B)", "pipe", (2, 2), ("pp", "tp"), m),
                ("pp4 (1F1B)", "pipe", (4,), ("pp",), m),
                ("pp2 x dp2 (1F1B)", "pipe", (2, 2), ("pp", "dp"), max(2, m // 2)),
                ("tp2 x dp2", "tpdp", (2, 2), ("dp", "tp"), None),
                ("tp4", "tp", None, None, None)]
    return [("pp2 (1F1B)", "pipe", (2,), ("pp",), m),
            ("tp2", "tp", None, None, None),
            ("dp2", "dp", None, None, None)]


def _build_step(kind, shape, names, microbatches, a, idx, tgt):
    """(step callable returning the loss of this rank's replica, dp group or None, build seconds)."""
    import autoshard
    t0 = time.perf_counter()
    model = _gpt(a)
    world = dist.get_world_size()
    if kind == "pipe":
        mesh = _mesh(shape, names)
        dp = mesh["dp"] if "dp" in names else None
        if dp is not None:                         # this replica's half of the batch
            d, n = dp.get_local_rank(), dp.size()
            half = idx.shape[0] // n
            idx, tgt = idx[d * half:(d + 1) * half], tgt[d * half:(d + 1) * half]
        pipe = autoshard.pipeline(model, (idx, tgt), mesh=mesh, microbatches=microbatches, schedule="1F1B")

        def step():
            loss = pipe.step(idx, tgt)
            pipe.zero_grad(set_to_none=True)
            return loss
        return step, (dp.get_group() if dp is not None else None), time.perf_counter() - t0, pipe.plan
    if kind == "tpdp":
        mesh = _mesh(shape, names)
        d, n = mesh["dp"].get_local_rank(), mesh["dp"].size()
        half = idx.shape[0] // n
        idx, tgt = idx[d * half:(d + 1) * half], tgt[d * half:(d + 1) * half]
        gm = autoshard.parallelize(model, mesh["tp"].size(), (idx, tgt), group=mesh["tp"])
        group = mesh["dp"].get_group()

        def step():
            loss = gm(idx, tgt)
            loss.backward()
            _average_grads(gm, group)
            gm.zero_grad(set_to_none=True)
            return loss.detach()
        return step, group, time.perf_counter() - t0, None
    if kind == "tp":
        gm = autoshard.parallelize(model, world, (idx, tgt))

        def step():
            loss = gm(idx, tgt)
            loss.backward()
            gm.zero_grad(set_to_none=True)
            return loss.detach()
        return step, None, time.perf_counter() - t0, None
    # dp: the whole model on every rank, its share of the batch
    r = dist.get_rank()
    part = idx.shape[0] // world
    idx, tgt = idx[r * part:(r + 1) * part], tgt[r * part:(r + 1) * part]

    def step():
        loss = model(idx, tgt)
        loss.backward()
        _average_grads(model, None)
        model.zero_grad(set_to_none=True)
        return loss.detach()
    return step, dist.group.WORLD, time.perf_counter() - t0, None


def _steps_rank(a):
    warnings.simplefilter("ignore")
    world = dist.get_world_size()
    idx, tgt = _batch(a, a["batch"])
    steps, first, build, cpu, plans = {}, {}, {}, {}, {}
    for name, kind, shape, names, m in _variants(world, a):
        step, dp, secs, plan = _build_step(kind, shape, names, m, a, idx, tgt)
        loss = step().detach().reshape(1).clone()
        if dp is not None:                         # the mean over replicas: the global batch's loss
            dist.all_reduce(loss, group=dp)
            loss /= dist.get_world_size(dp)
        first[name], build[name], cpu[name] = loss.item(), secs, []
        if plan is not None:
            plans[name] = dict(bubble=plan.bubble, balance=plan.balance, stages=[len(s) for s in plan.stages])

        def timed(step=step, out=cpu[name]):
            t = time.process_time()
            step()
            out.append(time.process_time() - t)
        steps[name] = timed
        gc.collect()
    times = time_interleaved(steps, warmup=a["warmup"] - 1, rounds=a["rounds"])   # the loss check was one warm-up
    names = list(steps)
    c = torch.tensor([cpu[n][-a["rounds"]:] for n in names], dtype=torch.float64)
    dist.all_reduce(c)                             # summed over the ranks
    cpu = {n: (c[i] * 1e3).tolist() for i, n in enumerate(names)}
    b = torch.tensor([build[n] for n in names], dtype=torch.float64)
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    return dict(world=world, times=times, cpu=cpu, first_loss=first, plans=plans,
                build_s={n: b[i].item() for i, n in enumerate(names)})


def run_steps(args, a) -> dict:
    out = {}
    print(f"\n== 1. step time: GPT vocab {a['vocab']}, hidden {a['hidden']}, {a['heads']} heads, {a['blocks']} blocks, "
          f"untied; global batch {a['batch']} x {a['seq']} tokens; forward + backward; {a['warmup']} warm-up steps, "
          f"{a['rounds']} interleaved rounds", flush=True)
    print(CORES_NOTE + ": the 4-rank rows are 2 processes a core, so wall times include waiting for a core; "
          "compare ratios within one table, not across the 2- and 4-rank tables", flush=True)
    for world in args.worlds:
        t0 = time.perf_counter()
        res = launch(_steps_rank, world, a, timeout_s=1500, collective_timeout_s=600)
        names = list(res["times"])
        base = names[0]
        losses = res["first_loss"]
        spread = max(losses.values()) - min(losses.values())
        rows = []
        for n in names:
            s = summarize(res["times"][n])
            cs = statistics.median(res["cpu"][n])
            paired = statistics.median(x / y for x, y in zip(res["times"][n], res["times"][base]))
            cpaired = statistics.median(x / y for x, y in zip(res["cpu"][n], res["cpu"][base]))
            plan = res["plans"].get(n)
            rows.append([n, s["median_ms"], f"{s['p25_ms']:.1f}-{s['p75_ms']:.1f}", s["n"],
                         s["median_ms"] / summarize(res["times"][base])["median_ms"], paired, cs,
                         cpaired, f"{plan['bubble']:.3f}" if plan else "-", f"{res['build_s'][n]:.1f}"])
            res.setdefault("summary", {})[n] = {**s, "cpu_median_ms": cs, "ratio_medians": rows[-1][4],
                                                "ratio_paired": paired, "cpu_ratio_paired": cpaired}
        title = (f"{world} ranks on {os.cpu_count()} cores ({world // max(1, os.cpu_count())} process(es) a core); "
                 f"first-step loss spread over variants {spread:.2e} ({', '.join(f'{k} {v:.6f}' for k, v in losses.items())})")
        print_table(rows, ["variant", "median step ms", "p25-p75", "rounds", f"/ {base} (medians)",
                           f"/ {base} (paired)", "CPU ms (ranks summed)", "CPU / first (paired)",
                           "plan bubble", "build s"], title=title, floatfmt=".3f")
        print(f"  [{world} ranks: {time.perf_counter() - t0:.0f} s]", flush=True)
        out[str(world)] = res
    return out


# ----------------------------------------------------------------------------- 2. bubble

EVENTS: list = []          # (kind, stage index, start, end, thread CPU seconds) of this process
# kinds: F, B, W the stage's compute; S the schedule (_step_microbatches); P waiting on p2p works
# (_wait_batch_p2p); Q posting them (_batch_p2p: isend / irecv / batch_isend_irecv)


def _install_timers() -> None:
    from torch.distributed.pipelining import schedules as S
    from torch.distributed.pipelining import stage as T
    if getattr(T._PipelineStageBase, "_bench_timed", False):
        return

    def timed(orig, kind, of_stage=False):
        def run(*args, **kwargs):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                EVENTS.append((kind, args[0].stage_index if of_stage else -1, t0, time.perf_counter(),
                               time.thread_time() - c0))
        return run
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
        setattr(T._PipelineStageBase, name, timed(getattr(T._PipelineStageBase, name), kind, of_stage=True))
    for cls in (S.ScheduleGPipe, S.Schedule1F1B):
        cls._step_microbatches = timed(cls._step_microbatches, "S")
    # module functions, looked up by name where the schedules call them
    S._wait_batch_p2p = timed(S._wait_batch_p2p, "P")
    S._batch_p2p = timed(S._batch_p2p, "Q")
    T._PipelineStageBase._bench_timed = True


# ----------------------------------------------------------------------------- 2a. calibration

def _gemm_shapes(a) -> list:
    """(label, m, k, n, times in one step of one microbatch through the whole model, operand layout) of
    every linear layer's three products: forward x @ W^T (tokens x in, W out x in), the input's gradient
    dY @ W and the weight's dY^T @ x, as autograd runs them (W^T and dY^T are transposed views)."""
    t, h, v, n = a["mb_size"] * a["seq"], a["hidden"], a["vocab"], a["blocks"]
    out = []
    for name, k, o, count in (("q/k/v/o", h, h, 4 * n), ("fc1", h, 4 * h, n), ("fc2", 4 * h, h, n),
                              ("head", h, v, 1)):
        out += [(f"{name} fwd", t, k, o, count, "x @ W^T"), (f"{name} dX", t, o, k, count, "dY @ W"),
                (f"{name} dW", o, t, k, count, "dY^T @ x")]
    return out


def _time_gemms(a, reps: int) -> list:
    """[(label, m, k, n, count, median seconds)] of this process's GEMMs (its torch threads: one)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for label, m, k, n, count, form in _gemm_shapes(a):
        if form == "x @ W^T":
            x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
        elif form == "dY @ W":
            x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        else:
            x, w = torch.randn(k, m, generator=g).t(), torch.randn(k, n, generator=g)
        for _ in range(3):
            torch.mm(x, w)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(x, w)
            ts.append(time.perf_counter() - t0)
        rows.append((label, m, k, n, count, statistics.median(ts)))
    return rows


def _rate(rows: list) -> float:
    """flop/s of one step's GEMM mix: their flops over their median seconds, each weighted by its count."""
    return sum(2.0 * m * k * n * c for _, m, k, n, c, _ in rows) / sum(c * s for *_, c, s in rows)


def _one_way(nbytes: int, tries: int) -> float:
    """One-way seconds of `nbytes` between ranks 0 and 1 by isend / irecv (each waited), as rank 0 saw
    it: median round trip / 2, broadcast to every rank."""
    t = torch.zeros(max(1, nbytes // 4))
    rank = dist.get_rank()
    rt = []
    dist.barrier()
    for _ in range(tries + 3):
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(t, 1).wait()
            dist.irecv(t, 1).wait()
        elif rank == 1:
            dist.irecv(t, 0).wait()
            dist.isend(t, 0).wait()
        rt.append(time.perf_counter() - t0)
    dist.barrier()
    one_way = torch.tensor([statistics.median(rt[3:]) / 2 if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(one_way, 0)
    return one_way.item()


CAL_SIZES = (4, 64 * 1024, 1 << 20, 4 << 20)       # bytes ping-ponged; the boundary's size is added


def _calibrate_rank(a):
    """On 2 ranks: the GEMM rate on rank 0 alone (rank 1 waits in a barrier), then on both at once, and the
    one-way times of CAL_SIZES (and the model's boundary tensor) by gloo isend / irecv."""
    reps = a["cal_reps"]
    rank = dist.get_rank()
    dist.barrier()
    alone = _time_gemms(a, reps) if rank == 0 else None
    dist.barrier()
    both = _time_gemms(a, reps)
    rates = [None] * dist.get_world_size()
    dist.all_gather_object(rates, _rate(both))
    boundary = a["mb_size"] * a["seq"] * a["hidden"] * 4
    sizes = sorted(set(CAL_SIZES) | {boundary})
    one_way = {n: _one_way(n, a["cal_tries"]) for n in sizes}
    return dict(alone=alone, both_rank0=both, rate_alone=_rate(alone) if alone else None, rate_both=rates,
                one_way=one_way, boundary=boundary)


def calibrate(a) -> dict:
    """This machine as the cost model's knobs: `flops` the one-thread GEMM rate of the model's shapes (rank 0
    alone), `latency` the one-way time of 4 bytes, `bandwidth` from the one-way time of 4 MiB less that."""
    print(f"\n== 2a. calibration: GEMMs of the model's shapes at microbatch {a['mb_size']} x {a['seq']} tokens "
          f"(one torch thread, median of {a['cal_reps']}), gloo isend/irecv ping-pong between 2 ranks on "
          f"127.0.0.1 (median of {a['cal_tries']} round trips / 2)", flush=True)
    t0 = time.perf_counter()
    res = launch(_calibrate_rank, 2, a, timeout_s=600, collective_timeout_s=300)
    ow = res["one_way"]
    small, large = min(CAL_SIZES), max(CAL_SIZES)
    latency = ow[small]
    bandwidth = (large - small) / max(ow[large] - latency, 1e-9)
    cost = dict(flops=res["rate_alone"], bandwidth=bandwidth, latency=latency)
    both = {label: s for label, *_, s in res["both_rank0"]}
    rows = [[label, f"{m} x {k} x {n}", c, s * 1e6, 2.0 * m * k * n / s / 1e9, 2.0 * m * k * n / both[label] / 1e9]
            for label, m, k, n, c, s in res["alone"]]
    print_table(rows, ["GEMM", "m x k x n", "per step", "us (rank 0 alone)", "GFLOP/s alone",
                       "GFLOP/s (2 ranks at once)"],
                title="GEMMs of one microbatch (per step: how many the whole model runs)", floatfmt=".1f")
    prows = [[n, ow[n] * 1e6, (latency + n / bandwidth) * 1e6,
              ("" if n != res["boundary"] else "the model's boundary tensor")] for n in sorted(ow)]
    print_table(prows, ["bytes", "one-way us (measured)", "latency + bytes / bandwidth (us)", ""],
                title="gloo isend/irecv one-way time", floatfmt=".1f")
    print(f"calibrated CostModel: flops {cost['flops'] / 1e9:.1f} GFLOP/s (both ranks at once: "
          f"{' / '.join(f'{r / 1e9:.1f}' for r in res['rate_both'])}), latency {latency * 1e6:.1f} us, "
          f"bandwidth {bandwidth / 1e9:.2f} GB/s (default: 50000 GFLOP/s, 1.0 us, 50 GB/s)  "
          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return dict(cost=cost, gemms_alone=res["alone"], gemms_both_rank0=res["both_rank0"],
                rate_both=res["rate_both"], one_way_s={str(k): v for k, v in ow.items()},
                boundary_bytes=res["boundary"])


# ----------------------------------------------------------------------------- 2b. measured and predicted

def _plan_fields(plan) -> dict:
    return dict(bubble=plan.bubble, idle=list(plan.idle), forward=list(plan.forward), backward=list(plan.backward),
                step_time=plan.step_time, stages=[len(s) for s in plan.stages], sent_bytes=list(plan.sent_bytes),
                balance=plan.balance, spans=[f"{s[0]} .. {s[-1]}" if len(s) > 1 else s[0] for s in plan.stages])


def _bubble_rank(a):
    import autoshard
    warnings.simplefilter("ignore")
    _install_timers()
    pp = dist.get_world_size()
    mesh = _mesh((pp,), ("pp",))
    cost = a.get("cost") or {}
    configs = [(schedule, m) for schedule in ("GPipe", "1F1B") for m in a["bubble_microbatches"]]
    pipes, defaults, latency = {}, {}, None
    for schedule, m in configs:
        idx, tgt = _batch(a, a["mb_size"] * m)
        # the pipeline the run measures: planned with the calibrated cost model (when there is one)
        pipe = autoshard.pipeline(_gpt(a), (idx, tgt), mesh=mesh, microbatches=m, schedule=schedule, **cost)
        pipes[schedule, m] = (pipe, idx, tgt)
        if dist.get_rank() == 0:             # the default cost model's plan of the same pipeline
            defaults[schedule, m] = _plan_fields(autoshard.plan_pipeline(_gpt(a), (idx, tgt), pp=pp, microbatches=m,
                                                                         schedule=schedule))
        if latency is None:
            latency = _one_way(int(max(pipe.plan.sent_bytes, default=0)), 20)
        for _ in range(a["warmup"]):
            pipe.step(idx, tgt)
            pipe.zero_grad(set_to_none=True)
    per_step = {c: [] for c in configs}
    fwd = {c: {} for c in configs}
    bwd = {c: {} for c in configs}
    for i in range(a["bubble_steps"]):             # interleaved: every configuration once a round, rotated
        k = i % len(configs)
        for c in configs[k:] + configs[:k]:
            pipe, idx, tgt = pipes[c]
            dist.barrier()
            EVENTS.clear()
            c0 = time.process_time()
            t0 = time.perf_counter()
            pipe.step(idx, tgt)
            t1 = time.perf_counter()
            cpu = time.process_time() - c0
            pipe.zero_grad(set_to_none=True)
            window = [(s, e) for k_, _, s, e, _ in EVENTS if k_ == "S"]

            def total(kinds):
                return sum(e - s for k_, _, s, e, _ in EVENTS if k_ in kinds)
            busy_cpu = sum(tc for k_, _, _, _, tc in EVENTS if k_ in "FBW")
            for k_, st, s, e, _ in EVENTS:
                if k_ == "F":
                    fwd[c].setdefault(st, []).append(e - s)
                elif k_ in "BW":
                    bwd[c].setdefault(st, []).append(e - s)
            # each action's overhead: the time on its rank since the previous action ended (or the schedule
            # began), less the waits on p2p in between (posting p2p, the schedule's Python, being descheduled)
            gaps = {"F": [], "B": []}
            prev = window[0][0]
            for k_, _, s, e, _ in sorted((ev for ev in EVENTS if ev[0] in "FBW"), key=lambda ev: ev[2]):
                waited = sum(min(e2, s) - max(s2, prev) for k2, _, s2, e2, _ in EVENTS
                             if k2 == "P" and e2 > prev and s2 < s)
                gaps["F" if k_ == "F" else "B"].append(s - prev - waited)
                prev = e
            # absolute times (CLOCK_MONOTONIC, one clock for every process on the machine)
            per_step[c].append(dict(gap_f=gaps["F"], gap_b=gaps["B"], s0=window[0][0], s1=window[-1][1], t0=t0,
                                    t1=t1, busy=total("FBW"),
                                    busy_cpu=busy_cpu, cpu=cpu, wait=total("P"), post=total("Q"),
                                    actions=sum(1 for k_, *_ in EVENTS if k_ in "FBW")))
    results = []
    for c in configs:
        plan = pipes[c][0].plan
        mine = dict(rank=dist.get_rank(), per_step=per_step[c],
                    fwd={s: statistics.median(v) for s, v in fwd[c].items()},
                    bwd={s: statistics.median(v) for s, v in bwd[c].items()},
                    fwd_mean={s: statistics.fmean(v) for s, v in fwd[c].items()},
                    bwd_mean={s: statistics.fmean(v) for s, v in bwd[c].items()})
        ranks = [None] * pp
        dist.all_gather_object(ranks, mine)
        results.append(dict(schedule=c[0], pp=pp, microbatches=c[1], batch=a["mb_size"] * c[1], ranks=ranks,
                            plan=_plan_fields(plan), default=defaults.get(c)))
    pipes.clear()
    gc.collect()
    return dict(results=results, latency=latency)


def _with_overhead(schedule: str, pp: int, m: int, fwd, bwd, send: float, overhead, overhead_b=None) -> tuple:
    """(bubble, idle per rank, makespan) of `simulate` with `overhead` seconds more on every action (a number, or
    one per stage for forwards and `overhead_b` for backwards), spent on the rank but not computing (idle, as the
    measurement counts it)."""
    from autoshard.planner.stages import simulate
    o_f = overhead if isinstance(overhead, (list, tuple)) else [overhead] * pp
    o_b = overhead_b if overhead_b is not None else o_f
    tl = simulate(schedule, pp, m, [f + o for f, o in zip(fwd, o_f)], [b + o for b, o in zip(bwd, o_b)], send=send)
    idle = [1 - m * (f + b) / tl.makespan for f, b in zip(fwd, bwd)]
    return sum(idle) / pp, idle, tl.makespan


def _analyse(r: dict, latency: float, cost: dict | None) -> dict:
    """What one configuration measured. A step's window is common to the ranks: from the first rank entering
    the schedule to the last leaving it (what `simulate`'s makespan models: a rank that finishes early is
    idle until the step ends); idle of a rank = 1 - its busy time / window. A rank's overhead = its own span
    in the schedule less its compute and its waits on p2p works, per action (F or B)."""
    from autoshard.planner.stages import ideal_bubble, simulate
    pp, m, schedule = r["pp"], r["microbatches"], r["schedule"]
    ranks = sorted(r["ranks"], key=lambda x: x["rank"])
    steps = len(ranks[0]["per_step"])
    idle, idle_whole, windows, whole, stretch, over, waits, posts, skew = [], [], [], [], [], [], [], [], []
    for i in range(steps):
        xs = [x["per_step"][i] for x in ranks]
        w = max(x["s1"] for x in xs) - min(x["s0"] for x in xs)
        ww = max(x["t1"] for x in xs) - min(x["t0"] for x in xs)
        windows.append(w)
        whole.append(ww)
        skew.append(max(x["s0"] for x in xs) - min(x["s0"] for x in xs))
        idle.append([1 - x["busy"] / w for x in xs])
        idle_whole.append([1 - x["busy"] / ww for x in xs])
        stretch.append([x["busy"] / x["busy_cpu"] for x in xs])
        over.append([(x["s1"] - x["s0"] - x["busy"] - x["wait"]) / x["actions"] for x in xs])
        waits.append([x["wait"] / w for x in xs])
        posts.append([x["post"] / x["actions"] for x in xs])

    def per_rank(rows):
        return [statistics.median(row[k] for row in rows) for k in range(pp)]
    gap_f = [statistics.fmean(g for x in ranks[s]["per_step"] for g in x["gap_f"]) for s in range(pp)]
    gap_b = [statistics.fmean(g for x in ranks[s]["per_step"] for g in x["gap_b"]) for s in range(pp)]
    bubbles = sorted(sum(row) / pp for row in idle)
    measured = statistics.median(bubbles)
    quart = statistics.quantiles(bubbles, n=4) if len(bubbles) > 1 else [measured] * 3
    fwd = [ranks[s]["fwd"][s] for s in range(pp)]
    bwd = [ranks[s]["bwd"][s] for s in range(pp)]
    # fed the mean durations: the simulated busy time is then the measured one, and what is left between
    # the two is the timeline (the order, the waits, the overhead) alone
    fmean = [ranks[s]["fwd_mean"][s] for s in range(pp)]
    bmean = [ranks[s]["bwd_mean"][s] for s in range(pp)]
    sim = simulate(schedule, pp, m, fmean, bmean, send=latency)
    # (e): each rank's measured overhead before its forwards and before its backwards, where it falls
    placed = _with_overhead(schedule, pp, m, fmean, bmean, latency, gap_f, gap_b)
    plan, default = r["plan"], r["default"]
    # the calibrated plan's send, as plan_pipeline prices it; simulate() with it gives the plan's bubble back
    send = (max(plan["sent_bytes"], default=0) / cost["bandwidth"] + cost["latency"]) if cost and pp > 1 else None
    check = simulate(schedule, pp, m, plan["forward"], plan["backward"], send=send).bubble if send is not None else None
    # the measured F and B with the calibrated send: the calibrated plan's error from its stage times alone
    sim_cal = simulate(schedule, pp, m, fmean, bmean, send=send).bubble if send is not None else None
    return dict(schedule=schedule, pp=pp, microbatches=m, measured=measured, ideal=ideal_bubble(schedule, pp, m),
                measured_p25=quart[0], measured_p75=quart[2], measured_steps=bubbles,
                measured_whole_step=statistics.median(sum(row) / pp for row in idle_whole),
                measured_per_rank=per_rank(idle), compute_wall_over_cpu=per_rank(stretch),
                overhead_per_rank_ms=[o * 1e3 for o in per_rank(over)],
                overhead_ms=statistics.median(sum(row) / pp for row in over) * 1e3,
                post_per_action_ms=statistics.median(sum(row) / pp for row in posts) * 1e3,
                wait_share_per_rank=per_rank(waits), entry_skew_ms=statistics.median(skew) * 1e3,
                window_ms=statistics.median(windows) * 1e3, whole_step_ms=statistics.median(whole) * 1e3,
                fwd_ms=[f * 1e3 for f in fwd], bwd_ms=[b * 1e3 for b in bwd],
                fwd_mean_ms=[f * 1e3 for f in fmean], bwd_mean_ms=[b * 1e3 for b in bmean],
                gap_f_ms=[g * 1e3 for g in gap_f], gap_b_ms=[g * 1e3 for g in gap_b], sim_placed_bubble=placed[0],
                sim_placed_idle=placed[1], sim_placed_makespan_ms=placed[2] * 1e3,
                sim_cal_send_bubble=sim_cal, sim_mean_bubble=sim.bubble, sim_mean_idle=list(sim.per_rank),
                sim_mean_makespan_ms=sim.makespan * 1e3,
                plan_bubble=plan["bubble"], plan_idle=plan["idle"], plan_step_ms=plan["step_time"] * 1e3,
                plan_fwd_ms=[f * 1e3 for f in plan["forward"]], plan_bwd_ms=[b * 1e3 for b in plan["backward"]],
                plan_send_ms=send * 1e3 if send is not None else None, plan_check_bubble=check,
                default_bubble=default["bubble"] if default else None,
                default_idle=default["idle"] if default else None,
                default_fwd_us=[f * 1e6 for f in default["forward"]] if default else None,
                same_cut=default["spans"] == plan["spans"] if default else None,
                stages=plan["stages"], spans=plan["spans"], sent_bytes=plan["sent_bytes"],
                plan_balance=plan["balance"])


def _add_overhead(x: dict, overhead_s: float, latency: float) -> None:
    """The measured-F/B timeline with `overhead_s` an action (the pp size's pooled measurement) charged on top."""
    b, idle, span = _with_overhead(x["schedule"], x["pp"], x["microbatches"], [f / 1e3 for f in x["fwd_mean_ms"]],
                                   [t / 1e3 for t in x["bwd_mean_ms"]], latency, overhead_s)
    x.update(sim_over_bubble=b, sim_over_idle=idle, sim_over_makespan_ms=span * 1e3, overhead_used_ms=overhead_s * 1e3)


def run_bubble(args, a, cal: dict | None) -> dict:
    out = {}
    cost = cal["cost"] if cal else None
    print(f"\n== 2b. bubble: GPT vocab {a['vocab']}, hidden {a['hidden']}, {a['heads']} heads, {a['blocks']} blocks, "
          f"untied; microbatch {a['mb_size']} x {a['seq']} tokens; {a['warmup']} warm-up steps, "
          f"{a['bubble_steps']} measured steps; pipelines planned with "
          + (f"the calibrated cost model (flops {cost['flops'] / 1e9:.1f} GFLOP/s, latency {cost['latency'] * 1e6:.1f} "
             f"us, bandwidth {cost['bandwidth'] / 1e9:.2f} GB/s)" if cost else "the default cost model"), flush=True)
    print(CORES_NOTE + ": at pp 4 the 4 ranks compete for 2 cores, so a rank's timed compute includes waiting "
          "for a core and its idle time gives a core to another rank; pp 2 fits the cores", flush=True)

    def f3(v):
        return " / ".join(f"{t:.3f}" for t in v)

    def f2(v):
        return " / ".join(f"{t:.2f}" for t in v)

    def f1(v):
        return " / ".join(f"{t:.1f}" for t in v)
    for pp in args.pp:
        t0 = time.perf_counter()
        res = launch(_bubble_rank, pp, {**a, "cost": cost}, timeout_s=1500, collective_timeout_s=600)
        analysed = [_analyse(r, res["latency"], cost) for r in res["results"]]
        overhead = statistics.median(x["overhead_ms"] for x in analysed) / 1e3      # one number for this pp
        for x in analysed:
            _add_overhead(x, overhead, res["latency"])
        rows, attrib, times = [], [], []
        for x in analysed:
            def err(p, x=x):
                return (p - x["measured"]) / x["measured"] if p is not None and x["measured"] > 0 else float("nan")
            cal = x["plan_bubble"] if cost else None
            rows.append([x["schedule"], x["microbatches"], x["ideal"], x["default_bubble"], cal, x["measured"],
                         f"{x['measured_p25']:.3f}-{x['measured_p75']:.3f}", err(x["default_bubble"]), err(cal),
                         x["measured_whole_step"]])
            attrib.append([x["schedule"], x["microbatches"], x["measured"], cal, err(cal), x["sim_cal_send_bubble"],
                           err(x["sim_cal_send_bubble"]), x["sim_mean_bubble"], err(x["sim_mean_bubble"]),
                           x["sim_over_bubble"], err(x["sim_over_bubble"]), x["sim_placed_bubble"],
                           err(x["sim_placed_bubble"]), x["overhead_ms"], f2(x["gap_f_ms"]), f2(x["gap_b_ms"]),
                           x["post_per_action_ms"], f2(x["wait_share_per_rank"]), x["entry_skew_ms"]])
            times.append([x["schedule"], x["microbatches"], f1(x["fwd_ms"]), f1(x["bwd_ms"]),
                          f1(x["plan_fwd_ms"]) if cost else "-", f1(x["plan_bwd_ms"]) if cost else "-",
                          " / ".join(f"{f:.0f}" for f in x["default_fwd_us"] or []),
                          x["window_ms"], x["plan_step_ms"] if cost else float("nan"), x["sim_over_makespan_ms"],
                          f2(x["measured_per_rank"]), f2(x["plan_idle"]) if cost else "-",
                          f2(x["sim_over_idle"]), f2(x["default_idle"] or []), f2(x["compute_wall_over_cpu"])])
        x0 = analysed[0]
        print_table(rows, ["schedule", "M", "ideal", "predicted, default cost model", "predicted, calibrated",
                           "measured", "measured p25-p75 over steps", "rel err default", "rel err calibrated",
                           "measured (whole pipe.step)"],
                    title=f"pp {pp} on {pp} ranks: bubble = mean idle fraction over ranks (median over steps); "
                          f"ideal = (pp-1)/(M+pp-1); stages {' | '.join(x0['spans'])} (the default cost model cuts "
                          f"{'alike' if all(x['same_cut'] for x in analysed) else 'DIFFERENTLY'}); calibrated send "
                          f"of {max(x0['sent_bytes'], default=0) / 1024:.0f} KiB: "
                          + (f"{x0['plan_send_ms']:.3f} ms" if x0["plan_send_ms"] is not None else "-"),
                    floatfmt=".3f")
        print_table(attrib, ["schedule", "M", "measured", "(a) calibrated plan", "rel err",
                             "(b) measured F/B, calibrated send", "rel err", "(c) measured F/B, measured send",
                             "rel err", "(d) (c) + overhead", "rel err", "(e) (c) + overhead where it falls",
                             "rel err", "overhead ms an action (mean over ranks)", "before F per rank",
                             "before B per rank", "of it posting p2p ms", "p2p wait / window per rank",
                             "entry skew ms"],
                    title=f"pp {pp}: the calibrated plan's error taken apart, one term at a time swapped for its "
                          f"measurement: (a) the plan; (b) simulate() fed the measured mean F and B per stage and the "
                          f"calibrated send; (c) the send measured in this run ({res['latency'] * 1e3:.3f} ms "
                          f"one-way); (d) and {overhead * 1e3:.2f} ms more an action (this pp's median overhead) spent "
                          f"on the rank, "
                          f"not computing; (e) instead each rank's mean overhead before its forwards on its "
                          f"forwards and before its backwards on its backwards. overhead = a rank's span in the "
                          f"schedule - its compute - its waits on p2p, per F or B action; before F / B: the time "
                          f"since the rank's previous action (or the schedule's start) less the p2p waits",
                    floatfmt=".3f")
        print_table(times, ["schedule", "M", "measured fwd ms per stage (median)", "measured bwd ms",
                            "calibrated fwd ms", "calibrated bwd ms", "default fwd us", "measured window ms",
                            "calibrated step ms", "(d) makespan ms", "measured idle per rank",
                            "calibrated idle per rank", "(d) idle per rank", "default idle per rank",
                            "compute wall / CPU per rank"],
                    title=f"pp {pp}: stage times and idle per rank, measured and predicted", floatfmt=".1f")
        if cost and any(x["plan_check_bubble"] is not None and abs(x["plan_check_bubble"] - x["plan_bubble"]) > 1e-9
                        for x in analysed):
            print("  note: simulate() with the calibrated send does not give the plan's bubble back", flush=True)
        print(f"  [pp {pp}: {time.perf_counter() - t0:.0f} s]", flush=True)
        out[str(pp)] = dict(latency_s=res["latency"], overhead_s=overhead, rows=analysed)
    return out


# ----------------------------------------------------------------------------- 3. cuts

def _llama70b():
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                   num_key_value_heads=8, num_hidden_layers=80, vocab_size=128256,
                                   max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa"), 4096


def _gpt3_175b():
    import transformers
    cfg = transformers.GPT2Config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, vocab_size=50257,
                                  n_inner=None, activation_function="gelu_new", tie_word_embeddings=True,
                                  use_cache=False)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa"), 2048


# (model, builder, pp, tp): each model's first call is cold (its capture, and the process's first for
# LLaMA); LLaMA-3-70B is planned a second time on the same model object, as a warm call
CUTS = (("LLaMA-3-70B", _llama70b, 8, 8), ("LLaMA-3-70B", _llama70b, 8, 8), ("GPT-3 175B", _gpt3_175b, 8, 8),
        ("GPT-3 175B", _gpt3_175b, 16, 8))


# phases of plan_pipeline timed apart (CPU seconds of this process): (label, module, attribute), each
# wrapped where the caller looks it up; a phase missing in this version of autoshard is skipped
PHASES = (("tp plan", "autoshard.pipe", "plan_tp"), ("capture", "autoshard.api", "capture"),
          ("search", "autoshard.planner.build", "least_comm"), ("memory", "autoshard.planner.build", "memory_of"),
          ("cut", "autoshard.pipe", "_cut_plan"))


def _timed_plan(model, example, pp, tp, m):
    """autoshard.plan_pipeline, timed whole (wall and CPU) and by phase (CPU): the tensor-parallel plan of one
    microbatch (`autoshard.plan`: capture, the search at its prices (`least_comm`), the predicted memory's fake
    run (`memory_of`), the rest) and the cut."""
    import importlib

    import autoshard
    box: dict = {"phases": {}}
    saved = []
    for label, module, attr in PHASES:
        mod = importlib.import_module(module)
        orig = getattr(mod, attr, None)
        if orig is None:
            continue

        def timed(*a, _orig=orig, _label=label, **k):
            c = time.process_time()
            try:
                out = _orig(*a, **k)
                if _label == "tp plan":
                    box["tp_plan"] = out
                elif _label == "cut":
                    box["names"] = a[1]
                return out
            finally:
                box["phases"][_label] = box["phases"].get(_label, 0.0) + time.process_time() - c
        saved.append((mod, attr, orig))
        setattr(mod, attr, timed)
    try:
        t, c = time.perf_counter(), time.process_time()
        plan = autoshard.plan_pipeline(model, example, pp=pp, tp=tp, microbatches=m, schedule="1F1B")
        wall = time.perf_counter() - t
        box["cpu_s"] = time.process_time() - c
    finally:
        for mod, attr, orig in saved:
            setattr(mod, attr, orig)
    return plan, wall, box


def _profile(model, example, pp, tp, m, top: int = 15) -> str:
    import cProfile
    import io
    import pstats

    import autoshard
    prof = cProfile.Profile()
    prof.enable()
    autoshard.plan_pipeline(model, example, pp=pp, tp=tp, microbatches=m, schedule="1F1B")
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def run_cuts(args, a) -> dict:
    from autoshard.planner.pipeline import block_costs
    from autoshard.planner.stages import ideal_bubble
    from autoshard.views.stages import format_pipeline      # PipelinePlan.report()'s table
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    m = a["cut_microbatches"]
    print(f"\n== 3. cuts: autoshard.plan_pipeline on meta, 1F1B, M = {m}, one process", flush=True)
    out, rows, built = {}, [], {}
    for name, make, pp, tp in CUTS:
        call = "cold"
        if name not in built:
            t = time.perf_counter()
            built[name] = (*make(), time.perf_counter() - t)
        else:
            call = "warm" if any(r[0] == name and r[1] == pp for r in rows) else "same model"
        model, seq, build_s = built[name]
        ids = torch.zeros(m, seq, dtype=torch.long, device="meta")
        example = {"input_ids": ids, "labels": ids}
        plan, wall, box = _timed_plan(model, example, pp, tp, m)
        first, costs, last, *_ = block_costs(box["tp_plan"], box["names"])
        block = statistics.median(costs)
        print(f"\n{name}: pp {pp} x tp {tp}, microbatch 1 x {seq} tokens, M = {m} ({call} call)")
        try:
            table = plan.report()
        except ImportError:                    # the report's import was broken at commit ce6f1ab
            table = format_pipeline(plan)
        print(table, flush=True)
        key = f"{name} pp{pp}" + (" warm" if call == "warm" else "")
        out[key] = dict(model=name, pp=pp, tp=tp, microbatches=m, tokens=seq, stages=[len(s) for s in plan.stages],
                        forward=list(plan.forward), backward=list(plan.backward), memory=list(plan.memory),
                        balance=plan.balance, bubble=plan.bubble, idle=list(plan.idle), step_time=plan.step_time,
                        ideal_bubble=ideal_bubble("1F1B", pp, m), plan_s=wall, plan_cpu_s=box["cpu_s"], call=call,
                        phases_cpu_s=dict(box["phases"]),
                        build_s=build_s, head_in_blocks=last / block,
                        embedding_in_blocks=first / block, blocks=len(costs))
        blocks = set(box["names"])
        shape = []                             # whole blocks + parts of blocks (a cut inside a block: its children)
        for g in plan.stages:
            whole = sum(1 for n in g if n in blocks)
            shape.append(f"{whole}+{len(g) - whole}p" if len(g) > whole else str(whole))
        # each stage's blocks in units of the median block's time (its share of the embedding and head left out)
        layers = [(3 * f - (first if s == 0 else 0) - (last if s == len(plan.stages) - 1 else 0)) / block
                  for s, f in enumerate(plan.forward)]
        out[key].update(shape=shape, layers=layers, spans=[f"{g[0]} .. {g[-1]}" for g in plan.stages],
                        sent_mib=[b / 2**20 for b in plan.sent_bytes])
        r = out[key]
        rows.append([name, pp, tp, m, call, " ".join(shape), " ".join(f"{x:.2f}" for x in layers),
                     f"{max(r['sent_mib'], default=0):.0f}", r["balance"], r["head_in_blocks"],
                     r["bubble"], r["ideal_bubble"], r["step_time"], wall, box["cpu_s"],
                     *(box["phases"].get(label, float("nan")) for label, _, _ in PHASES)])
        box.clear()
        gc.collect()
    print_table(rows, ["model", "pp", "tp", "M", "call", "blocks per stage (whole+parts)",
                       "blocks per stage (by time)", "largest send MiB", "balance (slowest/mean)",
                       "head+loss in blocks", "plan bubble", "ideal bubble", "pred. step s", "plan_pipeline s (wall)",
                       "CPU s", *(f"{label} CPU s" for label, _, _ in PHASES)],
                title="\ncuts (whole+parts: whole blocks a stage holds + children of a block cut inside, '10+1p'; "
                      "by time: the stage's blocks and parts over the median block's predicted time; balance: the "
                      "slowest stage over the mean, the min-max cut over whole blocks or, where over 1% better, over "
                      "blocks' children); the call's wall and CPU seconds, and "
                      "CPU seconds by phase: tp plan = autoshard.plan of one microbatch (capture + search + memory + "
                      "the rest), then the cut", floatfmt=".3f")
    llama = out["LLaMA-3-70B pp8"]
    print(f"LLaMA-3-70B pp 8: balance {llama['balance']:.3f} (target <= 1.05) -> "
          f"{'met' if llama['balance'] <= 1.05 else 'missed'}; planned in {llama['plan_s']:.1f} s wall, "
          f"{llama['plan_cpu_s']:.1f} s CPU, cold (target <= 10 s) -> {'met' if llama['plan_s'] <= 10 else 'missed'}; "
          f"warm call {out['LLaMA-3-70B pp8 warm']['plan_s']:.1f} s", flush=True)
    if llama["plan_s"] > 10 and not args.no_profile:
        model, seq, _ = built["LLaMA-3-70B"]
        ids = torch.zeros(m, seq, dtype=torch.long, device="meta")
        print("\nLLaMA-3-70B pp 8 under cProfile (its times are inflated by the profiler):", flush=True)
        text = _profile(model, {"input_ids": ids, "labels": ids}, 8, 8, m)
        print(text, flush=True)
        out["profile"] = text
    return out


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", action="store_true", help="part 1: step time against tp and dp")
    p.add_argument("--bubble", action="store_true", help="part 2: measured idle against the predicted bubble")
    p.add_argument("--cuts", action="store_true", help="part 3: LLaMA-3-70B and GPT-3 175B cuts on meta")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences) of part 1")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches of part 1's pipelines")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 2], help="world sizes of part 1")
    p.add_argument("--mb-size", type=int, default=4, help="sequences a microbatch, part 2")
    p.add_argument("--bubble-steps", type=int, default=20)
    p.add_argument("--bubble-microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--no-calibrate", action="store_true",
                   help="part 2: no calibration; the pipelines are planned with the default cost model")
    p.add_argument("--calibrate", action="store_true", help="part 2a alone: this machine's GEMM rate and gloo p2p")
    p.add_argument("--cal-reps", type=int, default=21, help="timed repetitions of each GEMM in the calibration")
    p.add_argument("--cal-tries", type=int, default=50, help="round trips of each size in the calibration")
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees of part 2")
    p.add_argument("--cut-microbatches", type=int, default=16)
    p.add_argument("--no-profile", action="store_true", help="part 3: no cProfile run when planning is slow")
    args = p.parse_args(argv)
    if not (args.steps or args.bubble or args.cuts or args.calibrate):
        args.steps = args.bubble = args.cuts = True
    a = {k: getattr(args, k) for k in ("vocab", "hidden", "heads", "blocks", "seq", "batch", "microbatches",
                                       "warmup", "rounds", "mb_size", "bubble_steps", "bubble_microbatches",
                                       "cut_microbatches", "cal_reps", "cal_tries")}
    load = note_load()
    result = {"env": {**env_info(), "load_before": load, "cores": os.cpu_count()}, "args": a}
    t0 = time.perf_counter()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    if args.steps:
        result["steps"] = run_steps(args, a)
    cal = None
    if args.calibrate or (args.bubble and not args.no_calibrate):
        cal = result["calibration"] = calibrate(a)
    if args.bubble:
        result["bubble"] = run_bubble(args, a, cal)
    if args.cuts:
        result["cuts"] = run_cuts(args, a)
    result["env"]["load_after"] = os.getloadavg()[0]
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.perf_counter() - t0:.0f} s",
          flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
