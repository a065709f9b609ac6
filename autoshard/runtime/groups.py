"""The tensor-parallel group registry (the bottom of autoshard's runtime: collectives, layers and
state dicts resolve their groups here).

`init_process_group(group_size)` forms tensor-parallel groups of `group_size` consecutive ranks
(as TorchShard does); ranks with the same position in their tensor-parallel group form a
data-parallel group.  Rewritten graphs name their group by a string key (FX code cannot hold a
ProcessGroup object), resolved here at run time.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - see below

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when first
# imported; imported after init_process_group (torch.export and FakeTensor import it), those
# defaults keep the default ProcessGroup alive past destroy_process_group, and a gloo group freed
# while the interpreter exits can abort the process. Importing it here, with autoshard, before
# the group exists binds None instead.

from ..errors import ProcessGroupError
from .shm import enable as enable_segment
from .shm import release_all as release_segments

_GROUPS: dict[str, object] = {}          # key -> ProcessGroup
_SUBGROUPS: dict[int, int] = {}          # id of a group made by `_make_subgroups` -> its ranks (m)
_MESHES: dict[tuple, object] = {}        # (key, device type) -> 1-D DeviceMesh over that group
_STATE = {"tp": None, "dp": None, "mesh": None}   # this rank's tensor- and data-parallel groups, their mesh


def _require_initialized(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ProcessGroupError(
            f"{what} needs a process group: call torch.distributed.init_process_group (or "
            "autoshard.distributed.init_process_group) first, e.g. under torchrun"
        )


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def device_of(pg=None) -> str:
    """The device type a collective on process group `pg` (default: the world) runs its tensors
    on: "cuda" for NCCL (the current device), "cpu" for gloo."""
    return "cuda" if dist.get_backend(pg) == "nccl" else "cpu"


def init_process_group(group_size: int | None = None, backend: str | None = None,
                       timeout: timedelta = timedelta(seconds=60), shm: bool = False, **kwargs):
    """Initialise torch.distributed if needed (env:// as torchrun sets it) and form the
    tensor-parallel groups of `group_size` consecutive ranks; returns this rank's TP group.
    `shm=True` opts this rank's groups in to shared-memory collectives (CPU inference on one host,
    runtime/shm.py; every rank must pass it alike)."""
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or default_backend(), timeout=timeout, **kwargs)
    world = dist.get_world_size()
    group_size = world if group_size is None else int(group_size)
    if group_size < 1 or world % group_size:
        raise ProcessGroupError(
            f"tensor-parallel group size {group_size} must be >= 1 and divide the world size {world}"
        )
    rank = dist.get_rank()
    tp = dp = None
    for start in range(0, world, group_size):                      # every rank creates every group
        g = dist.new_group(list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            tp = g
    for offset in range(group_size):
        g = dist.new_group(list(range(offset, world, group_size)))
        if rank % group_size == offset:
            dp = g
    _STATE["tp"], _STATE["dp"], _STATE["mesh"] = tp, dp, None
    if shm:
        enable_segment(tp)
        enable_segment(dp)
    register_group(tp)
    return tp


def destroy_process_group() -> None:
    """Forget the registered groups and tear torch.distributed down.

    Call it after the modules and autograd graphs of the run are dropped: autograd nodes of the
    collectives hold their ProcessGroup, and a gloo group that is only freed while the
    interpreter exits can abort the process ("terminate called without an active exception").
    The `gc.collect()` frees such objects that sit in reference cycles (GraphModules do).
    """
    forget()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def forget() -> None:
    """Drop every registered group and the current tensor- and data-parallel groups, and unmap
    the groups' shared-memory segments (the process groups themselves stay as they are; a
    group's next small collective sets its segment up again, on every rank alike)."""
    release_segments()
    _GROUPS.clear()
    _SUBGROUPS.clear()
    _MESHES.clear()
    _STATE["tp"] = _STATE["dp"] = _STATE["mesh"] = None


def _release_at_exit() -> None:
    """atexit hook: a script that ends without `destroy_process_group` gets it here.

    Otherwise the groups are freed (if at all) while the interpreter tears its modules down,
    in no fixed order, and a gloo group freed then can abort the process (SIGABRT after a
    finished run, reported as a failure by torchrun).  Here autoshard's references go first,
    cycles holding groups (GraphModules, autograd nodes) are collected, and torch.distributed
    shuts every group down while the interpreter is whole.  Registered at import, so hooks the
    user registers later (which may still communicate) run before it.  Never raises."""
    try:
        destroy_process_group()
    except Exception as e:  # noqa: BLE001 - exiting anyway; say why, do not mask the exit status
        print(f"autoshard: destroy_process_group at exit failed: {e!r}", file=sys.stderr)


atexit.register(_release_at_exit)


def set_group(group) -> None:
    """Make `group` (a ProcessGroup or a 1-D DeviceMesh) this rank's current tensor-parallel group."""
    group = get_group(group) if group is not None else None
    _STATE["tp"] = group
    _STATE["mesh"] = None
    register_group(group)


def device_mesh(device_type: str | None = None):
    """The 2-D DeviceMesh ("dp", "tp") over the groups `init_process_group(group_size)` formed:
    `mesh["tp"]` is this rank's tensor-parallel group (to `parallelize` on), `mesh["dp"]` its
    data-parallel group (to `fully_shard` on); made once, on every rank alike."""
    _require_initialized("device_mesh()")
    if _STATE["tp"] is None or _STATE["dp"] is None:
        raise ProcessGroupError("device_mesh() needs the groups of autoshard.distributed.init_process_group("
                                "tensor_parallel_size); with groups of your own, build the mesh with "
                                "torch.distributed.device_mesh.init_device_mesh")
    device_type = device_type or device_of(_STATE["tp"])
    cached = _STATE.get("mesh")
    if cached is None or cached.device_type != device_type:
        from torch.distributed.device_mesh import DeviceMesh
        world, tp = dist.get_world_size(), dist.get_world_size(_STATE["tp"])
        layout = torch.arange(world).reshape(world // tp, tp)      # tensor-parallel groups: consecutive ranks
        cached = _STATE["mesh"] = DeviceMesh.from_group([_STATE["dp"], _STATE["tp"]], device_type, mesh=layout,
                                                        mesh_dim_names=("dp", "tp"))
    return cached


def register_mesh(mesh) -> str:
    """Register the group of a 1-D DeviceMesh (`register_group`) and remember the mesh itself, so
    that DTensors made over that group (`tensor_parallel_mesh`) are over the caller's mesh."""
    key = register_group(_from_mesh(mesh))
    _MESHES[(key, mesh.device_type)] = mesh
    return key


def tensor_parallel_mesh(group=None, device_type: str = "cpu"):
    """The 1-D DeviceMesh of the tensor-parallel group `group` (as `get_group` resolves it) for
    `device_type`: the one registered with `register_mesh` (a `parallelize(group=mesh["tp"])`),
    else `device_mesh()["tp"]` when that is the group, else one made by `DeviceMesh.from_group`
    once and kept until `forget`."""
    pg = get_group(group)
    key = register_group(pg)
    mesh = _MESHES.get((key, device_type))
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh
        both = _STATE.get("mesh")
        if both is not None and both.device_type == device_type and pg is _STATE["tp"]:
            mesh = both["tp"]
        else:
            mesh = DeviceMesh.from_group(pg, device_type)
        _MESHES[(key, device_type)] = mesh
    return mesh


def _from_mesh(mesh):
    """The ProcessGroup of a 1-D DeviceMesh (`mesh["tp"]` of a 2-D one)."""
    if mesh.ndim != 1:
        raise ProcessGroupError(f"a {mesh.ndim}-D DeviceMesh {mesh.mesh_dim_names or ''} was given as the "
                                "tensor-parallel group: pass its tensor-parallel dim, e.g. mesh['tp']")
    return mesh.get_group()


def get_group(group=None):
    """Resolve `group` (a ProcessGroup, a 1-D DeviceMesh, a registered key, or None for the
    current TP group)."""
    known = _GROUPS.get(group) if isinstance(group, str) else None
    if known is not None and dist.is_initialized():   # a rewritten graph's key: every collective call asks
        return known
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(group, DeviceMesh):
        return _from_mesh(group)
    if group is not None and not isinstance(group, str):
        return group
    _require_initialized("a tensor-parallel collective")
    if isinstance(group, str):
        if group not in _GROUPS:
            if group == "world":
                return dist.group.WORLD
            if "/" in group:
                return _make_subgroups(group)
            raise ProcessGroupError(
                f"process group {group!r} is not registered on rank {dist.get_rank()}; "
                f"known: {sorted(_GROUPS)}. Build the module with parallelize(..., group=...) on this rank."
            )
        return _GROUPS[group]
    return _STATE["tp"] if _STATE["tp"] is not None else dist.group.WORLD


def get_data_parallel_group():
    """This rank's data-parallel group (None when init_process_group was not called here)."""
    return _STATE["dp"]


def data_parallel_size() -> int:
    """How many data-parallel replicas there are: the size of this rank's data-parallel group
    (`init_process_group(group_size)`), else the world over the tensor-parallel group's size;
    1 without a process group. Split the data into this many parts."""
    if not is_initialized():
        return 1
    if _STATE["dp"] is not None:
        return dist.get_world_size(_STATE["dp"])
    return dist.get_world_size() // get_world_size()


def data_parallel_rank() -> int:
    """Which part of the data this rank reads: its rank in its data-parallel group, else the
    index of its tensor-parallel group (groups of consecutive ranks); 0 without a process group.
    Every rank of a tensor-parallel group has the same one."""
    if not is_initialized():
        return 0
    if _STATE["dp"] is not None:
        return dist.get_rank(_STATE["dp"])
    return dist.get_rank() // get_world_size()


def register_group(group) -> str:
    """Register `group` and return the key rewritten graphs use to name it."""
    if group is None or group is dist.group.WORLD:
        return "world"
    key = f"pg{id(group):x}"
    name = getattr(group, "group_name", None)
    if name:
        key = f"pg:{name}"
    _GROUPS[key] = group
    return key


def subgroup(key: str, m: int) -> str:
    """The key naming, within the tensor-parallel group `key` (None: the current one, resolved at
    run time), the group of the m consecutive ranks that this rank is among (K and V heads held by
    the ranks whose query heads read them: gathered and summed within such groups). `get_group`
    makes it at its first use (`_make_subgroups`)."""
    return f"{key or ''}/{m}"


def subgroup_size(key) -> int | None:
    """The m of a `subgroup` key; None for any other group."""
    return int(key.rpartition("/")[2]) if isinstance(key, str) and "/" in key else None


def _make_subgroups(key: str):
    """The ProcessGroup a `subgroup` key names, made at its first use: every rank of the world
    reaches that collective at the same point of the same graph, so the world makes the groups of
    m consecutive ranks of every tensor-parallel group together, each rank learning the others'
    groups, every rank calling `new_group` for each in one order (what NCCL and gloo need of a
    new group). Registered under the tensor-parallel group's own key, so a later `set_group`
    resolves a None key to its own subgroups."""
    base, m = key.rpartition("/")[0] or None, subgroup_size(key)
    pg = get_group(base)
    own = f"{register_group(pg)}/{m}"
    if own in _GROUPS:
        return _GROUPS[own]
    tp = dist.get_process_group_ranks(pg)
    if len(tp) % m:
        raise ProcessGroupError(f"groups of {m} ranks do not divide the tensor-parallel group {tp}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tp)
    made = None
    for ranks in sorted({tuple(r) for r in every}):
        for start in range(0, len(ranks), m):
            members = list(ranks[start:start + m])
            group = dist.new_group(members)
            if dist.get_rank() in members:
                made = group
    position = dist.get_rank(pg)
    if dist.get_rank(made) != position % m:
        raise ProcessGroupError(f"the tensor-parallel group {tp} does not list its ranks in ascending order: "
                                f"rank {dist.get_rank()} would be {dist.get_rank(made)} of its group of {m}, "
                                f"not {position % m}")
    _GROUPS[own] = made
    _SUBGROUPS[id(made)] = m
    return made


def subgroup_of(group) -> int | None:
    """m where `group` (a ProcessGroup) is one of `subgroup`'s groups of m ranks, else None."""
    return _SUBGROUPS.get(id(group))


def get_world_size(group=None) -> int:
    """Size of the tensor-parallel group."""
    return dist.get_world_size(get_group(group))


def get_rank(group=None) -> int:
    """This rank's index inside the tensor-parallel group."""
    return dist.get_rank(get_group(group))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_group_size(group=None) -> int:
    """TorchShard's name for the size of the tensor-parallel group (= `get_world_size`)."""
    return get_world_size(group)


def local_rank() -> int:
    """LOCAL_RANK as torchrun sets it (0 when absent)."""
    return int(os.environ.get("LOCAL_RANK", 0))
