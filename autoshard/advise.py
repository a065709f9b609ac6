"""Entry points: `estimate` (one layout of a training job on a cluster: step time, memory, MFU) and
`advise` (the fastest layouts that fit), from autoshard's own plan of the model (planner.step).

The model is planned on meta with one layer (a transformers config, built-in name or module with
a config) once per tensor-parallel degree and sequence parallelism, at one sequence of the step's
length; pipeline, data parallelism, microbatch, interleaving, recomputation and FSDP reuse that
plan (`_PROFILES`). `python -m autoshard advise ...` (`main`) prints the best layouts and the code.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn

from .capture import capture
from .errors import LoadError, MemoryBudgetError, ShardingError
from .io import configs, loading
from .planner import plan_graph
from .planner.cluster import GPUS, Cluster, Estimate, Layout
from .planner.cost import CostModel
from .planner.step import check_fits, estimate_step, profile
from .rewrite.blocks import resolve_blocks

__all__ = ["Cluster", "Layout", "Estimate", "estimate", "advise", "main"]

_PROFILES: dict = {}            # (model key, tp, sequence parallel, seq, dtype) -> planner.step.Profile
_CAPTURES: dict = {}            # (model key, seq, dtype) -> (the capture of the one-layer model, its blocks)
MICROBATCHES = (1, 2, 4, 8, 16)
INTERLEAVE = (1, 2, 3, 4, 6, 8)
REPLAYED = 4                    # advise replays the schedule of the REPLAYED x top (>= 20) best by the textbook bubble


def _dtype(model_or_config, dtype):
    """The 16-bit dtype the step computes in: given, else the config's / module's if 16-bit, else bf16."""
    if dtype is not None:
        return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    if isinstance(model_or_config, nn.Module):
        t = next((p.dtype for p in model_or_config.parameters() if p.is_floating_point()), None)
        if t in (torch.float16, torch.bfloat16):
            return t
        model_or_config = getattr(model_or_config, "config", None)
    t = getattr(model_or_config, "dtype", None) or getattr(model_or_config, "torch_dtype", None)
    t = getattr(torch, t) if isinstance(t, str) else t
    return t if t in (torch.float16, torch.bfloat16) else torch.bfloat16


def _config(model_or_config):
    """The transformers config to build from (a name, a path, a config, a module's config), or None."""
    if isinstance(model_or_config, (str, bytes)) or hasattr(model_or_config, "__fspath__"):
        return configs.config_of(model_or_config)
    if isinstance(model_or_config, nn.Module):
        return getattr(model_or_config, "config", None)
    if hasattr(model_or_config, "to_dict") and hasattr(model_or_config, "model_type"):
        return model_or_config
    raise TypeError(f"estimate/advise take a transformers config, a built-in name, a config.json path or a module, "
                    f"got {type(model_or_config).__name__}")


def _layers(cfg) -> int:
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise LoadError(f"{type(cfg).__name__} names no num_hidden_layers: cannot build it with one layer")
    return n


def _single_layer(model: nn.Module) -> list:
    """[name] of the layer of a model built with one: the one child of its largest list of modules."""
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) == 1]
    if not lists:
        raise ShardingError(f"{type(model).__name__} built with one layer has no list of layers")
    name = max(lists)[1]
    return [f"{name}.{next(iter(model.get_submodule(name)._modules))}"]


def _key(model_or_config, cfg) -> str:
    if cfg is not None:
        return cfg.to_json_string(use_diff=False) + str(getattr(cfg, "_attn_implementation", None))
    return f"module {id(model_or_config)}"


def profile_of(model_or_config, tp: int, sequence_parallel: bool, seq: int, dtype=None):
    """The planner.step.Profile of the model at tensor-parallel degree `tp` (cached)."""
    dt = _dtype(model_or_config, dtype)
    cfg = _config(model_or_config)
    key = (_key(model_or_config, cfg), tp, bool(sequence_parallel and tp > 1), seq, dt)
    if key in _PROFILES:
        return _PROFILES[key]
    ckey = key[0], seq, dt
    if ckey not in _CAPTURES:        # one capture serves every degree (planning reads the graph, never writes it)
        if cfg is not None:
            one = copy.deepcopy(cfg)
            one.num_hidden_layers = 1
            one.use_cache = False
            model = loading.meta_model(one, dt)
            if getattr(cfg, "_attn_implementation", None):
                model.config._attn_implementation = cfg._attn_implementation
        else:
            model = model_or_config
        model.train()
        blocks = resolve_blocks(model, "auto") if cfg is None else _single_layer(model)
        if not blocks:
            raise ShardingError(f"{type(model).__name__} has no layers to repeat (no ModuleList of one class)")
        ids = torch.zeros((1, seq), dtype=torch.long, device="meta")
        _CAPTURES.clear()
        _CAPTURES[ckey] = capture(model, {"input_ids": ids, "labels": ids}, once=True), blocks
    cap, blocks = _CAPTURES[ckey]
    layers = _layers(cfg) if cfg is not None else len(blocks)
    plan = plan_graph(cap.gm, tp, CostModel(), tracer=cap.tracer, notes=cap.notes, example=(cap.args, cap.kwargs),
                      outputs="sharded", sequence_parallel=bool(sequence_parallel and tp > 1),
                      autocast=cap.autocast, memory_with=True)
    _PROFILES[key] = profile(plan, blocks, seq, layers)
    return _PROFILES[key]


def estimate(model_or_config, cluster: Cluster, layout: Layout, *, global_batch: int, seq_len: int,
             dtype=None, fused: bool = True, replay: bool = True) -> Estimate:
    """What a training step of `layout` on `cluster` is predicted to cost (autoshard.planner.step):
    seconds an optimizer step of `global_batch` sequences of `seq_len` tokens, peak memory a GPU and
    its parts, tokens/s a GPU, MFU and the breakdown. `model_or_config`: a transformers config, a
    built-in name (autoshard.io.configs), a config.json path, or a module (on meta). `fused`: element-wise
    ops run in fused chains (Megatron's kernels, torch.compile), else one kernel an op (eager PyTorch);
    `replay`: the pipeline schedule replayed (else its textbook bubble)."""
    if layout.gpus != cluster.gpus:
        raise ShardingError(f"estimate: {layout.short()} uses {layout.gpus} GPUs, the cluster has {cluster.gpus}")
    if layout.tp > cluster.gpus_per_node:
        raise ShardingError(f"estimate: tp {layout.tp} spans nodes of {cluster.gpus_per_node} GPUs")
    prof = profile_of(model_or_config, layout.tp, layout.sequence_parallel, seq_len, dtype)
    return estimate_step(prof, cluster, layout, global_batch, replay, fused)


def layouts(cluster: Cluster, layers: int, global_batch: int):
    """Every layout advise considers: tp a power of two inside a node, pp dividing the rest, dp the
    rest; microbatches dividing the batch a replica; interleaving where the layers divide and torch's
    schedule takes the microbatches; sequence parallelism with tp; FSDP with dp."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.gpus % t == 0]
    for tp in tps:
        for pp in (p for p in range(1, cluster.gpus // tp + 1) if (cluster.gpus // tp) % p == 0 and p <= layers):
            dp = cluster.gpus // (tp * pp)
            if global_batch % dp:
                continue
            for b in (b for b in MICROBATCHES if (global_batch // dp) % b == 0):
                m = global_batch // (dp * b)
                if pp > 1 and m < pp:
                    continue
                for v in INTERLEAVE:
                    if v > 1 and (pp == 1 or layers % (pp * v) or m % pp):
                        continue
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for rc in ("none", "selective", "full"):
                            for fsdp in ((False, True) if dp > 1 else (False,)):
                                yield Layout(tp=tp, pp=pp, dp=dp, microbatch=b, interleave=v, sequence_parallel=sp,
                                             recompute=rc, fsdp=fsdp)


def advise(model_or_config, cluster: Cluster, *, global_batch: int, seq_len: int, top: int = 5,
           dtype=None, fused: bool = True) -> list:
    """The `top` fastest layouts of the job that fit the GPUs' memory, best first (Estimates); a
    MemoryBudgetError giving the smallest peak where none fits."""
    cfg = _config(model_or_config)
    source = cfg if cfg is not None else model_or_config
    layers = _layers(cfg) if cfg is not None else len(resolve_blocks(model_or_config, "auto"))
    profiles: dict = {}

    def step(layout, replay):
        key = (layout.tp, layout.sequence_parallel and layout.tp > 1)
        if key not in profiles:
            profiles[key] = profile_of(source, *key, seq_len, dtype)
        return estimate_step(profiles[key], cluster, layout, global_batch, replay, fused)
    out = []
    for layout in layouts(cluster, layers, global_batch):
        try:
            out.append(step(layout, False))
        except ShardingError:
            continue
    if not out:
        raise ShardingError(f"advise: no layout of {cluster.gpus} GPUs runs a global batch of {global_batch}")
    check_fits(out, cluster)
    fit = sorted((e for e in out if e.fits), key=lambda e: (e.step_time, e.memory))
    replayed = [step(e.layout, True) for e in fit[:max(REPLAYED * top, 20)]]   # the best by the textbook bubble
    return sorted(replayed, key=lambda e: (e.step_time, e.memory))[:top]


def code(estimate: Estimate, source: str, global_batch: int, seq_len: int) -> str:
    """Python that runs `estimate`'s layout with autoshard (under torchrun, one process a GPU)."""
    lay = estimate.layout
    lines = ["import torch, autoshard",
             "from torch.distributed.device_mesh import init_device_mesh",
             "from autoshard.io.loading import meta_model",
             "from autoshard.io.configs import config_of",
             f'mesh = init_device_mesh("cuda", ({lay.pp}, {lay.dp}, {lay.tp}), mesh_dim_names=("pp", "dp", "tp"))',
             f"model = meta_model(config_of({source!r}))     # or a checkpoint directory",
             f"ids = torch.zeros(({lay.microbatch if lay.pp == 1 else global_batch // lay.dp}, {seq_len}), "
             "dtype=torch.long)",
             'batch = {"input_ids": ids, "labels": ids}']
    extra = (", sequence_parallel=True" if lay.sequence_parallel else "")
    if lay.pp > 1:
        sched = "Interleaved1F1B" if lay.interleave > 1 else "1F1B"
        lines.append(f"pipe = autoshard.pipeline(model, batch, mesh=mesh, microbatches={estimate.microbatches}, "
                     f'schedule="{sched}", stages_per_rank={lay.interleave}{extra})')
        lines.append("loss = pipe.step(**batch)")
    else:
        lines.append(f'gm = autoshard.parallelize(model, {lay.tp}, batch, group=mesh["tp"], device="cuda"{extra})')
        if lay.recompute == "full":
            lines.append("# full recomputation: torch.utils.checkpoint each of autoshard.blocks_of(gm)")
        elif lay.recompute == "selective":
            lines.append("# selective recomputation: attention's scores (sdpa / flash attention recomputes them itself)")
        if lay.fsdp:
            lines += ["from torch.distributed.fsdp import fully_shard",
                      'for block in autoshard.blocks_of(gm).values(): fully_shard(block, mesh=mesh["dp"])',
                      'fully_shard(gm, mesh=mesh["dp"])']
        elif lay.dp > 1:
            lines += ["autoshard.register_ddp_parameters_to_ignore(gm)",
                      'gm = torch.nn.parallel.DistributedDataParallel(gm, process_group=mesh["dp"].get_group())']
        lines.append(f"# {estimate.microbatches} microbatches of {lay.microbatch} a step, gradients accumulated")
    return "\n".join(lines)


def main(argv=None) -> int:
    """`python -m autoshard advise --config NAME_OR_JSON --gpus N --gpu H100-SXM --global-batch B --seq S`."""
    from tabulate import tabulate
    ap = argparse.ArgumentParser(prog="autoshard advise", description="the fastest layouts of a training job that "
                                 "fit the GPUs, from autoshard's plan of the model")
    ap.add_argument("--config", required=True, help=f"a config.json (or its directory) or a built-in name: "
                    f"{', '.join(sorted({**configs.CONFIGS, **configs.LARGE}))}")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu", default="H100-SXM", choices=sorted(GPUS))
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences an optimizer step")
    ap.add_argument("--seq", type=int, required=True, help="tokens a sequence")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16"])
    args = ap.parse_args(argv)
    cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu)
    t0 = time.perf_counter()
    try:
        best = advise(args.config, cluster, global_batch=args.global_batch, seq_len=args.seq, top=args.top,
                      dtype=args.dtype)
    except (MemoryBudgetError, ShardingError, LoadError) as e:
        print(f"autoshard advise: {e}")
        return 1
    seconds = time.perf_counter() - t0
    print(tabulate([e.row() for e in best], headers="keys", tablefmt="github"))
    print(f"\n{len(best)} best of the layouts that fit {args.gpus} x {args.gpu}, searched in {seconds:.1f} s\n")
    print(code(best[0], args.config, args.global_batch, args.seq))
    return 0
