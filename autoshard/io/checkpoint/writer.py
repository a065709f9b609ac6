"""A DCP storage writer that also records the checksums of everything it wrote (`.checksums`).

`FileSystemWriter` is PyTorch's, plus this: once a rank has written its files, it reads back the
items it wrote, once each, a block at a time (they are still in the page cache), and computes
their block, head and tail CRC-32s (checksums.py). They travel to the coordinator with DCP's own
write results, and the coordinator writes them into `.checksums` before DCP writes `.metadata`.
The `.distcp` files and `.metadata` are exactly what PyTorch's writer writes, so plain
`dcp.load` and `dcp_to_torch_save` read the checkpoint unchanged.

Why read back rather than checksum while writing: `torch.save` streams an archive into the file
in pieces whose boundaries DCP does not expose, and an item's blocks start at its first byte; a
read from the page cache costs a fraction of the CRC itself (docs/benchmarks.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CheckpointError
from .checksums import BLOCK_BYTES, Checksums, ItemSums, edge_bytes_for, item_sums, write_checksums

__all__ = ["FileSystemWriter"]


@dataclass(frozen=True)
class SummedWriteResult(WriteResult):
    """DCP's WriteResult with the checksums of the item it describes."""
    sums: ItemSums | None = None


class FileSystemWriter(dcp.FileSystemWriter):
    """`torch.distributed.checkpoint.FileSystemWriter` that also writes `.checksums`: the CRC-32
    of every `block_bytes` block (and of the head and tail) of every saved item, which
    `autoshard.checkpoint.FileSystemReader` checks on every read.

        dcp.save(sd, storage_writer=autoshard.checkpoint.FileSystemWriter(path))"""

    def __init__(self, path, *, block_bytes: int = BLOCK_BYTES, **kwargs):
        super().__init__(path, **kwargs)
        if int(block_bytes) < 1:
            raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
        self.block_bytes = int(block_bytes)
        self.edge_bytes = edge_bytes_for(self.block_bytes)

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner).wait()
        summed = self._sum(results)
        fut = torch.futures.Future()
        fut.set_result(summed)
        return fut

    def _sum(self, results) -> list:
        """The write results with the checksums of their items, each file read once in order."""
        by_file: dict = {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r)
        out, buffer = [], bytearray(0)
        for name, rs in by_file.items():
            path = os.path.join(os.fspath(self.path), name)
            with open(path, "rb", buffering=0) as f:
                for r in sorted(rs, key=lambda r: r.storage_data.offset):
                    info = r.storage_data
                    if len(buffer) < min(self.block_bytes, info.length):
                        buffer = bytearray(min(self.block_bytes, info.length))
                    sums = item_sums(f, info.offset, info.length, self.block_bytes, self.edge_bytes, path, buffer)
                    out.append(SummedWriteResult(r.index, r.size_in_bytes, info, sums))
        return out

    def finish(self, metadata, results) -> None:
        items = {}
        for rank_results in results:
            for r in rank_results:
                if not isinstance(r, SummedWriteResult) or r.sums is None:
                    raise CheckpointError(f"{r.index.fqn}: a rank wrote it without checksums (every rank must "
                                          "save with autoshard.checkpoint.FileSystemWriter)")
                items[(r.storage_data.relative_path, r.storage_data.offset)] = r.sums
        write_checksums(self.path, Checksums(self.block_bytes, self.edge_bytes, items), sync=self.sync_files)
        super().finish(metadata, results)
