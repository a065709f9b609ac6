#!/usr/bin/env python
"""autoshard.estimate and autoshard.advise against published training runs (docs/benchmarks.md, section 16).

    python benchmarks/advise.py             # Korthikanti's table, the runs kept aside, advise, LLaMA-3-70B on 64 H100
    python benchmarks/advise.py --quick     # the 22B row and the LLaMA-3-70B search only

1. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): Table 5
   (iteration seconds, full recomputation and SP + selective recomputation) and Figure 1 (GiB a GPU:
   parameters with optimizer state; activations without recomputation and with SP + selective), GPT
   models on A100-80GB, fp16, DP 1 (tests/test_advise.py KORTHIKANTI). Each row: the published layout
   estimated (`autoshard.estimate`, the model built by `autoshard.io.configs.config_of`), and
   `autoshard.advise` over the same GPUs, batch and sequence: its best layout's predicted time beside
   the published layout's, its memory, and the search's wall seconds.
2. Kept aside (never looked at while the efficiency model was written): torchtitan's published
   Llama 2 / Llama 3 numbers on 64 A100-80GB with FSDP2 (docs/performance.md of pytorch/torchtitan,
   "Llama 3 performance numbers" and "Llama 2 performance numbers": tokens/s a GPU and MFU, local
   batch 1 or 2, sequence 8192 / 4096, activation checkpointing as listed; torchtitan's "selective
   op" checkpointing is taken as autoshard's "selective"; eager PyTorch, `fused=False`: torchtitan's
   configurations then left torch.compile off). Predicted tokens/s a GPU against published.
3. `advise` for the LLaMA-3-70B configuration on 64 H100-SXM, global batch 128 of 8192 tokens, timed.

Wall seconds include planning the model's layer once per tensor-parallel degree and sequence
parallelism (on meta, one process); the machine is shared, so they are an upper bound.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import autoshard  # noqa: E402
from autoshard import Cluster, Layout  # noqa: E402
from common import env_info  # noqa: E402
from test_advise import KORTHIKANTI, korthikanti_estimates  # noqa: E402

GiB = 2 ** 30
RESULTS = ROOT / "benchmarks" / "results"
# torchtitan docs/performance.md: (model, local batch, sequence, checkpointing, tokens/s a GPU, MFU)
TORCHTITAN = [("llama3-8b", 1, 8192, "selective", 2973, 0.582), ("llama3-70b", 1, 8192, "full", 331, 0.517),
              ("llama2-13b", 2, 4096, "none", 2162, 0.611), ("llama2-13b", 2, 4096, "selective", 1904, 0.538),
              ("llama2-70b", 2, 4096, "full", 353, 0.505)]


def korthikanti(rows, log) -> list:
    out = []
    for row in rows:
        name, tp, pp, gb, mb, v, full, sel, state, act_none, act_sel = row
        c = Cluster(gpus=tp * pp, gpu="A100-80GB")
        t0 = time.perf_counter()
        f, s, n, held = korthikanti_estimates(row)
        t1 = time.perf_counter()
        best = autoshard.advise(name, c, global_batch=gb, seq_len=2048, top=1)[0]
        t2 = time.perf_counter()
        rec = {"model": name, "layout": f"tp {tp} pp {pp}" + (f" v {v}" if v > 1 else ""), "gpus": tp * pp,
               "full_published": full, "full_predicted": f.step_time, "full_error": f.step_time / full - 1,
               "sel_published": sel, "sel_predicted": s.step_time, "sel_error": s.step_time / sel - 1,
               "state_published": state, "state_predicted": held, "state_error": held / state - 1,
               "act_none_published": act_none, "act_none_predicted": n.parts["activations"] / GiB,
               "act_none_error": n.parts["activations"] / GiB / act_none - 1,
               "act_sel_published": act_sel, "act_sel_predicted": s.parts["activations"] / GiB,
               "act_sel_error": s.parts["activations"] / GiB / act_sel - 1,
               "mfu_sel": s.mfu, "breakdown_sel": dict(s.breakdown), "estimate_seconds": t1 - t0,
               "advise": best.layout.short(), "advise_time": best.step_time, "advise_memory_gib": best.memory / GiB,
               "advise_vs_published": best.step_time / s.step_time, "advise_seconds": t2 - t1}
        log(json.dumps({k: (round(x, 4) if isinstance(x, float) else x) for k, x in rec.items()}))
        out.append(rec)
    return out


def torchtitan(log) -> list:
    out = []
    for name, b, seq, rc, wps, mfu in TORCHTITAN:
        c = Cluster(gpus=64, gpu="A100-80GB")
        e = autoshard.estimate(name, c, Layout(dp=64, microbatch=b, recompute=rc, fsdp=True), global_batch=64 * b,
                               seq_len=seq, fused=False)
        row = {"model": name, "batch": b, "seq": seq, "recompute": rc, "wps_published": wps,
               "wps_predicted": e.tokens_per_s_per_gpu, "error": e.tokens_per_s_per_gpu / wps - 1,
               "mfu_published": mfu, "mfu_predicted": e.mfu, "memory_gib": e.memory / GiB, "fits": e.fits,
               "breakdown": dict(e.breakdown)}
        log(json.dumps({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()}))
        out.append(row)
    return out


def llama70b(log) -> dict:
    t0 = time.perf_counter()
    best = autoshard.advise("llama3-70b", Cluster(gpus=64, gpu="H100-SXM"), global_batch=128, seq_len=8192, top=5)
    seconds = time.perf_counter() - t0
    rows = [e.row() for e in best]
    log(f"advise llama3-70b on 64 H100-SXM: {seconds:.1f} s; best {best[0].layout.short()} {best[0].step_time:.2f} s")
    return {"seconds": seconds, "top": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    log = print
    out = {"env": env_info()}
    out["llama3_70b"] = llama70b(log)          # first: the search time of a fresh process
    out["korthikanti"] = korthikanti(KORTHIKANTI[:1] if args.quick else KORTHIKANTI, log)
    if not args.quick:
        out["torchtitan"] = torchtitan(log)
    errors = [abs(r[k]) for r in out["korthikanti"] for k in ("full_error", "sel_error")]
    out["korthikanti_time_error"] = {"mean": sum(errors) / len(errors), "max": max(errors)}
    log(json.dumps(out["korthikanti_time_error"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("advise_quick.json" if args.quick else "advise.json")).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
