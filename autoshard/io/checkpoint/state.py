"""State dicts for DCP: each sharded tensor as a DTensor or ShardedTensor of its global shape.

`get_state_dict(gm, optimizer)` returns the model's and the optimizer's state under the original
model's keys (optimizer state keyed by parameter name, as PyTorch's FQN-keyed optimizer state
dicts are): a contiguous `Shard(d)` is a DTensor over the tensor-parallel group, a strided
`Shard(d, k)` (the q/k/v rows of a fused weight) a ShardedTensor with k local shards, one per
`pieces.boxes` box. The values alias the module's parameters and the optimizer's state (but
for the boxes of a strided shard along a dim > 0, e.g. GPT-2's Conv1D c_attn, which ShardedTensor
needs as contiguous copies), so `dcp.save` writes them without a copy and `dcp.load` fills them
in place. `set_state_dict` checks keys and global shapes, then copies into the module whatever
does not already alias it (a full tensor from `torch.load` too).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ...errors import CheckpointError
from ...runtime.pieces import boxes, fill_boxes
from .layout import Layout, global_shape_of, is_data_parallel_part, is_sharded_tensor, quiet, unwrap


# ----------------------------------------------------------------------------- optimizer state

def _init_optimizer_state(optimizer) -> None:
    """Give the parameters of `optimizer` that have no state yet their state (zero moments, a step
    count) so that a load can fill it: one step at learning rate 0 on zero gradients, which moves no
    parameter (PyTorch's get_state_dict does the same). Parameters that already have state get no
    gradient for that step, so optimizers skip them; every gradient is put back afterwards."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fresh = {id(p) for p in params if not optimizer.state.get(p)}
    if not fresh:
        return
    saved = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in fresh else None
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, saved):
            p.grad = grad


def _optimizer_entries(gm, optimizer):
    """(name, parameter) of every parameter the optimizer holds, in its order; unknown ones raise."""
    names = {id(p): name for name, p in gm.named_parameters()}     # a tied parameter is named once
    out = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"parameter group {i} of {type(optimizer).__name__} holds a tensor of shape "
                                      f"{tuple(p.shape)} that is no parameter of {type(gm).__name__}")
            out.append((names[id(p)], p))
    return out


def _is_param_shaped(value, param) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


# ----------------------------------------------------------------------------- get / set

def get_state_dict(gm, optimizer=None):
    """(model_state_dict, optimizer_state_dict) of `gm` ready for `dcp.save` / `dcp.load`.

    Keys are the original model's `state_dict()` keys; the optimizer's state is keyed by parameter
    name ({"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}). Sharded tensors are
    DTensors or ShardedTensors over the tensor-parallel group; every value aliases the module's
    or the optimizer's tensor (no copy). A fresh optimizer gets its state first."""
    gm = unwrap(gm)
    lay = Layout(gm)
    msd = {key: lay.wrap(key, t) for key, t in gm.state_dict().items()}
    if optimizer is None:
        return msd, {}
    _init_optimizer_state(optimizer)
    entries = _optimizer_entries(gm, optimizer)
    state = {name: {k: lay.wrap(name, v) if _is_param_shaped(v, p) else v for k, v in optimizer.state.get(p, {}).items()}
             for name, p in entries}
    names = {id(p): name for name, p in entries}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return msd, {"state": state, "param_groups": _whole_groups(gm, groups)}


def _whole_groups(gm, groups: list) -> list:
    """A pipeline rank's parameter groups name its stages' parameters only; every rank saves the
    groups under the same keys, so each group lists the names of every pipeline rank's (merged
    over the "pp" group, in stage order), as one process's optimizer would."""
    pg = gm.__dict__.get("_autoshard_pp_group")
    if pg is None or dist.get_world_size(pg) == 1:
        return groups
    every = [None] * dist.get_world_size(pg)
    dist.all_gather_object(every, [g["params"] for g in groups], group=pg)
    if len({len(x) for x in every}) > 1:
        raise CheckpointError(f"the pipeline ranks' optimizers have {[len(x) for x in every]} parameter groups: "
                              "build the optimizer alike on every rank")
    merged = [list(dict.fromkeys(n for rank in every for n in rank[i])) for i in range(len(groups))]
    return [{**g, "params": names} for g, names in zip(groups, merged)]


def _expected_model(gm, lay) -> dict:
    """{key: (global shape, local tensor)} of every state-dict entry of `gm`."""
    return {key: (lay.global_shape(key, t.shape), t) for key, t in gm.state_dict(keep_vars=True).items()}


def _expected_optimizer(entries, optimizer, lay) -> dict:
    """{name: {state key: (global shape or None for a scalar/non-tensor, local value)}} of the
    optimizer's (name, parameter) `entries`."""
    out = {}
    for name, p in entries:
        out[name] = {k: ((lay.global_shape(name, v.shape) if _is_param_shaped(v, p) else
                          tuple(v.shape) if isinstance(v, torch.Tensor) else None), v)
                     for k, v in optimizer.state.get(p, {}).items()}
    return out


def _compare(what, expected: dict, given: dict) -> list:
    """Lines naming the missing, unexpected and differently shaped keys."""
    problems = []
    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    if missing:
        problems.append(f"{what}: missing keys {few(missing)}")
    if extra:
        problems.append(f"{what}: unexpected keys {few(extra)}")
    for key, (shape, _) in expected.items():
        if key in given and shape is not None:
            got = global_shape_of(given[key])
            if got is not None and got != tuple(shape):
                problems.append(f"{what}: {key!r} has global shape {got}, the model's is {tuple(shape)}")
    return problems


def few(keys, n=8) -> str:
    """The first n keys, and how many more."""
    keys = list(keys)
    return repr(keys[:n])[:-1] + (f", ... and {len(keys) - n} more]" if len(keys) > n else "]")


def set_state_dict(gm, optimizer=None, *, model_state_dict, optim_state_dict=None) -> None:
    """Put `model_state_dict` (and `optim_state_dict`) into `gm` (and `optimizer`).

    Values may be what `get_state_dict` returned (after `dcp.load` they already hold the data:
    nothing is copied), or full tensors of the global shape (e.g. `torch.load` of a converted
    checkpoint), of which this rank takes its boxes. Keys and global shapes are checked for every
    entry before anything is written; a mismatch raises CheckpointError naming them."""
    gm = unwrap(gm)
    lay = Layout(gm)
    model = _expected_model(gm, lay)
    problems = _compare("model state dict", model, model_state_dict)
    optim = None
    if optimizer is not None and optim_state_dict is not None:
        _init_optimizer_state(optimizer)
        entries = _optimizer_entries(gm, optimizer)
        optim = _expected_optimizer(entries, optimizer, lay)
        param_of = dict(entries)
        given = optim_state_dict.get("state", {})
        problems += _compare("optimizer state", {k: (None, None) for k in optim}, given)
        for name, expected in optim.items():
            if name in given:
                problems += _compare(f"optimizer state of {name!r}", expected, given[name])
        problems += _check_groups(optimizer, optim_state_dict, list(optim))
    if problems:
        raise CheckpointError(f"the state dict does not fit {type(gm).__name__}:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for key, (_, local) in model.items():
            _copy_into(lay, key, local, model_state_dict[key])
        if optim is not None:
            for name, expected in optim.items():
                for k, (_, local) in expected.items():
                    value = optim_state_dict["state"][name][k]
                    if isinstance(local, torch.Tensor):
                        _copy_into(lay if local.dim() else None, name, local, value)
                    else:
                        optimizer.state[param_of[name]][k] = value
            for group, saved in zip(optimizer.param_groups, optim_state_dict["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})


def _check_groups(optimizer, osd, names) -> list:
    groups = osd.get("param_groups")
    if groups is None:
        return ["optimizer state dict: no 'param_groups'"]
    if len(groups) != len(optimizer.param_groups):
        return [f"optimizer state dict has {len(groups)} parameter groups, the optimizer "
                f"{len(optimizer.param_groups)}"]
    it = iter(names)
    out = []
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        mine = list(itertools.islice(it, len(group["params"])))
        given = list(saved.get("params", []))
        if sorted(given) != sorted(mine) and not set(mine) <= set(given):    # a pipeline rank holds a part
            out.append(f"parameter group {i} holds {given}, the optimizer's {mine}")
    return out


def _copy_into(lay, key, local: torch.Tensor, value) -> None:
    """Copy this rank's part of `value` into `local` (skipped where `value` already aliases it)."""
    from torch.distributed.tensor import DTensor
    if is_data_parallel_part(local):
        return _copy_into_part(lay, key, local, value)
    layout = lay.of(key) if lay is not None else None
    if is_sharded_tensor(value):
        with quiet():
            shards, size = value.local_shards(), value.size()
        mine = {tuple(b.offsets): b for b in boxes(size, layout, lay.rank, lay.p)} if layout else {}
        for shard in shards:
            box = mine.get(tuple(shard.metadata.shard_offsets))
            if box is None or list(box.sizes) != list(shard.metadata.shard_sizes):
                raise CheckpointError(f"{key!r}: local shard at {shard.metadata.shard_offsets} of size "
                                      f"{shard.metadata.shard_sizes} is not one of this rank's boxes "
                                      f"{[(b.offsets, b.sizes) for b in mine.values()]}")
            dst = local[box.local_index()]
            if not _same(shard.tensor, dst):
                dst.copy_(shard.tensor)
        return
    mine = False                      # whether `value` is laid out as `local` is (this rank's shard)
    if isinstance(value, DTensor):
        from torch.distributed.tensor import Shard as DShard
        mine = (layout is not None and value.device_mesh.size() == lay.p and value.device_mesh.get_local_rank() ==
                lay.rank and tuple(value.placements) == (DShard(layout.dim),))
        value = value.to_local()
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{key!r}: a {type(value).__name__} where a tensor was expected")
    value = value.detach()
    if value.shape == local.shape and (layout is None or mine or _same(value, local)):
        if not _same(value, local):
            local.copy_(value)
        return
    if layout is None:
        raise CheckpointError(f"{key!r}: shape {tuple(value.shape)}, expected {tuple(local.shape)}")
    if tuple(value.shape) != lay.global_shape(key, local.shape):
        raise CheckpointError(f"{key!r}: a tensor of shape {tuple(value.shape)} is neither this rank's shard "
                              f"{tuple(local.shape)} nor the global tensor {lay.global_shape(key, local.shape)}")
    fill_boxes(local, value.shape, layout, lay.rank, lay.p, value.__getitem__)     # a full tensor: my boxes


def _copy_into_part(lay, key, part, value) -> None:
    """Copy this rank's pieces of `value` (a ShardedTensor from get_state_dict, or a full tensor)
    into `part`, a data-parallel part of this rank's shard (FSDP2)."""
    local = part.to_local()
    mine = {offsets: (sizes, index) for offsets, sizes, index in lay.pieces(key, part)}
    if is_sharded_tensor(value):
        with quiet():
            shards = value.local_shards()
        for shard in shards:
            offsets = tuple(shard.metadata.shard_offsets)
            if offsets not in mine or tuple(mine[offsets][0]) != tuple(shard.metadata.shard_sizes):
                raise CheckpointError(f"{key!r}: local shard at {list(offsets)} of size {shard.metadata.shard_sizes} "
                                      f"is not one of this rank's pieces {sorted(mine)}")
            dst = local[mine[offsets][1]]
            if not _same(shard.tensor, dst):
                dst.copy_(shard.tensor)
        return
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        if value.device_mesh == part.device_mesh and value.placements == part.placements:
            if not _same(value.to_local(), local):
                local.copy_(value.to_local())
            return
        value = value.full_tensor()
    glob = lay.global_shape(key, tuple(part.shape))
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(glob):
        raise CheckpointError(f"{key!r}: expected the global tensor {tuple(glob)} or this rank's pieces, got "
                              f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    for offsets, (sizes, index) in mine.items():
        local[index].copy_(value[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
