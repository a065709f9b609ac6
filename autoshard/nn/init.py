"""Initialisation of parameter shards (TorchShard's `torchshard.nn.init`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import _split_along
from ..distributed import get_group
from ..state_dict import ORDER_TYPE, get_parallel_dim, torchshard_layout
from ._common import group_info


def shard_init_helper_(init_method, tensor, group=None, **kwargs):
    """Initialise the full tensor with `init_method(full, **kwargs)` and keep this rank's shard.

    The shard follows the tensor's TorchShard attributes (`parallel_dim`, `order_type`); the full
    tensor is broadcast from the group's first rank, so every rank's shard comes from one tensor
    and fan-in/fan-out are those of the full shape.  Unsharded tensors are initialised directly."""
    layout = torchshard_layout(get_parallel_dim(tensor), getattr(tensor, ORDER_TYPE, 0), tensor.dim())
    if layout is None:
        return init_method(tensor, **kwargs)
    key, size, rank = group_info(group, f"shard_init_helper_ on a tensor of shape {tuple(tensor.shape)}")
    if size == 1:
        return init_method(tensor, **kwargs)
    pg = get_group(key)
    shape = list(tensor.shape)
    shape[layout.dim] *= size
    full = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        init_method(full, **kwargs)
        dist.broadcast(full, src=dist.get_global_rank(pg, 0), group=pg)
        tensor.copy_(_split_along(full, layout.dim, size, layout.chunks)[rank])
    return tensor
