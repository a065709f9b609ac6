"""Helpers shared by the parallel layers: dim checks, group lookup, installing parameter shards."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ProcessGroupError
from ..runtime.groups import get_group, register_group
from ..runtime.pieces import split_along
from ..runtime.state_dict import (check_parallel_dim, layouts, register_ddp_parameters_to_ignore,
                                  register_parallel_attribute, torchshard_layout)


def check_dim(dim, what: str):
    """`dim` if it is one of TorchShard's None, 0, 1, -1; else a ShardingError naming `what`."""
    check_parallel_dim(dim, what)
    return dim


def group_info(group, what: str):
    """(registry key, size, rank) of `group`; a clear ProcessGroupError naming `what` if none."""
    try:
        pg = get_group(group)
    except ProcessGroupError as e:
        raise ProcessGroupError(f"{what} is sharded and needs a process group: {e}") from e
    return register_group(pg), dist.get_world_size(pg), dist.get_rank(pg)


def install_shards(module, fulls: dict, order_type: int, size: int, rank: int,
                   requires_grad: bool = True) -> None:
    """Make each `module.<name>` a Parameter holding this rank's shard of `fulls[name]`.

    The layout follows TorchShard's (module.dim, order_type) convention; the Parameters get
    TorchShard's attributes and the layouts go in `module._autoshard_layouts`.  Existing
    Parameters are updated in place (reset_parameters keeps optimizer references valid)."""
    table = {}
    for name, full in fulls.items():
        if full is None:
            module.register_parameter(name, None)
            continue
        layout = torchshard_layout(module.dim, order_type, full.dim())
        piece = full.detach()
        if layout is not None:
            table[name] = layout
            piece = split_along(piece, layout.dim, size, layout.chunks,
                                 what=f"{module._describe()} {name}")[rank]
        param = module._parameters.get(name)
        if param is not None and param.shape == piece.shape:
            with torch.no_grad():
                param.copy_(piece)
        else:
            param = torch.nn.Parameter(piece.clone(memory_format=torch.contiguous_format),
                                       requires_grad=requires_grad)
            module.register_parameter(name, param)
        register_parallel_attribute(param, module.dim, order_type)
    module._autoshard_layouts = table


def convert_modules(module, torch_cls, make):
    """Replace every `torch_cls` instance in `module` (or `module` itself) by `make(instance)`.

    Like TorchShard's converters, the result lists its sharded parameters for DDP to ignore
    (`register_ddp_parameters_to_ignore`): a model converted in place and then wrapped in DDP
    must not have one rank's shards broadcast over the others, nor different shards averaged."""
    out = _convert(module, torch_cls, make)
    if layouts(out):
        register_ddp_parameters_to_ignore(out)
    return out


def _convert(module, torch_cls, make):
    if isinstance(module, torch_cls):
        return make(module)
    for name, child in module.named_children():
        new = _convert(child, torch_cls, make)
        if new is not child:
            setattr(module, name, new)
    return module
