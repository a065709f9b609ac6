"""A module's layout table with its tensor-parallel group, and its tensors wrapped for DCP.

`Layout(gm)` knows each key's Shard and wraps a local tensor as what DCP saves: a contiguous
`Shard(d)` as a DTensor over the tensor-parallel group, a strided one as a ShardedTensor with one
local shard per `pieces.boxes` box, FSDP2's data-parallel parts inside either (`pieces`, `grid`).
`state` builds the model's and optimizer's state dicts with it; `storage` reads global shapes
back (`global_shape_of`).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from ...errors import CheckpointError
from ...runtime.pieces import boxes
from ...runtime.placements import Replicate, dtensor_boundaries, global_shape
from ...runtime.state_dict import group_of, layouts

# DCP reads .size()/.device of the ShardedTensors we hand it and each read warns that ShardedTensor
# is deprecated; we use it on purpose (docs/design.md, "Sharded checkpoints"), so the warning is noise.
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)


def unwrap(module):
    """The module under a DistributedDataParallel wrapper (keys without 'module.')."""
    return getattr(module, "module", module) if isinstance(module, torch.nn.parallel.DistributedDataParallel) \
        else module


class Layout:
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


def is_sharded_tensor(value) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    return isinstance(value, ShardedTensor)


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
