#!/usr/bin/env python
"""Draw the plans pictured in the README and docs (docs/img/plan_*.png, and .svg with --svg).

    python benchmarks/draw_plans.py            # writes docs/img/plan_demo_gpt.png, plan_llama.png
    python benchmarks/draw_plans.py --svg      # the same pictures as SVG too

- plan_demo_gpt: the model of `python -m autoshard demo` (fused q/k/v, LM head tied to the token
  embedding, loss inside the model) with its default sizes and inputs, 2 ranks, symbolic_trace.
- plan_llama: a tiny Hugging Face LLaMA (tests/hf_models.llama: hidden 64, 4 query / 2 key-value
  heads, vocabulary 256) with 4 layers, 2 ranks, tracer="export".
Needs matplotlib (pip install -e ".[draw]") and, for LLaMA, transformers. Prints the seconds each
plan and picture took.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import autoshard  # noqa: E402


def demo_gpt():
    from autoshard.demo import GPT
    vocab, seq, batch = 1024, 32, 8                  # the demo's defaults
    model = GPT(vocab, 64, 4, 2, seq)
    tokens = torch.randint(vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), "symbolic_trace"


def llama():
    from hf_models import llama as build
    model, kwargs = build(num_hidden_layers=4)
    return model, kwargs, "export"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the pictures")
    ap.add_argument("--svg", action="store_true", help="write SVG files beside the PNGs")
    ap.add_argument("--world-size", "-n", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, build in (("plan_demo_gpt", demo_gpt), ("plan_llama", llama)):
        model, example, tracer = build()
        t0 = time.perf_counter()
        plan = autoshard.plan(model, args.world_size, example, tracer=tracer)
        t1 = time.perf_counter()
        for ext in ("png", "svg") if args.svg else ("png",):
            plan.draw(out / f"{name}.{ext}", title=f"autoshard plan: {type(model).__name__} "
                      f"({name.removeprefix('plan_')}), {plan.world_size} ranks, {plan.tracer}")
        t2 = time.perf_counter()
        print(f"{name}: plan {t1 - t0:.1f} s, draw {t2 - t1:.1f} s -> {out / name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
