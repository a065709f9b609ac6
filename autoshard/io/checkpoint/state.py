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

import contextlib
import itertools
import warnings

import torch
import torch.distributed as dist

from ...errors import CheckpointError
from ...runtime.placements import Replicate, dtensor_boundaries, global_shape
from ...runtime.pieces import boxes, fill_boxes
from ...runtime.state_dict import group_of, layouts

# DCP reads .size()/.device of the ShardedTensors we hand it and each read warns that ShardedTensor
# is deprecated; we use it on purpose (docs/design.md, "Sharded checkpoints"), so the warning is noise.
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)


# ----------------------------------------------------------------------------- layouts and wrapping

def _unwrap(module):
    """The module under a DistributedDataParallel wrapper (keys without 'module.')."""
    return getattr(module, "module", module) if isinstance(module, torch.nn.parallel.DistributedDataParallel) \
        else module


class _Layout:
    """A module's layout table with its tensor-parallel group: wraps local tensors for DCP."""

    def __init__(self, gm):
        self.table = layouts(gm)
        plan = getattr(gm, "_autoshard_plan", None)
        if plan is not None and plan.world_size > 1 and not dist.is_initialized():
            raise CheckpointError(f"{type(gm).__name__} holds one rank's shards of a degree-{plan.world_size} plan "
                                  "but no process group is initialised: checkpoints are saved and loaded by all "
                                  "ranks of the tensor-parallel group together")
        self.pg, self.p, self.rank = group_of(gm, None, bool(self.table) and dist.is_initialized())
        self._mesh = self._grid = None

    def of(self, key):
        """The Shard of `key`, or None where it is replicated (or the group has one rank)."""
        return self.table.get(key) if self.p > 1 else None

    def global_shape(self, key, local_shape) -> tuple:
        layout = self.of(key)
        return tuple(local_shape) if layout is None else global_shape(local_shape, layout, self.p)

    def mesh(self, device):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            self._mesh = DeviceMesh.from_group(self.pg, device.type)
        return self._mesh

    def wrap(self, key, local: torch.Tensor):
        """`local` as DCP sees it: a plain tensor, a DTensor (contiguous shard) or a ShardedTensor
        (strided shard: one local shard per box; a data-parallel part of a shard, under FSDP2).
        Shares `local`'s storage."""
        if is_data_parallel_part(local):     # replicated over tensor parallel: FSDP2's DTensor as it is
            return local if self.of(key) is None else self._sharded_tensor_of(key, local)
        layout = self.of(key)
        if layout is None:
            return local
        shape = self.global_shape(key, local.shape)
        if dtensor_boundaries(shape, layout, self.p):     # DTensor's boundaries: torch.chunk's
            from torch.distributed.tensor import DTensor, Shard as DShard
            return DTensor.from_local(local, self.mesh(local.device), [DShard(layout.dim)], run_check=False,
                                      shape=torch.Size(shape), stride=_contiguous_stride(shape))
        return self._sharded_tensor(local, shape, layout)

    def _sharded_tensor(self, local, shape, layout):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard as STShard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
        dev = local.device.type if local.device.type == "cpu" else f"{local.device.type}:{local.device.index}"
        metas, mine = [], []
        for r in range(self.p):
            placement = f"rank:{dist.get_global_rank(self.pg, r)}/{dev}"
            for box in boxes(shape, layout, r, self.p):
                md = ShardMetadata(list(box.offsets), list(box.sizes), placement)
                metas.append(md)
                if r == self.rank:       # ShardedTensor takes only contiguous shards: a box cut
                    piece = local[box.local_index()]          # along a dim > 0 becomes a copy
                    mine.append(STShard(piece if piece.is_contiguous() else piece.contiguous(), md))
        props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        with warnings.catch_warnings():           # ShardedTensor is deprecated; DTensor cannot hold this layout
            warnings.simplefilter("ignore")
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                mine, ShardedTensorMetadata(metas, torch.Size(shape), props), process_group=self.pg)


    # ------------------------------------------------------------- FSDP2 over the data-parallel mesh
    def pieces(self, key, value, tp_rank=None, dp_rank=None) -> list:
        """[(global offsets, sizes, local index)] of a data-parallel part `value` (a DTensor over
        the data-parallel mesh whose global tensor is a rank's tensor-parallel shard) held by
        tensor-parallel rank `tp_rank` and data-parallel rank `dp_rank` (default: this rank): its
        tensor-parallel boxes cut to the rows FSDP2 gives it (torch.chunk's boundaries)."""
        tp_rank = self.rank if tp_rank is None else tp_rank
        mesh = value.device_mesh
        dp_rank = mesh.get_local_rank() if dp_rank is None else dp_rank
        (placement,) = value.placements
        shard_shape = tuple(value.shape)              # this tensor-parallel rank's shard
        if not placement.is_shard():                  # replicated over the data-parallel ranks
            d, start, stop = 0, 0, shard_shape[0] if shard_shape else 0
        else:
            d = placement.dim % len(shard_shape)
            step = -(-shard_shape[d] // mesh.size())
            start, stop = min(dp_rank * step, shard_shape[d]), min((dp_rank + 1) * step, shard_shape[d])
        layout = self.of(key)
        glob = self.global_shape(key, shard_shape)
        out = []
        for box in boxes(glob, layout if layout is not None else Replicate(), tp_rank, self.p if layout else 1):
            if not shard_shape:                       # a scalar: one piece
                return [((), (), ())]
            lo = box.local_offsets[d]
            a, b = max(lo, start), min(lo + box.sizes[d], stop)
            if a >= b:
                continue
            offsets, sizes, index = list(box.offsets), list(box.sizes), list(box.local_index())
            offsets[d] += a - lo
            sizes[d] = b - a
            index[d] = slice(a - start, b - start)    # in the data-parallel part's own coordinates
            out.append((tuple(offsets), tuple(sizes), tuple(index)))
        return out

    def grid(self, mesh) -> list:
        """Global ranks by [data-parallel rank][tensor-parallel rank] (one exchange, then kept)."""
        if self._grid is None:
            mine = dist.get_process_group_ranks(self.pg) if self.pg is not None and self.p > 1 else [dist.get_rank()]
            every = [None] * mesh.size()
            dist.all_gather_object(every, mine, group=mesh.get_group())
            self._grid = every
        return self._grid

    def _sharded_tensor_of(self, key, value):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard as STShard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
        local = value.to_local()
        dev = local.device.type if local.device.type == "cpu" else f"{local.device.type}:{local.device.index}"
        grid = self.grid(value.device_mesh)
        metas, mine = [], []
        me = (value.device_mesh.get_local_rank(), self.rank)
        for q, row in enumerate(grid):
            for r, global_rank in enumerate(row):
                for offsets, sizes, index in self.pieces(key, value, r, q):
                    md = ShardMetadata(list(offsets), list(sizes), f"rank:{global_rank}/{dev}")
                    metas.append(md)
                    if (q, r) == me:
                        piece = local[index]
                        mine.append(STShard(piece if piece.is_contiguous() else piece.contiguous(), md))
        glob = self.global_shape(key, tuple(value.shape))
        props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                 memory_format=torch.contiguous_format, pin_memory=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                mine, ShardedTensorMetadata(metas, torch.Size(glob), props))


def is_data_parallel_part(value) -> bool:
    """Whether a module's tensor `value` is a DTensor (FSDP2 makes its parameters and their
    optimizer state DTensors over the 1-D data-parallel mesh): a part of a tensor-parallel shard."""
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor) and value.device_mesh.ndim == 1


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def global_shape_of(value) -> tuple | None:
    """The global shape a state-dict value claims (DTensor and ShardedTensor: their global size)."""
    if isinstance(value, torch.Tensor):
        with quiet():                       # ShardedTensor warns that it is deprecated at every call
            return tuple(value.size())
    return None


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
    gm = _unwrap(gm)
    lay = _Layout(gm)
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
    return msd, {"state": state, "param_groups": groups}


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
    gm = _unwrap(gm)
    lay = _Layout(gm)
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
        if list(saved.get("params", [])) != mine:
            out.append(f"parameter group {i} holds {list(saved.get('params', []))}, the optimizer's {mine}")
    return out


def _copy_into(lay, key, local: torch.Tensor, value) -> None:
    """Copy this rank's part of `value` into `local` (skipped where `value` already aliases it)."""
    from torch.distributed.tensor import DTensor
    if is_data_parallel_part(local):
        return _copy_into_part(lay, key, local, value)
    layout = lay.of(key) if lay is not None else None
    if _is_sharded_tensor(value):
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
    if _is_sharded_tensor(value):
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


def _is_sharded_tensor(value) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    return isinstance(value, ShardedTensor)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


@contextlib.contextmanager
def quiet():
    """No warnings inside the block (ShardedTensor's deprecation notice comes at every call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def quiet_single_process():
    """Without a process group DCP warns that it assumes one process: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
