"""Initialisation of parameter shards (TorchShard's `torchshard.nn.init`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.groups import get_group
from ..runtime.pieces import split_along
from ..runtime.state_dict import ORDER_TYPE, PARALLEL_DIM, get_parallel_dim, torchshard_layout
from .common import group_info


def shard_init_helper_(init_method, tensor, group=None, **kwargs):
    """Initialise the full tensor with `init_method(full, **kwargs)` and keep this rank's part.

    As TorchShard's: a tensor that carries a `parallel_dim` attribute (a parallel layer's
    parameter, sharded or not) is initialised whole and broadcast, so that every rank holds the
    same tensor (parallel_dim None) or its shard of one tensor (fan-in/fan-out are those of the
    full shape); the shard follows `parallel_dim` / `order_type`.  The broadcast is from global
    rank 0 over all ranks (every data-parallel replica gets the same values), or from the first
    rank of `group` over it when a group is given.  A tensor without the attribute, or a run
    without a process group, is initialised directly."""
    if not hasattr(tensor, PARALLEL_DIM) or not dist.is_initialized():
        return init_method(tensor, **kwargs)
    layout = torchshard_layout(get_parallel_dim(tensor), getattr(tensor, ORDER_TYPE, 0), tensor.dim())
    what = f"shard_init_helper_ on a tensor of shape {tuple(tensor.shape)}"
    if layout is None:
        size, rank = 1, 0
    else:
        _, size, rank = group_info(group, what)
    pg = get_group(group) if group is not None else dist.group.WORLD
    shape = list(tensor.shape)
    if layout is not None:
        shape[layout.dim] *= size
    full = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        init_method(full, **kwargs)
        if dist.get_world_size(pg) > 1:
            dist.broadcast(full, src=dist.get_global_rank(pg, 0), group=pg)
        tensor.copy_(full if layout is None else split_along(full, layout.dim, size, layout.chunks, what=what)[rank])
    return tensor
