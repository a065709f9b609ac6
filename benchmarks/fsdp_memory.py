#!/usr/bin/env python
"""Per-rank memory and step time of tensor parallel x FSDP2 at 2 x 2 against tensor parallel + DDP.

A GPT (tests/models.py: vocab 32000, hidden 768, 12 heads, 12 blocks, tied embeddings, 109.7M
parameters, GPT-2's initialisation) runs on 4 gloo ranks (CPU, one thread each) as tensor
parallel 2 x data parallel 2, three ways in one run, each built from the same seed:

- `tp+ddp`: `autoshard.parallelize` over mesh["tp"], `register_ddp_parameters_to_ignore`, DDP
  over the data-parallel group (docs/examples/train_gpt.py without --fsdp);
- `tp+fsdp2/block`: `fully_shard(block, mesh=mesh["dp"])` for each of `autoshard.blocks_of(gm)`,
  then `fully_shard(gm, ...)` (train_gpt.py --fsdp);
- `tp+fsdp2/root`: `fully_shard(gm, mesh=mesh["dp"])` only.

Per rank it reports:

- training state held after an AdamW step: bytes of parameters, gradients and AdamW state
  (moments and step counters), each the storage of the local tensor (a DTensor's `to_local()`),
  every storage counted once (FSDP2's gradients of one module are views of one reduce-scatter
  output; the tied embedding/head weight is one parameter); against the full model's state / 4
  (perfect sharding), against that plus the parameters tensor parallel replicates (norms, biases
  of row-parallel layers: FSDP2 can only halve those), and against `tp+ddp`;
- the parameter peak of a forward: resident (sharded) parameter bytes plus the bytes of
  parameters FSDP2 holds unsharded (its all-gather outputs whose storage is allocated), sampled by
  forward hooks on the root and on every block, before (after FSDP2's pre-forward unshard) and
  after (before FSDP2's post-forward reshard) each one runs. Unsharding and resharding happen
  only in those hooks, so the largest sample is the peak. FSDP2's flat all-gather buffer, alive
  only while one module's parameters are copied out of it, is not included;
- as a second view, the peak of torch's CPU allocator during the same forward above its level at
  the start (torch.profiler memory events, as benchmarks/common.py's step_peak_bytes): it includes
  activations (the same in all three) and FSDP2's transient all-gather buffers;
- step time (forward + loss + backward + AdamW + zero_grad): after each configuration's two
  measured steps (step 1: the loss check below and the training state; step 2: the profiled
  forward), which are its 2 warm-up steps, interleaved rounds
  (benchmarks/common.time_interleaved: each step after a barrier, the slowest rank's time, the
  order rotated every round), at least 5; the median of each and the ratios to `tp+ddp`, of the
  medians and the median of the per-round ratios; beside it the CPU time of each step (process
  time, summed over the 4 ranks), which other work on a shared machine disturbs less.

Before anything is measured, the three modules' first losses on the same batches are checked to
agree (each data-parallel replica reads its own batch; the printed loss is their mean).

The script also checks that a module keeps no full-size tensor alive beside its shards once the
model is dropped (the plan keeps only shapes; this benchmark found the full copy it used to keep).

    python benchmarks/fsdp_memory.py            # 110M-parameter GPT, 4 x 64 tokens per replica (~9 min on 2 busy cores)
    python benchmarks/fsdp_memory.py --quick    # vocab 8192, hidden 256, 4 blocks (1-2 min)
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                                    # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))     # tests/models.py

import torch
import torch.distributed as dist

from benchmarks.common import (env_info, launch, print_table, step_peak_bytes, summarize,  # noqa: E402
                               time_interleaved, write_json)

TP, DP = 2, 2
CONFIGS = ("tp+ddp", "tp+fsdp2/block", "tp+fsdp2/root")
MB = 1e6


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors` (DTensors: their local tensor), each counted once."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _state(module, opt) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds."""
    params = list(module.parameters())
    moments = [v for st in opt.state.values() for v in st.values()]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params),
            "optim": _storage_bytes(moments)}


class ParamPeak:
    """Largest (resident parameter bytes + FSDP2's unsharded parameter bytes) seen at the forward
    hooks of the root and of every block; at the peak, which modules' parameters were unsharded."""

    def __init__(self, root, blocks: dict):
        from torch.distributed.fsdp import FSDPModule
        self.resident = _storage_bytes(root.parameters())
        self.groups = {}                                   # module name -> its FSDPParams
        for name, m in root.named_modules():
            if isinstance(m, FSDPModule):
                for g in m._get_fsdp_state()._fsdp_param_groups or ():
                    self.groups.setdefault(name or "(root)", []).extend(g.fsdp_params)
        self.peak, self.at_peak, self.where = 0, {}, None
        for name, m in [("(root)", root), *blocks.items()]:
            m.register_forward_pre_hook(lambda mod, args, name=name: self.sample(f"{name} pre"))
            m.register_forward_hook(lambda mod, args, out, name=name: self.sample(f"{name} post"), prepend=True)

    def gathered(self) -> dict:
        out = {}
        for name, fsdp_params in self.groups.items():
            n = sum(t.untyped_storage().nbytes() for fp in fsdp_params
                    for t in getattr(fp, "all_gather_outputs", ()) or ())
            if n:
                out[name] = n
        return out

    def sample(self, where: str) -> None:
        g = self.gathered()
        total = self.resident + sum(g.values())
        if total > self.peak:
            self.peak, self.at_peak, self.where = total, g, where

    def reset(self) -> None:
        self.peak, self.at_peak, self.where = 0, {}, None


def _captured_copy(gm) -> int:
    """Bytes of full-size tensors the module keeps alive beside its own (the plan's captured graph
    must hold only meta tensors of the model's weights: 0 expected)."""
    captured = gm._autoshard_plan.graph_module
    own = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
    kept, seen = 0, set()
    for t in [*captured.parameters(), *captured.buffers()]:
        ptr = t.untyped_storage().data_ptr() if not t.is_meta else None
        if ptr is None or ptr in own or ptr in seen:
            continue
        seen.add(ptr)
        kept += t.untyped_storage().nbytes()
    return kept


def _build(config: str, args, mesh, example):
    """A fresh GPT from seed 0, tensor-parallel over mesh['tp'], then DDP or FSDP2 over mesh['dp']."""
    import autoshard
    from models import GPT
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, h=args.hidden, heads=args.heads, blocks=args.blocks, seq=args.seq, tied=True)
    for m in model.modules():                      # GPT-2's initialisation (as docs/examples/train_gpt.py)
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)
    full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    gm = autoshard.parallelize(model, TP, example, group=mesh["tp"])
    del model
    kept = _captured_copy(gm)
    blocks = autoshard.blocks_of(gm)
    # a parameter tensor parallel leaves whole (LayerNorms, biases of row-parallel layers)
    local = {n: p.numel() * p.element_size() for n, p in gm.named_parameters()}
    replicated = sum(b for n, b in full.items() if local[n] == b)
    train = gm
    if config == "tp+ddp":
        autoshard.register_ddp_parameters_to_ignore(gm)
        train = DDP(gm, process_group=mesh["dp"].get_group())
    else:
        if config == "tp+fsdp2/block":
            for block in blocks.values():
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(gm, mesh=mesh["dp"])
    opt = torch.optim.AdamW(train.parameters(), lr=1e-4)
    block_bytes = {n: _storage_bytes(b.parameters()) for n, b in blocks.items()}   # this rank's, sharded
    return dict(gm=gm, train=train, opt=opt, blocks=blocks, peak=ParamPeak(gm, blocks),
                full=sum(full.values()), replicated=replicated, block_bytes=block_bytes, kept=kept)


def _rank(args):
    import autoshard
    autoshard.distributed.init_process_group(TP)
    mesh = autoshard.distributed.device_mesh()
    rank = dist.get_rank()
    d = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (DP, args.batch, args.seq + 1), generator=g)
    idx, targets = data[d, :, :-1].contiguous(), data[d, :, 1:].contiguous()    # this replica's batch

    runs, out = {}, {c: {} for c in CONFIGS}
    for config in CONFIGS:
        t0 = time.perf_counter()
        r = runs[config] = _build(config, args, mesh, (idx, targets))
        out[config]["build_s"] = time.perf_counter() - t0
        train, opt = r["train"], r["opt"]
        # step 1: the correctness guard's loss, then the training state after the AdamW step
        loss = train(idx, targets)
        loss.backward()
        opt.step()
        out[config]["loss1"] = loss.item()
        out[config]["state"] = _state(train, opt)
        opt.zero_grad(set_to_none=True)
        # step 2: the parameter peak of the forward (hooks) and the allocator's (profiler)
        r["peak"].reset()
        box = {}
        out[config]["fwd_alloc_peak"] = step_peak_bytes(lambda: box.setdefault("loss", train(idx, targets)))
        box.pop("loss").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        p = r["peak"]
        out[config].update(param_resident=p.resident, param_peak=p.peak, peak_where=p.where,
                           gathered_at_peak=p.at_peak, full=r["full"], replicated=r["replicated"],
                           block_bytes=r["block_bytes"], kept=r["kept"])
        gc.collect()
    losses = torch.tensor([[out[c]["loss1"] for c in CONFIGS]], dtype=torch.float64)
    dist.all_reduce(losses, group=mesh["dp"].get_group())
    for i, c in enumerate(CONFIGS):
        out[c]["loss1_mean"] = losses[0, i].item() / DP

    cpu = {c: [] for c in CONFIGS}                   # this process's CPU seconds of each timed step

    def step(c):
        r = runs[c]

        def run():
            t = time.process_time()
            loss = r["train"](idx, targets)
            loss.backward()
            r["opt"].step()
            r["opt"].zero_grad(set_to_none=True)
            cpu[c].append(time.process_time() - t)
        return run

    # the two steps above (the guard's, the profiled one) are each configuration's 2 warm-up steps
    times = time_interleaved({c: step(c) for c in CONFIGS}, warmup=0, rounds=args.rounds,
                             budget_s=args.budget, min_rounds=5)
    cpu_t = torch.tensor([cpu[c] for c in CONFIGS], dtype=torch.float64)
    dist.all_reduce(cpu_t)                           # summed over the 4 ranks
    cpu = {c: (cpu_t[i] * 1e3).tolist() for i, c in enumerate(CONFIGS)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": rank, **out})
    runs.clear()
    gc.collect()
    return {"ranks": rows, "times": times, "cpu": cpu} if rank == 0 else None


def _mb(n) -> float:
    return n / MB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="vocab 8192, hidden 256, 4 heads, 4 blocks, 2 x 32 tokens")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per data-parallel replica")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds at most (at least 5)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of timed rounds, after which they stop (>= 5 rounds)")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.heads, args.blocks, args.seq, args.batch = 8192, 256, 4, 4, 32, 2
    t0 = time.perf_counter()
    res = launch(_rank, TP * DP, args, timeout_s=1800, collective_timeout_s=600)
    rows, times, cpu = res["ranks"], res["times"], res["cpu"]

    r0 = rows[0]
    full = r0[CONFIGS[0]]["full"]
    replicated = r0[CONFIGS[0]]["replicated"]
    n_params = full // 4
    print(f"GPT vocab {args.vocab}, hidden {args.hidden}, {args.heads} heads, {args.blocks} blocks, tied, fp32: "
          f"{n_params / 1e6:.1f}M parameters ({_mb(full):.1f} MB; tensor parallel replicates {replicated / 1e3:.1f} kB of them); "
          f"tp {TP} x dp {DP}, gloo, 1 thread per rank; {args.batch} x {args.seq} tokens per replica")

    kept = max(r[c]["kept"] for r in rows for c in CONFIGS)
    print(f"full-size tensors a module keeps alive beside its shards once the model is dropped: {_mb(kept):.1f} MB "
          "per configuration per rank (0 expected)")

    # the correctness guard
    l1 = {c: r0[c]["loss1_mean"] for c in CONFIGS}
    spread = max(l1.values()) - min(l1.values())
    ok = spread <= 1e-5 * max(1.0, abs(l1[CONFIGS[0]]))
    print("step-1 loss (mean over replicas): " + ", ".join(f"{c} {v:.6f}" for c, v in l1.items())
          + f"; spread {spread:.2e} -> {'same' if ok else 'DIFFERENT'}")

    # training state per rank (max over ranks; every rank is printed in the JSON)
    ideal = 4 * full / (TP * DP)                     # params + grads + 2 moments of the full model, / 4
    with_norms = 4 * ((full - replicated) / (TP * DP) + replicated / DP)
    ddp_total = max(sum(r[CONFIGS[0]]["state"].values()) for r in rows)
    state_rows = []
    for c in CONFIGS:
        st = {k: max(r[c]["state"][k] for r in rows) for k in ("params", "grads", "optim")}
        total = max(sum(r[c]["state"].values()) for r in rows)
        state_rows.append([c, _mb(st["params"]), _mb(st["grads"]), _mb(st["optim"]), _mb(total),
                           total / ideal, total / with_norms, total / ddp_total])
    print_table(state_rows, ["config", "params MB", "grads MB", "AdamW MB", "total MB", "/ (full/4)",
                             "/ (full/4 + norms)", "/ tp+ddp"], floatfmt=(".1f",) * 5 + (".3f",) * 3,
                title=f"training state per rank after an AdamW step, max over ranks; full model's state "
                      f"{_mb(4 * full):.1f} MB, / 4 = {_mb(ideal):.1f} MB, + what tp replicates = {_mb(with_norms):.1f} MB")

    # forward parameter peak
    peak_rows = []
    for c in CONFIGS:
        worst = max(rows, key=lambda r: r[c]["param_peak"])
        x = worst[c]
        at = x["gathered_at_peak"]
        root_g = at.get("(root)", 0)
        block_g = sum(v for k, v in at.items() if k != "(root)")
        peak_rows.append([c, _mb(x["param_resident"]), _mb(x["param_peak"]),
                          _mb(x["param_peak"] - x["param_resident"]), _mb(root_g), _mb(block_g),
                          ", ".join(k for k in at if k != "(root)") or "-", x["peak_where"],
                          _mb(max(r[c]["fwd_alloc_peak"] for r in rows))])
    blk = max(max(r[CONFIGS[0]]["block_bytes"].values()) for r in rows)
    print_table(peak_rows, ["config", "resident params MB", "forward param peak MB", "gathered MB",
                            "of it root MB", "of it blocks MB", "blocks unsharded at peak", "peak at",
                            "allocator fwd peak rise MB"], floatfmt=".1f",
                title=f"parameters during one forward, the rank with the highest peak; one block's "
                      f"tensor-parallel shard (what FSDP2 gathers per block) {_mb(blk):.1f} MB")

    # step time
    med = {c: summarize(times[c])["median_ms"] for c in CONFIGS}
    cpu_med = {c: summarize(cpu[c])["median_ms"] for c in CONFIGS}
    time_rows = []
    for c in CONFIGS:
        s = summarize(times[c])
        paired = statistics.median(a / b for a, b in zip(times[c], times[CONFIGS[0]]))
        cpu_paired = statistics.median(a / b for a, b in zip(cpu[c], cpu[CONFIGS[0]]))
        time_rows.append([c, s["median_ms"], f"{s['p25_ms']:.0f}-{s['p75_ms']:.0f}", s["n"],
                          med[c] / med[CONFIGS[0]], paired, cpu_med[c], cpu_med[c] / cpu_med[CONFIGS[0]], cpu_paired])
    print_table(time_rows, ["config", "median step ms", "p25-p75", "rounds", "/ tp+ddp (medians)",
                            "/ tp+ddp (median paired)", "CPU ms (4 ranks)", "CPU / tp+ddp (medians)",
                            "CPU / tp+ddp (paired)"],
                floatfmt=(".0f", ".0f", "", "", ".3f", ".3f", ".0f", ".3f", ".3f"),
                title="step time (forward + backward + AdamW): wall, the slowest rank; CPU, the 4 ranks' process "
                      "time summed; interleaved rounds after 2 warm-up steps")
    ratio = med[CONFIGS[1]] / med[CONFIGS[0]]
    print(f"tp+fsdp2/block step time / tp+ddp = {ratio:.3f} (target <= 1.2) -> {'met' if ratio <= 1.2 else 'missed'}")
    name = "fsdp_memory" + ("_quick" if args.quick else "")
    path = write_json(name, {"env": env_info(), "config": vars(args), "ranks": rows, "times_ms": times,
                             "cpu_ms": cpu, "median_ms": med, "cpu_median_ms": cpu_med, "loss_check": l1})
    print(f"wrote {path.relative_to(Path(__file__).resolve().parent.parent)} in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
