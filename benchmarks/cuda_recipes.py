#!/usr/bin/env python
"""The production recipe on a GPU: precision recipes and torch.compile on CUDA, and single-GPU
step times.

Part 1, correctness (what tests/test_precision.py and tests/test_compile.py check on CPU), run on
``--device`` (default cuda) at world 1 (NCCL on one GPU; gloo on CPU) and world 2 (two ranks
sharing one device over gloo: NCCL refuses two ranks on one GPU). Models: tiny Hugging Face
LLaMA (grouped K/V heads) and GPT-2 (fused Conv1D q/k/v) from tests/hf_models.py, through
torch.export, in train mode; recipes: fp32, ``torch.autocast(device, bf16)`` and ``float16``
around the forward (fp32 weights), and bf16 weights. Each case: the parallel module's loss and
every gradient (dtypes included) against the single-process model under the same recipe, with
the low precision's tolerance; bytes each rank counted against the call's plan. Then
``block.compile(fullgraph=True)`` of each of its blocks, and ``torch.compile(gm, fullgraph=True)``
of the whole LLaMA module, against eager at two batch x sequence
sizes, fp32 and bf16 autocast. Each case reports ``ok`` or its first error line; the run goes on.

Part 2, timing on one device (world 1): a LLaMA of hidden 1024, 8 layers, 16 query / 8 K/V
heads, intermediate 2816, vocabulary 32000, 8 x 512 tokens, forward + backward under bf16
autocast: the model eager and with each decoder layer compiled, autoshard's module eager and
with each block compiled; medians over timed steps (device synchronised), first-step seconds
(compile included). Results: a table and ``benchmarks/results/cuda_recipes.json``.

    python benchmarks/cuda_recipes.py              # on a GPU
    python benchmarks/cuda_recipes.py --device cpu --quick --worlds 1  # the same code on CPU
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import common  # noqa: E402

RECIPES = ("fp32", "autocast_bf16", "autocast_fp16", "bf16_weights")
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _recipe(recipe: str, device: str):
    if recipe == "fp32":
        return contextlib.nullcontext(), torch.float32
    if recipe == "bf16_weights":
        return contextlib.nullcontext(), torch.bfloat16
    dtype = torch.bfloat16 if recipe == "autocast_bf16" else torch.float16
    return torch.autocast(device, dtype), dtype


def _worst(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> float:
    """Largest |got - want| relative to want's scale; raises if the dtypes differ or it is over
    the recipe's tolerance."""
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype} != {want.dtype}")
    scale = want.detach().abs().max().item() + 1e-6
    err = (got.detach().float() - want.detach().float()).abs().max().item() / scale
    if not err <= TOL[dtype]:
        raise AssertionError(f"{what}: relative error {err:.3g} > {TOL[dtype]}")
    return err


def _device_of_rank(device: str) -> torch.device:
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def _build(name: str, dev):
    import hf_models
    model, kw = hf_models.llama(num_hidden_layers=2) if name == "llama" else hf_models.gpt2()
    return model.train().to(dev), {k: v.to(dev) for k, v in kw.items()}


def _recipe_case(name: str, recipe: str, device: str) -> dict:
    import autoshard
    from autoshard.runtime.collectives import count_comm
    dev = _device_of_rank(device)
    p = torch.distributed.get_world_size()
    model, kw = _build(name, dev)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(copy.deepcopy(model), p, kw, tracer="export")
    context, dtype = _recipe(recipe, device)
    if recipe == "bf16_weights":
        ref.to(torch.bfloat16)
        gm.to(torch.bfloat16)
    with context:
        want = ref(**kw).loss
    with context, count_comm() as counted:
        got = gm(**kw).loss
        got.backward()
    want.backward()
    worst = _worst(got, want, dtype, "loss")
    grads = autoshard.collect_state_dict(gm, {n: t.grad for n, t in gm.named_parameters(remove_duplicate=False)})
    for n, t in ref.named_parameters(remove_duplicate=False):
        worst = max(worst, _worst(grads[n], t.grad, dtype, f"grad of {n}"))
    return {"max_rel_err": worst, "bytes": counted.bytes}


def _compile_case(recipe: str, device: str, whole: bool) -> dict:
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    import autoshard
    import hf_models
    dev = _device_of_rank(device)
    p = torch.distributed.get_world_size()
    model, _ = hf_models.llama(num_hidden_layers=2)
    model.train().to(dev)

    def inputs(b, t):
        ids = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(b * t)).to(dev)
        return {"input_ids": ids, "labels": ids}
    eager = autoshard.parallelize(copy.deepcopy(model), p, inputs(2, 16), tracer="export")
    compiled = autoshard.parallelize(copy.deepcopy(model), p, inputs(2, 16), tracer="export")
    dynamo.reset()
    counters.clear()
    if whole:
        run = torch.compile(compiled, fullgraph=True)
    else:
        for block in autoshard.blocks_of(compiled).values():
            block.compile(fullgraph=True)
        run = compiled
    context, dtype = _recipe(recipe, device)
    worst = 0.0
    for b, t in ((2, 16), (3, 24)):
        kw = inputs(b, t)
        with context:
            got, want = run(**kw).loss, eager(**kw).loss
        got.backward()
        want.backward()
        worst = max(worst, _worst(got, want, dtype, f"loss at {b}x{t}"))
    for (n, a), (_, b) in zip(compiled.named_parameters(), eager.named_parameters()):
        worst = max(worst, _worst(a.grad, b.grad, dtype, f"grad of {n}"))
    breaks = sum(counters["graph_break"].values())
    return {"max_rel_err": worst, "graph_breaks": breaks, "graphs": counters["stats"]["unique_graphs"]}


def correctness(device: str, quick: bool) -> dict:
    """Every case on this rank; {case: "ok ..." or the error's first line} (rank 0's)."""
    out = {}
    cases = [("recipe", n, r) for n in ("llama", "gpt2") for r in RECIPES]
    cases += [(f"compile {how}", "llama", r) for how in ("blocks", "whole")
              for r in (("fp32",) if quick else ("fp32", "autocast_bf16"))]
    for kind, name, recipe in cases:
        key = f"{kind} {name} {recipe}"
        try:
            res = _recipe_case(name, recipe, device) if kind == "recipe" else \
                _compile_case(recipe, device, whole=kind.endswith("whole"))
            out[key] = "ok " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in res.items())
        except Exception as e:                                      # noqa: BLE001 - reported per case
            out[key] = "FAIL " + _first_line(e)
        torch.distributed.barrier()
    return out


def _big_llama(dev, small: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    size = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, vocab_size=512) if small else \
        dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=32000)
    cfg = LlamaConfig(num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024, **size)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dev).train()
    shape = (2, 64) if small else (8, 512)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(1)).to(dev)
    return model, {"input_ids": ids, "labels": ids}


def timing(device: str, steps: int, small: bool, profile: bool = False) -> dict:
    """World 1 on one device: the model and autoshard's module, eager and compiled per block
    (`small`: a tiny model, to try the code on CPU)."""
    import autoshard
    dev = _device_of_rank(device)
    model, kw = _big_llama(dev, small)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step_of(m):
        def step():
            with torch.autocast(device, torch.bfloat16):
                loss = m(**kw).loss
            loss.backward()
            m.zero_grad(set_to_none=True)
            return loss.detach()
        return step

    def model_compiled():
        m = copy.deepcopy(model)
        for layer in m.model.layers:
            layer.compile(fullgraph=True)
        return m

    def autoshard_compiled():
        gm = autoshard.parallelize(copy.deepcopy(model), 1, kw, tracer="export")
        for block in autoshard.blocks_of(gm).values():
            block.compile(fullgraph=True)
        return gm
    variants = {"model eager": lambda: copy.deepcopy(model), "model compiled": model_compiled,
                "autoshard eager": lambda: autoshard.parallelize(copy.deepcopy(model), 1, kw, tracer="export"),
                "autoshard compiled": autoshard_compiled}
    out = {}
    for name, build in variants.items():
        try:
            m = build()
            step = step_of(m)
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            first = time.perf_counter() - t0
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = {"median_ms": statistics.median(times), "first_step_s": first, "loss": loss.item(),
                         "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
            if profile and name.endswith("eager"):
                acts = [torch.profiler.ProfilerActivity.CPU] + \
                    ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    step()
                    sync()
                by = "cuda_time_total" if device == "cuda" else "cpu_time_total"
                out[name]["profile"] = prof.key_averages().table(sort_by=by, row_limit=15)
            del m
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        except Exception as e:                                      # noqa: BLE001
            out[name] = {"error": _first_line(e)}
    return out


def _rank_job(device: str, quick: bool, steps: int, profile: bool = False):
    if device == "cuda":
        torch.cuda.set_device(0)
    result = {"correctness": correctness(device, quick)}
    if torch.distributed.get_world_size() == 1 and steps:
        result["timing"] = timing(device, steps, small=quick, profile=profile)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="one compile case, a tiny timing model, 3 steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one eager step of each")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")
    results = {"env": common.env_info(),
               "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    for world in (int(w) for w in args.worlds.split(",")):
        backend = "nccl" if args.device == "cuda" and world == 1 else "gloo"
        threads = max(1, (os.cpu_count() or 2) // (2 * world))
        t0 = time.perf_counter()
        try:
            res = common.launch(_rank_job, world, args.device, args.quick, 3 if args.quick else args.steps, args.profile,
                                backend=backend, threads=threads, timeout_s=900)
        except RuntimeError as e:
            res = {"error": str(e)[-3000:]}
        res["seconds"] = time.perf_counter() - t0
        res["backend"] = backend
        results[f"world {world}"] = res
        print(f"\n== world {world} ({backend} on {args.device}, {res['seconds']:.0f} s)")
        for case, status in res.get("correctness", {}).items():
            print(f"  {case:32s} {status}")
        for name, t in res.get("timing", {}).items():
            print(f"  {name:20s} " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in t.items() if k != "profile"))
            if "profile" in t:
                print(t["profile"])
        if "error" in res:
            print(res["error"])
    path = common.write_json("cuda_recipes" + ("_quick" if args.quick else ""), results)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
