"""`autoshard.distributed`: TorchShard's `torchshard.distributed` under autoshard.

The group functions (`init_process_group(group_size)`, `get_group`, `get_world_size`, ...) are
those of `autoshard.runtime.groups`, the registry every layer of autoshard resolves its groups through;
`copy / scatter / gather / reduce` are TorchShard's communication functions: autograd functions
over the tensor-parallel group whose backward is the dual of the forward (they are the
collectives of `autoshard.collectives`), and which label their output with TorchShard's
`parallel_dim` / `order_type` attributes, as TorchShard's layers read them: scatter and gather
label it `dim`, reduce None, copy not at all. At group size 1 the input comes back unchanged and
unlabelled. One difference: TorchShard's `reduce` sums a tensor that needs no gradient in place;
this one returns the sum in a new tensor and leaves its input alone.
"""
from __future__ import annotations

import torch.fx

from .runtime.collectives import copy_to, gather_from, reduce_from, scatter_to
from .runtime.groups import (data_parallel_rank, data_parallel_size, default_backend, destroy_process_group,
                             device_mesh, get_data_parallel_group, get_group, get_group_size, get_rank, get_world_size,
                             init_process_group, is_initialized, local_rank, register_group, set_group)


def _label(out, input, parallel_dim):
    if out is not input and not isinstance(out, torch.fx.Proxy):
        out.parallel_dim, out.order_type = parallel_dim, 0      # any dim, as TorchShard (no check)
    return out


def copy(input, group=None):
    """Forward: identity; backward: all-reduce of the gradient (input of a column-parallel op)."""
    return copy_to(input, group=group)


def scatter(input, dim: int = -1, group=None):
    """Forward: this rank's block of `input` along `dim`; backward: all-gather. Labelled `dim`."""
    return _label(scatter_to(input, dim, group=group), input, dim)


def gather(input, dim: int = -1, group=None):
    """Forward: all-gather of every rank's block along `dim`; backward: keep this rank's block.
    Labelled `dim` (TorchShard's convention, although the result is whole)."""
    return _label(gather_from(input, dim, group=group), input, dim)


def reduce(input, group=None):
    """Forward: all-reduce (sum) into a new tensor; backward: identity. Labelled None."""
    return _label(reduce_from(input, group=group), input, None)
