"""A checkpoint from elsewhere builds data, never runs code: `.metadata` and pickled items read through allowlists.

A DCP checkpoint holds two kinds of pickles besides its tensors. `.metadata` is one `pickle.dump`
of DCP's `Metadata`, which PyTorch's `FileSystemReader.read_metadata` reads with `pickle.load`;
each non-tensor value (optimizer hyperparameters, step counters, a user's extras) is a
`torch.save` archive, which DCP's `DefaultLoadPlanner.load_bytes` reads with
`torch.load(weights_only=False)`. Either runs whatever the file asks for (a `__reduce__` calling
`os.system`) the moment it is read: a checkpoint copied from elsewhere would run code on load,
and on `verify`.

Here, instead:
- `read_metadata_file` unpickles `.metadata` with `MetadataUnpickler`, whose `find_class`
  admits only `METADATA_GLOBALS` (DCP's metadata classes, torch.Size, dtypes, layouts, memory
  formats; see there how the list was found). Any other class or function is a CheckpointError
  naming the file and `module.name`, raised from `find_class`: nothing of it is built.
- `load_item` reads a pickled item with `torch.load(weights_only=True)` (PyTorch's own
  allowlist: containers, numbers, strings, tensors, and what the user allowed with
  `torch.serialization.add_safe_globals`); anything else is a CheckpointError naming the key and
  the classes it needs (read statically, not run).
- `SafeLoadBytes` makes a DCP load planner read its items through `load_item`
  (`SafeLoadPlanner`, `SafeEmptyStateDictLoadPlanner`, storage.py's `LoadPlanner`).

`trust_checkpoint=True` (on `autoshard.checkpoint.load`, `verify`, the converters, the reader
and the planners) restores plain `pickle.load` / `torch.load(weights_only=False)`: for a
checkpoint whose source the user trusts, e.g. one holding an object of their own class.
"""
from __future__ import annotations

import importlib
import io
import os
import pathlib
import pickle

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CheckpointError

__all__ = ["METADATA_GLOBALS", "MetadataUnpickler", "read_metadata_file", "load_item", "load_pickled", "unsafe_globals",
           "SafeLoadBytes", "SafeLoadPlanner", "SafeEmptyStateDictLoadPlanner", "TRUST_HINT"]

TRUST_HINT = ("if you trust where this checkpoint came from, pass trust_checkpoint=True "
              "(it then unpickles as PyTorch does, running what the file asks for)")

_DCP = "torch.distributed.checkpoint.metadata"
_ST = "torch.distributed._shard.sharded_tensor.metadata"


def _layout(name):
    """torch.serialization._get_layout (how a torch.layout pickles), for names of torch layouts only."""
    value = getattr(torch, str(name).replace("torch.", "", 1), None) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _codecs_encode(text, encoding="utf-8"):
    """_codecs.encode, as protocol-2 pickles write bytes (latin-1), and no other codec."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin-1")


# (module, name) -> what find_class returns: the object itself, imported on first use (None), or a
# stand-in. Found by logging every find_class call while unpickling `.metadata` of real
# checkpoints (torch 2.13): autoshard.checkpoint.save and plain dcp.save at 1 and 2 ranks (DTensor
# and ShardedTensor shards, AdamW state, extras of plain types), PyTorch's get_state_dict and
# torch_save_to_dcp, tensors of every dtype and channels_last: DCP's metadata classes,
# _StorageInfo, torch.Size, dtypes, `torch.serialization._get_layout` (how a layout pickles),
# pathlib.PosixPath (StorageMeta.checkpoint_id). Added: the other memory-format and path
# classes, and TensorProperties and its encoding from sharded_tensor.metadata, where DCP's
# metadata of torch 2.0-2.1 found them; OrderedDict and builtin containers and numbers that
# older pickle protocols name. Paths become pure paths (no file system access).
METADATA_GLOBALS = {
    **{(_DCP, name): None for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                       "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                       "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    (_ST, "TensorProperties"): None,
    (_ST, "MEM_FORMAT_ENCODING"): None,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): None,
    **{(m, n): pathlib.PurePosixPath for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath")},
    **{(m, n): pathlib.PureWindowsPath for m in ("pathlib", "pathlib._local")
       for n in ("WindowsPath", "PureWindowsPath")},
    **{("builtins", n): None for n in ("set", "frozenset", "list", "dict", "tuple", "complex", "int", "float",
                                       "bool", "str", "bytes", "bytearray")},
    ("_codecs", "encode"): _codecs_encode,
}


def _torch_constant(name: str):
    """torch.<name> where it is a dtype, layout or memory format (they pickle by name)."""
    value = getattr(torch, name, None) if "." not in name else None
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` (`name`: the file, for errors): `find_class` returns only what
    `METADATA_GLOBALS` admits (and torch dtypes, layouts, memory formats); anything else raises
    CheckpointError naming the file and `module.name` before anything of it is built."""

    def __init__(self, file, name: str = ".metadata"):
        super().__init__(file)
        self.name = name

    def find_class(self, module, name):
        if module == "torch" and (value := _torch_constant(name)) is not None:
            return value
        if (module, name) not in METADATA_GLOBALS:
            raise CheckpointError(f"{self.name} cannot be read: it asks to build {module}.{name}, which is not one "
                                  f"of DCP's metadata classes: refused, nothing of it was built (a file from "
                                  f"elsewhere could run code this way); {TRUST_HINT}")
        value = METADATA_GLOBALS[(module, name)]
        return getattr(importlib.import_module(module), name) if value is None else value

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.name} cannot be read: it holds a persistent id, which DCP's metadata never has")


def read_metadata_file(file, *, name: str | None = None, trust_checkpoint: bool = False) -> Metadata:
    """The DCP `Metadata` in `file` (a path or a binary file), unpickled by `MetadataUnpickler`
    (with `trust_checkpoint`: by `pickle.load`, as PyTorch reads it). Refused classes raise
    CheckpointError; a damaged file raises what unpickling raised; a pickle of anything but
    Metadata raises CheckpointError."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return read_metadata_file(f, name=name or os.fspath(file), trust_checkpoint=trust_checkpoint)
    name = name or getattr(file, "name", ".metadata")
    metadata = pickle.load(file) if trust_checkpoint else MetadataUnpickler(file, name).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{name} cannot be read: it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def unsafe_globals(source) -> list:
    """The classes and functions (`module.name`) the `torch.save` archive `source` (bytes, a path
    or a seekable binary file) names that `torch.load(weights_only=True)` refuses, read
    statically (nothing is unpickled); [] when it cannot tell."""
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(source)
        elif hasattr(source, "seek"):
            source.seek(0)
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - not an archive it can read: the caller says what load said
        return []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def load_pickled(source, name: str, *, trust_checkpoint: bool = False, what: str = "the pickled item"):
    """The object in `source` (bytes, a path, or a seekable binary file holding a `torch.save`
    archive), by `torch.load(weights_only=True)` (with `trust_checkpoint`: weights_only=False).
    What the weights-only unpickler refuses is a CheckpointError naming `name` (the key or file)
    and the classes `source` needs; one that cannot be read at all raises CheckpointError too."""
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        return torch.load(stream, map_location="cpu", weights_only=not trust_checkpoint)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        if trust_checkpoint:
            raise CheckpointError(f"{name}: {what} cannot be read: {_first_line(e)}") from e
        names = unsafe_globals(stream)
        need = (f"needs {', '.join(names)}" if names else
                f"is refused by torch.load(weights_only=True) ({_first_line(e)})")
        raise CheckpointError(f"{name}: {what} {need}, which autoshard does not unpickle from a checkpoint: "
                              f"refused, nothing of it was built (a file from elsewhere could run code this way). "
                              f"To load it, allow that class with torch.serialization.add_safe_globals, "
                              f"or {TRUST_HINT}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointError(f"{name}: {what} cannot be read: {_first_line(e)}") from e


def load_item(value, key: str, *, trust_checkpoint: bool = False):
    """A non-tensor item of a checkpoint (`value`: its bytes or a binary file of them, a
    `torch.save` archive as DCP writes it), read by `load_pickled`; errors name `key`."""
    return load_pickled(value, repr(key), trust_checkpoint=trust_checkpoint)


class SafeLoadBytes:
    """For a subclass of DCP's `DefaultLoadPlanner`: `load_bytes` reads each non-tensor item
    with `load_item` (weights-only unless `trust_checkpoint`), and puts it where DCP's would."""

    trust_checkpoint = False

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element
        fqn = read_item.dest_index.fqn
        obj = load_item(value, fqn, trust_checkpoint=self.trust_checkpoint)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(SafeLoadBytes, DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner reading non-tensor items weights-only (`trust_checkpoint=True`:
    as PyTorch's)."""

    def __init__(self, *args, trust_checkpoint: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.trust_checkpoint = bool(trust_checkpoint)


class SafeEmptyStateDictLoadPlanner(SafeLoadBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state dict from the metadata (what
    `dcp_to_torch_save` loads with), reading non-tensor items weights-only."""

    def __init__(self, *args, trust_checkpoint: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.trust_checkpoint = bool(trust_checkpoint)
