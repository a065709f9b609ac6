"""Decode speed, bytes and cache memory of `gm.generate` (autoshard.io.generate) against one process.

A LLaMA whose weights dominate a decode step (hidden 1024, 4 layers, 16 query / 8 K/V heads,
vocabulary 8192: 63 M parameters, fp32), greedy, batch 1, a prompt of 32 tokens. Every rank (and
the one-process baseline: Hugging Face's own `model.generate`) runs one thread. Per world size:

- prefill: the median time of `generate(max_new_tokens=1)`;
- decode tokens/s: 31 over the median of (time of 32 new tokens - time of 1), the time of a
  call being the maximum over ranks (each timed call starts after a barrier);
- bytes per decode token: counted (autoshard.runtime.collectives.count_comm, ring bytes a rank
  sends) over one decode step, and predicted from that step's plan (its forward collectives);
- cache bytes per rank after 32 new tokens, against one process's;
- CPU ms a decode token: rank 0's main-thread CPU time (time.thread_time) of the same difference
  over 31: what the step costs the rank, whatever the machine's load (the wall time waits on
  the other ranks and the scheduler; with shared-memory collectives, autoshard.runtime.shm, it
  includes their spinning wait);
- how many of the decode step's collectives ran through shared memory (off by default: gloo;
  `AUTOSHARD_SHM=1` in the environment opts in: the comparison of the two transports).

The module is planned with a fine-tuning batch (`--example train`: 4 x 256 tokens with labels),
whose layouts then serve generation; `--example prompt` plans with the prompt itself (32 tokens;
at a fixed price of state its norms' weights were sharded and the decode step gathered each
norm's output: under the default objective its decode step is Megatron's too).

With `--cache static`, both sides generate with `cache_implementation="static"` (HF's StaticCache;
at world > 1 each rank's buffers hold its own K/V heads); with `--compile` too, the decode step
is compiled (the parallel module: `gm.generate(..., compile=True)`; one process: HF's own
compiled forward, its `CompileConfig` allowed on the CPU). Compiling happens in the warm-up
generate, outside the timed calls.

With `--ceiling`, the machine's own limit: one process's matrix-vector product over a matrix of
the model's parameter count against the slowest of `world` processes over 1/world of it each, at
once (a decode step reads every weight once, so it is memory-bound on CPU; where the cores share
the memory bandwidth, this ratio, not the plan, caps the decode speed-up).

With `--transports` (world 2 only), one launch times one process's generate (rank 0 alone), the
module over gloo (the default) and the module over shared memory (autoshard.runtime.shm),
in interleaved rounds, so that the three see the same load (a shared machine's load moves
between launches). Measured so far, the one process ran slower inside that launch than in its
own (66-72 against 50-56 ms of CPU a token, the 214 M model; cause not found): compare its two
world-2 variants with each other, and one process in its own launch.

Usage: python benchmarks/generate.py [--worlds 1 2 4] [--rounds 5] [--example train|prompt] [--ceiling]
       [--cache dynamic|static] [--compile] [--transports] [--wide] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import launch, note_load  # noqa: E402

CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
              num_hidden_layers=4, vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=False,
              use_cache=True, attention_dropout=0.0)
# --wide (set in the environment, so that the spawned ranks read it too): hidden 2048, 32 query / 8 K/V
# heads, 214 M parameters (0.86 GB fp32), where the weights' reads outweigh a step's 10 collectives
WIDE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8)
if os.environ.get("AUTOSHARD_GENERATE_WIDE") == "1":
    CONFIG.update(WIDE)
PROMPT, NEW = 32, 32


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**CONFIG), attn_implementation="sdpa").float().eval()
    return model


def _prompt():
    return torch.randint(0, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))


def _timed(fn, world: int) -> float:
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _example(kind: str, ids) -> dict:
    """What the module is planned with: "train", a fine-tuning batch (4 x 256 tokens with labels,
    the shards then train and generate); "prompt", the prompt itself."""
    if kind == "prompt":
        return {"input_ids": ids}
    batch = torch.randint(0, CONFIG["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(2))
    return {"input_ids": batch, "labels": batch}


def _options(world: int, cache: str, compiled: bool) -> dict:
    """generate's options: greedy, the cache, and the decode step compiled (`compiled`)."""
    opts = dict(do_sample=False, use_cache=True, pad_token_id=0)
    if cache == "static":
        opts["cache_implementation"] = "static"
    if compiled and world > 1:
        opts["compile"] = True
    elif compiled:
        from transformers import CompileConfig
        config = CompileConfig()
        config._compile_all_devices = True                 # HF compiles on accelerators only unless told
        opts["compile_config"] = config
    return opts


def _run(world: int, rounds: int, example: str = "train", cache: str = "dynamic", compiled: bool = False) -> dict:
    import autoshard
    from autoshard.runtime.collectives import count_comm
    from autoshard.runtime.counters import ring_bytes, split_kind
    model = _model()
    ids = _prompt()
    opts = _options(world, cache, compiled)
    if world == 1:
        gen = model
    else:
        gen = autoshard.parallelize(model, world, _example(example, ids), tracer="export")
        gen.eval()
    with torch.no_grad():
        full = gen.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, return_dict_in_generate=True, **opts)
        one, many, cpu = [], [], []
        for _ in range(rounds):
            c0 = time.thread_time()
            one.append(_timed(lambda: gen.generate(ids, max_new_tokens=1, **opts), world))
            c1 = time.thread_time()
            many.append(_timed(lambda: gen.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **opts), world))
            cpu.append((time.thread_time() - c1) - (c1 - c0))
    kv = getattr(full, "cache", None) or full.past_key_values
    out = {"world": world, "prefill_s": statistics.median(one),
           "decode_tokens_per_s": (NEW - 1) / (statistics.median(many) - statistics.median(one)),
           "cache_bytes_per_rank": _cache_bytes(kv), "tokens": full.sequences[0, -8:].tolist(),
           "decode_cpu_ms_per_token": statistics.median(cpu) / (NEW - 1) * 1e3}
    if world > 1:
        adapter = gen.__dict__["_autoshard_generator"]
        sig = gen._autoshard_signatures
        name = "generate.static" if cache == "static" else "generate.step"
        key = next(k for k in sig.served if len(k) == 4 and k[3] == name and dict(k[1]).get("keys") != ("tuple", ()))
        plan = sig.plans[key]
        last = full.sequences[:, -1:]
        if cache == "static":                  # the static cache is full: the last decode step again
            last = full.sequences[:, -2:-1]
            for layer in kv.layers:
                layer.crop(-1)
        at = torch.tensor([[full.sequences.size(1) - (2 if cache == "static" else 1)]])
        from autoshard.runtime import shm
        before = shm.served(dist.group.WORLD)
        with torch.no_grad(), count_comm() as c:
            adapter(input_ids=last, position_ids=at, use_cache=True, **{adapter._cache_name: kv})
        out["decode_shm_calls"] = shm.served(dist.group.WORLD) - before     # of c.calls (0 with AUTOSHARD_SHM=0)
        out["decode_bytes_counted"] = c.bytes
        out["decode_bytes_predicted"] = sum(ring_bytes(k, r.nbytes, world) for r in plan.redistributions
                                            for k in r.forward) + \
            sum(ring_bytes(k, nb, world) for d in plan.nodes.values() for k, nb in d.comm
                if split_kind(k)[0] == "all_gather")        # a node's own forward all-gathers (K/V heads)
        out["decode_by_kind"] = {k: list(v) for k, v in c.by_kind.items()}
        h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
        layers = CONFIG["num_hidden_layers"]
        out["megatron_bytes"] = (2 * layers + 1) * ring_bytes("all_reduce", h * 4, world) + \
            ring_bytes("all_gather", v * 4, world)
    return out


def _transports(rounds: int, cache: str = "dynamic", compiled: bool = False) -> dict:
    """At world 2, in one launch so that every variant sees the same load: one process's generate
    (rank 0 alone, rank 1 waiting), and the parallel module over a gloo group (set up with
    AUTOSHARD_SHM=0) and over a shared-memory group, built once each, in interleaved rounds (the
    order rotated each round). Per variant: prefill and decode as in `_run`, rank 0's CPU a token."""
    import autoshard
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import raw_all_reduce
    model, ids = _model(), _prompt()
    gens = {"one": model}
    for name, on in (("gloo", False), ("shm", True)):
        os.environ["AUTOSHARD_SHM"] = "1" if on else "0"
        group = dist.new_group([0, 1])
        raw_all_reduce(torch.zeros(2), group)                     # its setup reads the variable
        if bool(shm.served(group)) != on:
            raise RuntimeError(f"the {name} group did not take that transport")
        gens[name] = autoshard.parallelize(model, 2, _example("train", ids), tracer="export", group=group).eval()
    times = {n: ([], [], []) for n in gens}
    with torch.no_grad():
        for r in range(rounds + 1):                               # round 0 warms up (and compiles)
            names = list(gens)[r % 3:] + list(gens)[:r % 3]
            for name in names:
                opts = _options(1 if name == "one" else 2, cache, compiled)
                alone = name == "one" and dist.get_rank() != 0
                run = (lambda *a, **kw: None) if alone else gens[name].generate
                c0 = time.thread_time()
                t1 = _timed(lambda: run(ids, max_new_tokens=1, **opts), 2)
                c1 = time.thread_time()
                tn = _timed(lambda: run(ids, max_new_tokens=NEW, min_new_tokens=NEW, **opts), 2)
                if r:
                    times[name][0].append(t1)
                    times[name][1].append(tn)
                    times[name][2].append((time.thread_time() - c1) - (c1 - c0))
    return {n: {"prefill_s": statistics.median(one), "decode_tokens_per_s": (NEW - 1) / (statistics.median(many) -
                                                                                       statistics.median(one)),
                "decode_cpu_ms_per_token": statistics.median(cpu) / (NEW - 1) * 1e3}
            for n, (one, many, cpu) in times.items()}


def _matvec(rows: int, ready, out) -> None:
    """One process's median time (ms) of a 1 x 1024 by 1024 x `rows` product, the others started
    alike at once (`ready`: a barrier)."""
    torch.set_num_threads(1)
    w, x = torch.randn(rows, 1024), torch.randn(1, 1024)
    for _ in range(3):
        x @ w.t()
    ready.wait()
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        x @ w.t()
        times.append(time.perf_counter() - t0)
    out.put(statistics.median(times) * 1e3)


def ceiling(world: int) -> float:
    """What the machine allows a decode step split over `world` processes: one process's time over
    a matrix of the model's parameter count against the slowest of `world` processes over 1/world
    of it each, at once (a decode step reads every weight once: memory-bound on CPU, so where
    the cores share the memory bandwidth, splitting the weights does not split the time)."""
    ctx = torch.multiprocessing.get_context("spawn")
    rows = sum(p.numel() for p in _model().parameters()) // 1024

    def run(n, r):
        ready, out = ctx.Barrier(n), ctx.SimpleQueue()
        procs = [ctx.Process(target=_matvec, args=(r, ready, out)) for _ in range(n)]
        for q in procs:
            q.start()
        times = [out.get() for _ in procs]
        for q in procs:
            q.join()
        return max(times)
    return run(1, rows) / run(world, rows // world)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--ceiling", action="store_true",
                    help="also time the weights' matrix-vector product in 1 and in `world` processes at once")
    ap.add_argument("--example", choices=("train", "prompt"), default="train",
                    help="plan with a fine-tuning batch (4 x 256 tokens, labels) or with the prompt itself")
    ap.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                    help="generate's cache: HF's DynamicCache (default) or cache_implementation=\"static\"")
    ap.add_argument("--compile", action="store_true", help="compile the decode step (with --cache static)")
    ap.add_argument("--transports", action="store_true",
                    help="world 2 only: one process, the module over gloo and over shared memory, in one launch")
    ap.add_argument("--wide", action="store_true",
                    help="a wider LLaMA (hidden 2048, 32 / 8 heads: 214 M parameters) whose weights dominate a step")
    args = ap.parse_args()
    if args.wide:
        os.environ["AUTOSHARD_GENERATE_WIDE"] = "1"
        CONFIG.update(WIDE)
    if args.compile and args.cache != "static":
        ap.error("--compile compiles the static cache's decode step: add --cache static")
    load = note_load()
    if args.transports:
        res = launch(_transports, 2, args.rounds, args.cache, args.compile, timeout_s=3600)
        print(f"{'variant':>7} {'prefill ms':>10} {'decode tok/s':>12} {'x 1 proc':>8} {'cpu ms/token':>12}")
        for name, r in res.items():
            print(f"{name:>7} {r['prefill_s'] * 1e3:>10.1f} {r['decode_tokens_per_s']:>12.1f} "
                  f"{r['decode_tokens_per_s'] / res['one']['decode_tokens_per_s']:>8.2f} "
                  f"{r['decode_cpu_ms_per_token']:>12.1f}")
        print(f"world 2 against one process, interleaved in one launch; {args.cache} cache"
              f"{', decode step compiled' if args.compile else ''}; hidden {CONFIG['hidden_size']}; 1-minute load "
              f"average {load:.2f} before the run, {os.getloadavg()[0]:.2f} after it")
        if args.json:
            Path(args.json).write_text(json.dumps({"config": CONFIG, "transports": res, "load": load}, indent=1))
        return
    results = [launch(_run, w, w, args.rounds, args.example, args.cache, args.compile, timeout_s=1800)
               for w in args.worlds]
    after = os.getloadavg()[0]
    base = next((r for r in results if r["world"] == 1), None)
    print(f"{'world':>5} {'prefill ms':>10} {'decode tok/s':>12} {'x 1 proc':>8} {'cache/rank':>11} "
          f"{'x 1 proc':>8} {'bytes/token counted':>20} {'predicted':>10} {'Megatron':>9} {'cpu ms/token':>12}")
    for r in results:
        speed = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else float("nan")
        mem = r["cache_bytes_per_rank"] / base["cache_bytes_per_rank"] if base else float("nan")
        print(f"{r['world']:>5} {r['prefill_s'] * 1e3:>10.1f} {r['decode_tokens_per_s']:>12.1f} {speed:>8.2f} "
              f"{r['cache_bytes_per_rank']:>11} {mem:>8.3f} {r.get('decode_bytes_counted', 0):>20.0f} "
              f"{r.get('decode_bytes_predicted', 0):>10.0f} {r.get('megatron_bytes', 0):>9.0f} "
              f"{r['decode_cpu_ms_per_token']:>12.1f}")
    for r in results:
        if "decode_by_kind" in r:
            print(f"world {r['world']}: collectives of one decode step (calls, bytes): {r['decode_by_kind']}; "
                  f"through shared memory: {r['decode_shm_calls']} (AUTOSHARD_SHM="
                  f"{os.environ.get('AUTOSHARD_SHM', 'unset')})")
    if args.ceiling:
        for w in args.worlds:
            if w > 1:
                print(f"ceiling at world {w}: one process's matrix-vector product over the weights / the slowest "
                      f"of {w} processes' over 1/{w} of them at once = {ceiling(w):.2f}")
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"the same tokens at every world size: {same}; planned with the {args.example!r} example; "
          f"{args.cache} cache{', decode step compiled' if args.compile else ''}; "
          f"hidden {CONFIG['hidden_size']}; "
          f"1-minute load average {load:.2f} before the run, {after:.2f} after it")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": CONFIG, "results": results, "load": load, "load_after": after,
                                               "example": args.example, "cache": args.cache,
                                               "compile": args.compile}, indent=1))


if __name__ == "__main__":
    main()
