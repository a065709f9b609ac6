#!/usr/bin/env python
"""The cost of `dropout_masks="single_process"` against the default independent masks.

A Hugging Face GPT-2 config with dropout 0.1 everywhere (embeddings, residuals, attention) is
parallelized twice in one run at world 2 (gloo, CPU, one thread per rank): once with the default
masks (replicated activations on the shared stream, sharded ones on the per-rank stream) and
once with the single-process masks (every rank draws the full mask of a sharded activation and
keeps its slice; attention on split heads runs as the math kernel with a sliced full mask).
Training steps (forward + backward + AdamW) are timed in interleaved rounds; the table gives the
medians and the ratio. Before timing, the single-process variant's loss is checked against the
one-process model under the same seed.

    python benchmarks/dropout_masks.py            # hidden 256, 4 layers, 4 x 128 tokens (~1 min)
    python benchmarks/dropout_masks.py --quick    # hidden 128, 2 layers, 2 x 64 tokens
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):                                    # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

import autoshard
from benchmarks.common import env_info, launch, print_table, summarize, time_interleaved, write_json


def _model(hidden: int, layers: int, seq: int):
    import transformers
    cfg = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=hidden // 32, vocab_size=8192,
                                  n_positions=seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").float().train()


def _rank(hidden, layers, batch, seq, rounds):
    model = _model(hidden, layers, seq)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    kw = dict(input_ids=ids, labels=ids)
    ref = copy.deepcopy(model)
    steps, check = {}, None
    for masks in ("independent", "single_process"):
        gm = autoshard.parallelize(copy.deepcopy(model), dist.get_world_size(), kw, tracer="export",
                                   dropout_masks=masks)
        if masks == "single_process":
            torch.manual_seed(5)
            want = ref(**kw).loss.item()
            autoshard.manual_seed(5)
            check = (gm(**kw).loss.item(), want)
        opt = torch.optim.AdamW(gm.parameters(), lr=1e-4)

        def step(gm=gm, opt=opt):
            gm(**kw).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[masks] = step
    times = time_interleaved(steps, warmup=2, rounds=rounds)
    return {"times": times, "check": check}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    hidden, layers, batch, seq = (128, 2, 2, 64) if a.quick else (256, 4, 4, 128)
    out = launch(_rank, a.world, hidden, layers, batch, seq, a.rounds)
    got, want = out["check"]
    if abs(got - want) > 1e-4 * max(1.0, abs(want)):
        print(f"single_process loss {got} differs from the one-process model's {want}")
        return 1
    med = {k: summarize(v)["median_ms"] for k, v in out["times"].items()}
    ratio = med["single_process"] / med["independent"]
    print_table([[k, f"{m:.1f}", f"{m / med['independent']:.3f}"] for k, m in med.items()],
                ["masks", "median step ms", "vs independent"],
                title=f"GPT-2 h={hidden} L={layers} tokens={batch}x{seq} dropout 0.1, world {a.world} "
                      f"(single_process loss {got:.6f} = model's {want:.6f})")
    write_json("dropout_masks" + ("_quick" if a.quick else ""),
               {"env": env_info(), "config": dict(hidden=hidden, layers=layers, batch=batch, seq=seq, world=a.world),
                "times_ms": out["times"], "median_ms": med, "ratio": ratio, "loss_check": [got, want]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
