"""The Hugging Face face of a parallel module: `config`, `generation_config` and `save_pretrained`.

`attach(gm, model)` (called by `parallelize`, hence by `from_pretrained`) gives the rank's
GraphModule of a Hugging Face model the model's `config` (and `generation_config` where it has
one) and a `save_pretrained(path, max_shard_size=)` method. `save_pretrained` writes a standard
checkpoint directory (config.json, generation_config.json, `model.safetensors` or
`model-0000i-of-0000n.safetensors` shards with `model.safetensors.index.json`) that
`AutoModelForCausalLM.from_pretrained(path)` loads in one process, without any rank holding more
than one full tensor at a time:

- every header is known before any data moves (global shapes and dtypes), so each file is opened
  with its header written and then receives the tensors' bytes in header order;
- per tensor, the writing rank receives every rank's shard straight into one full-size buffer
  (point to point; a gloo `gather` would stage a second full copy), writes it in row-major order
  (a strided or column shard through a bounded slab), and drops it before the next tensor;
- only one rank writes (global rank 0, in the tensor-parallel group that holds it: data-parallel
  replicas write nothing), into a hidden sibling directory that is renamed into place at the
  end; a failure anywhere raises on every rank and leaves the old directory as it was.

Keys are those the model's `save_pretrained` writes: the persistent state dict (non-persistent
buffers such as rotary `inv_freq` are not written), less `_keys_to_ignore_on_save` and, of each
group of tied aliases, all but one name (the one that is not a target of the model's
`all_tied_weights_keys`, as transformers keeps `transformer.wte.weight` and drops
`lm_head.weight`). Weights are written in transformers' in-memory layout (what
`save_pretrained(save_original_format=False)` writes, which transformers 5 loads as well).
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil

import torch
import torch.distributed as dist

from ..errors import CheckpointError, ProcessGroupError
from . import generate
from ..runtime.groups import device_of
from ..runtime.pieces import pad_along
from ..runtime.placements import block_sizes, global_shape, is_even, local_shape
from ..runtime.state_dict import group_of, layouts

__all__ = ["attach", "save_pretrained", "saved_keys", "parse_size", "WEIGHTS_NAME", "INDEX_NAME"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"          # transformers 5's default
SLAB_BYTES = 1 << 20                     # a strided or column shard is reordered this much at a time

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")     # replaced, never carried


# ----------------------------------------------------------------------------- attach

def attach(gm, model) -> bool:
    """Give `gm` (a rank's module of `model`) `model`'s Hugging Face `config`, its
    `generation_config` where it has one, and `save_pretrained`; False (nothing done) when
    `model` has no Hugging Face config. The method is set on `type(gm)`, which torch.fx makes
    unique to each GraphModule instance, so no other module gets it."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)) \
            or not callable(getattr(config, "to_json_string", None)):
        return False
    gm.config = config
    for name in ("loss_type", "main_input_name"):       # what the Trainer reads of a model (its loss's label shift)
        if isinstance(getattr(model, name, None), str):
            setattr(gm, name, getattr(model, name))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        gm.generation_config = generation
    gm._autoshard_hf = {
        "architecture": type(model).__name__,
        "class": type(model),
        "tied_targets": frozenset(getattr(model, "all_tied_weights_keys", None) or ()),
        "ignore": frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ()),
    }
    type(gm).save_pretrained = save_pretrained
    generate.attach(gm, model)          # gm.generate where the model can generate
    return True


# ----------------------------------------------------------------------------- sizes and keys

def parse_size(size) -> int:
    """Bytes of `size`: an int, or a string like "5GB" (10**9) / "200KiB" (2**10), as transformers."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be bytes (an int) or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size {size!r}: expected an int or a number with a unit "
                         f"({', '.join(u.replace('I', 'i') for u in _UNITS)}), e.g. '5GB'")
    out = int(float(m.group(1)) * _UNITS[m.group(2)])
    if out < 1:
        raise ValueError(f"max_shard_size {size!r} is less than one byte")
    return out


def saved_keys(gm) -> list:
    """The state-dict keys `save_pretrained` writes, in state-dict order: persistent tensors, less
    the model's `_keys_to_ignore_on_save` and all but one name of each group of tied aliases."""
    info = gm.__dict__["_autoshard_hf"]
    sd = gm.state_dict(keep_vars=True)
    aliases: dict = {}
    for key, t in sd.items():
        if key not in info["ignore"]:
            aliases.setdefault(id(t), []).append(key)
    keep = set()
    for names in aliases.values():
        sources = [n for n in names if n not in info["tied_targets"]] or names
        keep.add(sources[0])
    return [k for k in sd if k in keep]


def _entries(gm, keys, p: int) -> list:
    """(key, local tensor, layout or None, global shape, dtype) of every key; a dtype safetensors
    cannot hold raises before anything is written or sent."""
    table = layouts(gm) if p > 1 else {}
    sd = gm.state_dict(keep_vars=True)
    out = []
    for key in keys:
        t = sd[key].detach()
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"save_pretrained: {key!r} has dtype {t.dtype}, which safetensors cannot hold")
        if t.is_meta:
            raise CheckpointError(f"save_pretrained: {key!r} is on the meta device (no values to write); "
                                  "parallelize with load= or without a meta model")
        layout = table.get(key)
        shape = list(t.shape) if layout is None else list(global_shape(t.shape, layout, p))
        out.append((key, t, layout, shape, t.dtype))
    return out


def _files(entries, limit: int) -> list:
    """Entries grouped into files of at most `limit` bytes each (a bigger tensor gets a file of its
    own), greedily in state-dict order as transformers splits; inside a file, wider dtypes first,
    so that every tensor's data starts at a multiple of its element size."""
    files, current, size = [], [], 0
    for e in entries:
        n = math.prod(e[3]) * e[4].itemsize
        if current and size + n > limit:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += n
    if current or not files:
        files.append(current)
    return [sorted(f, key=lambda e: -e[4].itemsize) for f in files]


def _header(entries) -> bytes:
    """A safetensors header (length, JSON padded with spaces to 8 bytes) for `entries` in order."""
    head, offset = {}, 0
    for key, _, _, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        head[key] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    head["__metadata__"] = {"format": "pt"}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


# ----------------------------------------------------------------------------- moving and writing bytes

def _write(f, t: torch.Tensor) -> None:
    """The bytes of `t` in row-major order (a contiguous CPU tensor is written without a copy)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel():
        f.write(t.reshape(-1).view(torch.uint8).numpy())


def _write_gathered(f, buf: torch.Tensor, layout, shape) -> None:
    """Write the full tensor whose rank pieces are `buf[r]` (Shard(dim, chunks) each) without
    assembling it: row-major order is [outer, block, rank, rows of its share, inner]. Pieces of
    unequal sizes come padded to the largest (`_padded`) and are cropped here, block by block."""
    p, dim = buf.size(0), layout.dim
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    sizes = block_sizes(shape[dim], p, **layout.blocking)                # [block][rank]
    v = buf.view(p, outer, sum(s[0] for s in sizes), inner)
    parts = [(r, sum(b[r] for b in sizes[:c]), s[r]) for c, s in enumerate(sizes) for r in range(p)]
    row = shape[dim] * inner * buf.element_size()                        # bytes of one outer index
    if row <= SLAB_BYTES and outer > 1:
        step = max(1, SLAB_BYTES // max(row, 1))
        for o in range(0, outer, step):                                   # a slab of outer indices
            _write(f, torch.cat([v[r, o:o + step, a:a + n] for r, a, n in parts], 1))
    else:
        for o in range(outer):
            for r, a, n in parts:
                _write(f, v[r, o, a:a + n])                                # contiguous: no copy


def _padded(local: torch.Tensor, layout, shape, p: int) -> torch.Tensor:
    """This rank's piece grown with zeros to the largest rank's size where pieces differ (an odd
    vocabulary, heads that do not divide), so every rank sends a buffer of one shape."""
    if is_even(shape, layout, p):
        return local
    return pad_along(local, layout.dim, local_shape(shape, layout, p)[layout.dim])


def _gather_to(local: torch.Tensor, pg, p: int, rank: int, dst: int):
    """Every rank's `local` in one [p, *local.shape] buffer on group rank `dst` (None elsewhere):
    point-to-point receives straight into the buffer, so the receiver holds one full tensor."""
    local = local.contiguous()
    if rank != dst:
        dist.send(local, dist.get_global_rank(pg, dst), group=pg)
        return None
    buf = local.new_empty((p,) + tuple(local.shape))
    works = [dist.irecv(buf[r], dist.get_global_rank(pg, r), group=pg) for r in range(p) if r != dst]
    buf[dst].copy_(local)
    for w in works:
        w.wait()
    return buf


# ----------------------------------------------------------------------------- save_pretrained

def _roles(gm):
    """(tensor-parallel group or None, its size, this rank in it, the group rank that writes or
    None when this group does not write). The writer is global rank 0; data-parallel replicas
    (other tensor-parallel groups) write nothing."""
    plan = gm.__dict__.get("_autoshard_plan")
    planned = plan.world_size if plan is not None else 1
    if not (dist.is_available() and dist.is_initialized()):
        if planned > 1:
            raise ProcessGroupError(f"save_pretrained: this module is one of {planned} ranks' shards and "
                                    "no process group is initialised; call it on every rank of the group "
                                    "it was built for")
        return None, 1, 0, 0
    pg, p, rank = group_of(gm, None)
    if p != planned:
        raise ProcessGroupError(f"save_pretrained: the module was planned for {planned} ranks but its "
                                f"tensor-parallel group has {p}")
    members = [dist.get_global_rank(pg, r) for r in range(p)]
    return pg, p, rank, (members.index(0) if 0 in members else None)


def _config_to_write(gm, entries):
    """A copy of `gm.config` with the model's class as its architecture and the saved dtype, as
    transformers' save_pretrained sets them."""
    cfg = copy.deepcopy(gm.config)
    cfg.architectures = [gm.__dict__["_autoshard_hf"]["architecture"]]
    floating = [e[4] for e in entries if e[4].is_floating_point]
    if floating:
        cfg.dtype = str(floating[0]).split(".")[1]
    return cfg


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(path: str, tmp: str) -> None:
    """Files of an existing `path` that save_pretrained does not write (a tokenizer, a training
    state) go into `tmp` too, as hard links where possible: the directory is replaced whole, but
    only its weights and configs change (stale weight shards go)."""
    if not os.path.isdir(path):
        return
    for name in os.listdir(path):
        if _WEIGHTS.fullmatch(name) or os.path.exists(os.path.join(tmp, name)):
            continue
        src, dst = os.path.join(path, name), os.path.join(tmp, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _write_directory(gm, entries, files, path, tmp, rank, p, pg, dst) -> None:
    """On the writer: config files, then each weights file header-first, tensor by tensor. On the
    other ranks of the writing group: their shards, sent in the same order. A writer that fails
    keeps receiving (the senders would wait for it) and raises after the last tensor."""
    writer = rank == dst
    failure = None
    names = [WEIGHTS_NAME] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    if writer:
        try:
            if os.path.isfile(path):
                raise CheckpointError(f"save_pretrained: {path} is a file, not a directory")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            _config_to_write(gm, entries).save_pretrained(tmp)
            generation = gm.__dict__.get("generation_config")
            if generation is not None:
                generation.save_pretrained(tmp)
            if len(files) > 1:
                params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
                index = {"metadata": {"total_size": sum(math.prod(e[3]) * e[4].itemsize for e in entries),
                                      "total_parameters": sum(math.prod(e[3]) for e in entries if e[0] in params)},
                         "weight_map": {e[0]: name for name, f in zip(names, files) for e in f}}
                with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as out:
                    out.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        except Exception as e:  # noqa: BLE001 - raised after the collectives below have paired up
            failure = e
    for name, file_entries in zip(names, files):
        out = None
        if writer and failure is None:
            try:
                out = open(os.path.join(tmp, name), "wb")
                out.write(_header(file_entries))
            except Exception as e:  # noqa: BLE001
                failure = e
        try:
            for key, local, layout, shape, _ in file_entries:
                if layout is None or p == 1:
                    full = local if writer else None        # replicated: the writer's own copy
                    if out is not None and failure is None:
                        try:
                            _write(out, full)
                        except Exception as e:  # noqa: BLE001
                            failure = e
                    continue
                buf = _gather_to(_padded(local, layout, shape, p), pg, p, rank, dst)
                if out is not None and failure is None:
                    try:
                        _write_gathered(out, buf, layout, shape)
                    except Exception as e:  # noqa: BLE001
                        failure = e
                del buf                                     # one full tensor at a time
            if out is not None and failure is None:
                out.flush()
                os.fsync(out.fileno())
        finally:
            if out is not None:
                out.close()
    if failure is not None:
        raise failure


def save_pretrained(self, save_directory, max_shard_size=DEFAULT_MAX_SHARD_SIZE, *, safe_serialization: bool = True,
                    is_main_process: bool = True) -> None:
    """Write this parallel module as a Hugging Face checkpoint directory `save_directory`.

    Call it on every rank of the default process group (each tensor-parallel rank sends its
    shards; data-parallel replicas only wait): global rank 0 writes config.json,
    generation_config.json and the weights as safetensors, split into files of at most
    `max_shard_size` (an int or a string like "5GB"; default "50GB", as transformers) with
    `model.safetensors.index.json` when there is more than one. No rank holds more than its
    shards plus one full tensor. The directory is written beside `save_directory` and renamed
    into place when complete; files of an existing directory that this does not write (a
    tokenizer) are kept. Every rank returns once the directory is complete, or raises if any
    part failed (the previous directory is then left as it was).

    `safe_serialization` must be True (only safetensors are written); `is_main_process` is
    accepted for scripts that pass it and is not used: the writer is always global rank 0."""
    if not safe_serialization:
        raise ValueError("save_pretrained of a parallel module writes safetensors only (safe_serialization=True)")
    del is_main_process
    from .checkpoint.storage import publish, sibling
    path = os.path.abspath(os.fspath(save_directory))
    limit = parse_size(max_shard_size)
    pg, p, rank, dst = _roles(self)
    entries = _entries(self, saved_keys(self), p)
    files = _files(entries, limit)
    tmp = sibling(path, "partial")
    failure = None
    if dst is not None:                                     # this tensor-parallel group writes
        try:
            _write_directory(self, entries, files, path, tmp, rank, p, pg, dst)
            if rank == dst:
                _carry_over(path, tmp)
                publish(tmp, path)
        except Exception as e:  # noqa: BLE001 - every rank raises, after _agree
            failure = e
            if rank == dst:
                shutil.rmtree(tmp, ignore_errors=True)
    _agree(failure, pg)


def _agree(failure, pg) -> None:
    """Every rank of the default group learns whether any failed (this is also the barrier after
    which the directory is complete); each raises: the failing rank its own error."""
    if pg is None:
        if failure is not None:
            raise failure
        return
    dev = device_of()
    flag = torch.tensor([0 if failure is None else dist.get_rank() + 1], dtype=torch.int64, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if flag.item():
        raise CheckpointError(f"save_pretrained failed on global rank {flag.item() - 1} (its error is raised "
                              "there); the directory was left as it was")
