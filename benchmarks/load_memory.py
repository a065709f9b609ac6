"""Peak memory and time of loading a Hugging Face checkpoint at tensor-parallel degree 4.

    python benchmarks/load_memory.py            # LLaMA-style ~1.03B parameters, 7B and 70B planning
    python benchmarks/load_memory.py --quick    # ~25M parameters, 7B planning only (~1-2 min)

1. A LLaMA-style model (hidden 2048, 20 layers, GQA 16/4 heads, vocab 32000: 1.03B parameters)
   is built in bf16 and written with `save_pretrained` in shards of 600 MB (its own process).
2. autoshard: 4 spawned ranks (gloo) each run `autoshard.from_pretrained(DIR, 4, dtype=float32)`
   (config -> meta model -> plan -> this rank's slices, converted to fp32).
3. Today's path: `AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)` then
   `autoshard.parallelize(model, 4, rank=r)`, one rank's process at a time (four full fp32
   copies at once would not fit this machine beside other work); each process does the same
   work as under a process group but the plan-digest exchange.
Per rank: peak RSS growth = VmHWM at the end (from /proc/self/status of the rank's own
process) minus VmRSS after the imports; the shard's bytes (parameters and buffers this rank
holds); the largest single tensor of the model in fp32; wall time of the load.
4. Meta planning of LLaMA-7B- and LLaMA-70B-sized configs at degree 8 (no weights anywhere):
   seconds end to end (config -> meta model -> export -> plan), search seconds, peak RSS.
Results: printed and written to benchmarks/results/load_memory.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import free_port, proc_status  # noqa: E402

FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
QUICK = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=16000, max_position_embeddings=2048)
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256)
WORLD, TOKENS = 4, 256


def _held_bytes(gm) -> int:
    seen, total = set(), 0
    for t in list(gm.parameters()) + list(gm.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _largest_fp32(directory) -> int:
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    best = 0
    for f in files:
        with safe_open(os.path.join(directory, f), framework="pt") as h:
            for k in h.keys():
                n = 1
                for s in h.get_slice(k).get_shape():
                    n *= s
                best = max(best, 4 * n)
    return best


def _write_model(directory, cfg, shard_size) -> None:
    import torch
    import transformers
    config = transformers.LlamaConfig(**cfg, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=shard_size)
    print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters (bf16) to "
          f"{len([f for f in os.listdir(directory) if f.endswith('.safetensors')])} shards", flush=True)


def _rank_ours(rank, world, port, directory, queue):
    import torch
    import torch.distributed as dist
    import autoshard
    import transformers  # noqa: F401 - imported before the baseline reading
    torch.set_num_threads(1)
    base = proc_status()["VmRSS"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t0 = time.perf_counter()
    gm = autoshard.from_pretrained(directory, world, dtype=torch.float32, tokens=TOKENS, progress=False)
    seconds = time.perf_counter() - t0
    st = proc_status()
    queue.put(dict(rank=rank, seconds=seconds, growth=st["VmHWM"] - base, shard=_held_bytes(gm)))
    del gm
    autoshard.distributed.destroy_process_group()


def _rank_today(rank, world, directory, queue):
    import torch
    import autoshard
    import transformers
    torch.set_num_threads(1)
    base = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.config.use_cache = False
    ids = {"input_ids": torch.zeros(1, TOKENS, dtype=torch.long)}
    gm = autoshard.parallelize(model, world, ids, rank=rank, tracer="export")
    seconds = time.perf_counter() - t0
    st = proc_status()
    queue.put(dict(rank=rank, seconds=seconds, growth=st["VmHWM"] - base, shard=_held_bytes(gm)))


def _plan_job(cfg, world, queue):
    import torch
    import transformers
    import autoshard
    from autoshard.io.loading import meta_model
    base = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    model = meta_model(transformers.LlamaConfig(**cfg, tie_word_embeddings=False))
    plan = autoshard.plan(model, world, {"input_ids": torch.zeros(1, 512, dtype=torch.long)}, tracer="export")
    seconds = time.perf_counter() - t0
    st = proc_status()
    queue.put(dict(seconds=seconds, search_seconds=plan.search_seconds, peak_rss=st["VmHWM"],
                   growth=st["VmHWM"] - base, params=plan.params_total))


def _spawn(ctx, target, args_list):
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, queue)) for a in args_list]
    for p in procs:
        p.start()
    out = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{target.__name__} exited with {p.exitcode}")
    return sorted(out, key=lambda r: r.get("rank", 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~25M-parameter model, 7B planning only")
    ap.add_argument("--dir", help="keep the checkpoint here (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    cfg = QUICK if args.quick else FULL
    directory = args.dir or tempfile.mkdtemp(prefix="load_memory_")
    results = dict(machine=f"{platform.machine()}, {os.cpu_count()} cores", world_size=WORLD, config=cfg,
                   quick=args.quick)
    try:
        if not os.path.isfile(os.path.join(directory, "model.safetensors.index.json")):
            p = ctx.Process(target=_write_model, args=(directory, cfg, "16MB" if args.quick else "600MB"))
            p.start()
            p.join()
        largest = _largest_fp32(directory)
        results["largest_tensor_fp32"] = largest
        ours = _spawn(ctx, _rank_ours, [(r, WORLD, port, directory) for port in [free_port()] for r in range(WORLD)])
        today = []
        for r in range(WORLD):                        # one full fp32 model at a time
            today += _spawn(ctx, _rank_today, [(r, WORLD, directory)])
        results["autoshard"], results["today"] = ours, today
        print(f"\nLLaMA-style model {cfg}, loaded as fp32 at world size {WORLD}; largest tensor "
              f"{largest / 2 ** 20:.0f} MiB (fp32)")
        print(f"{'path':<44}{'rank':>5}{'shard MiB':>11}{'peak RSS growth MiB':>21}{'bound MiB':>11}{'ratio':>7}{'load s':>9}")
        for label, rows in (("autoshard.from_pretrained (4 ranks at once)", ours),
                            ("HF from_pretrained + parallelize (1 at a time)", today)):
            for row in rows:
                bound = 1.3 * row["shard"] + largest
                row["bound"] = bound
                print(f"{label:<44}{row['rank']:>5}{row['shard'] / 2 ** 20:>11.0f}{row['growth'] / 2 ** 20:>21.0f}"
                      f"{bound / 2 ** 20:>11.0f}{row['growth'] / bound:>7.2f}{row['seconds']:>9.1f}")
        ok = all(r["growth"] <= r["bound"] for r in ours)
        print(f"autoshard within 1.3 x shard + largest tensor on every rank: {ok}")
        results["within_bound"] = ok
        plans = {}
        for name, c in (("llama-7b", LLAMA_7B),) + ((("llama-70b", LLAMA_70B),) if not args.quick else ()):
            plans[name] = _spawn(ctx, _plan_job, [(c, 8)])[0]
            r = plans[name]
            print(f"meta planning {name} ({r['params'] / 1e9:.1f}B) at degree 8: {r['seconds']:.1f} s end to end, "
                  f"search {r['search_seconds']:.2f} s, peak RSS {r['peak_rss'] / 2 ** 30:.2f} GiB")
        results["planning"] = plans
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "load_memory" + ("_quick" if args.quick else "") + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
