"""Check a whole checkpoint directory: `.metadata` against the files, every block against `.checksums`.

`verify(path)` is what `python -m autoshard verify CKPT_DIR` prints, for use before a long run
resumes from a checkpoint or after copying one: it reads every byte of every saved item once
and lists every problem it finds (not only the first): a missing or unreadable `.metadata`, a
file `.metadata` names that is missing, an item that lies past the end of its file, an item
`.checksums` does not list (or lists with another length), checksums of items `.metadata` does
not name, and each block, head or tail whose CRC-32 does not match. A checkpoint without
`.checksums` (plain `dcp.save`, an older autoshard) gets a note, and the CRC-32s `torch.save`
wrote into its archives are checked instead (where it wrote them).
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ...errors import CheckpointError
from .checksums import FILE_NAME, CheckedItem, ItemWindow, Scratch, describe_key, read_checksums

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


def verify(checkpoint_dir) -> Report:
    """Check every file and every block of the DCP checkpoint directory `checkpoint_dir` (one
    process, reading each item once); the Report lists every problem found."""
    path = os.fspath(checkpoint_dir)
    report = Report(path)
    if not os.path.isdir(path):
        report.problems.append(f"{path}: no such checkpoint directory")
        return report
    if not os.path.isfile(os.path.join(path, ".metadata")):
        report.problems.append(f"{path}: no .metadata file: an unfinished or failed save, or not a DCP checkpoint")
        return report
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
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
    for name, entries in sorted(per_file.items()):
        _check_file(report, path, name, sorted(entries, key=lambda e: e[0]), metadata, checksums or None)
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


def _check_file(report: Report, path: str, name: str, entries: list, metadata, checksums) -> None:
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
            if checksums is None:
                report.problems.extend(_zip_crcs(f, file, key, info, metadata.state_dict_metadata.get(index.fqn)))
                report.bytes += info.length
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
            report.problems.extend(item.problems())
            report.blocks += item.blocks_checked
            report.bytes += item.bytes_read


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
