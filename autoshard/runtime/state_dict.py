"""TorchShard parameter attributes, layout tables, and collect / relocate of state dicts.

A sharded tensor's layout is a `Shard(dim, chunks)` placement keyed by its state-dict key.
Layouts are read, in order, from
1. `module._autoshard_layouts` (dict key -> Shard, keys relative to that module, tied aliases
   included) on the model and on every submodule (autoshard's layers and rewritten graphs keep
   one; it survives `copy.deepcopy` and `load_state_dict(assign=True)`);
2. TorchShard's `parallel_dim` / `order_type` attributes of every parameter and buffer, read
   with `remove_duplicate=False` so that tied alias keys get their layout too.
The group is the `group` argument, else `model._autoshard_group` (a registry key), else the
current tensor-parallel group of `autoshard.distributed`.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..errors import ShardingError
from .groups import get_data_parallel_group, get_group
from .pieces import cat_along, pad_along, split_along
from .placements import Shard, global_shape, piece_sizes

__all__ = ["slice", "collect_state_dict", "relocate_state_dict", "get_parallel_dim",
           "register_parallel_dim", "register_parallel_attribute",
           "register_ddp_parameters_to_ignore", "layouts", "torchshard_layout"]

PARALLEL_DIM = "parallel_dim"
ORDER_TYPE = "order_type"
VALID_DIMS = (None, 0, 1, -1)


# ----------------------------------------------------------------------------- TorchShard attributes

def check_parallel_dim(parallel_dim, what: str = "tensor") -> None:
    """A ShardingError naming `what` unless `parallel_dim` is one of TorchShard's None, 0, 1, -1."""
    if parallel_dim not in VALID_DIMS or isinstance(parallel_dim, bool):
        raise ShardingError(f"{what}: parallel_dim must be one of None, 0, 1, -1; got {parallel_dim!r}")


def get_parallel_dim(tensor):
    """TorchShard's `parallel_dim` attribute of `tensor` (None when absent)."""
    if isinstance(tensor, torch.fx.Proxy):        # a proxy would answer every getattr
        return None
    return getattr(tensor, PARALLEL_DIM, None)


def register_parallel_dim(tensor, parallel_dim) -> None:
    """Set TorchShard's `parallel_dim` attribute on `tensor` (in place)."""
    check_parallel_dim(parallel_dim)
    setattr(tensor, PARALLEL_DIM, parallel_dim)


def register_parallel_attribute(tensor, parallel_dim, order_type: int = 0) -> None:
    """Set `parallel_dim` and `order_type` on `tensor` (and on `.data` of a Parameter, as TorchShard)."""
    check_parallel_dim(parallel_dim)
    if order_type not in (0, 1):
        raise ShardingError(f"order_type must be 0 ([out, in] weights) or 1 ([in, out]); got {order_type!r}")
    targets = [tensor, tensor.data] if isinstance(tensor, torch.nn.Parameter) else [tensor]
    for t in targets:
        setattr(t, PARALLEL_DIM, parallel_dim)
        setattr(t, ORDER_TYPE, order_type)


def torchshard_layout(parallel_dim, order_type: int, ndim: int):
    """The Shard a TorchShard (parallel_dim, order_type) pair means for an `ndim`-D tensor, or None.

    order_type 0 ([out, in]): -1/1 split dim 0, 0 splits dim 1 (1-D: not split);
    order_type 1 ([in, out]): 0 splits dim 0, -1/1 split dim 1 (1-D: not split)."""
    check_parallel_dim(parallel_dim)
    if parallel_dim is None:
        return None
    along_first = (parallel_dim == 0) == (order_type == 1)
    if along_first:
        return Shard(0)
    return Shard(1) if ndim >= 2 else None


# ----------------------------------------------------------------------------- layouts

def layouts(model: torch.nn.Module) -> dict:
    """{state-dict key: Shard} of every sharded tensor of `model` (tied aliases included)."""
    out: dict = {}
    named = itertools.chain(model.named_parameters(remove_duplicate=False),
                            model.named_buffers(remove_duplicate=False))
    for name, t in named:
        layout = torchshard_layout(get_parallel_dim(t), getattr(t, ORDER_TYPE, 0), t.dim())
        if layout is not None:
            out[name] = layout
    tables = [(prefix, m.__dict__.get("_autoshard_layouts"))
              for prefix, m in model.named_modules(remove_duplicate=False)]
    for prefix, table in sorted((t for t in tables if t[1] is not None), key=lambda t: -len(t[0])):
        for key, layout in table.items():            # outer tables win: the model's is applied last
            full_key = f"{prefix}.{key}" if prefix else key
            if layout is None:
                out.pop(full_key, None)
            else:
                out[full_key] = layout
    return out


def group_of(model, group, needed: bool = True):
    """(ProcessGroup, size, rank) for `model`; (None, 1, 0) when nothing needs a group."""
    if not needed:
        return None, 1, 0
    if group is None:
        group = getattr(model, "_autoshard_group", None)
    pg = get_group(group)
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def _entries(model, state_dict, prefix: str, fn: str) -> list:
    """(key, tensor, model tensor, layout) for each state-dict entry; unknown keys raise."""
    table = layouts(model)
    known = model.state_dict(keep_vars=True)
    out = []
    for key, value in state_dict.items():
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name not in known:
            raise ShardingError(
                f"{fn}: state dict key {key!r} (prefix {prefix!r}) matches no entry of "
                f"{type(model).__name__}.state_dict(); expected keys like {list(known)[:3]}")
        out.append((key, value, known[name], table.get(name)))
    return out


def _expect_shape(fn, key, value, shape, what):
    if tuple(value.shape) != tuple(shape):
        raise ShardingError(f"{fn}: {key!r} has shape {tuple(value.shape)} but {what} "
                            f"has shape {tuple(shape)}")


# ----------------------------------------------------------------------------- public API

def slice(tensor, num_partitions: int, dim=-1, contiguous: bool = False):
    """TorchShard's slice: `torch.split` into `num_partitions` equal pieces along `dim` (None: -1)."""
    dim = -1 if dim is None else dim
    pieces = split_along(tensor, dim, num_partitions, what=f"slice: tensor of dtype {tensor.dtype}")
    return tuple(p.contiguous() for p in pieces) if contiguous else tuple(pieces)


def collect_state_dict(model, state_dict, prefix: str = "", *, dst=None, group=None):
    """Full tensors for every sharded entry of `state_dict` (keys: `prefix` + model keys).

    With `dst=r` the full tensors are gathered to group rank r only (one tensor at a time); the
    other ranks get an empty dict, so no rank but r ever holds the full model."""
    entries = _entries(model, state_dict, prefix, "collect_state_dict")
    pg, p, rank = group_of(model, group, dst is not None or any(e[3] for e in entries))
    out = OrderedDict()
    for key, value, local, layout in entries:
        if layout is None or p == 1:
            out[key] = value
            continue
        _expect_shape("collect_state_dict", key, value, local.shape, "this rank's shard of it")
        full = _gather_entry(value.detach(), layout, pg, p, dst, rank)
        if full is not None:
            out[key] = full
    return out if dst is None or rank == dst else OrderedDict()


def _gather_entry(value, layout, pg, p, dst, rank):
    """The full tensor of `layout` from every rank's `value` (shards of unequal sizes travel
    padded to the largest and are cropped)."""
    sizes = None if layout.size is None else piece_sizes(layout.size, p, **layout.blocking)
    if sizes is not None and value.size(layout.dim) != sizes[rank]:
        raise ShardingError(f"collect_state_dict: a {tuple(value.shape)} shard on rank {rank}, but {layout.size} "
                            f"rows on {p} ranks give it {sizes[rank]} along dim {layout.dim}")
    if sizes is not None:
        value = pad_along(value, layout.dim, sizes[0])
    value = value.contiguous()
    if dst is None:
        pieces = [torch.empty_like(value) for _ in range(p)]
        dist.all_gather(pieces, value, group=pg)
    else:
        pieces = [torch.empty_like(value) for _ in range(p)] if dist.get_rank(pg) == dst else None
        dist.gather(value, pieces, dst=dist.get_global_rank(pg, dst), group=pg)
        if pieces is None:
            return None
    if sizes is not None:
        pieces = [piece.narrow(layout.dim, 0, n) for piece, n in zip(pieces, sizes)]
    return cat_along(pieces, layout.dim, **layout.blocking)


def relocate_state_dict(model, state_dict, prefix: str = "", group=None):
    """This rank's shard of every sharded entry of a full `state_dict` (inverse of collect)."""
    entries = _entries(model, state_dict, prefix, "relocate_state_dict")
    pg, p, rank = group_of(model, group, any(e[3] for e in entries))
    out = OrderedDict()
    for key, value, local, layout in entries:
        if layout is None or p == 1:
            out[key] = value
            continue
        _expect_shape("relocate_state_dict", key, value, global_shape(local.shape, layout, p),
                      f"the full tensor of a {layout} shard of {tuple(local.shape)} on {p} ranks")
        piece = split_along(value, layout.dim, p, what=f"state dict entry {key!r}", uneven=layout.size is not None,
                            **layout.blocking)[rank]
        out[key] = piece.clone(memory_format=torch.contiguous_format)
    return out


def register_ddp_parameters_to_ignore(module) -> list:
    """Mark `module`'s sharded parameters and buffers for DDP to ignore; returns their names.

    DDP then neither broadcasts nor averages them (each tensor-parallel rank holds a different
    shard).  Since they must still be averaged over data-parallel replicas, each sharded
    parameter also gets a post-accumulate-grad hook that averages its `.grad` over
    `autoshard.distributed.get_data_parallel_group()` when that group has more than one rank
    (the hook runs on every backward, also under `no_sync`)."""
    table = layouts(module)
    named = list(itertools.chain(module.named_parameters(remove_duplicate=False),
                                 module.named_buffers(remove_duplicate=False)))
    names = [name for name, _ in named if name in table]
    previous = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    module._ddp_params_and_buffers_to_ignore = previous + [n for n in names if n not in previous]
    dp = get_data_parallel_group()
    if dp is not None and dist.get_world_size(dp) > 1:
        sharded = {id(t) for name, t in named if name in table}
        for param in module.parameters():
            if id(param) in sharded:
                _add_dp_average_hook(param, dp)
    return names


def _add_dp_average_hook(param, dp) -> None:
    if not param.requires_grad or getattr(param, "_autoshard_dp_hook", None) is not None:
        return
    size = dist.get_world_size(dp)

    def average(p):
        if p.grad is not None:
            p.grad.div_(size)
            dist.all_reduce(p.grad, group=dp)

    param._autoshard_dp_hook = param.register_post_accumulate_grad_hook(average)

