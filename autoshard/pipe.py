"""Entry point of pipeline parallelism: `pipeline` (a model -> this rank's stages, run by
torch.distributed.pipelining, with autoshard's tensor parallelism inside every stage) and
`plan_pipeline` (the cuts and their predicted cost, without a process group).

Each rank builds its tensor-parallel module of the whole model at one microbatch
(`parallelize` over `mesh["tp"]`), cuts the rank's graph at the blocks the pipeline plan
chose (autoshard.rewrite.stages) and keeps the stages its pp rank holds: stage s on pp rank
s % pp (one stage a rank, or several for the interleaved schedules).
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from .api import parallelize, plan as plan_tp
from .capture.shapes import fetch_attr, placeholder_inputs
from .errors import ProcessGroupError, ShardingError
from .planner.pipeline import plan_pipeline as _cut_plan
from .planner.stages import check_schedule
from .rewrite import blocks as B
from .rewrite.stages import cut, input_name
from .runtime import groups as D, rng
from .runtime.pipeline import Pipeline, Stage, place

# parallelize's own options (the rest plan): how the module is built, not what it runs
_BUILD_OPTIONS = ("load", "progress", "dropout_masks", "overlap")
PP_SEED_OFFSET = 100            # Megatron's seed offset a pipeline rank (dropout masks differ by stage)


def _batch_of(example) -> tuple[tuple, dict, int]:
    args, kwargs = (example, {}) if not isinstance(example, dict) else ((), example)
    args = args if isinstance(args, tuple) else (args,)
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves:
        raise ShardingError("pipeline: the example has no tensor with a batch dim to cut microbatches from")
    return args, kwargs, leaves[0].shape[0]


def _microbatch(args, kwargs, batch: int, microbatches: int):
    if batch % microbatches:
        raise ShardingError(f"pipeline: a batch of {batch} does not split into {microbatches} equal microbatches")
    size = batch // microbatches

    def one(x):
        return x[:size] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x
    return pytree.tree_map(one, (args, kwargs))


def _call_example(args: tuple, kwargs: dict):
    """The example as `plan` / `parallelize` take it: positional inputs, or keywords alone."""
    if args and kwargs:
        raise ShardingError("pipeline: give the example as a tuple of positional inputs or a dict of keywords")
    return kwargs if kwargs else args


def _loss_leaves(plan) -> list:
    out = next(n for n in plan.graph_module.graph.nodes if n.op == "output")
    leaves, _ = pytree.tree_flatten(out.args[0])
    return [hasattr(v := getattr(leaf, "meta", {}).get("val"), "dim") and v.dim() == 0 and v.is_floating_point()
            for leaf in leaves]


def plan_pipeline(model: nn.Module, example, *, pp: int, tp: int = 1, dp: int = 1, microbatches: int,
                  schedule: str = "1F1B", stages_per_rank: int = 1, split=None, blocks="auto", **plan_options):
    """The pipeline plan of `model` (which blocks each stage holds, each stage's predicted times
    and memory, the schedule's bubble) at pp x tp, planned on one process (a model on meta too)."""
    start = time.perf_counter()
    args, kwargs, batch = _batch_of(example)
    check_schedule(schedule, pp, microbatches, stages_per_rank)
    mb = _microbatch(args, kwargs, batch, microbatches)
    tp_plan = plan_tp(model, tp, _call_example(*mb), **plan_options)
    names = B.resolve_blocks(model, blocks)
    return _cut_plan(tp_plan, names, pp=pp, dp=dp, microbatches=microbatches, schedule=schedule,
                     stages_per_rank=stages_per_rank, split=split, parts=_parts(model, names),
                     seconds=time.perf_counter() - start)


def _parts(model: nn.Module, names: list) -> dict:
    """{block: its children holding tensors}: where a stage boundary may fall inside a block
    (planner.pipeline). A child without tensors (a dropout, an activation) is no module of the
    rank's graph to keep as a block: its ops run with the stage of their inputs."""
    return {n: [f"{n}.{k}" for k, m in model.get_submodule(n).named_children()
                if next(iter([*m.parameters(), *m.buffers()]), None) is not None] for n in names}


def _mesh_dims(mesh):
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ProcessGroupError(f"pipeline: the mesh needs a 'pp' dim; its dims are {names or 'unnamed'}")
    unknown = set(names) - {"pp", "dp", "tp"}
    if unknown:
        raise ProcessGroupError(f"pipeline: mesh dims {sorted(unknown)} are not 'pp', 'dp' or 'tp'")
    return {n: mesh[n] for n in names}


def _tied_groups(mesh, pipe: Pipeline, root: nn.Module, readers: dict, pp: int) -> list:
    """[(group, names)]: a parameter that stages on different pp ranks read is summed over those
    ranks (one group per set of pp ranks and coordinate of the other dims, made by every rank in
    the same order, as new_group requires)."""
    by_tensor: dict = {}
    for target, stages in readers.items():
        t = root.get_parameter(target)
        ranks = tuple(sorted({s % pp for s in stages}))
        if len(ranks) > 1:
            by_tensor.setdefault(ranks, {}).setdefault(id(t), target)
    if not by_tensor:
        return []
    names = tuple(mesh.mesh_dim_names)
    grid = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp)
    me = dist.get_rank()
    out = []
    for ranks in sorted(by_tensor):
        held = [n for n in by_tensor[ranks].values()]
        for row in grid.tolist():
            group = dist.new_group([row[r] for r in ranks])
            if me in [row[r] for r in ranks]:
                out.append((group, tuple(n for n in held if _has(pipe, n))))
    return out


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def _holder(pipe: Pipeline, gm: nn.Module, stage_modules: list) -> None:
    """Give `pipe` the tensors and modules of its stages under the model's names, tied aliases too."""
    ids = set()
    for st in stage_modules:
        for n in st.graph.graph.nodes:
            if n.op not in ("get_attr", "call_module"):
                continue
            obj = fetch_attr(gm, n.target)
            if isinstance(obj, nn.Module):
                place(pipe, n.target, obj)
                ids.update(id(t) for t in [*obj.parameters(), *obj.buffers()])
            elif isinstance(obj, torch.Tensor):
                ids.add(id(obj))
    for name, t in gm.named_parameters(remove_duplicate=False):
        if id(t) in ids:
            place(pipe, name, t)
    persistent = set(gm.state_dict(keep_vars=True))
    for name, t in gm.named_buffers(remove_duplicate=False):
        if id(t) in ids:
            place(pipe, name, t, persistent=name in persistent)


def _release(gm: nn.Module, pipe: Pipeline) -> None:
    """The rank's whole module keeps only this rank's stages' parameters (the others' become meta):
    it stays alive for the evaluation graph, built on first use, which reads the same ones."""
    held = {id(t) for t in pipe.parameters()}
    memo: dict = {}
    for mod in gm.modules():
        for k, t in list(mod._parameters.items()):
            if t is not None and id(t) not in held and not t.is_meta:
                if id(t) not in memo:
                    memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                mod._parameters[k] = memo[id(t)]


def pipeline(model: nn.Module, example, *, mesh=None, microbatches: int, schedule: str = "1F1B",
             stages_per_rank: int = 1, split=None, device=None, **options) -> Pipeline:
    """This rank's pipeline stages of `model`, run by torch.distributed.pipelining.

    `example`: one whole batch (a tuple of positional inputs or a dict of keywords) whose first
    batched tensor's dim 0 is cut into `microbatches` equal microbatches; the model must return
    its loss for it (labels / targets given). `mesh`: a DeviceMesh with a "pp" dim and optionally
    "dp" and "tp" (default: every rank a pipeline rank). `schedule`: "GPipe", "1F1B",
    "Interleaved1F1B" or "InterleavedZeroBubble" (the last two run `stages_per_rank` stages a rank:
    stage s on pp rank s % pp). `split`: blocks per stage, pinned (e.g. [3, 3, 2]); by default the cuts
    balance the stages' predicted time, the first stage's embeddings and the last stage's head and
    loss counted. Other keywords go to `parallelize` (tracer, sequence_parallel, ...), which plans
    tensor parallelism over `mesh["tp"]` inside every stage; `device` holds the stages' tensors
    (default: the process group's: "cuda" under NCCL, with the current device). A model on meta, or
    `load=`, fills only this rank's stages.

    The Pipeline: `step(*args, **kwargs)` runs a training step (forward and backward over the
    microbatches; the gradients are those of the batch's loss, the mean over microbatches) and
    returns that loss on every rank; in eval mode it runs forward only. `pipe(...)` runs forward
    only and returns (loss, outputs on the last stage's ranks or None). Its parameters and state
    dict are this rank's stages' shards under the model's names; `pipe.plan` is the PipelinePlan.
    """
    if not D.is_initialized():
        raise ProcessGroupError("pipeline: needs an initialised process group (torch.distributed.init_process_group "
                                "or torchrun); plan_pipeline plans without one")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(D.device_of(None), (dist.get_world_size(),), mesh_dim_names=("pp",))
    dims = _mesh_dims(mesh)
    pp = dims["pp"].size()
    tp_mesh = dims.get("tp")
    if tp_mesh is None:
        from torch.distributed.device_mesh import DeviceMesh
        tp_mesh = DeviceMesh.from_group(dist.new_group([dist.get_rank()], use_local_synchronization=True),
                                        D.device_of(None))
    tp, dp = tp_mesh.size(), dims["dp"].size() if "dp" in dims else 1
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ShardingError(f"pipeline: microbatches must be a positive int, got {microbatches!r}")
    check_schedule(schedule, pp, microbatches, stages_per_rank)
    start = time.perf_counter()
    args, kwargs, batch = _batch_of(example)
    mb_args, mb_kwargs = _microbatch(args, kwargs, batch, microbatches)
    names = B.resolve_blocks(model, options.pop("blocks", "auto"))
    stages = pp * stages_per_rank
    if stages > len(names):
        raise ShardingError(f"pipeline: {stages} stages (pp {pp} x {stages_per_rank} a rank) but "
                            f"{type(model).__name__} has {len(names)} blocks: a stage holds at least one block")
    build = {k: options.pop(k) for k in _BUILD_OPTIONS if k in options}
    if device is not None:
        build["device"] = device
    mb_example = _call_example(mb_args, mb_kwargs)
    tp_plan = plan_tp(model, tp, mb_example, **options)       # planned once, then cut, then built
    pplan = _cut_plan(tp_plan, names, pp=pp, dp=dp, microbatches=microbatches, schedule=schedule,
                      stages_per_rank=stages_per_rank, split=split, parts=_parts(model, names))
    names = [n for group in pplan.stages for n in group]       # a block cut inside: its children
    stage_of = {n: s for s, group in enumerate(pplan.stages) for n in group}
    me = dims["pp"].get_local_rank()
    mine = [s for s in range(stages) if s % pp == me]
    others = tuple(n + "." for n in names if stage_of[n] not in mine)
    gm = parallelize(model, tp, mb_example, plan=tp_plan, group=tp_mesh, blocks=names,
                     only=lambda name: not (name + ".").startswith(others), **build)
    missing = [n for n in names if n not in B.blocks_of(gm)]
    if missing:
        raise ShardingError(f"pipeline: blocks {missing[:3]} could not be kept as modules (see the warning above), "
                            "so the model cannot be cut there; pass blocks= naming the layers that can")
    flags = _loss_leaves(tp_plan)
    train_cut = cut(gm, gm.graph, stage_of, stages, loss_only=True, is_loss=lambda i: flags[i])
    train_stages = [Stage(s, train_cut.modules[s], tp_plan.autocast) for s in mine]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tracer = tp_plan.tracer

    def inputs(a, k) -> dict:
        flat = placeholder_inputs(gm, tracer, a, k, placeholders)
        return {input_name(i): v for i, v in enumerate(flat) if v is not None}
    example_flat = placeholder_inputs(gm, tracer, args, kwargs, placeholders)
    batched = {input_name(i) for i, v in enumerate(example_flat)
               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch}

    def build_eval():
        """The evaluation graph of the example's call, built by the module's dispatcher, cut alike."""
        sig = gm._autoshard_signatures
        mode = gm.training
        gm.eval()
        try:
            sig.prepare(gm)
            key = next(k for k in sig.served if k[0] is False and k[1] == sig.first.key)
            served, eplan = sig.served[key], sig.plans[key]
        finally:
            gm.train(mode)
        eflags = _loss_leaves(eplan)
        ecut = cut(gm, served.holder.graph, stage_of, stages, loss_only=False, is_loss=lambda i: eflags[i])
        out = [Stage(s, ecut.modules[s], eplan.autocast) for s in mine]
        for st in out:
            st.eval()
        return out, next((i for i, f in enumerate(eflags) if f), 0), ecut.output_leaves

    pipe = Pipeline(stages=train_stages, inputs=inputs, batched=batched, microbatches=microbatches,
                    schedule=schedule, pp_group=dims["pp"].get_group(),
                    dp_group=dims["dp"].get_group() if "dp" in dims else None,
                    num_stages=stages, plan=pplan, build_eval=build_eval,
                    device=device or D.device_of(dims["pp"].get_group()))
    _holder(pipe, gm, train_stages)
    pipe.sum_across(_tied_groups(mesh, pipe, gm, train_cut.readers, pp))
    pipe._autoshard_layouts = {k: v for k, v in gm._autoshard_layouts.items()}
    pipe._autoshard_group = gm._autoshard_group
    pipe._autoshard_plan = tp_plan
    pipe.__dict__["_autoshard_blocks"] = {n: b for n, b in B.blocks_of(gm).items() if stage_of[n] in mine}
    pipe.__dict__["_autoshard_pp_group"] = dims["pp"].get_group()        # checkpoints: the groups of every stage
    rng.offset_stage(PP_SEED_OFFSET * me)
    _release(gm, pipe)
    pipe.train(model.training)
    pipe.plan = dataclasses.replace(pplan, seconds=time.perf_counter() - start)
    return pipe
