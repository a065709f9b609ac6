"""Saving and loading DCP checkpoints: atomic saves, checked loads, conversion to one file.

`save` / `load` wrap `dcp.save` / `dcp.load`: save writes into a hidden sibling directory and
renames it into place once every rank has written (a failed save leaves no checkpoint that looks
complete, and keeps the previous one), with `.checksums` of every block (writer.py); load refuses
a checkpoint of another model (missing or extra keys, other global shapes) or a partial
directory before any tensor is touched, and checks every block it reads (reader.py).
`LoadPlanner` is the same check for `dcp.load(..., planner=LoadPlanner())`. Nothing a checkpoint
holds runs code (safe.py): `.metadata` is read through an allowlist, non-tensor items
weights-only, in `load`, `LoadPlanner` and both converters, unless `trust_checkpoint=True`.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ...errors import CheckpointError
from .checksums import BLOCK_BYTES, FILE_NAME
from .layout import global_shape_of, quiet, quiet_single_process
from .reader import FileSystemReader
from .safe import (SafeEmptyStateDictLoadPlanner, SafeLoadBytes, SafeLoadPlanner, load_pickled,
                   read_metadata_file)
from .state import few
from .verify import verify
from .writer import FileSystemWriter


# ----------------------------------------------------------------------------- checks against a checkpoint

def _flat(state_dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return flatten_state_dict(state_dict)[0]


def check_checkpoint(state_dict, metadata, asked=None) -> None:
    """Refuse `metadata` (a DCP checkpoint's) for `state_dict`: keys the state dict asks for that the
    checkpoint lacks, keys the checkpoint has under the state dict's top-level names that nobody
    asks for (`asked`: the keys every rank asks for, where ranks hold different parts: pipeline
    stages), and tensors whose global shapes differ. Raises CheckpointError naming all of them."""
    flat = _flat(state_dict)
    saved = metadata.state_dict_metadata
    asked = set(flat) if asked is None else set(asked)
    tops = {k.split(".", 1)[0] for k in asked}
    missing = sorted(k for k in flat if k not in saved)
    extra = sorted(k for k in saved if k not in asked and k.split(".", 1)[0] in tops)
    shapes = []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            continue
        got = global_shape_of(value)
        if isinstance(md, TensorStorageMetadata) and got is not None and tuple(md.size) != got:
            shapes.append(f"{key!r}: checkpoint {tuple(md.size)}, model {got}")
        elif isinstance(md, BytesStorageMetadata) and isinstance(value, torch.Tensor):
            shapes.append(f"{key!r}: the checkpoint holds an object, the model a tensor of {got}")
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {few(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in the model: {few(extra)}")
    if shapes:
        problems.append("global shapes differ: " + "; ".join(shapes[:8]) +
                        (f"; and {len(shapes) - 8} more" if len(shapes) > 8 else ""))
    if problems:
        raise CheckpointError("the checkpoint does not fit the state dict (nothing was loaded):\n  "
                              + "\n  ".join(problems))


class LoadPlanner(SafeLoadBytes, DefaultLoadPlanner):
    """DCP's default load planner that first runs `check_checkpoint` (on every rank, before any
    read): `dcp.load(sd, checkpoint_id=path, planner=LoadPlanner())`. Non-tensor items are read
    weights-only (safe.py; `trust_checkpoint=True`: as PyTorch's planner reads them)."""

    def __init__(self, *args, trust_checkpoint: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.trust_checkpoint = bool(trust_checkpoint)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        if metadata is not None:
            check_checkpoint(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _read_metadata(path, trust_checkpoint: bool = False):
    """The checkpoint's Metadata (read through safe.py's allowlist unless `trust_checkpoint`),
    after checking that every file it names is there and long enough."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        names = sorted(os.listdir(path))[:8]
        raise CheckpointError(f"{path}: not a complete checkpoint (no .metadata file; it holds {names}): "
                              "an unfinished or failed save, or not a DCP checkpoint")
    try:
        metadata = read_metadata_file(os.path.join(path, ".metadata"), trust_checkpoint=trust_checkpoint)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling error means the same thing
        raise CheckpointError(f"{path}/.metadata cannot be read: {type(e).__name__}: {e}") from e
    need: dict = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            raise CheckpointError(f"{path}: partial checkpoint: {name} is "
                                  f"{'missing' if have is None else f'{have} bytes'}, .metadata needs {size} bytes")
    return metadata


# ----------------------------------------------------------------------------- save / load

def _is_coordinator(pg) -> bool:
    return not dist.is_initialized() or dist.get_rank(pg) == 0


def _barrier(pg) -> None:
    if dist.is_initialized():
        dist.barrier(group=pg)


def sibling(path: str, suffix: str) -> str:
    """The hidden sibling `.NAME.suffix` of `path`, where a checkpoint is written before it is published."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{suffix}")


def publish(tmp: str, path: str) -> None:
    """Rename the finished `tmp` into `path`; a checkpoint already there goes only after."""
    old = sibling(path, "old")
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save(state_dict, checkpoint_id, *, process_group=None, checksums: bool = True,
         checksum_block_bytes: int = BLOCK_BYTES) -> None:
    """`dcp.save(state_dict)` into `checkpoint_id` (a directory), atomically: the ranks write into
    a hidden sibling directory, which rank 0 renames into place once every rank has written. A
    failed save raises on every rank and leaves `checkpoint_id` as it was. With `checksums`
    (the default) it also writes `.checksums`: the CRC-32 of every `checksum_block_bytes` block
    of every saved item, which `load` checks on every read."""
    path = os.path.abspath(os.fspath(checkpoint_id))
    tmp = sibling(path, "partial")
    pg = process_group
    if _is_coordinator(pg):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(pg)
    try:
        with quiet_single_process():
            writer = FileSystemWriter(tmp, block_bytes=checksum_block_bytes) if checksums else dcp.FileSystemWriter(tmp)
            dcp.save(state_dict, storage_writer=writer, process_group=pg,
                     no_dist=not dist.is_initialized())
    except BaseException as e:
        if _is_coordinator(pg):
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointException):      # a BaseException: make it an ordinary error
            raise CheckpointError(f"saving {path} failed; it was left as it was. {_failures(e)}") from e
        raise
    if _is_coordinator(pg):
        publish(tmp, path)
    _barrier(pg)


def _failures(e) -> str:
    """The per-rank errors of DCP's CheckpointException, one line each."""
    return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))


def load(state_dict, checkpoint_id, *, process_group=None, trust_checkpoint: bool = False) -> None:
    """`dcp.load(state_dict)` from `checkpoint_id` in place, after checking that the directory is
    complete and that its keys and global shapes are the state dict's (CheckpointError otherwise,
    raised on every rank before any tensor is touched). Reads with `FileSystemReader`: only this
    rank's boxes of each saved tensor, a bounded block at a time, each block checked against the
    checkpoint's `.checksums` before it is copied (a mismatch is a CheckpointError naming the
    file, key and byte range; what was loaded before it came from blocks that matched). A
    checkpoint without `.checksums` loads unchecked, with a one-line note.

    A checkpoint from elsewhere runs no code: `.metadata` is unpickled through an allowlist of
    DCP's metadata classes, and each non-tensor item (optimizer hyperparameters, step counts,
    extras) with `torch.load(weights_only=True)`; anything else is a CheckpointError naming the
    file, the key and the class, before anything of it is built. `trust_checkpoint=True` reads
    them as PyTorch does (running what they ask for): for a trusted checkpoint that holds objects
    of your own classes (or allow just those with `torch.serialization.add_safe_globals`)."""
    path = os.fspath(checkpoint_id)
    metadata = _read_metadata(path, trust_checkpoint)
    check_checkpoint(state_dict, metadata, _asked_by_all(state_dict, process_group))
    try:
        with quiet_single_process():
            dcp.load(state_dict, storage_reader=FileSystemReader(path, trust_checkpoint=trust_checkpoint,
                                                                 metadata=metadata),
                     planner=SafeLoadPlanner(trust_checkpoint=trust_checkpoint),  # checked above
                     process_group=process_group, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise CheckpointError(f"loading {path} failed: {_failures(e)}") from e


def _asked_by_all(state_dict, pg):
    """The keys every rank of `pg` asks for (ranks of a pipeline hold different stages); one
    exchange of the key lists."""
    if not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return None
    every = [None] * dist.get_world_size(pg)
    dist.all_gather_object(every, sorted(_flat(state_dict)), group=pg)
    return set().union(*every)


# ----------------------------------------------------------------------------- conversion

def dcp_to_torch_save(checkpoint_dir, torch_file, *, trust_checkpoint: bool = False) -> None:
    """A DCP checkpoint as one `torch.save` file of full tensors (for the unsharded model); one
    process. A checkpoint with `.checksums` is verified first (every problem named, nothing
    written). The state dict is rebuilt from `.metadata` (as PyTorch's converter does) and read
    with autoshard's reader: `.metadata` through the allowlist, non-tensor items weights-only,
    every block checked (`trust_checkpoint=True`: unpickled as PyTorch does)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    path = os.fspath(checkpoint_dir)
    _read_metadata(path, trust_checkpoint)
    if os.path.isfile(os.path.join(path, FILE_NAME)):
        report = verify(path, trust_checkpoint=trust_checkpoint)
        if not report.ok:
            raise CheckpointError(f"{path} is damaged, not converted:\n  " +
                                  "\n  ".join(report.problems[:8]) +
                                  (f"\n  and {len(report.problems) - 8} more" if len(report.problems) > 8 else ""))
    state_dict: dict = {}
    try:
        with quiet():
            _load_state_dict(state_dict, storage_reader=FileSystemReader(path, trust_checkpoint=trust_checkpoint),
                             planner=SafeEmptyStateDictLoadPlanner(trust_checkpoint=trust_checkpoint), no_dist=True)
    except CheckpointException as e:
        raise CheckpointError(f"converting {path} failed, nothing written: {_failures(e)}") from e
    torch.save(state_dict, torch_file)


def torch_save_to_dcp(torch_file, checkpoint_dir, *, trust_checkpoint: bool = False) -> None:
    """A `torch.save` file (e.g. {"model": model.state_dict(), ...}) as a DCP checkpoint that loads
    at any degree (as PyTorch's converter writes it, into a hidden sibling directory renamed into
    place). The file is read with `torch.load(weights_only=True)`: an object of another class is
    a CheckpointError naming it (`trust_checkpoint=True`: weights_only=False, as PyTorch's
    converter reads it)."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
    if not os.path.isfile(torch_file):
        raise CheckpointError(f"{torch_file}: no such file")
    state_dict = load_pickled(torch_file, os.fspath(torch_file), trust_checkpoint=trust_checkpoint,
                              what="the torch.save file")
    path = os.path.abspath(os.fspath(checkpoint_dir))
    tmp = sibling(path, "partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with quiet():
            _save_state_dict(state_dict, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (Exception, CheckpointException)):
            raise CheckpointError(f"converting {torch_file}: {type(e).__name__}: {e}") from e
        raise
    publish(tmp, path)
