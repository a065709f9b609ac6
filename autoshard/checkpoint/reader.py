"""A DCP storage reader that reads only the requested part of each saved tensor.

PyTorch's `FileSystemReader` deserialises a whole saved chunk (`torch.load`) and then narrows it
to the box a rank asked for: loading a checkpoint written unsharded (degree 1, or
`torch_save_to_dcp`) makes every rank hold each full tensor in turn. A saved chunk is a
`torch.save` archive, an uncompressed zip whose storage record holds the tensor's bytes, so this
reader finds that record's place in the `.distcp` file and reads only the rows of the request, a
bounded block at a time (never larger than the box), straight into the destination. A rank's
memory during a load is then its own shard plus one block (`block_bytes`), whatever degree the
checkpoint was written at.

Anything it does not recognise (byte items, transformed or compressed items, non-contiguous saved
views, big-endian archives) goes to PyTorch's reader unchanged.
"""
from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

__all__ = ["FileSystemReader"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")       # a zip local file header, 30 bytes


@dataclass(frozen=True)
class _Saved:
    """Where a saved tensor's elements lie: byte `start` of element 0 of its (C-contiguous) view."""
    start: int
    dtype: torch.dtype
    size: tuple


class _Window(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file of their own (what
    `zipfile` needs to read one saved item's archive in place)."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class _Header(pickle.Unpickler):
    """Unpickles a saved tensor's `data.pkl` into (storage key, dtype, storage offset, size,
    stride) without touching its bytes; any other object raises (the caller falls back)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (*storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        from torch.storage import _get_dtype_from_pickle_storage_type
        return key, _get_dtype_from_pickle_storage_type(storage_type)


def _contiguous(size, stride) -> bool:
    expect = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _locate(f, offset: int, length: int):
    """The `_Saved` place of the tensor saved (by `torch.save`) at bytes [offset, offset + length)
    of `f`, or None where the item is not one this reader can read in place."""
    try:
        zf = zipfile.ZipFile(_Window(f, offset, length))
        names = zf.namelist()
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            return None
        prefix = pkl[: -len("data.pkl")]
        if prefix + "byteorder" in names and zf.read(prefix + "byteorder") != b"little":
            return None
        key, dtype, storage_offset, size, stride = _Header(io.BytesIO(zf.read(pkl))).load()
        info = zf.getinfo(f"{prefix}data/{key}")
        if info.compress_type != zipfile.ZIP_STORED or not _contiguous(size, stride):
            return None
        f.seek(offset + info.header_offset)
        header = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        if header[0] != b"PK\x03\x04":
            return None
        data = offset + info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (storage_offset + math.prod(size)) * itemsize > info.file_size:
            return None
        return _Saved(data + storage_offset * itemsize, dtype, size)
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, TypeError, struct.error):
        return None


class FileSystemReader(dcp.FileSystemReader):
    """`torch.distributed.checkpoint.FileSystemReader` that reads, of each saved tensor, only the
    rows a request covers, in blocks of at most `block_bytes` and at most the box's own size,
    into the destination: no rank holds more of a saved tensor than its box (never a full tensor
    from an unsharded checkpoint).

        dcp.load(sd, storage_reader=autoshard.checkpoint.FileSystemReader(path))

    `bytes_read` and `largest_block` count what the last loads read (for tests and benchmarks)."""

    def __init__(self, path, *, block_bytes: int = 4 << 20, **kwargs):
        super().__init__(path, **kwargs)
        self.block_bytes = int(block_bytes)
        self.bytes_read = 0
        self.largest_block = 0

    def read_data(self, plan: LoadPlan, planner):
        rest, per_file = [], {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                rest.append(req)
            else:
                per_file.setdefault(info.relative_path, []).append(req)
        places: dict = {}
        for relative_path, reqs in per_file.items():
            with open(self.fs.concat_path(self.path, relative_path), "rb", buffering=0) as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    key = (relative_path, info.offset)
                    if key not in places:
                        places[key] = _locate(f, info.offset, info.length)
                    saved = places[key]
                    if saved is None:
                        rest.append(req)
                        continue
                    target = planner.resolve_tensor(req).detach()
                    if tuple(req.lengths) != tuple(target.shape):
                        raise AssertionError(f"{req.storage_index}: saved box {tuple(req.lengths)}, "
                                             f"destination {tuple(target.shape)}")
                    self._copy(f, saved, tuple(req.storage_offsets), target)
                    planner.commit_tensor(req, target)
        if rest:
            return super().read_data(LoadPlan(rest, plan.storage_data, plan.planner_data), planner)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -------------------------------------------------------------------- reading a box

    def _read(self, f, start: int, nbytes: int, dtype) -> torch.Tensor:
        """nbytes from byte `start`, as a flat tensor of `dtype` (a fresh block)."""
        buf = bytearray(nbytes)
        f.seek(start)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{f.name}: ends at byte {start + got}, a saved tensor needs {start + nbytes}")
            got += n
        self.bytes_read += nbytes
        self.largest_block = max(self.largest_block, nbytes)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype) if nbytes else torch.empty(0, dtype=dtype)

    def _copy(self, f, saved: _Saved, offsets: tuple, target: torch.Tensor) -> None:
        """Copy the box (offsets, target.shape) of the saved tensor into target, reading whole
        dim-0 slices (rows) a block at a time. A block holds at most `block_bytes`, and never more
        than the box itself: where one row is larger, it goes a dim deeper (one row at a time)."""
        itemsize = torch.empty((), dtype=saved.dtype).element_size()
        limit = min(self.block_bytes, max(target.numel(), 1) * itemsize)
        self._copy_dims(f, saved.start, saved.size, saved.dtype, itemsize, limit, offsets, target)

    def _copy_dims(self, f, start, size, dtype, itemsize, limit, offsets, target) -> None:
        if target.numel() == 0:
            return
        if len(size) == 0:
            target.copy_(self._read(f, start, itemsize, dtype).view(()))
            return
        row = math.prod(size[1:]) * itemsize                      # bytes of one dim-0 slice
        first, count = offsets[0], target.shape[0]
        if len(size) == 1 or row <= limit:
            rows = max(1, limit // row)
            for r in range(0, count, rows):
                k = min(rows, count - r)
                block = self._read(f, start + (first + r) * row, k * row, dtype).view(k, *size[1:])
                for d in range(1, len(size)):
                    block = block.narrow(d, offsets[d], target.shape[d])
                target[r:r + k].copy_(block)
            return
        for r in range(count):
            self._copy_dims(f, start + (first + r) * row, size[1:], dtype, itemsize, limit, offsets[1:], target[r])
