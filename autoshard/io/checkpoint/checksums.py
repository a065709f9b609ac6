"""Checksums of a DCP checkpoint's saved items, block by block, and reads that check them.

A `.distcp` file is a run of saved items: a `torch.save` archive per tensor chunk, pickled bytes
for other values. The archives carry CRC-32s, but a reader that reads a box in place (reader.py)
never reads a whole member, so nothing would notice a flipped byte. autoshard's writer
(writer.py) records, for every item, the CRC-32 (zlib's; computed by ISA-L where the `isal`
package is installed, which gives the same values several times faster) of

- each block of its bytes: [0, B), [B, 2B), ... from the item's first byte, the last one partial
  (B = `block_bytes`, 4 MiB by default, the reader's block), so that a rank reading a box reads
  and checks only the blocks under it;
- its head and its tail: its first and its last E bytes (E = min(64 KiB, B)). The archive's
  headers (local zip headers, `data.pkl`) lie in the head and its zip directory in the tail, so
  reading those costs two small reads, not two whole blocks.

They go into one JSON file, `.checksums`, beside `.metadata`; DCP and PyTorch's converters
ignore it. `CheckedItem` reads an item through them: whatever it returns comes from whole blocks
(or a whole head or tail) that matched, and a mismatch raises CheckpointError naming the file,
the key and the byte range before the bytes go anywhere.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass

from ...errors import CheckpointError

try:                # ISA-L's CRC-32 is zlib's, bit for bit, and about 3x as fast here (optional)
    from isal.isal_zlib import crc32
    CRC32_BY = "isal"
except ImportError:
    from zlib import crc32
    CRC32_BY = "zlib"

__all__ = ["BLOCK_BYTES", "FILE_NAME", "ItemSums", "Checksums", "CheckedItem", "ItemWindow", "item_sums",
           "read_checksums", "write_checksums", "describe_key", "crc32", "CRC32_BY", "Scratch"]

BLOCK_BYTES = 4 << 20          # bytes of a block (the reader's block)
EDGE_BYTES = 64 << 10          # bytes of an item's head and tail, at most
FILE_NAME = ".checksums"
FORMAT = "autoshard.checkpoint.checksums"
VERSION = 1


@dataclass(frozen=True)
class ItemSums:
    """The CRC-32s of one saved item of `length` bytes: its blocks (the last one partial), its
    head (first E bytes) and tail (last E bytes), E = min(edge_bytes, length)."""
    length: int
    head: int
    tail: int
    blocks: tuple


@dataclass
class Checksums:
    """A checkpoint's `.checksums`: block and edge sizes, and the ItemSums of each item by
    (file name relative to the checkpoint, offset in the file)."""
    block_bytes: int
    edge_bytes: int
    items: dict

    def to_json(self) -> str:
        files: dict = {}
        for (name, offset), s in sorted(self.items.items()):
            files.setdefault(name, []).append([offset, s.length, s.head, s.tail, list(s.blocks)])
        return json.dumps({"format": FORMAT, "version": VERSION, "algorithm": "crc32",
                           "block_bytes": self.block_bytes, "edge_bytes": self.edge_bytes, "files": files},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Checksums":
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("algorithm") != "crc32" or doc.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} crc32 {FORMAT} file")
        items = {}
        for name, rows in doc["files"].items():
            for offset, length, head, tail, blocks in rows:
                items[(name, int(offset))] = ItemSums(int(length), int(head), int(tail), tuple(blocks))
        return cls(int(doc["block_bytes"]), int(doc["edge_bytes"]), items)


def edge_bytes_for(block_bytes: int) -> int:
    """E for a block size B: min(64 KiB, B)."""
    return min(EDGE_BYTES, block_bytes)


def read_checksums(directory) -> Checksums | None:
    """The `.checksums` of a checkpoint directory, None where it has none; CheckpointError where
    it cannot be read."""
    path = os.path.join(os.fspath(directory), FILE_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return Checksums.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from e


def write_checksums(directory, checksums: Checksums, *, sync: bool = True) -> None:
    """Write `.checksums` into `directory` (through a temporary file renamed into place)."""
    path = os.path.join(os.fspath(directory), FILE_NAME)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(checksums.to_json())
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def describe_key(index) -> str:
    """A DCP MetadataIndex as an error names it: 'model.wte.weight' (saved chunk at (256, 0))."""
    if index is None:
        return "an item .metadata does not name"
    offset = getattr(index, "offset", None)
    chunk = f" (saved chunk at {tuple(offset)})" if offset is not None and any(offset) else ""
    return f"{index.fqn!r}{chunk}"


def _read_exactly(f, pos: int, view: memoryview, name: str) -> memoryview:
    f.seek(pos)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{name}: ends at byte {pos + got}, bytes [{pos}, {pos + len(view)}) "
                                  "are needed: the file is truncated")
        got += n
    return view


def item_sums(f, offset: int, length: int, block_bytes: int, edge_bytes: int, name: str = "",
              buffer: bytearray | None = None) -> ItemSums:
    """The ItemSums of the item at [offset, offset + length) of the open file `f` (read once, a
    block at a time, into `buffer` when given)."""
    buf = memoryview(buffer if buffer is not None and len(buffer) >= min(block_bytes, length)
                     else bytearray(min(block_bytes, length)))
    edge = min(edge_bytes, length)
    blocks, head = [], crc32(b"")
    for start in range(0, length, block_bytes):
        data = _read_exactly(f, offset + start, buf[:min(block_bytes, length - start)], name)
        if start == 0:
            head = crc32(data[:edge])
        blocks.append(crc32(data))
    tail = crc32(_read_exactly(f, offset + length - edge, buf[:edge], name)) if edge else head
    return ItemSums(length, head, tail, tuple(blocks))


class Scratch:
    """One reusable read buffer, grown when a read needs more: the items a reader reads one after
    another share it (no fresh pages to fault in for every item)."""

    def __init__(self):
        self.buf = bytearray(0)

    def get(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


class CheckedItem:
    """One saved item, bytes [offset, offset + length) of the open binary file `f`, read through
    its checksums `sums` (None: read as it is, unchecked).

    `read(pos, n)` (pos counted in the file) returns the bytes from whole blocks that matched:
    a range inside the cached block (the last one read) or the item's only block from that
    block, else a range inside the head or the tail from that edge, anything else from the
    blocks it overlaps, each read whole and checked (a box read row by row reads each block
    once). A mismatch raises CheckpointError naming `name` (the file), `key` and the block's
    byte range in the file. `bytes_read`, `largest` and `blocks_checked` count what it did."""

    def __init__(self, f, name: str, key: str, offset: int, length: int, sums: ItemSums | None = None,
                 block_bytes: int = BLOCK_BYTES, edge_bytes: int = EDGE_BYTES, scratch: Scratch | None = None):
        if sums is not None and sums.length != length:
            raise CheckpointError(f"{name}: {key}: bytes [{offset}, {offset + length}): .checksums records "
                                  f"{sums.length} bytes for this item, .metadata {length}")
        self.f, self.name, self.key, self.offset, self.length, self.sums = f, name, key, offset, length, sums
        self.block_bytes, self.edge = block_bytes, min(edge_bytes, length)
        self.bytes_read = self.largest = self.blocks_checked = 0
        self._edges: dict = {}
        self._cached = (None, None)                 # (block index, its bytes)
        self.scratch = scratch if scratch is not None else Scratch()

    # -------------------------------------------------------------- reading

    def read(self, pos: int, n: int) -> memoryview:
        """n bytes from file position pos (inside the item), checked; a view that stays valid
        until the next read."""
        rel = pos - self.offset
        if rel < 0 or n < 0 or rel + n > self.length:
            raise CheckpointError(f"{self.name}: {self.key}: bytes [{pos}, {pos + n}) lie outside the item "
                                  f"[{self.offset}, {self.offset + self.length})")
        if n == 0:
            return memoryview(b"")
        if self.sums is None:
            view = _read_exactly(self.f, pos, self.scratch.get(n), self.name)
            self._count(n)
            return view
        first, last = rel // self.block_bytes, (rel + n - 1) // self.block_bytes
        if first != last or (self._cached[0] != first and len(self.sums.blocks) > 1):
            if rel + n <= self.edge:                     # not in the cached block, nor the item's only one
                return self._edge("head")[rel:rel + n]
            tail_start = self.length - self.edge
            if rel >= tail_start:
                return self._edge("tail")[rel - tail_start:rel - tail_start + n]
        if first == last:
            start = rel - first * self.block_bytes
            return self._block(first)[start:start + n]
        out = memoryview(bytearray(n))
        self.largest = max(self.largest, n)
        for i in range(first, last + 1):
            lo, hi = max(rel, i * self.block_bytes), min(rel + n, (i + 1) * self.block_bytes)
            out[lo - rel:hi - rel] = self._block(i)[lo - i * self.block_bytes:hi - i * self.block_bytes]
        return out

    def run_end(self, pos: int) -> int:
        """The file position up to which a read from `pos` comes out of one checked block (the
        end of the block holding pos; the item's end when unchecked): reads that stop there are
        handed out without being copied together from two blocks."""
        if self.sums is None:
            return self.offset + self.length
        rel = pos - self.offset
        return self.offset + min(self.length, (rel // self.block_bytes + 1) * self.block_bytes)

    def readinto(self, pos: int, b) -> int:
        """Fill b from file position pos with checked bytes (at most to the item's end)."""
        n = max(0, min(len(b), self.offset + self.length - pos))
        memoryview(b)[:n] = self.read(pos, n)
        return n

    def problems(self) -> list:
        """Every block, head and tail checked: the message of each that does not match ([] when
        all do, or when there are no checksums)."""
        if self.sums is None:
            return []
        out, bad = [], set()
        for i in range(len(self.sums.blocks)):
            try:
                self._block(i)
            except CheckpointError as e:
                out.append(str(e))
                bad.add(i)
        last = (self.edge - 1) // self.block_bytes
        for which, under in (("head", range(0, last + 1)),
                             ("tail", range((self.length - self.edge) // self.block_bytes, len(self.sums.blocks)))):
            try:
                self._edge(which)
            except CheckpointError as e:
                if not bad.intersection(under):         # else a block already names these bytes
                    out.append(str(e))
        return out

    # -------------------------------------------------------------- blocks

    def _count(self, n: int) -> None:
        self.bytes_read += n
        self.largest = max(self.largest, n)

    def _check(self, data, start: int, expected: int, what: str) -> None:
        self.blocks_checked += 1
        got = crc32(data)
        if got != expected:
            a = self.offset + start
            raise CheckpointError(
                f"{self.name}: {self.key}: bytes [{a}, {a + len(data)}) ({what}) do not match their checksum "
                f"(saved crc32 {expected:08x}, read {got:08x}): the checkpoint is corrupt; nothing from these "
                f"bytes was loaded")

    def _edge(self, which: str) -> memoryview:
        view = self._edges.get(which)
        if view is None:
            start = 0 if which == "head" else self.length - self.edge
            view = _read_exactly(self.f, self.offset + start, memoryview(bytearray(self.edge)), self.name)
            self._count(self.edge)
            self._check(view, start, self.sums.head if which == "head" else self.sums.tail,
                        f"the item's first {self.edge} bytes" if which == "head" else f"its last {self.edge} bytes")
            self._edges[which] = view
        return view

    def _block(self, i: int) -> memoryview:
        index, view = self._cached
        if index == i:
            return view
        start = i * self.block_bytes
        n = min(self.block_bytes, self.length - start)
        self._cached = (None, None)
        view = _read_exactly(self.f, self.offset + start, self.scratch.get(n), self.name)
        self._count(n)
        self._check(view, start, self.sums.blocks[i], f"block {i} of the item, {len(self.sums.blocks)} blocks "
                    f"of {self.block_bytes} bytes")
        self._cached = (i, view)
        return view


class ItemWindow(io.RawIOBase):
    """A CheckedItem as a seekable binary file of its own (position 0 = the item's first byte):
    what `zipfile` needs to read one saved archive in place, every byte checked."""

    def __init__(self, item: CheckedItem):
        self.item, self.pos = item, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        pos += {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.item.length}[whence]
        if pos < 0:
            raise OSError(f"seek to {pos}, before the saved item")
        self.pos = pos
        return self.pos

    def readinto(self, b) -> int:
        got = self.item.readinto(self.item.offset + self.pos, b) if self.pos < self.item.length else 0
        self.pos += got
        return got
