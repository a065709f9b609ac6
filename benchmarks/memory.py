#!/usr/bin/env python
"""Predicted against measured memory of a training step per rank (`plan.memory`, autoshard.planner.memory).

For a GPT (tests/models.py: vocab 1024, hidden 128, 4 heads, 4 blocks), a Hugging Face LLaMA and
a BERT (tests/hf_models.py: hidden 64, 2 layers, vocab 256) at 1 x T tokens, T in 512..4096, on 2
and 4 gloo ranks (CPU, one thread each): each rank plans, parallelizes and runs one AdamW step
under PyTorch's MemTracker (torch.distributed._tools.mem_tracker; the steady state: a first step,
outside the tracker, makes the optimizer state, gradients are set to None before each step). Per
configuration: the predicted peak and the measured one (the largest rank of each), their ratio,
the predicted activations per rank against one process's (the same model planned at world 1) / p,
and where the predicted peak occurs. One process is measured too (world 1: autoshard's module of
the captured graph, and the model's own eager step beside it).

    python benchmarks/memory.py            # T = 512 and 2048 (a few minutes on 2 cores)
    python benchmarks/memory.py --full     # T = 512, 1024, 2048, 4096
    python benchmarks/memory.py --sequence-parallel both --tokens 512 1024   # each plan also with
                                           # sequence parallelism (`sequence_parallel=True`)
    python benchmarks/memory.py --outputs sharded   # the module returns what each rank holds (the
                                           # logits split over the vocabulary, the loss vocab-parallel)
    python benchmarks/memory.py --autocast bf16     # planned and stepped under torch.autocast("cpu",
                                           # bfloat16), fp32 weights (the Trainer's bf16=True)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):                                    # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))     # models.py, hf_models.py, refs.py

import torch  # noqa: E402

from benchmarks.common import launch, note_load, print_table, write_json  # noqa: E402

MODELS = ("gpt", "llama", "bert")
AUTOCAST = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def recipe(autocast: str):
    """The precision recipe a step is planned and run under: torch.autocast on CPU, or none."""
    dtype = AUTOCAST[autocast]
    return torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None)


def under(autocast: str, loss_of):
    def run(m):
        with recipe(autocast):
            return loss_of(m)
    return run


def build(name: str, tokens: int):
    """(model, example inputs, loss_of(module)) of `name` at 1 x `tokens`."""
    if name == "gpt":
        from models import GPT
        torch.manual_seed(0)
        model = GPT(vocab=1024, h=128, heads=4, blocks=4, seq=tokens)
        idx = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(1))
        return model, (idx, idx.roll(1, 1)), lambda m: m(idx, idx.roll(1, 1))
    import hf_models
    model, kw = getattr(hf_models, name)(batch=1, seq=tokens, max_position_embeddings=tokens)
    return model, kw, lambda m: m(**kw).loss


def measure(name: str, tokens: int, sequence_parallel: bool = False, outputs: str = "full", autocast: str = "off"):
    """On every rank: (predicted memory, measured peak, measured parts), gathered to rank 0."""
    import torch.distributed as dist

    import autoshard
    import refs
    p = dist.get_world_size()
    model, example, loss_of = build(name, tokens)
    loss_of = under(autocast, loss_of)
    with recipe(autocast):
        plan = autoshard.plan(model, p, example, sequence_parallel=sequence_parallel, outputs=outputs)
    assert bool(plan.sequence_parallel) == sequence_parallel, (name, plan.sequence_parallel)
    gm = autoshard.parallelize(model, p, example, plan=plan)
    gm.train()
    peak, parts = refs.measured_step_peak(gm, loss_of)
    out = [None] * p
    dist.all_gather_object(out, (dict(plan.memory), plan.memory.peak_at, peak, parts))
    return out


def single(name: str, tokens: int, autocast: str = "off"):
    """One process: the plan's memory at world 1, MemTracker's peak of its module's step (the
    captured graph) and of the model's own step."""
    import autoshard
    import refs
    model, example, loss_of = build(name, tokens)
    loss_of = under(autocast, loss_of)
    with recipe(autocast):
        plan = autoshard.plan(model, 1, example)
    gm = autoshard.parallelize(model, 1, example, plan=plan)
    gm.train()
    peak, _ = refs.measured_step_peak(gm, loss_of)
    model.train()
    own, _ = refs.measured_step_peak(model, loss_of)
    return dict(plan.memory), plan.memory.peak_at, peak, own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="T = 512, 1024, 2048, 4096 (default 512 and 2048)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--tokens", nargs="+", type=int, help="sequence lengths (overrides --full)")
    ap.add_argument("--sequence-parallel", choices=("off", "on", "both"), default="off",
                    help="plan without sequence parallelism (default), with it, or both")
    ap.add_argument("--outputs", choices=("full", "sharded"), default="full",
                    help="the module returns its outputs whole (default: the logits gathered, B x T x vocab "
                         "on every rank) or as each rank holds them (outputs='sharded')")
    ap.add_argument("--autocast", choices=tuple(AUTOCAST), default="off",
                    help="plan and step under torch.autocast('cpu', bfloat16 / float16), fp32 weights")
    args = ap.parse_args(argv)
    load = note_load()
    sizes = args.tokens or ((512, 1024, 2048, 4096) if args.full else (512, 2048))
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.sequence_parallel]
    rows, records = [], []
    for name in args.models:
        for tokens in sizes:
            one, one_at, one_measured, own = single(name, tokens, args.autocast)
            rows.append([name, tokens, 1, "", one["peak"] / 2 ** 20, one_measured / 2 ** 20, one["peak"] / one_measured,
                         one["activations"] / 2 ** 20, 1.0, one_at, own / 2 ** 20])
            for p in args.worlds:
                for sp in modes:
                    ranks = launch(measure, p, name, tokens, sp, args.outputs, args.autocast, timeout_s=1200)
                    mem, at, measured, parts = max(ranks, key=lambda r: r[2])
                    predicted = max(r[0]["peak"] for r in ranks)
                    share = mem["activations"] / (one["activations"] / p)
                    rows.append([name, tokens, p, "yes" if sp else "no", predicted / 2 ** 20, measured / 2 ** 20,
                                 predicted / measured, mem["activations"] / 2 ** 20, share, at, ""])
                    records.append(dict(model=name, tokens=tokens, world=p, sequence_parallel=sp, outputs=args.outputs,
                                        autocast=args.autocast,
                                        predicted=mem,
                                        peak_at=at, measured_peak=measured, measured_parts=parts, single=one,
                                        single_measured_peak=one_measured, model_measured_peak=own))
    print_table(rows, ["model", "tokens", "ranks", "seq. parallel", "predicted peak MiB", "measured MiB", "pred/meas",
                       "activations/rank MiB", "act / (one process / p)", "predicted peak at",
                       "model's own step MiB"],
                title=f"memory of one AdamW step per rank (MemTracker, gloo CPU ranks, outputs={args.outputs!r}, "
                      f"autocast={args.autocast!r})", floatfmt=".3f")
    ratios = [r[6] for r in rows]
    print(f"\npred/meas: min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} configurations")
    write_json("memory", dict(load_before=load, rows=records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
