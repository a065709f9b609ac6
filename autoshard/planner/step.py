"""A training step of a whole job predicted from autoshard's own plan of one layer of the model.

`profile` reads a tensor-parallel Plan of the model built with one layer (capture of identical layers
is per layer anyway, so one layer is every layer): for the layer, and for what runs before it
(embeddings: the first stage's) and after it (final norm, head, loss: the last stage's), each op's
work on one rank at the plan's placements (matmuls by shape, from the captured shapes, divided where
the plan splits them; scaled_dot_product_attention as its two matmuls, half of them under a causal
mask; other ops the bytes they move), the plan's own collectives and redistributions (forward and
backward, exact bytes), the attention-score ops (what Megatron's selective recomputation makes
again), the parameters each part holds (read where the graph reads them), and the saved activations of the
plan's memory model (`memory.step_memory`) with nothing, the scores or the whole layer recomputed.
All of it for one sequence; a microbatch of b sequences scales it by b.

`estimate_step` lays out the job of a `cluster.Layout`: the layers cut into pp x interleave stages
(`stages.balance`), one microbatch's forward and backward of each stage (the efficiency model of
`cluster`; tensor-parallel collectives exposed, as Megatron runs them; recomputation in backward),
the schedule replayed (`stages.simulate`: 1F1B, or Interleaved1F1B; sends between stages), the
gradients' reduction over dp overlapped with the last microbatch's backward (FSDP: each layer's
gathers and reduce-scatter overlapped with the layer's compute), the optimizer's update; memory: the
training state (Megatron's mixed precision: 16-bit weights, fp32 gradients, fp32 master weights and
two Adam moments, 18 bytes a parameter; FSDP2's: fp32 parameters, gradients and moments sharded over
dp, 16 bytes, and the gathered 16-bit weights of two layers) and the activations of the microbatches
the schedule holds in flight on its first rank (its last rank: one, with the head's).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..capture.repeats import owner
from ..errors import MemoryBudgetError, ShardingError
from ..runtime.placements import Partial, Replicate
from .cluster import (USABLE, Cluster, Estimate, Layout, comm_time, links, matmul_time,
                      memory_time)
from .cost import flops
from .rules.registry import family_of
from .stages import balance, simulate

_VIEWS = {"view", "reshape", "permute", "transpose", "expand", "getitem", "split", "chunk", "unsqueeze", "squeeze",
          "t", "size", "flatten", "unflatten", "getattr", "unbind", "narrow", "slice", "select", "view_as",
          "expand_as", "_unsafe_view", "alias", "detach", "arange", "full", "ones", "zeros", "empty"}
ADAM_MEGATRON = (2, 4, 4 + 8)        # bytes a parameter: 16-bit weight, fp32 gradient, fp32 master + 2 moments
ADAM_FSDP = (4, 4, 8)                # fp32 parameter, gradient, 2 moments (sharded over dp)


@dataclass(frozen=True)
class Part:
    """One rank's work of one sequence in a part of the model (the layer, before it, after it):
    `gemms` ((batch, m, n, k, scales batch?, backward factor), ...), `moved` bytes of element-wise
    ops, `forward`/`backward` collectives ((kind, bytes), ...), `scores`: the attention-score ops'
    gemms and bytes (selective recomputation), `flops`: forward + backward matmul flops."""

    gemms: tuple
    moved: float
    forward: tuple
    backward: tuple
    score_gemms: tuple
    score_moved: float
    flops: float
    eager: float = 0.0           # bytes element-wise ops move run one kernel an op (no fusion)


@dataclass(frozen=True)
class Profile:
    """What a step needs of the model at one tensor-parallel degree (one sequence of `seq` tokens)."""

    tp: int
    sequence_parallel: bool
    seq: int
    layers: int
    layer: Part
    first: Part
    last: Part
    params_layer: float          # elements a rank holds
    params_first: float
    params_last: float
    params_outside: float        # first and last together, tied weights once
    activations: dict            # recompute -> saved bytes of a layer
    act_first: float
    act_last: float
    workspace: float             # bytes the last part makes and drops in backward (logits' gradient)
    send: float                  # bytes a stage sends the next (the layer's input)
    dtype_bytes: int


def _tensor(v):
    return v if isinstance(v, torch.Tensor) else None


def _name(node) -> str:
    t = node.target
    return (t if isinstance(t, str) else getattr(t, "__name__", str(t))).split(".")[-1]


def _square(v, seq: int) -> bool:
    return v is not None and v.dim() >= 2 and tuple(v.shape[-2:]) == (seq, seq)


def _gemms(node, share: float, dec) -> tuple:
    """((batch, m, n, k, scales_batch, backward factor), ...) of a matmul-family or sdpa node on one rank."""
    out = _tensor(node.meta.get("val"))
    ins = [_tensor(a.meta.get("val")) for a in node.all_input_nodes]
    if _name(node) == "scaled_dot_product_attention":
        q, k, v = ins[:3]
        causal = bool(node.kwargs.get("is_causal", False)) or (len(node.args) > 5 and bool(node.args[5]))
        half = 0.5 if causal else 1.0
        batch = q.shape[:-2].numel() * share * half
        return ((batch, q.shape[-2], k.shape[-2], q.shape[-1], True, 2.5),
                (batch, q.shape[-2], v.shape[-1], k.shape[-2], True, 2.5))
    x = next((t for t in ins if t is not None and t.dim() >= 2), None)
    if out is None or x is None or out.dim() < 1:
        return ()
    k = x.shape[-1]
    n = out.shape[-1]
    weighted = any(a.op == "get_attr" for a in node.all_input_nodes)
    if weighted or out.dim() < 3:
        m, batch = out.numel() // max(n, 1), 1
        if isinstance(getattr(dec, "output", None), Partial):
            k = k * share
        else:
            n = n * share
        return ((batch, m, n, k, False, 2.0),)
    m = out.shape[-2]
    return ((out.shape[:-2].numel() * share, m, n, k, True, 2.0),)


def _fused(node) -> bool:
    """Whether `node` is an element-wise op (not a matmul, not a view): one kernel with its neighbours
    of the same kind (Megatron's fused kernels, torch.compile's fusion)."""
    return node.op in ("call_function", "call_method") and _name(node) not in _VIEWS and \
        family_of(node) != "matmul" and _name(node) != "scaled_dot_product_attention" and \
        _tensor(node.meta.get("val")) is not None


def _source(node):
    """The op whose output `node` views (itself if it is not a view)."""
    while node.op in ("call_function", "call_method") and _name(node) in _VIEWS and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _readers(node) -> list:
    """The ops that read `node`'s output, through views."""
    out = []
    for u in node.users:
        out += _readers(u) if u.op in ("call_function", "call_method") and _name(u) in _VIEWS else [u]
    return out


def score_nodes(nodes, seq: int) -> frozenset:
    """Names of attention's score ops: a matmul of two activations (q @ k^T) whose output ends in
    (seq, seq), and the ops that make a tensor of that shape from one (scale, mask, softmax, dropout)."""
    out = set()
    for n in nodes:
        if n.op not in ("call_function", "call_method") or not _square(_tensor(n.meta.get("val")), seq):
            continue
        srcs = [_source(a) for a in n.all_input_nodes]
        if family_of(n) == "matmul" and not any(a.op == "get_attr" for a in n.all_input_nodes) or \
                any(a.name in out for a in srcs):
            out.add(n.name)
    return frozenset(out)


def _part(nodes, plan, seq: int, scores=frozenset()) -> Part:
    p = plan.world_size
    by_name = {r.node: [] for r in plan.redistributions}
    for r in plan.redistributions:
        by_name[r.node].append(r)
    gemms, moved, fwd, bwd, sg, sm, fl, eager = [], 0.0, [], [], [], 0.0, 0.0, 0.0
    for node in nodes:
        for r in by_name.get(node.name, ()):
            fwd += [(k, r.nbytes) for k in r.forward]
            bwd += [(k, r.nbytes) for k in r.backward]
        if node.op not in ("call_function", "call_method", "call_module") or _name(node) in _VIEWS:
            continue
        dec = plan.nodes.get(node.name)
        if dec is not None:
            fwd += list(dec.comm)
        out = _tensor(node.meta.get("val"))
        share = 1.0 if dec is None or isinstance(dec.output, Replicate) or p == 1 else 1.0 / p
        score = node.name in scores
        if family_of(node) == "matmul" or _name(node) == "scaled_dot_product_attention":
            g = _gemms(node, share, dec)
            gemms += g
            fl += sum(6.0 * b * m * n * k for b, m, n, k, _, _ in g) \
                if _name(node) == "scaled_dot_product_attention" else flops(node, None) * share
            if score or any(_source(a).name in scores for a in node.all_input_nodes):
                sg += g
            continue
        if out is None:
            continue
        ins = [t for t in (_tensor(a.meta.get("val")) for a in node.all_input_nodes) if t is not None and t.dim()]
        eager += (sum(t.numel() * t.element_size() for t in ins) + out.numel() * out.element_size()) * share
        nb = sum(t.numel() * t.element_size() for t in (_tensor(a.meta.get("val")) for a in node.all_input_nodes
                                                         if not _fused(_source(a)))
                 if t is not None and t.dim())         # a fused chain reads what comes from outside it once
        written = [u for u in _readers(node)]
        if len(written) != 1 or not _fused(written[0]):       # and writes what leaves it
            nb += out.numel() * out.element_size()
        nb *= share
        moved += nb
        if score:
            sm += nb
    return Part(tuple(gemms), moved, tuple(fwd), tuple(bwd), tuple(sg), sm, fl, eager)


def profile(plan, blocks: list, seq: int, layers: int | None = None) -> Profile:
    """The Profile of `plan` for sequences of `seq` tokens (the plan's example: one of them): a plan
    of the model built with few identical layers `blocks` (one: the published model's depth built
    with one layer), the real model having `layers` (default: len(blocks)). The layer is the first
    block; what runs before the first block is the first part, after the last the last part."""
    if plan.memory_with is None:
        raise ShardingError("profile: the plan was made without memory_with (plan_graph(..., memory_with=True))")
    names = frozenset(blocks)
    nodes = list(plan.graph_module.graph.nodes)
    whose = [owner(n, names) for n in nodes]
    inside = [w == blocks[0] for w in whose]
    if not any(inside):
        raise ShardingError(f"profile: no op of the plan runs inside {blocks[0]!r}")
    any_block = [w is not None for w in whose]
    a = any_block.index(True)
    z = len(nodes) - 1 - any_block[::-1].index(True)
    scores = score_nodes(nodes, seq)
    layer = _part([n for n, i in zip(nodes, inside) if i], plan, seq, scores)
    first, last = _part(nodes[:a], plan, seq), _part(nodes[z + 1:], plan, seq)
    width = next((p.element_size() for p in plan.graph_module.parameters() if p.is_floating_point()), 2)
    p = plan.world_size
    layer_params, first_params, last_params = _params(plan, nodes, inside, a, z)
    send = 0.0                  # what the layer reads from before it: its input (split on tokens under SP)
    at = {n: i for i, n in enumerate(nodes)}
    for n in (n for n, i in zip(nodes, inside) if i):
        for x in n.all_input_nodes:
            if x.op != "get_attr" and not inside[at[x]] and _tensor(x.meta.get("val")) is not None:
                v = x.meta["val"]
                if v.is_floating_point() and v.dim() >= 2:
                    dec = plan.nodes.get(x.name)
                    split = p > 1 and dec is not None and not isinstance(dec.output, (Replicate, Partial))
                    send = max(send, v.numel() * v.element_size() / (p if split else 1))
    k = len(blocks)
    none = plan.memory_with(device="cuda")
    full = plan.memory_with(checkpointed=tuple(blocks), device="cuda").activations
    selective = plan.memory_with(scores=scores, device="cuda").activations
    outside = max(0.0, full - k * send)
    early = plan.memory_with(device="cuda", before=nodes[a].name).activations     # what the first part saves
    acts = {"none": (none.activations - outside) / k, "selective": (selective - outside) / k, "full": float(send)}
    workspace = 0.0 if none.peak_at == "optimizer step" else \
        max(0.0, none.peak - none.parameters - none.buffers - none.optimizer - none.gradients - none.activations)
    return Profile(tp=p, sequence_parallel=bool(plan.sequence_parallel), seq=seq, layers=layers or k, layer=layer,
                   first=first, last=last, params_layer=layer_params, params_first=first_params,
                   params_last=last_params, params_outside=plan.params_per_rank - k * layer_params,
                   activations=acts, act_first=float(early), act_last=max(0.0, outside - early),
                   workspace=workspace, send=send, dtype_bytes=width)


def _params(plan, nodes, inside, a: int, z: int) -> tuple:
    """Elements one rank holds of the first layer's parameters, of those read before the layers (the
    first stage's) and of those read after them (the last stage's; a tied embedding and head: both)."""
    p = plan.world_size
    at = {n: i for i, n in enumerate(nodes)}
    layer = first = last = 0.0
    seen = set()
    for n in nodes:
        if n.op != "get_attr" or n.target in seen or n.target not in plan.layouts:
            continue
        seen.add(n.target)
        v = _tensor(n.meta.get("val"))
        if v is None:
            continue
        size = v.numel() / (1 if isinstance(plan.layouts[n.target], Replicate) else p)
        users = [at[u] for u in n.users if u in at]
        if any(inside[u] for u in users):
            layer += size
        first += size if any(u < a for u in users) else 0.0
        last += size if any(u > z for u in users) else 0.0
    return layer, first, last


def _times(part: Part, cluster: Cluster, b: int, tp: int, link, fused: bool = True) -> dict:
    """Seconds of one microbatch of `b` sequences through `part` on one rank (`fused`: element-wise
    chains one kernel each, else one kernel an op)."""
    def gemm(g, backward):
        batch, m, n, k, batched, factor = g
        t = matmul_time(cluster, batch * b, m, n, k) if batched else matmul_time(cluster, batch, m * b, n, k)
        return t * (factor if backward else 1.0)
    bw, lat = link
    moved = part.moved if fused else part.eager
    return {"f": sum(gemm(g, False) for g in part.gemms) + memory_time(cluster, moved * b),
            "b": sum(gemm(g, True) for g in part.gemms) + 2 * memory_time(cluster, moved * b),
            "tf": sum(comm_time(k, nb * b, tp, bw, lat) for k, nb in part.forward),
            "tb": sum(comm_time(k, nb * b, tp, bw, lat) for k, nb in part.backward),
            "scores": sum(gemm(g, False) for g in part.score_gemms) + memory_time(cluster, part.score_moved * b)
            if part.score_gemms or part.score_moved else 0.0}


@functools.lru_cache(maxsize=4096)
def _counts(layers: int, chunks: int, first: float, last: float) -> tuple:
    """Layers a stage of `chunks` holds, the cut `stages.balance` makes of alike layers with the
    embedding (`first`) and the head (`last`) counted in layers' time."""
    starts = balance([1.0] * layers, chunks, first=first, last=last)
    return tuple(e - s for s, e in zip(starts, list(starts[1:]) + [layers]))


def _in_flight(pp: int, v: int, rank: int, chunks_m: int) -> int:
    """Chunk-microbatches whose activations rank `rank` holds at most (torch's and Megatron's warm-up
    of 1F1B and of the interleaved schedule, plus the one in its steady state)."""
    if pp == 1:
        return 1
    if v == 1:
        return min(chunks_m, pp - rank)
    return min(chunks_m, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)


def estimate_step(prof: Profile, cluster: Cluster, layout: Layout, global_batch: int, replay: bool = True,
                  fused: bool = True) -> Estimate:
    """The Estimate of one optimizer step of `global_batch` sequences under `layout`; `replay`: the
    pipeline's schedule replayed action by action (`stages.simulate`), else its textbook bubble (a
    search ranks by that, then replays the best); `fused`: element-wise chains run fused (Megatron's
    kernels, torch.compile), else one kernel an op (eager PyTorch)."""
    tp, pp, dp, b, v = layout.tp, layout.pp, layout.dp, layout.microbatch, layout.interleave
    if tp != prof.tp:
        raise ValueError(f"estimate: the profile is of tp {prof.tp} sp {prof.sequence_parallel}, not {layout.short()}")
    if global_batch % (dp * b):
        raise ShardingError(f"estimate: global batch {global_batch} is not a multiple of dp {dp} x microbatch {b}")
    m = global_batch // (dp * b)
    chunks = pp * v
    if chunks > prof.layers:
        raise ShardingError(f"estimate: {chunks} pipeline stages (pp {pp} x interleave {v}) but {prof.layers} layers")
    link = links(cluster, layout)
    lay, fst, lst = (_times(x, cluster, b, tp, link["tp"], fused) for x in (prof.layer, prof.first, prof.last))
    rc = {"none": 0.0, "selective": lay["scores"], "full": lay["f"] + lay["tf"]}[layout.recompute]
    per_layer = lay["f"] + lay["b"] + lay["tf"] + lay["tb"] + rc
    counts = _counts(prof.layers, chunks, round((fst["f"] + fst["b"] + fst["tf"] + fst["tb"]) / per_layer, 2),
                     round((lst["f"] + lst["b"] + lst["tf"] + lst["tb"]) / per_layer, 2))
    fwd, bwd, parts = [], [], []
    for s, c in enumerate(counts):
        extra = [x for x, on in ((fst, s == 0), (lst, s == chunks - 1)) if on]
        fwd.append(c * (lay["f"] + lay["tf"]) + sum(x["f"] + x["tf"] for x in extra))
        bwd.append(c * (lay["b"] + lay["tb"] + rc) + sum(x["b"] + x["tb"] for x in extra))
        parts.append({"compute": c * (lay["f"] + lay["b"]) + sum(x["f"] + x["b"] for x in extra),
                      "tp_comm": c * (lay["tf"] + lay["tb"]) + sum(x["tf"] + x["tb"] for x in extra),
                      "recompute": c * rc})
    schedule = "1F1B" if v == 1 else "Interleaved1F1B"
    work = [sum(fwd[s] + bwd[s] for s in range(r, chunks, pp)) for r in range(pp)]
    busy_rank = max(range(pp), key=work.__getitem__)
    if pp == 1:
        makespan = m * work[0]
    else:
        bw, lat = link["pp"]
        send = prof.send * b / (bw * 0.8) + lat
        if replay:
            makespan = simulate(schedule, pp, m, fwd, bwd, stages_per_rank=v, send=send).makespan
        else:               # the textbook bubble, (pp - 1) / v of a microbatch's work, and the sends on the way
            makespan = (m + (pp - 1) / v) * work[busy_rank] + 2 * (pp - 1) * send
    mine = [s for s in range(chunks) if s % pp == busy_rank]
    breakdown = {k: m * sum(parts[s][k] for s in mine) for k in ("compute", "tp_comm", "recompute")}
    breakdown["pipeline"] = max(0.0, makespan - sum(breakdown.values()))

    # parameters of the fullest rank, data parallelism, the optimizer
    held = []
    for r in range(pp):
        n = sum(counts[s] for s in range(chunks) if s % pp == r) * prof.params_layer
        if pp == 1:
            n += prof.params_outside
        else:
            n += (prof.params_first if r == 0 else 0) + (prof.params_last if r == pp - 1 else 0)
        held.append(n)
    params = max(held)
    bw, lat = link["dp"]
    layers_rank = max(1, max(sum(counts[s] for s in range(chunks) if s % pp == r) for r in range(pp)))
    if layout.fsdp and dp > 1:
        gather = comm_time("all_gather", params * 2, dp, bw, lat)
        scatter = comm_time("reduce_scatter", params * 4, dp, bw, lat)
        per_layer_f, per_layer_b = gather / layers_rank, (gather + scatter) / layers_rank
        hidden_f = max(0.0, per_layer_f - lay["f"] - lay["tf"]) * layers_rank
        hidden_b = max(0.0, per_layer_b - lay["b"] - lay["tb"] - rc) * layers_rank
        exposed = m * (hidden_f + hidden_b) + per_layer_f + per_layer_b
        state = params * sum(ADAM_FSDP) / dp + 2 * 2 * prof.params_layer
        weights, grads, opt = params * ADAM_FSDP[0] / dp + 4 * prof.params_layer, params * 4 / dp, params * 8 / dp
    else:
        reduce = comm_time("all_reduce", params * 4, dp, bw, lat) if dp > 1 else 0.0
        window = sum(bwd[s] for s in mine)            # the last microbatch's backward of the rank
        exposed = max(reduce - window, reduce / layers_rank) if dp > 1 else 0.0
        state = params * sum(ADAM_MEGATRON)
        weights, grads, opt = params * 2, params * 4, params * 12
    update = memory_time(cluster, params / (dp if layout.fsdp else 1) * 2 * sum(ADAM_FSDP))
    breakdown["dp_comm"] = exposed
    breakdown["compute"] += update
    step = makespan + exposed + update

    # activations: the first rank's microbatches in flight, the last rank's one with the head's
    act = prof.activations[layout.recompute] * b
    per_chunk = max(counts) * act
    first_rank = _in_flight(pp, v, 0, m * v) * per_chunk + _in_flight(pp, v, 0, m * v) * prof.act_first * b
    last_rank = _in_flight(pp, v, pp - 1, m * v) * per_chunk + (prof.act_last + prof.workspace) * b
    if pp == 1:
        activations = act * prof.layers + (prof.act_first + prof.act_last + prof.workspace) * b
    else:
        activations = max(first_rank, last_rank)
    peak = state + activations
    tokens = global_batch * prof.seq
    flop = (prof.layer.flops * prof.layers + prof.first.flops + prof.last.flops) * tp * global_batch
    gpus = layout.gpus
    parts_mem = {"parameters": int(weights), "gradients": int(grads), "optimizer": int(opt),
                 "activations": int(activations)}
    return Estimate(layout=layout, step_time=step, memory=int(peak), parts=parts_mem,
                    tokens_per_s_per_gpu=tokens / step / gpus, mfu=flop / (step * gpus * cluster.peak),
                    breakdown=breakdown, fits=peak <= USABLE * cluster.memory, schedule=schedule if pp > 1 else "",
                    microbatches=m)


def check_fits(estimates, cluster: Cluster) -> None:
    """A MemoryBudgetError naming the smallest peak where none of `estimates` fits."""
    if estimates and not any(e.fits for e in estimates):
        low = min(estimates, key=lambda e: e.memory)
        raise MemoryBudgetError(f"no layout fits {cluster.gpus} x {cluster.gpu} ({USABLE:.0%} of "
                                f"{cluster.memory / 2 ** 30:.1f} GiB usable): the smallest peak is "
                                f"{low.memory / 2 ** 30:.1f} GiB, {low.layout.short()}")

