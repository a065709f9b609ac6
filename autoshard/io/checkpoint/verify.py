"""Check a whole checkpoint directory: `.metadata` against the files, every block against `.checksums`.

`verify(path)` is what `python -m autoshard verify CKPT_DIR` prints, for use before a long run
resumes from a checkpoint or after copying one: it reads every byte of every saved item once
and lists every problem it finds (not only the first): a missing or unreadable `.metadata`, a
file `.metadata` names that is missing, an item that lies past the end of its file, an item
`.checksums` does not list (or lists with another length), checksums of items `.metadata` does
not name, and each block, head or tail whose CRC-32 does not match. A checkpoint without
`.checksums` (plain `dcp.save`, an older autoshard) gets a note, and the CRC-32s `torch.save`
wrote into its archives are checked instead (where it wrote them).

It runs nothing the checkpoint holds (safe.py): `.metadata` is unpickled through the allowlist
of DCP's metadata classes (a refused class is a problem naming it), and each item is checked to
be what `.metadata` says it is: a tensor item a `torch.save` archive of a tensor of the chunk's
dtype and size (its header read by the reader's unpickler, which builds nothing), a non-tensor
item an archive `torch.load(weights_only=True)` reads (one that needs another class is a problem
naming it; with `trust_checkpoint=True` a note, and the item is not unpickled at all). Items
stored transformed (compressed) are checked against their checksums only.
"""
from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ...errors import CheckpointError
from .checksums import FILE_NAME, CheckedItem, ItemWindow, Scratch, describe_key, read_checksums
from .reader import locate
from .safe import load_item, read_metadata_file, unsafe_globals

__all__ = ["verify", "Report"]


@dataclass
class Report:
    """What `verify` found: `problems` (empty: the checkpoint is whole), `notes`, and what it read."""
    path: str
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    files: int = 0
    items: int = 0
    blocks: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"note: {n}" for n in self.notes] + [f"problem: {p}" for p in self.problems]
        verdict = "OK" if self.ok else f"{len(self.problems)} problem(s)"
        lines.append(f"{self.path}: {verdict} ({self.files} file(s), {self.items} item(s), {self.blocks} "
                     f"checksum(s) compared, {self.bytes} bytes read)")
        return "\n".join(lines)


def verify(checkpoint_dir, *, trust_checkpoint: bool = False) -> Report:
    """Check every file and every block of the DCP checkpoint directory `checkpoint_dir` (one
    process, reading each item once), and that each item is what `.metadata` says; the Report
    lists every problem found. Nothing in the checkpoint runs: `.metadata` is read through an
    allowlist and non-tensor items weights-only (a pickle that asks for anything else is a
    problem). `trust_checkpoint=True`: `.metadata` is unpickled as PyTorch does, and a
    non-tensor item that needs other classes is a note (it is not unpickled)."""
    path = os.fspath(checkpoint_dir)
    report = Report(path)
    if not os.path.isdir(path):
        report.problems.append(f"{path}: no such checkpoint directory")
        return report
    if not os.path.isfile(os.path.join(path, ".metadata")):
        report.problems.append(f"{path}: no .metadata file: an unfinished or failed save, or not a DCP checkpoint")
        return report
    try:
        metadata = read_metadata_file(os.path.join(path, ".metadata"), trust_checkpoint=trust_checkpoint)
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    except Exception as e:  # noqa: BLE001 - any unpickling error means the same thing
        report.problems.append(f"{path}/.metadata cannot be read: {type(e).__name__}: {e}")
        return report
    try:
        checksums = read_checksums(path)
    except CheckpointError as e:
        report.problems.append(str(e))
        checksums = False
    if checksums is None:
        report.notes.append(f"no {FILE_NAME} (written by plain dcp.save or an older autoshard): checked the files "
                            "against .metadata and the CRC-32s torch.save wrote into its archives")
    per_file: dict = {}
    for index, info in (metadata.storage_data or {}).items():
        per_file.setdefault(info.relative_path, []).append((info.offset, index, info))
    unnamed = sorted({index.fqn for index in (metadata.storage_data or {}) if index.fqn not in
                      metadata.state_dict_metadata})
    if unnamed:
        report.problems.append(f"{path}/.metadata: storage entries for keys it does not describe: "
                               f"{', '.join(map(repr, unnamed[:4]))}{' ...' if len(unnamed) > 4 else ''}")
    for name, entries in sorted(per_file.items()):
        _check_file(report, path, name, sorted(entries, key=lambda e: e[0]), metadata, checksums or None,
                    trust_checkpoint)
    if checksums:
        named = {(info.relative_path, info.offset) for info in metadata.storage_data.values()}
        stray = sorted(set(checksums.items) - named)
        if stray:
            report.problems.append(f"{path}/{FILE_NAME} has checksums of {len(stray)} item(s) .metadata does not "
                                   f"name: {', '.join(f'{n} at byte {o}' for n, o in stray[:4])}"
                                   f"{' ...' if len(stray) > 4 else ''} (a file from another checkpoint?)")
    extra = sorted(set(os.listdir(path)) - set(per_file) - {".metadata", FILE_NAME})
    if extra:
        report.notes.append(f"files .metadata does not name (not read): {', '.join(extra[:8])}"
                            f"{' ...' if len(extra) > 8 else ''}")
    return report


def _check_file(report: Report, path: str, name: str, entries: list, metadata, checksums, trust) -> None:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        keys = [describe_key(index) for _, index, _ in entries]
        report.problems.append(f"{file}: missing; .metadata names {len(entries)} item(s) in it: "
                               f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}")
        return
    size = os.path.getsize(file)
    report.files += 1
    scratch = Scratch()
    with open(file, "rb", buffering=0) as f:
        for offset, index, info in entries:
            key = describe_key(index)
            report.items += 1
            if offset + info.length > size:
                report.problems.append(f"{file}: {key}: bytes [{offset}, {offset + info.length}) lie past the end "
                                       f"of the file ({size} bytes): it is truncated")
                continue
            md = metadata.state_dict_metadata.get(index.fqn)
            if checksums is None:
                crcs = _zip_crcs(f, file, key, info, md)
                report.problems.extend(crcs)
                report.bytes += info.length
                if not crcs:
                    _check_item(report, CheckedItem(f, file, key, offset, info.length, scratch=scratch), index,
                                info, md, trust)
                continue
            sums = checksums.items.get((name, offset))
            if sums is None:
                report.problems.append(f"{file}: {key}: bytes [{offset}, {offset + info.length}) have no checksum "
                                       f"in {FILE_NAME}")
                continue
            try:
                item = CheckedItem(f, file, key, offset, info.length, sums, checksums.block_bytes,
                                   checksums.edge_bytes, scratch)
            except CheckpointError as e:                        # another length
                report.problems.append(str(e))
                continue
            damaged = item.problems()
            report.problems.extend(damaged)
            report.blocks += item.blocks_checked
            report.bytes += item.bytes_read
            if not damaged:
                _check_item(report, item, index, info, md, trust)


def _zip_crcs(f, file: str, key: str, info, md) -> list:
    """Without `.checksums`: the CRC-32s torch.save wrote into a tensor's archive (members whose
    CRC is 0 were written without one and are skipped); pickled bytes have none."""
    if isinstance(md, BytesStorageMetadata) or getattr(info, "transform_descriptors", None):
        return []
    item = CheckedItem(f, file, key, info.offset, info.length)
    try:
        with zipfile.ZipFile(ItemWindow(item)) as zf:
            for member in zf.infolist():
                if member.CRC == 0:
                    continue
                with zf.open(member) as data:
                    while data.read(1 << 20):
                        pass
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        return [f"{file}: {key}: bytes [{info.offset}, {info.offset + info.length}): the torch.save archive is "
                f"damaged: {type(e).__name__}: {e}"]
    return []


def _check_item(report: Report, item: CheckedItem, index, info, md, trust: bool) -> None:
    """That the (undamaged) item is what `.metadata` says: a tensor item a torch.save archive of a
    tensor of its chunk's dtype and size, a non-tensor item an archive that loads weights-only.
    Problems (or, for a trusted pickle of other classes, a note) go into the report."""
    where = f"{item.name}: {item.key}: bytes [{item.offset}, {item.offset + item.length})"
    if getattr(info, "transform_descriptors", None):
        return                          # stored transformed (compressed): what it holds is not checked here
    if isinstance(md, BytesStorageMetadata):
        data = bytes(item.read(item.offset, item.length))
        if trust:
            names = unsafe_globals(data)
            if names:
                report.notes.append(f"{where}: a pickled object that needs {', '.join(names)} (not unpickled; "
                                    "trusted)")
            return
        try:
            load_item(data, index.fqn)
        except CheckpointError as e:
            report.problems.append(f"{item.name}: {e}")
        return
    if not isinstance(md, TensorStorageMetadata):
        return                          # .metadata does not describe it (reported above)
    chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
    if chunk is None:
        report.problems.append(f"{where}: .metadata lists no chunk of {index.fqn!r} at {tuple(index.offset or ())}")
        return
    saved = locate(item)
    if saved is not None:
        size = [0] * len(saved.size)
        for i, d in enumerate(saved.order):
            size[d] = saved.size[i]
        dtype, size = saved.dtype, tuple(size)
    else:                               # not one the reader reads in place: PyTorch's reader, weights-only
        try:
            value = torch.load(io.BytesIO(bytes(item.read(item.offset, item.length))), map_location="cpu",
                               weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever it is, it is not a tensor archive
            names = unsafe_globals(bytes(item.read(item.offset, item.length)))
            report.problems.append(f"{where}: not a torch.save archive of a tensor: "
                                   f"{'it needs ' + ', '.join(names) if names else type(e).__name__}")
            return
        if not isinstance(value, torch.Tensor):
            report.problems.append(f"{where}: holds a {type(value).__name__}, .metadata says a tensor")
            return
        dtype, size = value.dtype, tuple(value.shape)
    if dtype != md.properties.dtype or size != tuple(chunk.sizes):
        report.problems.append(f"{where}: holds a {dtype} tensor of size {size}, .metadata says {md.properties.dtype} "
                               f"of size {tuple(chunk.sizes)}")
