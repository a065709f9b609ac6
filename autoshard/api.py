"""Entry points: `plan` (capture -> planner -> Plan), `parallelize` (Plan -> this rank's
GraphModule, filled from a checkpoint or initialised) and `from_pretrained` (a Hugging Face
checkpoint directory -> this rank's GraphModule, never building the full model)."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import capture, has_meta
from .capture.trace import fake_mode_of
from .runtime.autocast import autocast_as
from .errors import CaptureError, LoadError, ProcessGroupError, ShardingError
from .io import hf, loading, training
from .nn.dropout import MASKS
from .plan import Plan, check_outputs
from .planner import plan_graph
from .planner.cost import CostModel
from .rewrite import blocks as B, rewrite, signatures
from .rewrite.recompute import recompute_blocks
from .runtime import groups as D, rng

_COST_KEYS = {"bandwidth", "latency", "flops", "memory_weight", "state_factor", "memory_budget", "optimizer"}


def _check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ShardingError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ShardingError(f"world_size must be >= 1, got {world_size}")
    return world_size


def plan(model: nn.Module, world_size: int, example_inputs=None, *, pin: dict | None = None,
         search: str = "greedy", tracer: str = "auto", tokens: int = 512, cost_model: CostModel | None = None,
         capture_once: bool = True, outputs: str = "full", sequence_parallel: bool | None = None,
         **cost_options) -> Plan:
    """Plan tensor parallelism for `model` at degree `world_size`.

    `example_inputs`: a tuple of positional arguments or a dict of keyword arguments (shapes
    only matter; with none, a batch of `tokens` positions is synthesised). `pin` fixes the
    TorchShard dim of named modules, e.g. {"head": None}. `search` is "greedy", "exact" (every
    combination: small graphs) or "optimal" (an integer linear program solved by HiGHS, with the
    extra `autoshard[optimal]`: planner.optimal).
    `outputs="full"` returns every output whole, as the model does; `outputs="sharded"` leaves
    an output the plan splits split (a DTensor at run time: no collective is spent on it).
    Cost knobs (bandwidth, latency, flops, memory_weight, state_factor, memory_budget, optimizer)
    may be given as keywords or as a CostModel. `memory_budget` (bytes, or a string such as
    "30GB"): the fastest plan whose predicted peak per rank of a training step (`plan.memory`, for
    `optimizer`, AdamW by default) fits, recomputing blocks in backward where nothing else does
    (`plan.checkpointed`, applied by `parallelize`); a MemoryBudgetError where no plan fits.
    `sequence_parallel`: hold the residual stream, norms and dropouts between row- and column-parallel
    layers split on tokens (Megatron's sequence parallelism: the all-reduces' bytes, those activations
    at 1/p per rank, the column layers saving their rank's tokens and gathering them again in backward,
    one all-gather more each; `plan.sequence_parallel` counts the ops split so): True, False, or None
    (default: only where `memory_budget` needs it).
    `capture_once`: trace each run of identical layers once and repeat it in the graph (autoshard.capture.repeats; the same graph, in a time flat in depth), or
    trace every layer.
    """
    world_size = _check_world_size(world_size)
    check_outputs(outputs)
    unknown = set(cost_options) - _COST_KEYS
    if unknown:
        raise TypeError(f"plan() got unknown options {sorted(unknown)}; cost knobs are {sorted(_COST_KEYS)}")
    cost = cost_model or CostModel(**cost_options)
    if search not in ("greedy", "exact", "optimal"):
        raise ValueError(f"search must be 'greedy', 'exact' or 'optimal', got {search!r}")
    _check_plain(model)
    with _collector_paused():
        cap = capture(model, example_inputs, tracer=tracer, tokens=tokens, once=capture_once)
        result = plan_graph(cap.gm, world_size, cost, pin=pin, search=search, tracer=cap.tracer,
                            notes=cap.notes, example=(cap.args, cap.kwargs), outputs=outputs,
                            blocks=B.resolve_blocks(model, "auto") if cost.memory_budget is not None else (),
                            sequence_parallel=sequence_parallel, autocast=cap.autocast)
    _without_weights(cap.gm, model)
    return result


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a plan is made, back on after (where it was on):
    planning makes millions of small objects that live until it ends, and each full collection walks
    them all (two took 0.5 s of the 5 s an 80-layer LLaMA's plan takes). Nothing is freed later than
    it would be: the collector runs again at its next threshold."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _without_weights(gm: fx.GraphModule, model: nn.Module) -> None:
    """A Plan keeps its captured graph (for its views and for rewriting other ranks), not the
    model's weights: the graph's references to the model's parameters and buffers become meta
    tensors of the same shapes (ties kept), so neither a plan nor a parallel module keeps a full
    model alive once the model is dropped. Submodules shared with the model (symbolic_trace's
    leaf modules) are the model's own and stay as they are; lifted constants are kept."""
    owned = {id(m) for m in model.modules()}
    weights = {id(t) for t in [*model.parameters(), *model.buffers()]}
    memo = {}
    for mod in gm.modules():
        if id(mod) in owned:
            continue
        for store in (mod._parameters, mod._buffers):
            for k, t in store.items():
                if t is None or t.is_meta or id(t) not in weights:
                    continue
                if id(t) not in memo:
                    meta = torch.empty_like(t, device="meta")
                    memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else meta
                store[k] = memo[id(t)]


def _check_plain(model: nn.Module) -> None:
    """A model whose parameters are already DTensors (fully_shard or parallelize_module applied
    first) cannot be planned: say which, and the order that works."""
    from torch.distributed.tensor import DTensor
    name, t = next(((n, t) for n, t in model.named_parameters() if isinstance(t, DTensor)), (None, None))
    if name is not None:
        raise ShardingError(f"{type(model).__name__}'s parameter {name} is already a DTensor over {t.device_mesh} "
                            f"({t.placements}): fully_shard or DTensor parallelism was applied before autoshard; "
                            "parallelize the plain model first, then fully_shard its blocks and root on the "
                            "data-parallel mesh")


def _fingerprint(model: nn.Module) -> tuple:
    return tuple(sorted((n, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)))


def parallelize(model: nn.Module, world_size: int, example_inputs=None, *, plan: Plan | None = None,
                group=None, rank: int | None = None, load=None, device=None, progress=None,
                dropout_masks: str = "independent", blocks="auto", outputs: str | None = None,
                overlap: bool = False, only=None, check_inputs: int | None = 100,
                **plan_options) -> fx.GraphModule:
    """This rank's tensor-parallel GraphModule of `model` (plans first unless `plan` is given).

    With a process group (the current tensor-parallel group of autoshard.distributed, or
    `group=`: a ProcessGroup or a 1-D DeviceMesh such as `mesh["tp"]`) its size must be `world_size`. With no process group, `rank=` builds that rank's
    module for inspection; running it needs the group. Replicated parameters are shared with
    `model` (not copied); sharded ones are new tensors holding this rank's shard.

    `model` may be built under `torch.device("meta")`: planning allocates nothing, and each rank
    then fills only its shards, from `load=` (a .safetensors file, a Hugging Face directory, a
    torch.save file or a mapping of tensors; autoshard.io.loading) or, without it, by each module's
    own initialisation. `device=` places the filled tensors; `progress` shows a bar while reading.

    A model in eval mode also gets the example call's evaluation graph built here, so its first
    call plans nothing. Dropout follows `gm.train()` / `gm.eval()` whatever mode `model` was captured in, and draws
    from autoshard's streams (autoshard.runtime.rng; seeded alike over the group here, or by
    `autoshard.manual_seed`): replicated activations get one mask on every rank, sharded ones
    independent masks per rank, or with `dropout_masks="single_process"` each rank's slice of the
    mask one process would draw under the same seed.

    `blocks`: the submodules kept as modules of their own, each a GraphModule the skeleton calls
    (so fully_shard, checkpoint_wrapper and torch.compile apply per block): "auto" (the children
    of every ModuleList / Sequential of one class: a transformer's layers), a list of qualified
    names or module classes, or None for one flat graph (autoshard.rewrite.blocks).

    `outputs` (default "full", or the given plan's): "full" returns every output whole, as the
    model does; "sharded" returns each output the plan leaves split as a
    `torch.distributed.tensor.DTensor` over the tensor-parallel group (`Shard(d)`: no collective;
    `.full_tensor()` gathers it), whole ones (the loss) as plain tensors. Every call signature
    of the module follows it. A module built with `rank=` and no process group can be
    inspected but not run: its DTensors need the group.

    `only(name)`: with a model on meta or `load=`, fill only the tensors it keeps (a pipeline
    rank's stages: autoshard.pipeline); the others stay on meta and cannot run.

    `overlap=True`: each column-parallel layer (the linear layers reading one copy of their input)
    runs as one autograd function whose backward all-reduces the input gradient while it computes
    the weight gradients, as Megatron does (autoshard.runtime.overlap); the same values.

    Under a process group of more than one rank the module is ready for the training loops people
    use (autoshard.io.training: the Trainer, accelerate, Lightning): it averages its gradients over
    its data-parallel replicas, clips by the norm over every shard, refuses a DDP wrap across its
    shards, and `check_inputs`: the ranks compare their inputs on the first call of each call
    signature and every `check_inputs`-th call after (0: first calls only; None: never), raising
    InputMismatchError where a batch was split over tensor-parallel ranks. Not with `only` (a
    pipeline's stages: autoshard.pipeline's Pipeline averages and steps them).
    """
    world_size = _check_world_size(world_size)
    _check_plain(model)
    block_names = B.resolve_blocks(model, blocks)
    if dropout_masks not in MASKS:
        raise ValueError(f"dropout_masks must be one of {MASKS}, got {dropout_masks!r}")
    if outputs is not None:
        check_outputs(outputs)
    source = loading.open_source(load) if load is not None else None             # opened once, read per rank
    chosen = loading.check_source(model, source) if source is not None else None  # before any allocation
    if load is None and has_meta(model):
        loading.check_initialisable(model)
    key = None
    if D.is_initialized():
        pg = D.get_group(group)
        size = torch.distributed.get_world_size(pg)
        if size != world_size:
            raise ProcessGroupError(f"parallelize({type(model).__name__}, world_size={world_size}) but the "
                                    f"tensor-parallel group has {size} ranks")
        if group is not None:
            key = D.register_group(pg)
            from torch.distributed.device_mesh import DeviceMesh
            if isinstance(group, DeviceMesh):
                D.register_mesh(group)        # the DTensors of outputs="sharded" are over the caller's mesh
        grank = torch.distributed.get_rank(pg)
        if rank is not None and rank != grank:
            raise ProcessGroupError(f"rank={rank} but this process is rank {grank} of its tensor-parallel group")
        rank = grank
    elif rank is None:
        if world_size != 1:
            raise ProcessGroupError(f"parallelize(world_size={world_size}) needs an initialised process group "
                                    "(torch.distributed.init_process_group), or rank= to build one rank's module "
                                    "for inspection")
        rank = 0
    elif not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is outside 0..{world_size - 1}")
    if plan is None:
        plan = globals()["plan"](model, world_size, example_inputs, outputs=outputs or "full", **plan_options)
    else:
        if plan_options:
            raise TypeError(f"plan options {sorted(plan_options)} given together with plan=")
        if outputs is not None and outputs != plan.outputs:
            raise ShardingError(f"outputs={outputs!r} but the plan was made with outputs={plan.outputs!r}; "
                                f"plan with autoshard.plan(..., outputs={outputs!r})")
        if plan.world_size != world_size:
            raise ShardingError(f"the plan was made for world_size {plan.world_size}, not {world_size}")
        if plan.fingerprint != tuple(sorted(_fingerprint(model))) and not set(plan.fingerprint) <= set(_fingerprint(model)):
            missing = sorted(set(plan.fingerprint) - set(_fingerprint(model)))[:4]
            raise ShardingError(f"the plan was made for another model: {type(model).__name__} lacks parameters "
                                f"{missing} of the planned one")
    if D.is_initialized():
        _check_same_plan(plan, pg)
        rng.synchronise(pg, rank)
    else:
        rng.ensure_seeded(rank)
    if plan.checkpointed and not set(plan.checkpointed) <= set(block_names):     # recomputed blocks are kept as modules
        block_names = B.resolve_blocks(model, [*block_names, *plan.checkpointed])
    with autocast_as(plan.autocast):      # the recipe the plan's graph was captured under, whatever the caller's
        gm = rewrite(plan, rank, key, model, dropout_masks, overlap)
    if load is not None or device is not None or has_meta(model):
        loading.materialize(gm, model, rank, world_size, source=source, chosen=chosen, device=device,
                            progress=progress, only=only)
    for note in B.keep_blocks(gm, block_names, {n: type(model.get_submodule(n)).__name__ for n in block_names}):
        warnings.warn(f"autoshard: {note}", stacklevel=2)
    gm.__dict__["_autoshard_blocks"] = {n: gm.get_submodule(n) for n in block_names
                                        if isinstance(gm.get_submodule(n), fx.GraphModule)}
    recompute_blocks(gm, plan.checkpointed)
    gm.train(model.training)             # captured in train mode; the module starts in the model's mode
    hf.attach(gm, model)             # a Hugging Face model's config, generation_config, save_pretrained
    with autocast_as(plan.autocast):      # the example's graph keyed, and an eval-mode one built, under it
        signatures.install(gm, model, plan.example,
                           _signature_builder(plan, rank, key, pg if D.is_initialized() else None, dropout_masks,
                                              overlap))
    torch.clear_autocast_cache()      # planning's casts (of fake and meta weights) must not serve a call in this region
    if D.is_initialized() and torch.distributed.get_world_size(pg) > 1 and only is None:
        training.attach(gm, pg, check_inputs, group)     # (a pipeline's stages: its Pipeline steps them)
    return gm


def _signature_builder(plan: Plan, rank: int, key, pg, dropout_masks: str, overlap: bool):
    """How a call with another signature gets its graph (autoshard.rewrite.signatures): captured on the
    meta copy of the model with the call's inputs, planned with the module's layouts fixed (and its
    sequence parallelism: a model trained in eval mode, dropout off, keeps the stream split), checked
    to be the same plan on every rank, rewritten for this rank."""
    def build(capture_on, bind_to, call, train, step=None):
        """`step` (autoshard.io.generate): capture `step.module(model)`'s forward instead, every
        layer traced, planned with the step's `held` outputs returned as each rank holds them."""
        args, kwargs = call.arrangement().split(call)
        if step is not None:
            args, kwargs = step.inputs(args, kwargs)       # whole-shaped stand-ins for the held pieces
        if plan.tracer != "export" and fake_mode_of(capture_on) is not None:
            capture_on = bind_to          # symbolic_trace keeps dtypes symbolic: the meta copy in the recipe's dtypes
        if pg is not None:
            capture_on = _same_source(capture_on, bind_to, pg)
        if step is not None:
            capture_on = step.module(capture_on)
        try:
            cap = capture(capture_on, args, tracer=plan.tracer, kwargs=kwargs, train=train, once=step is None)
        except CaptureError as e:
            raise CaptureError(f"the {'training' if train else 'evaluation'} graph of a call with "
                               f"({call.describe()}) could not be captured:\n{e}") from e
        try:
            variant = plan_graph(cap.gm, plan.world_size, plan.cost_model, search=plan.search, tracer=cap.tracer,
                                 notes=cap.notes, example=(cap.args, cap.kwargs), layouts=dict(plan.layouts),
                                 outputs=plan.outputs if step is None else "full",
                                 held=frozenset() if step is None else step.held(cap.gm), inference=step is not None,
                                 held_inputs=None if step is None else step.held_inputs(cap.gm),
                                 sequence_parallel=step is None and bool(plan.sequence_parallel),
                                 autocast=cap.autocast)
        except ShardingError as e:
            raise ShardingError(f"a call with ({call.describe()}) cannot run on this module: {e}") from e
        if pg is not None:
            _check_same_plan(variant, pg)
        return rewrite(variant, rank, key, bind_to, dropout_masks, overlap), variant
    return build


def _same_source(model: nn.Module, on_meta: nn.Module, pg) -> nn.Module:
    """What every rank captures a new call on: the model itself only where every rank still has
    it, else the meta copy everywhere (a model that one rank's garbage collector has freed and
    another's not yet would make the ranks capture, and plan, different graphs)."""
    alive = torch.tensor([int(model is not on_meta)], dtype=torch.int64, device=D.device_of(pg))
    torch.distributed.all_reduce(alive, op=torch.distributed.ReduceOp.MIN, group=pg)
    return model if alive.item() else on_meta


def _plan_digest(plan: Plan) -> int:
    """A number that differs when two plans would shard or communicate differently."""
    text = repr((sorted((k, str(v)) for k, v in plan.layouts.items()),
                 [(r.node, str(r.src), str(r.dst), str(r.grad), r.consumers, r.via) for r in plan.redistributions],
                 plan.outputs, sorted((k, str(v)) for k, v in plan.output_placements.items())))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _check_same_plan(plan: Plan, pg) -> None:
    """Every rank of the group must build from the same plan, or collectives would not pair up
    (a hang until the timeout); compare digests and say which ranks differ."""
    mine = torch.tensor([_plan_digest(plan)], dtype=torch.int64, device=D.device_of(pg))
    every = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size(pg))]
    torch.distributed.all_gather(every, mine, group=pg)
    digests = [int(t.item()) for t in every]
    if len(set(digests)) > 1:
        raise ProcessGroupError(f"the ranks of the tensor-parallel group planned differently (plan digests "
                                f"{digests}); plan once with the same model, inputs and options on every rank, "
                                "or pass the same plan= everywhere")


def from_pretrained(path, world_size: int, example_inputs=None, *, dtype=None, model_class=None, device=None,
                    rank: int | None = None, progress=None, **plan_options):
    """This rank's GraphModule of the Hugging Face checkpoint directory `path`, never building the
    full model: config -> meta model -> plan -> this rank's slices of the weights.

    `example_inputs` (default: input_ids of shape (1, tokens)) shape the plan; `dtype` (default:
    the config's) is the dtype the weights are converted to; `model_class` defaults to
    AutoModelForCausalLM; `device` holds the shards; other options go to `plan`."""
    if not os.path.isdir(os.fspath(path)):
        raise LoadError(f"from_pretrained: {os.fspath(path)!r} is not a checkpoint directory")
    model = loading.meta_model(path, dtype, model_class)
    if example_inputs is None:
        example_inputs = loading.example_ids(model, plan_options.pop("tokens", 512))
    plan_options.setdefault("tracer", "export")
    return parallelize(model, world_size, example_inputs, load=path, device=device, rank=rank, progress=progress,
                       **plan_options)
