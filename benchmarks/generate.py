"""Decode speed, bytes and cache memory of `gm.generate` (autoshard.io.generate) against one process.

A LLaMA whose weights dominate a decode step (hidden 1024, 4 layers, 16 query / 8 K/V heads,
vocabulary 8192: 63 M parameters, fp32), greedy, batch 1, a prompt of 32 tokens. Every rank (and
the one-process baseline: Hugging Face's own `model.generate`) runs one thread. Per world size:

- prefill: the median time of `generate(max_new_tokens=1)`;
- decode tokens/s: 31 over the median of (time of 32 new tokens - time of 1), the time of a
  call being the maximum over ranks (each timed call starts after a barrier);
- bytes per decode token: counted (autoshard.runtime.collectives.count_comm, ring bytes a rank
  sends) over one decode step, and predicted from that step's plan (its forward collectives);
- cache bytes per rank after 32 new tokens, against one process's.

Usage: python benchmarks/generate.py [--worlds 1 2 4] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
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


def _run(world: int, rounds: int) -> dict:
    import autoshard
    from autoshard.runtime.collectives import count_comm
    from autoshard.runtime.counters import ring_bytes, split_kind
    model = _model()
    ids = _prompt()
    opts = dict(do_sample=False, use_cache=True, pad_token_id=0)
    if world == 1:
        gen = model
    else:
        gen = autoshard.parallelize(model, world, {"input_ids": ids}, tracer="export")
        gen.eval()
    with torch.no_grad():
        full = gen.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, return_dict_in_generate=True, **opts)
        one, many = [], []
        for _ in range(rounds):
            one.append(_timed(lambda: gen.generate(ids, max_new_tokens=1, **opts), world))
            many.append(_timed(lambda: gen.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **opts), world))
    cache = getattr(full, "cache", None) or full.past_key_values
    out = {"world": world, "prefill_s": statistics.median(one),
           "decode_tokens_per_s": (NEW - 1) / (statistics.median(many) - statistics.median(one)),
           "cache_bytes_per_rank": _cache_bytes(cache), "tokens": full.sequences[0, -8:].tolist()}
    if world > 1:
        adapter = gen.__dict__["_autoshard_generator"]
        sig = gen._autoshard_signatures
        key = next(k for k in sig.served if len(k) == 4 and dict(k[1]).get("keys") != ("tuple", ()))
        plan = sig.plans[key]
        with torch.no_grad(), count_comm() as c:
            adapter(input_ids=full.sequences[:, -1:], use_cache=True, **{adapter._cache_name: cache})
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    load = note_load()
    results = [launch(_run, w, w, args.rounds, timeout_s=1800) for w in args.worlds]
    base = next((r for r in results if r["world"] == 1), None)
    print(f"{'world':>5} {'prefill ms':>10} {'decode tok/s':>12} {'x 1 proc':>8} {'cache/rank':>11} "
          f"{'x 1 proc':>8} {'bytes/token counted':>20} {'predicted':>10} {'Megatron':>9}")
    for r in results:
        speed = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base else float("nan")
        mem = r["cache_bytes_per_rank"] / base["cache_bytes_per_rank"] if base else float("nan")
        print(f"{r['world']:>5} {r['prefill_s'] * 1e3:>10.1f} {r['decode_tokens_per_s']:>12.1f} {speed:>8.2f} "
              f"{r['cache_bytes_per_rank']:>11} {mem:>8.3f} {r.get('decode_bytes_counted', 0):>20.0f} "
              f"{r.get('decode_bytes_predicted', 0):>10.0f} {r.get('megatron_bytes', 0):>9.0f}")
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    print(f"the same tokens at every world size: {same}; load before the run {load:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": CONFIG, "results": results, "load": load}, indent=1))


if __name__ == "__main__":
    main()
