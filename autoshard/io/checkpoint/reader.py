"""A DCP storage reader that reads only the requested part of each saved tensor.

PyTorch's `FileSystemReader` deserialises a whole saved chunk (`torch.load`) and then narrows it
to the box a rank asked for: loading a checkpoint written unsharded (degree 1, or
`torch_save_to_dcp`) makes every rank hold each full tensor in turn. A saved chunk is a
`torch.save` archive, an uncompressed zip whose storage record holds the tensor's bytes, so this
reader finds that record's place in the `.distcp` file and reads only the rows of the request, a
bounded block at a time (never larger than the box), straight into the destination. A rank's
memory during a load is then its own shard plus one block (`block_bytes`), whatever degree the
checkpoint was written at.

Saved tensors in any dense layout (contiguous, transposed, channels_last) and any dtype are read
in place. What it does not recognise (transformed or compressed items, overlapping or gapped
saved views, big-endian archives, another pickle) goes to PyTorch's reader, with a warning.

Every byte it reads, on either path, is checked against the checkpoint's `.checksums`
(checksums.py, written by autoshard's writer): whole blocks, a mismatch is a CheckpointError
naming the file, the key and the byte range, raised before those bytes reach the destination. A
checkpoint without `.checksums` (plain `dcp.save`, an older autoshard) loads unchecked, with a
one-line note.

Nothing it reads runs code (safe.py): `read_metadata` unpickles `.metadata` through an allowlist
of DCP's metadata classes, and each non-tensor item is read weights-only, whichever planner the
load uses (an autoshard planner reads it so itself; another gets it only after a weights-only
read succeeded); a refused class is a CheckpointError naming the file, the key and the class.
`trust_checkpoint=True` reads as PyTorch's reader does.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.storage import _get_dtype_from_pickle_storage_type

from ...errors import CheckpointError
from .checksums import CheckedItem, ItemWindow, Scratch, describe_key, read_checksums
from .safe import SafeLoadBytes, load_item, read_metadata_file

__all__ = ["FileSystemReader", "locate"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")       # a zip local file header, 30 bytes


@dataclass(frozen=True)
class _Saved:
    """Where a saved tensor's elements lie: from byte `start`, a C-contiguous block of `size`
    (its dims in storage order: `order[i]` is the tensor dim stored i-th, outermost first)."""
    start: int
    dtype: torch.dtype
    size: tuple
    order: tuple


def _rebuild_v2(storage, offset, size, stride, *rest):
    key, dtype = storage
    return key, dtype, offset, tuple(size), tuple(stride)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *rest):
    return storage[0], dtype, offset, tuple(size), tuple(stride)


class _Header(pickle.Unpickler):
    """Unpickles a saved tensor's `data.pkl` into (storage key, dtype, storage offset, size,
    stride) without touching its bytes: `_rebuild_tensor_v2` (typed storages) and `_v3` (an
    untyped storage and the dtype as an argument: float8, uint16-64). Anything else raises (the
    caller falls back)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return None
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        dtype = None if storage_type is None else _get_dtype_from_pickle_storage_type(storage_type)
        return key, dtype


def _storage_order(size, stride):
    """The dims of a saved view from outermost to innermost in its storage, where the view is a
    dense block in some dim order (contiguous, transposed, channels_last); None otherwise."""
    order = tuple(sorted(range(len(size)), key=lambda d: -stride[d]))
    expect = 1
    for d in reversed(order):
        if size[d] != 1 and stride[d] != expect:
            return None
        expect *= size[d]
    return order


def _member(item: CheckedItem, info: zipfile.ZipInfo) -> tuple:
    """(first byte in the file, byte count) of a stored zip member of the archive `item`, from its
    local header (zip64 sizes come from the central directory through `info`; the zip CRC is not
    checked: torch.save may omit it, and the item's own checksums cover these bytes)."""
    pos = item.offset + info.header_offset
    header = _LOCAL_HEADER.unpack(item.read(pos, _LOCAL_HEADER.size))
    if header[0] != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED:
        raise ValueError("not a stored zip member")
    return pos + _LOCAL_HEADER.size + header[9] + header[10], info.file_size


def _read_member(item: CheckedItem, info: zipfile.ZipInfo) -> bytes:
    return bytes(item.read(*_member(item, info)))


def _locate(item: CheckedItem):
    """The `_Saved` place of the tensor saved (by `torch.save`) as `item`, or None where the item
    is not one this reader can read in place. A checksum mismatch in what it reads raises."""
    try:
        with zipfile.ZipFile(ItemWindow(item)) as zf:
            infos = {i.filename: i for i in zf.infolist()}
        pkl = next((n for n in infos if n.endswith("/data.pkl")), None)
        if pkl is None:
            return None
        prefix = pkl[: -len("data.pkl")]
        if prefix + "byteorder" in infos and _read_member(item, infos[prefix + "byteorder"]) != b"little":
            return None
        key, dtype, storage_offset, size, stride = _Header(io.BytesIO(_read_member(item, infos[pkl]))).load()
        order = _storage_order(size, stride)
        if order is None or not isinstance(dtype, torch.dtype):
            return None
        start, nbytes = _member(item, infos[f"{prefix}data/{key}"])
        if (storage_offset + math.prod(size)) * dtype.itemsize > nbytes:
            return None
        return _Saved(start + storage_offset * dtype.itemsize, dtype, tuple(size[d] for d in order), order)
    except CheckpointError:
        raise
    except Exception:  # noqa: BLE001 - whatever this reader cannot parse, PyTorch's reader reads whole
        return None


def locate(item: CheckedItem):
    """Where the tensor saved as `item` lies (its first byte, dtype, size in storage order and
    the dims' order: `start`, `dtype`, `size`, `order`), read from its archive's headers by an
    unpickler that builds nothing; None where this reader cannot read it in place (PyTorch's
    reader, weights-only, reads it whole). A checksum mismatch in what it reads raises."""
    return _locate(item)


class _CheckedBytes:
    """The planner as PyTorch's `read_data` sees it, through the reader: a non-tensor item goes to
    an autoshard planner as it is (it reads weights-only itself), to any other only after a
    weights-only read of it succeeded (unless the reader trusts the checkpoint); a refusal names
    the file. Everything else is the planner's."""

    def __init__(self, planner, reader: "FileSystemReader"):
        self._planner, self._reader = planner, reader

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        reader, planner = self._reader, self._planner
        try:
            if not reader.trust_checkpoint and not isinstance(planner, SafeLoadBytes):
                load_item(value, read_item.storage_index.fqn)
                value.seek(0)
            planner.load_bytes(read_item, value)
        except CheckpointError as e:
            info = reader.storage_data[read_item.storage_index]
            raise CheckpointError(f"{os.path.join(os.fspath(reader.path), info.relative_path)}: {e}") from None


class FileSystemReader(dcp.FileSystemReader):
    """`torch.distributed.checkpoint.FileSystemReader` that reads, of each saved tensor, only the
    rows a request covers, in blocks of at most `block_bytes` and at most the box's own size,
    into the destination: no rank holds more of a saved tensor than its box (never a full tensor
    from an unsharded checkpoint). Where the checkpoint has `.checksums`, every byte read is
    checked first (a whole checksum block at a time, the last one kept: a rank holds one more
    block, of the checkpoint's block size).

        dcp.load(sd, storage_reader=autoshard.checkpoint.FileSystemReader(path))

    Since construction, `bytes_read` counts the bytes it read from files in place,
    `largest_block` the largest buffer it read them into, `blocks_checked` the checksums it
    compared, and `fallbacks` the tensor requests it left to PyTorch's reader (read whole; a
    warning says so). `checksums` is the checkpoint's `.checksums` (None: it has none).

    `.metadata` is read through an allowlist and non-tensor items weights-only (safe.py), with
    any planner; `trust_checkpoint=True` reads both as PyTorch does (for a checkpoint whose
    source you trust that holds objects of other classes). `metadata`: the checkpoint's Metadata
    where the caller has read it already (`load` does: `.metadata` is then read once)."""

    def __init__(self, path, *, block_bytes: int = 4 << 20, trust_checkpoint: bool = False, metadata=None,
                 **kwargs):
        super().__init__(path, **kwargs)
        if int(block_bytes) < 1:
            raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
        self.block_bytes = int(block_bytes)
        self.trust_checkpoint = bool(trust_checkpoint)
        self.metadata = metadata
        self.bytes_read = 0
        self.largest_block = 0
        self.blocks_checked = 0
        self.fallbacks = 0
        self.checksums = None
        self._keys: dict = {}
        self._handed: list = []                 # items handed to PyTorch's reader, counted after it
        self._scratch = Scratch()               # the read buffer every item shares

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:                       # another checkpoint: the Metadata given was this one's
            self.metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args, **kwargs):
        """The checkpoint's Metadata, as PyTorch's reader gives it, but unpickled through the
        allowlist of safe.py (a refused class: CheckpointError naming the file and the class)."""
        from torch.distributed.checkpoint.metadata import StorageMeta
        metadata = self.metadata if kwargs.get("rank") is None else None
        if metadata is None:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = read_metadata_file(f, name=os.fspath(path), trust_checkpoint=self.trust_checkpoint)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.checksums = read_checksums(self.path)
        self._keys = {(info.relative_path, info.offset): index for index, info in self.storage_data.items()}
        if self.checksums is None and is_coordinator:
            warnings.warn(f"autoshard.checkpoint: {os.fspath(self.path)} has no {'.checksums'} (written by plain "
                          "dcp.save or an older autoshard): it loads without checking its bytes", stacklevel=3)

    def item(self, f, info) -> CheckedItem:
        """The saved item `info` (a `.metadata` storage entry) of the open file `f`, read through
        its checksums where the checkpoint has them. An item `.checksums` does not list is an error:
        that file does not describe this checkpoint."""
        name = os.path.join(os.fspath(self.path), info.relative_path)
        key = describe_key(self._keys.get((info.relative_path, info.offset)))
        if self.checksums is None:
            return CheckedItem(f, name, key, info.offset, info.length, scratch=self._scratch)
        sums = self.checksums.items.get((info.relative_path, info.offset))
        if sums is None:
            raise CheckpointError(f"{name}: {key}: bytes [{info.offset}, {info.offset + info.length}) have no "
                                  f"checksum in .checksums, which does not match .metadata")
        return CheckedItem(f, name, key, info.offset, info.length, sums, self.checksums.block_bytes,
                           self.checksums.edge_bytes, self._scratch)

    def _counted(self, item: CheckedItem) -> None:
        self.bytes_read += item.bytes_read
        self.largest_block = max(self.largest_block, item.largest)
        self.blocks_checked += item.blocks_checked

    def _slice_file(self, file, sinfo):
        """PyTorch's reader (pickled values, and the tensors this one leaves to it) reads an item
        through this: a file of the item's bytes, each read checked where the checkpoint has
        checksums (`torch.load` has read, and so checked, every byte it uses before a value
        comes out)."""
        if self.checksums is None:
            return super()._slice_file(file, sinfo)
        item = self.item(file, sinfo)
        self._handed.append(item)
        return io.BufferedReader(ItemWindow(item), buffer_size=64 << 10)

    def read_data(self, plan: LoadPlan, planner):
        rest, whole, per_file = [], [], {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                rest.append(req)
            elif getattr(info, "transform_descriptors", None):
                whole.append(req)
            else:
                per_file.setdefault(info.relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as f:
                item = saved = None
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if item is None or item.offset != info.offset:      # the next saved item
                        if item is not None:
                            self._counted(item)
                        item = self.item(f, info)
                        saved = _locate(item)
                    if saved is None:
                        whole.append(req)
                        continue
                    target = planner.resolve_tensor(req).detach()
                    if tuple(req.lengths) != tuple(target.shape):
                        raise AssertionError(f"{req.storage_index}: saved box {tuple(req.lengths)}, "
                                             f"destination {tuple(target.shape)}")
                    self._copy(item, saved, tuple(req.storage_offsets), target)
                    planner.commit_tensor(req, target)
                if item is not None:
                    self._counted(item)
        if whole:
            self.fallbacks += len(whole)
            names = sorted({r.storage_index.fqn for r in whole})
            warnings.warn(f"autoshard.checkpoint.FileSystemReader: {len(whole)} saved tensor(s) read whole by "
                          f"PyTorch's reader (compressed or an archive layout this reader does not know): "
                          f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}", stacklevel=2)
        if rest or whole:
            try:
                return super().read_data(LoadPlan(rest + whole, plan.storage_data, plan.planner_data),
                                         _CheckedBytes(planner, self) if rest else planner)
            finally:
                for item in self._handed:
                    self._counted(item)
                self._handed.clear()
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -------------------------------------------------------------------- reading a box

    def _read(self, item: CheckedItem, start: int, nbytes: int, dtype) -> torch.Tensor:
        """nbytes (> 0) from file position `start`, checked, as a flat tensor of `dtype` (valid
        until the next read)."""
        return torch.frombuffer(item.read(start, nbytes), dtype=torch.uint8).view(dtype)

    def _copy(self, item: CheckedItem, saved: _Saved, offsets: tuple, target: torch.Tensor) -> None:
        """Copy the box (offsets, target.shape) of the saved tensor into target, reading whole
        slices of the outermost stored dim (rows) a block at a time. A block holds at most
        `block_bytes`, and never more than the box itself: where one row is larger, it goes a dim
        deeper (one row at a time)."""
        limit = min(self.block_bytes, max(target.numel(), 1) * saved.dtype.itemsize)
        self._copy_dims(item, saved.start, saved.size, saved.dtype, limit,
                        tuple(offsets[d] for d in saved.order), target.permute(saved.order))

    def _copy_dims(self, item, start, size, dtype, limit, offsets, target) -> None:
        if target.numel() == 0:
            return
        if len(size) == 0:
            target.copy_(self._read(item, start, dtype.itemsize, dtype).view(()))
            return
        row = math.prod(size[1:]) * dtype.itemsize                # bytes of one dim-0 slice
        first, count = offsets[0], target.shape[0]
        if len(size) == 1 or row <= limit:
            rows, r = max(1, limit // row), 0
            while r < count:
                pos = start + (first + r) * row
                # stop at the end of a checksum block where a row fits before it: a read that
                # crosses one is copied together from both blocks (one row at a time, it is small)
                k = min(rows, count - r, max(1, (item.run_end(pos) - pos) // row))
                block = self._read(item, pos, k * row, dtype).view(k, *size[1:])
                for d in range(1, len(size)):
                    block = block.narrow(d, offsets[d], target.shape[d])
                target[r:r + k].copy_(block)
                r += k
            return
        for r in range(count):
            self._copy_dims(item, start + (first + r) * row, size[1:], dtype, limit, offsets[1:], target[r])
