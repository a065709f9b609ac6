"""Autograd-aware collectives over a tensor-parallel group (their bytes counted by `counters`).

Each collective is one small autograd function whose backward is the dual of its forward
(Megatron's mappings.py): copy/all-reduce, scatter/all-gather, reduce-scatter/all-gather,
all-to-all/all-to-all.  Every public wrapper returns its input unchanged at group size 1 and is
an FX leaf (`torch.fx.wrap`), so a traced or rewritten graph shows it as one named
`call_function` node.  In traced code pass `group` as a registry key string
(`autoshard.runtime.groups.register_group`), never as a ProcessGroup object.

Under `torch.compile` every collective is one of PyTorch's functional collectives
(`torch.ops._c10d_functional`, what DTensor dispatches), traced into its graph (fullgraph, no
break at a collective), where inductor may reorder them; small CPU all-reduces and all-gathers
are this module's custom ops instead (`autoshard::all_reduce`, `autoshard::all_gather`, see
`_in_graph`: compiled decode and training steps alike, unless inductor is asked to reorder
collectives for overlap), which run c10d's own ops as eager does.
Eager runs all-reduces and all-gathers as c10d's own ops (`dist.all_reduce` on a copy,
`dist.all_gather_single`): on gloo a functional all-reduce of 4 KiB took 3 to 5 times as long as
c10d's (2 ranks, measured; the cause inside c10d was not looked into), which a decode step of
small collectives pays on each. Where a gloo group opted in to shared memory (`shm`, for CPU
inference: `AUTOSHARD_SHM=1`), small CPU all-reduces and all-gathers of the ranks of one host go
through its segment instead, eager and compiled alike. The others stay functional, waited for at
once. The byte counters record eager runs only, whichever transport carried them.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.fx

from ..errors import ProcessGroupError
from . import shm
from .counters import CommCounter, count_comm, ring_bytes, record  # noqa: F401  (count_comm, ring_bytes: public here too)
from .groups import get_group, is_initialized, tensor_parallel_mesh
from .pieces import cat_along, checked_dim, pad_along, split_along
from .placements import block_sizes, blocks_of, piece_sizes

__all__ = ["copy_to", "reduce_from", "scatter_to", "slice_partial", "slice_held", "gather_from", "reduce_scatter",
           "all_gather", "all_to_all", "to_dtensor", "ring_bytes", "count_comm", "CommCounter"]

# ----------------------------------------------------------------------------- raw communication

functional = torch.ops._c10d_functional     # PyTorch's functional collectives: traced by torch.compile


def _group_name(group) -> str:
    return group.group_name


def count_eager(op, kind, direction, t, p, group, times: int = 1) -> None:
    """Record a collective on the full tensor, `times` the bytes of `t` (eager only: a compiled
    graph has no counters)."""
    if not torch.compiler.is_compiling():
        record(op, kind, direction, t.nbytes * times, p, group)


def eager_all_reduce(x: torch.Tensor, group, reduce_op: str = "sum", inplace: bool = False) -> torch.Tensor:
    """c10d's in-place all-reduce on a contiguous copy of `x` (on `x` itself with `inplace`), or
    the group's shared-memory segment where it opted in and `x` fits (`shm.all_reduce`)."""
    out = shm.all_reduce(x, group, reduce_op, inplace)
    if out is None:
        out = x if inplace else x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=getattr(dist.ReduceOp, reduce_op.upper()), group=group)
    return out


def eager_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's flat contiguous `x` in rank order, [p * x.numel()]: c10d's, or the segment's."""
    out = shm.all_gather(x, group)
    if out is None:
        out = x.new_empty(group.size() * x.numel())
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)
    return out.view(-1)


def _in_graph(x: torch.Tensor) -> bool:
    """Whether a collective of `x` traced by torch.compile calls this module's custom ops (a CPU
    tensor of at most shm.LIMIT bytes) rather than PyTorch's functional ones; decided from what
    tracing sees, the same on every rank. Not where inductor is asked to reorder collectives for
    overlap (its passes move the functional ones), nor for an `x` that requires grad where grad is
    on (the ops have no derivative: autoshard's autograd functions call them with grad off)."""
    from torch._inductor import config as inductor_config
    return x.device.type == "cpu" and x.numel() * x.element_size() <= shm.LIMIT and \
        not (torch.is_grad_enabled() and x.requires_grad) and not inductor_config.reorder_for_compute_comm_overlap


@torch.library.custom_op("autoshard::all_reduce", mutates_args=())
def graph_all_reduce(x: torch.Tensor, group_name: str, reduce_op: str) -> torch.Tensor:
    """eager_all_reduce as an op a compiled graph calls (opaque to inductor); `group_name`, the
    process group's name."""
    return eager_all_reduce(x, dist.distributed_c10d._resolve_process_group(group_name), reduce_op)


@graph_all_reduce.register_fake
def _(x, group_name, reduce_op):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("autoshard::all_gather", mutates_args=())
def graph_all_gather(x: torch.Tensor, group_name: str, p: int) -> torch.Tensor:
    """eager_all_gather of a flat `x` as an op a compiled graph calls: [p * x.numel()], rank order."""
    return eager_all_gather(x.contiguous(), dist.distributed_c10d._resolve_process_group(group_name))


@graph_all_gather.register_fake
def _(x, group_name, p):
    return x.new_empty(p * x.numel())


def raw_all_reduce(x, group, op="copy_to", direction="forward", reduce_op="sum", inplace=False):
    """Sum (or `reduce_op`: "max", "min", ...) of `x` over the group, in a fresh contiguous tensor
    (in `x` itself with `inplace`, eager only, which needs `x` contiguous)."""
    if not torch.compiler.is_compiling():
        out = eager_all_reduce(x, group, reduce_op, inplace)
    elif _in_graph(x):                            # compiled, a small CPU tensor: c10d's own op (or the segment)
        out = torch.ops.autoshard.all_reduce(x.contiguous(), _group_name(group), reduce_op)
    else:
        out = functional.wait_tensor(functional.all_reduce(x.contiguous(), reduce_op, _group_name(group)))
    count_eager(op, "all_reduce", direction, out, group.size(), group)
    return out


def _stacked_gather(x, group):
    """[p, *x.shape] tensor of every rank's `x`."""
    p, shape = dist.get_world_size(group), tuple(x.shape)
    x = x.contiguous().view(-1)
    if not torch.compiler.is_compiling():
        flat = eager_all_gather(x, group)
    elif _in_graph(x):
        flat = torch.ops.autoshard.all_gather(x, _group_name(group), p)
    else:
        flat = functional.wait_tensor(functional.all_gather_into_tensor(x, p, _group_name(group)))
    return flat.view((p,) + shape)


def gather_pieces(x, dim, chunks, group, size=None, op="gather_from", direction="forward", **cut):
    """Full tensor from every rank's Shard(dim, chunks) piece; `size`, the full size of `dim`
    where shards differ (torch.chunk's boundaries, in `unit`s, of equal blocks or of `parts`,
    in groups of `nest` ranks: the `cut` keywords): each is padded to the largest and cropped."""
    p = dist.get_world_size(group)
    dim = checked_dim(dim, x.dim())
    sizes = None if size is None else piece_sizes(size, p, chunks, **cut)
    if sizes is not None and sizes[0] == sizes[-1]:
        sizes = None                                 # equal pieces: nothing to pad
    stacked = _stacked_gather(x if sizes is None else pad_along(x, dim, sizes[0]), group)
    count_eager(op, "all_gather", direction, stacked, stacked.size(0), group)
    pieces = stacked.unbind(0)
    if sizes is not None:
        pieces = [piece.narrow(dim, 0, n) for piece, n in zip(pieces, sizes)]
    return cat_along(pieces, dim, chunks, **cut)


def _scatter(x, dim, chunks, group, **cut):
    """This rank's Shard(dim, chunks) piece of the full `x` (no communication; torch.chunk's
    boundaries, in `unit`s, where the size does not divide)."""
    pieces = split_along(x, dim, dist.get_world_size(group), chunks, uneven=True, **cut)
    return pieces[dist.get_rank(group)].contiguous()


def reduce_scatter_pieces(x, dim, chunks, group, op="reduce_scatter", direction="forward", **cut):
    """This rank's Shard(dim, chunks) piece of the sum of `x` over the group (an uneven split
    reduces equal pieces padded to the largest and crops its own)."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = checked_dim(dim, x.dim())
    pieces = split_along(x, dim, p, chunks, uneven=True, **cut)
    own, largest = pieces[rank].size(dim), pieces[0].size(dim)
    if any(piece.size(dim) != largest for piece in pieces):        # uneven: padded to the largest
        pieces = [pad_along(piece, dim, largest) for piece in pieces]
    stacked = torch.stack(pieces)
    out = functional.reduce_scatter_tensor(stacked.view(-1), "sum", p, _group_name(group))
    out = functional.wait_tensor(out).view(pieces[0].shape)
    count_eager(op, "reduce_scatter", direction, stacked, p, group)
    return out if own == out.size(dim) else out.narrow(dim, 0, own).contiguous()


def _all_to_all(x, src_dim, dst_dim, group, op="all_to_all", direction="forward"):
    """Move the shard from `src_dim` to `dst_dim`: split on dst_dim, exchange, cat on src_dim."""
    p = dist.get_world_size(group)
    src_dim, dst_dim = checked_dim(src_dim, x.dim()), checked_dim(dst_dim, x.dim())
    stacked = torch.stack(split_along(x, dst_dim, p))
    out = functional.wait_tensor(functional.all_to_all_single(stacked, [1] * p, [1] * p, _group_name(group)))
    count_eager(op, "all_to_all", direction, x, p, group, times=p)       # a rank holds 1/p of the tensor
    return torch.cat(out.unbind(0), src_dim)


# ----------------------------------------------------------------------------- autograd functions

class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return raw_all_reduce(grad, ctx.group, "copy_to", "backward"), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace=False):
        inplace = inplace and x.is_contiguous() and not torch.compiler.is_compiling()
        if inplace:
            ctx.mark_dirty(x)               # autograd sees the in-place write (version counter)
        return raw_all_reduce(x, group, "reduce_from", "forward", inplace=inplace)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, group, cut):
        out = _scatter(x, dim, chunks, group, **dict(cut))          # checks dim first
        ctx.args = (dim, chunks, group, x.size(dim))
        ctx.cut = dict(cut)
        return out

    @staticmethod
    def backward(ctx, grad):
        return gather_pieces(grad, *ctx.args, op="scatter_to", direction="backward", **ctx.cut), None, None, None, None


class _SlicePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, group, cut):
        out = _scatter(x, dim, chunks, group, **dict(cut))
        ctx.args = (x.shape, dim, chunks, dict(cut), dist.get_world_size(group), dist.get_rank(group))
        return out

    @staticmethod
    def backward(ctx, grad):
        shape, dim, chunks, cut, p, rank = ctx.args
        full = grad.new_zeros(shape)
        sizes = block_sizes(shape[dim], p, chunks, **cut)                                 # [block][rank]
        blocks = full.split(blocks_of(shape[dim], chunks, cut.get("parts")), dim)         # views of `full`
        for block, piece, share in zip(blocks, grad.split([s[rank] for s in sizes], dim), sizes):
            block.narrow(dim, sum(share[:rank]), share[rank]).copy_(piece)
        return full, None, None, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, group, size, cut):
        ctx.args = (dim, chunks, group)
        ctx.cut = dict(cut)
        return gather_pieces(x, dim, chunks, group, size, op="gather_from", **ctx.cut)

    @staticmethod
    def backward(ctx, grad):
        return _scatter(grad, *ctx.args, **ctx.cut), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, group, cut):
        out = reduce_scatter_pieces(x, dim, chunks, group, op="reduce_scatter", **dict(cut))
        ctx.args = (dim, chunks, group, x.size(dim))
        ctx.cut = dict(cut)
        return out

    @staticmethod
    def backward(ctx, grad):
        return gather_pieces(grad, *ctx.args, op="reduce_scatter", direction="backward", **ctx.cut), None, None, None, \
            None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, group, size, cut):
        ctx.args = (dim, chunks, group)
        ctx.cut = dict(cut)
        return gather_pieces(x, dim, chunks, group, size, op="all_gather", **ctx.cut)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_pieces(grad, *ctx.args, op="all_gather", direction="backward", **ctx.cut), None, None, \
            None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group):
        ctx.args = (src_dim, dst_dim, group)
        return _all_to_all(x, src_dim, dst_dim, group)

    @staticmethod
    def backward(ctx, grad):
        src_dim, dst_dim, group = ctx.args
        return _all_to_all(grad, dst_dim, src_dim, group, direction="backward"), None, None, None


# ----------------------------------------------------------------------------- public wrappers

def _fx_leaf(fn):
    """Record `fn` as one call_function node when called on FX proxies, however it was imported;
    anywhere else (eager, or traced by torch.compile: its collectives are PyTorch's functional
    ones, so they land in the compiled graph) it runs `fn`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.fx.Proxy):
                return a.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)
    return wrapper


def resolve(group):
    """(ProcessGroup, size) of `group`; raises ProcessGroupError when there is none."""
    pg = get_group(group)
    return pg, pg.size()


@_fx_leaf
def copy_to(x, group=None):
    """fwd: identity; bwd: all-reduce (sum) of the gradient (none without grad: x itself)."""
    if not torch.is_grad_enabled():
        return x
    pg, p = resolve(group)
    return x if p == 1 else _CopyTo.apply(x, pg)


@_fx_leaf
def reduce_from(x, group=None, inplace=False):
    """fwd: all-reduce (sum); bwd: identity. `inplace=True` sums into `x` itself (saves a copy,
    as Megatron does): only for an intermediate that nothing else reads, such as the output of a
    row-parallel matmul; the rewriter sets it where the graph proves that."""
    pg, p = resolve(group)
    return x if p == 1 else _ReduceFrom.apply(x, pg, inplace)


def _cut(unit=1, parts=None, nest=1) -> tuple:
    """How a shard's dim is cut (`placements.block_sizes`' unit / parts / nest), as the items of
    its keywords: `parts` a tuple (an FX graph may carry it as a list)."""
    return (("unit", int(unit)), ("parts", None if parts is None else tuple(int(q) for q in parts)), ("nest", int(nest)))


@_fx_leaf
def scatter_to(x, dim, chunks=1, group=None, unit=1, parts=None, nest=1):
    """fwd: keep this rank's Shard(dim, chunks) piece (torch.chunk's boundaries, in `unit`s of
    that many elements, where the size does not divide; `parts`: blocks of those sizes); bwd:
    all-gather the gradient."""
    pg, p = resolve(group)
    return x if p == 1 else _ScatterTo.apply(x, dim, chunks, pg, _cut(unit, parts, nest))


@_fx_leaf
def slice_partial(x, dim, chunks=1, group=None, unit=1, parts=None, nest=1):
    """fwd: keep this rank's Shard(dim, chunks) piece, as scatter_to; bwd: the gradient's piece
    in place in zeros of the full shape, no communication. The ranks' gradients are then
    summands of the whole one (Partial): the slice of a tensor whose gradient stays Partial
    (`ReplicatePartialGrad`: replicated K/V heads sliced to the heads this rank's queries read)."""
    pg, p = resolve(group)
    return x if p == 1 else _SlicePartial.apply(x, dim, chunks, pg, _cut(unit, parts, nest))


@_fx_leaf
def slice_held(x, dim, start, length):
    """fwd: the piece [start, start + length) of `dim` of a tensor this rank holds whole or in a
    larger piece (K/V heads held by the ranks that read them, cut to its own query heads; a whole
    cache input cut to those heads); bwd: the gradient zero-padded, a summand (no communication)."""
    return x.narrow(dim, start, length)


@_fx_leaf
def gather_from(x, dim, chunks=1, group=None, size=None, unit=1, parts=None, nest=1):
    """fwd: all-gather Shard(dim, chunks) pieces; bwd: keep this rank's piece of the gradient.
    `size`: the full size of `dim` when the pieces differ in size (torch.chunk's boundaries, in
    `unit`s of that many elements)."""
    pg, p = resolve(group)
    return x if p == 1 else _GatherFrom.apply(x, dim, chunks, pg, size, _cut(unit, parts, nest))


@_fx_leaf
def reduce_scatter(x, dim, chunks=1, group=None, unit=1, parts=None, nest=1):
    """fwd: reduce-scatter (sum, keep Shard(dim, chunks) piece); bwd: all-gather the gradient."""
    pg, p = resolve(group)
    return x if p == 1 else _ReduceScatter.apply(x, dim, chunks, pg, _cut(unit, parts, nest))


@_fx_leaf
def all_gather(x, dim, chunks=1, group=None, size=None, unit=1, parts=None, nest=1):
    """fwd: all-gather Shard(dim, chunks) pieces (`size`, `unit` as in gather_from); bwd:
    reduce-scatter the (Partial) gradient."""
    pg, p = resolve(group)
    return x if p == 1 else _AllGather.apply(x, dim, chunks, pg, size, _cut(unit, parts, nest))


@_fx_leaf
def all_to_all(x, src_dim, dst_dim, group=None):
    """fwd: shard moves from src_dim to dst_dim; bwd: the gradient's shard moves back."""
    pg, p = resolve(group)
    return x if p == 1 else _AllToAll.apply(x, src_dim, dst_dim, pg)


def global_shape_stride(x, dim: int, p: int, size=None) -> tuple:
    """(size, stride) of the global tensor whose dim `dim` is `x`'s split over p ranks, as
    DTensor computes them for a Shard(dim): the dim times p (or `size`, the full size where
    shards differ), and the strides of dims laid out outside it scaled to match."""
    shape, stride = list(x.shape), list(x.stride())
    local = shape[dim]
    shape[dim] = local * p if size is None else size
    for i in range(len(stride)):
        if i != dim and stride[i] >= stride[dim] and local:
            stride[i] = stride[i] // local * shape[dim]
    return torch.Size(shape), tuple(stride)


@_fx_leaf
def to_dtensor(x, dim, group=None, size=None):
    """`x`, this rank's block of a tensor split on `dim` over the tensor-parallel group (`size`:
    the full size of `dim` where blocks differ, at torch.chunk's boundaries as DTensor's),
    as a `torch.distributed.tensor.DTensor` with placement `Shard(dim)` over that group's 1-D
    mesh (`groups.tensor_parallel_mesh`). No communication; differentiable (the gradient of
    the DTensor, brought to `Shard(dim)`, is the gradient of `x`). Made for every group size."""
    from torch.distributed.tensor import DTensor, Shard as DShard
    if not is_initialized():
        raise ProcessGroupError("outputs='sharded' returns split outputs as DTensors over the tensor-parallel "
                                "group, which needs the process group: a module built with rank= and no group "
                                "is for inspection only")
    mesh = tensor_parallel_mesh(group, x.device.type)
    dim = dim % x.dim()
    shape, stride = global_shape_stride(x, dim, mesh.size(), size)
    return DTensor.from_local(x, mesh, (DShard(dim),), run_check=False, shape=shape, stride=stride)


for _name in ("copy_to", "reduce_from", "scatter_to", "slice_held", "gather_from", "reduce_scatter",
              "all_gather", "all_to_all", "to_dtensor"):
    torch.fx.wrap(_name)
del _name
