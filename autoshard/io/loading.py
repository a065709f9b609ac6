"""Models larger than one process: build on meta, fill only this rank's shards.

`parallelize(model_on_meta, p, example, load=SOURCE)` plans and rewrites the meta model (no
parameter memory), then fills each of this rank's tensors box by box
(`pieces.boxes`: one box for a contiguous shard, k for a strided fused q/k/v shard) from a
checkpoint, reading only those slices and converting their dtype slice by slice. Without
`load=`, each module's own initialisation (`reset_parameters`, or a Hugging Face model's
`_init_weights`) runs module by module in the model's order on a full-size copy of that module's
own tensors only, and the rank keeps its shard. `meta_model` builds a Hugging Face model from its
config on meta, with which `autoshard.from_pretrained` (autoshard.api) goes from a checkpoint
directory to this rank's GraphModule without ever building the full model.

Sources: a `.safetensors` file, a Hugging Face directory (`model.safetensors` or shards with
`model.safetensors.index.json`; `pytorch_model.bin`), a `torch.save` file (opened with
`mmap=True`) or a mapping of tensors.
"""
from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping

import torch
import torch.nn as nn

from ..errors import LoadError
from ..runtime.pieces import fill_boxes
from ..runtime.placements import Replicate, local_shape

__all__ = ["open_source", "check_source", "check_initialisable", "materialize", "meta_model", "example_ids",
           "Source"]

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_PROGRESS_BYTES = 256 * 2 ** 20          # a bar (on rank 0) when a load reads more than this


def _require(name: str):
    try:
        return __import__(name)
    except ImportError as e:
        raise ImportError(f"autoshard needs `{name}` for this (an optional dependency): "
                          f"pip install 'autoshard[hf]' or pip install {name}") from e


# ----------------------------------------------------------------------------- sources

class Source:
    """A checkpoint read lazily: `entries` {key: (shape, dtype)} from headers only, and
    `read(key, index)` -> the slice `index` of tensor `key` in its stored dtype."""

    def __init__(self, entries: dict, what: str):
        self.entries, self.what = entries, what

    def read(self, key, index):
        raise NotImplementedError


class SafetensorsSource(Source):
    """One or several .safetensors files. A file is opened (memory-mapped) per tensor read and
    closed after it, so that the pages a read touched do not stay mapped (they would count in
    the process's resident memory until the end of the load)."""

    def __init__(self, paths, what: str, weight_map: dict | None = None):
        from safetensors import safe_open
        self._open, self.files = safe_open, {}
        entries = {}
        for path in paths:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dt = _ST_DTYPES.get(sl.get_dtype())
                    if dt is None:
                        raise LoadError(f"{path}: tensor {key!r} has dtype {sl.get_dtype()}, which autoshard "
                                        f"does not read")
                    entries[key] = (tuple(sl.get_shape()), dt)
                    self.files[key] = path
        missing = sorted(k for k in weight_map or {} if k not in entries)
        if missing:
            raise LoadError(f"{what}: the index names {missing[:5]} but their files do not hold them")
        super().__init__(entries, what)

    def read(self, key, index):
        with self._open(self.files[key], framework="pt") as f:
            return f.get_slice(key)[index]


class MappingSource(Source):
    """A mapping of tensors (a state dict, or a `torch.load(..., mmap=True)` result)."""

    def __init__(self, mapping: Mapping, what: str):
        bad = [k for k, v in mapping.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise LoadError(f"{what}: entries {bad[:5]} are not tensors ({type(mapping[bad[0]]).__name__}); "
                            "load= wants a mapping of tensors")
        self.mapping = mapping
        super().__init__({k: (tuple(v.shape), v.dtype) for k, v in mapping.items()}, what)

    def read(self, key, index):
        return self.mapping[key][index]


def open_source(source) -> Source:
    """A Source for `source`: a Source, a mapping of tensors, or a path (see the module doc)."""
    if isinstance(source, Source):
        return source
    if isinstance(source, Mapping):
        return MappingSource(source, "the load= mapping")
    if not isinstance(source, (str, os.PathLike)):
        raise LoadError(f"load= wants a path or a mapping of tensors, got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        for name in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                return open_source(os.path.join(path, name))
        raise LoadError(f"{path} holds none of model.safetensors.index.json, model.safetensors, "
                        "pytorch_model.bin: not a Hugging Face checkpoint directory")
    if not os.path.isfile(path):
        raise LoadError(f"load={path!r}: no such file or directory")
    if path.endswith(".json"):
        _require("safetensors")
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{path} has no weight_map: not a safetensors index")
        base = os.path.dirname(path)
        files = [os.path.join(base, f) for f in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise LoadError(f"{path} names shard files that do not exist: {absent[:3]}")
        return SafetensorsSource(files, path, weight_map)
    if path.endswith(".safetensors"):
        _require("safetensors")
        return SafetensorsSource([path], path)
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported with its cause
        raise LoadError(f"load={path!r}: torch.load(mmap=True) failed: {type(e).__name__}: {e}") from e
    if not isinstance(loaded, Mapping):
        raise LoadError(f"load={path!r} holds a {type(loaded).__name__}, not a mapping of tensors")
    return MappingSource(loaded, path)


# ----------------------------------------------------------------------------- matching

def _groups(model: nn.Module) -> list:
    """[(names, tensor)] for every distinct parameter and buffer of `model` in its order; names
    holds every alias, those in state_dict() (persistent) first."""
    persistent = set(model.state_dict(keep_vars=True))
    by_id: dict = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if t is None:
            continue
        by_id.setdefault(id(t), ([], t))[0].append(name)
    return [(sorted(names, key=lambda n: n not in persistent), t) for names, t in by_id.values()]


def check_source(model: nn.Module, source) -> dict:
    """{model tensor id: source key} for every persistent tensor of `model`: each is read under
    one of its names (a tied weight once); missing, unexpected or wrongly shaped keys raise one
    LoadError naming all of them (nothing has been allocated yet)."""
    src = open_source(source)
    persistent = set(model.state_dict(keep_vars=True))
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    chosen, missing, shapes, known = {}, [], [], set()
    for names, t in _groups(model):
        known.update(names)
        if not any(n in persistent for n in names):
            continue                                        # non-persistent buffer: initialised, not read
        present = [n for n in names if n in src.entries]
        if not present:
            missing.append(f"{names[0]} {list(t.shape)}")
            continue
        for n in present:
            if tuple(src.entries[n][0]) != tuple(t.shape):
                shapes.append(f"{n}: {list(src.entries[n][0])} in the checkpoint, {list(t.shape)} in the model")
        chosen[id(t)] = present[0]
    unexpected = sorted(k for k in src.entries if k not in known and not any(p.search(k) for p in ignore))
    if missing or unexpected or shapes:
        lines = [f"load={src.what} does not match {type(model).__name__}:"]
        for what, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", shapes)):
            if items:
                more = f" (and {len(items) - 8} more)" if len(items) > 8 else ""
                lines.append(f"  {what} ({len(items)}): {', '.join(items[:8])}{more}")
        raise LoadError("\n".join(lines))
    return chosen


# ----------------------------------------------------------------------------- filling

def _empty_local(shape, placement, p: int, rank: int, dtype, device) -> torch.Tensor:
    return torch.empty(local_shape(shape, placement, p, rank), dtype=dtype, device=device)


def _init_fn(model: nn.Module, qualname: str, module: nn.Module):
    """The function that initialises `module`'s own tensors: the nearest Hugging Face model's
    `_init_weights(module)`, else `module.reset_parameters()`; None when there is neither."""
    owner = None
    parts = qualname.split(".") if qualname else []
    for i in range(len(parts), -1, -1):
        m = model.get_submodule(".".join(parts[:i]))
        if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config"):
            owner = m
            break
    if owner is not None:
        return lambda: owner._init_weights(module)
    if callable(getattr(module, "reset_parameters", None)):
        return module.reset_parameters
    return None


def _no_init(qualname: str, module: nn.Module, names) -> LoadError:
    return LoadError(f"module {qualname or '(root)'} ({type(module).__name__}) has tensors on meta "
                     f"({', '.join(names)}) and no way to initialise them (no reset_parameters); give "
                     "load=, or add reset_parameters()")


def _placement(layouts: dict, names) -> object:
    """The planned placement of a tensor known under `names` (its tied aliases); Replicate if none."""
    return next((layouts[n] for n in names if n in layouts), Replicate())


def _own_meta(module: nn.Module) -> list:
    """(its dict, name, tensor) for each parameter and buffer of the module itself on meta."""
    return [(d, k, t) for d in (module._parameters, module._buffers) for k, t in d.items()
            if t is not None and t.is_meta]


def check_initialisable(model: nn.Module) -> None:
    """Raise a LoadError naming the first module that holds meta tensors and has no way to
    initialise them (before anything is allocated)."""
    for qualname, module in model.named_modules():
        own = [k for _, k, _ in _own_meta(module)]
        if own and _init_fn(model, qualname, module) is None:
            raise _no_init(qualname, module, own)


def _initialise(model, wanted: set, rank: int, p: int, placement_of, dtype_of, device, every_module: bool) -> dict:
    """{tensor id: local tensor} for the meta tensors in `wanted`, by each module's own init run
    on a full-size copy of that module's own tensors (then dropped). Modules run in the model's
    order; with `every_module` also those whose tensors are done (tied aliases), so that the
    random stream advances as when the model is built on CPU. The first module that initialises
    a tied tensor gives its value."""
    done = {}
    for qualname, module in model.named_modules():
        own = _own_meta(module)
        if not own or not (every_module or any(id(t) in wanted and id(t) not in done for _, _, t in own)):
            continue
        init = _init_fn(model, qualname, module)
        label = f"{qualname or '(root)'} ({type(module).__name__})"
        if init is None:
            raise _no_init(qualname, module, [k for _, k, _ in own])
        try:
            for d, k, t in own:
                full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                if full.is_floating_point():
                    full.fill_(float("nan"))              # so that a tensor init leaves alone is caught
                d[k] = nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
            with torch.no_grad():
                init()
            for d, k, t in own:
                value = d[k]
                if id(t) not in wanted or id(t) in done:
                    continue
                if value.is_floating_point() and torch.isnan(value).any():
                    raise LoadError(f"module {label}: its initialisation left {k} {list(t.shape)} unset")
                pl, full = placement_of[id(t)], value.detach()
                done[id(t)] = fill_boxes(_empty_local(t.shape, pl, p, rank, dtype_of[id(t)], device), t.shape, pl, rank, p,
                                         full.__getitem__)
        finally:
            for d, k, t in own:                            # the model stays as it was (meta, ties intact)
                d[k] = t
    left = wanted - set(done)
    if left:
        raise LoadError(f"no module initialises {len(left)} meta tensor(s) of {type(model).__name__}")
    return done


def _progress(total: int, enabled):
    if enabled is None:
        enabled = total > _PROGRESS_BYTES
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="autoshard: loading shards")


def materialize(gm, model: nn.Module, rank: int, p: int, *, source=None, chosen=None, device=None,
                progress=None, only=None) -> None:
    """Give `gm` (this rank's rewrite of `model`) real tensors for every tensor of `model`: read
    from `source` (keys as check_source chose them) box by box, initialised by the modules for
    meta tensors the source lacks (or all of them without a source), on `device`. Tensors neither
    read nor on meta stay as `gm` holds them (moved to `device` when given). `only(name)`: fill
    just the tensors it keeps (a pipeline rank's stages); the others stay on meta."""
    layouts = getattr(gm, "_autoshard_layouts", {})
    groups = _groups(model)
    if only is not None:
        skipped = {id(t) for names, t in groups if not any(only(n) for n in names)}
        groups = [(names, t) for names, t in groups if id(t) not in skipped]
    placement_of = {id(t): _placement(layouts, names) for names, t in groups}
    dtype_of = {id(t): t.dtype for _, t in groups}
    local_device = torch.device(device) if device is not None else torch.device("cpu")
    src = open_source(source) if source is not None else None
    if src is not None and chosen is None:
        chosen = check_source(model, src)
    chosen = chosen or {}
    filled = {}
    if src is not None:
        todo = [(names, t) for names, t in groups if id(t) in chosen]
        bar = _progress(sum(t.numel() * t.element_size() for _, t in todo), progress if rank == 0 else False)
        for names, t in todo:
            pl, key = placement_of[id(t)], chosen[id(t)]
            local = _empty_local(t.shape, pl, p, rank, dtype_of[id(t)], local_device)
            filled[id(t)] = fill_boxes(local, t.shape, pl, rank, p, lambda index: src.read(key, index))
            if bar is not None:
                bar.update(t.numel() * t.element_size())
        if bar is not None:
            bar.close()
    wanted = {id(t) for _, t in groups if t.is_meta and id(t) not in filled}
    if wanted:
        filled.update(_initialise(model, wanted, rank, p, placement_of, dtype_of, local_device,
                                  every_module=src is None))
    _install(gm, groups, filled, device, only)


def _install(gm, groups, filled, device, only=None) -> None:
    """Put the filled tensors into `gm` under every alias (parameters stay Parameters with their
    TorchShard attributes; buffers keep their persistence); move the others to `device`."""
    from ..runtime.state_dict import ORDER_TYPE, PARALLEL_DIM, register_parallel_attribute
    for names, t in groups:
        present = []
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            try:
                owner = gm.get_submodule(owner_name) if owner_name else gm
            except AttributeError:
                continue
            for d in (owner._parameters, owner._buffers):
                if attr in d and d[attr] is not None:
                    present.append((d, attr, d[attr]))
        if not present:
            continue
        old = present[0][2]
        new = filled.get(id(t))
        if new is None:
            if old.is_meta:
                raise LoadError(f"{names[0]} {list(t.shape)} is still on meta after loading")
            if device is None or old.device == torch.device(device):
                continue
            new = old.detach().to(device)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
            if hasattr(old, PARALLEL_DIM):                   # TorchShard's attributes travel with it
                register_parallel_attribute(new, getattr(old, PARALLEL_DIM), getattr(old, ORDER_TYPE, 0))
        for d, attr, _ in present:
            d[attr] = new
    stale = [n for n, t in list(gm.named_parameters()) + list(gm.named_buffers())
             if t is not None and t.is_meta and (only is None or only(n))]
    stale += [f"{n}.{k}" if n else k for n, m in gm.named_modules() for k, v in vars(m).items()
              if isinstance(v, torch.Tensor) and v.is_meta]
    if stale:
        raise LoadError(f"{type(gm).__name__} still holds meta tensors {stale[:6]} that are not the model's "
                        "parameters or buffers (constants made while capturing on meta)")


# ----------------------------------------------------------------------------- Hugging Face

def _hf_dtype(config, dtype):
    if dtype is not None:
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def meta_model(path_or_config, dtype=None, model_class=None) -> nn.Module:
    """A Hugging Face model built from its config on the meta device (no weights read or made),
    in `dtype` (default: the config's, as `from_pretrained(dtype="auto")`), in eval mode; from a
    directory with a generation_config.json, that generation config (as `from_pretrained`)."""
    transformers = _require("transformers")
    config = path_or_config
    if isinstance(path_or_config, (str, os.PathLike)):
        if not os.path.isfile(os.path.join(path_or_config, "config.json")):
            raise LoadError(f"{os.fspath(path_or_config)} has no config.json: not a Hugging Face checkpoint directory")
        try:        # never the directory's own code (auto_map), and no prompt asking whether to run it
            config = transformers.AutoConfig.from_pretrained(path_or_config, trust_remote_code=False)
        except ValueError as e:
            if "trust_remote_code" not in str(e):
                raise
            raise LoadError(f"{os.fspath(path_or_config)}/config.json names code of its own (auto_map), which "
                            "autoshard does not run: build that model yourself (transformers' "
                            "trust_remote_code=True, if you trust its source) and pass it, on meta, to "
                            "parallelize(..., load=the directory)") from e
    else:
        config = copy.deepcopy(config)
    model_class = model_class or transformers.AutoModelForCausalLM
    dt = _hf_dtype(config, dtype)
    previous = torch.get_default_dtype()
    try:
        if dt.is_floating_point:
            torch.set_default_dtype(dt)
        with torch.device("meta"):
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config, dtype=dt)
            else:
                model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    if isinstance(path_or_config, (str, os.PathLike)) and getattr(model, "generation_config", None) is not None \
            and os.path.isfile(os.path.join(path_or_config, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path_or_config)   # as from_pretrained
    return model.to(dt).eval()


def example_ids(model: nn.Module, tokens: int) -> dict:
    """Keyword inputs of a causal LM: zero `input_ids` of (1, tokens), at most its position limit."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or tokens
    return {"input_ids": torch.zeros((1, min(tokens, limit)), dtype=torch.long)}
