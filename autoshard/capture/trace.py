"""Capture a model as a torch.fx GraphModule whose nodes carry FakeTensor shapes.

Two tracers, one normal form: parameters are `get_attr` nodes feeding ops.
- `torch.fx.symbolic_trace`-style tracing that inlines nn.Linear and nn.Embedding (a tied weight
  becomes one parameter used by two ops) and keeps other torch.nn modules as leaves, so dropout
  still follows train()/eval();
- `torch.export.export(..., strict=False).module()`: aten-level, for models FX cannot trace.
Shapes come from FakeTensor propagation of the example inputs: no real compute. A second
propagation (torch.export's own symbolic one, with every input dim `Dim.AUTO`; for
symbolic_trace a FakeTensorProp of inputs with other batch / sequence sizes: `shapes`) finds the
dims whose size follows the inputs' batch and sequence lengths: `node.meta["autoshard_dynamic"]`
lists them, the planner never shards them, and the rewritten module accepts any size there. A dim of size 1 in the example (a batch of one)
is captured or probed at size 2, since torch.export specialises sizes 0 and 1; it stays 1, with
a note, where the model does not run so (a broadcast dim, a dim the model needs at 1).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from . import repeats
from .normalize import constant_list_indices, regroup_blocks, unfuse_head_views, unmerge_batch_heads
from ..errors import CaptureError, first_line
from .shapes import (input_dynamic_dims, mark_changed, mark_dynamic, placeholder_inputs, probe, probe_each_dim,
                     propagate, quiet_fake_tensor, resized, shapes_of)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` lives on the meta device."""
    return any(t.is_meta for t in module.parameters()) or \
        any(b is not None and b.is_meta for b in module.buffers())


@dataclass
class Captured:
    """A captured graph, the tracer that made it and the example inputs it was shaped with."""

    gm: fx.GraphModule
    tracer: str
    args: tuple
    kwargs: dict
    notes: list = field(default_factory=list)


class InliningTracer(fx.Tracer):
    """Traces through nn.Linear / nn.Embedding / nn.LayerNorm / nn.RMSNorm / nn.Conv1d-3d so
    their parameters become get_attr nodes the planner can split (a convolution with
    padding_mode other than "zeros" becomes F.pad then F.conv*)."""

    INLINED = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if type(m) in self.INLINED:
            return False
        return super().is_leaf_module(m, qualname)


def _from_shape(a):
    """A `torch.Size` example stands for token ids of that shape (zeros: values do not matter)."""
    return torch.zeros(a, dtype=torch.long) if isinstance(a, torch.Size) else a


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, torch.Size):
        return (_from_shape(example_inputs),), {}
    if isinstance(example_inputs, dict):
        return (), {k: _from_shape(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(_from_shape(a) for a in example_inputs), {}
    raise TypeError(f"example_inputs must be a tuple of positional arguments or a dict of keyword "
                    f"arguments, got {type(example_inputs).__name__}")


def synthesize_inputs(model: nn.Module, tokens: int) -> tuple:
    """Example inputs for a model given none: token ids for an embedding-first model, else
    features for a linear-first one (batch 1, `tokens` positions)."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return (torch.randint(0, m.num_embeddings, (1, tokens)),)
        if isinstance(m, nn.Linear):
            return (torch.randn(1, tokens, m.in_features),)
    raise CaptureError(f"cannot guess example inputs for {type(model).__name__}: it has no nn.Embedding or "
                       "nn.Linear; pass example_inputs=(tensor, ...) or a dict of keyword arguments")


def _keep_all_names(gm: fx.GraphModule, model: nn.Module) -> None:
    """Give `gm` every parameter and buffer name of `model` (tied aliases, unused ones) so that
    its state_dict keys are the model's."""
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for name, t in named:
            owner_name, _, attr = name.rpartition(".")
            owner = gm
            for part in owner_name.split(".") if owner_name else []:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            if attr not in owner._parameters and attr not in owner._buffers:
                if isinstance(t, nn.Parameter):
                    owner.register_parameter(attr, t)
                else:
                    src = model.get_submodule(owner_name) if owner_name else model
                    owner.register_buffer(attr, t, persistent=attr not in src._non_persistent_buffers_set)


def _absent_defaults(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """forward() parameters the example leaves at a None default: traced as the constant None,
    so `if targets is None:` takes the branch the example takes."""
    params = list(inspect.signature(model.forward).parameters.values())[len(args):]
    return {q.name: None for q in params
            if q.name not in kwargs and q.default is None and q.kind is q.POSITIONAL_OR_KEYWORD}


def _symbolic(model: nn.Module, args: tuple, kwargs: dict, notes: list) -> fx.GraphModule:
    tracer = InliningTracer()
    graph = tracer.trace(model, concrete_args=_absent_defaults(model, args, kwargs) or None)
    gm = fx.GraphModule(model, graph, model.__class__.__name__)
    _keep_all_names(gm, model)
    extra = set(kwargs) - {n.target for n in gm.graph.nodes if n.op == "placeholder"}
    if extra:
        raise CaptureError(f"example inputs name {sorted(extra)} which {type(model).__name__}.forward does not take")
    flat = placeholder_inputs(gm, "symbolic_trace", args, kwargs)
    error = None
    with quiet_fake_tensor():
        try:               # the same graph at other batch / sequence sizes: what changes is dynamic
            propagate(gm, [probe(a) for a in flat])
            probe_shapes = shapes_of(gm)
        except Exception as e:  # noqa: BLE001 - find the dims that may change one at a time; else say so
            error = e
            probe_shapes, free = probe_each_dim(gm, flat)
    if probe_shapes is None:
        notes.append(f"the model did not run at other input sizes ({type(error).__name__}: {first_line(error, 120)}); "
                     "it is planned for the example's sizes")
    elif error is not None:
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        kept = [f"{name} dim {d}" for name, a, dims in zip(names, flat, free) if isinstance(a, torch.Tensor)
                for d in input_dynamic_dims(a) if a.shape[d] == 1 and d not in dims]
        if kept:
            notes.append(f"the model did not run with size 2 at {', '.join(kept)} (size 1 in the example): "
                         "the module takes only size 1 there")
    propagate(gm, flat)
    if probe_shapes is not None:            # else no dim is dynamic (a fresh trace carries no marks)
        mark_changed(gm, probe_shapes)
    return gm


def _auto_shapes(model: nn.Module, args: tuple, kwargs: dict):
    """export's dynamic_shapes by forward() argument name: every dim of every top-level tensor
    input Dim.AUTO (export keeps the dims the model fixes, such as feature sizes, static itself)."""
    def spec(a):
        return {d: Dim.AUTO for d in range(a.dim())} if isinstance(a, torch.Tensor) and a.dim() else None
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    return {k: (tuple(spec(x) for x in v) if isinstance(v, tuple) else
                {kk: spec(x) for kk, x in v.items()} if isinstance(v, dict) else spec(v))
            for k, v in bound.arguments.items()}


def _reachable(args: tuple, kwargs: dict):
    """The input tensors `_enlarged` can replace: an argument, or an item of a plain tuple or dict argument."""
    for v in [*args, *kwargs.values()]:
        items = v if type(v) is tuple else v.values() if type(v) is dict else (v,)
        yield from (x for x in items if isinstance(x, torch.Tensor))


def _enlarged(args: tuple, kwargs: dict, grown: dict) -> tuple[tuple, dict]:
    """`args`, `kwargs` with every tensor `_reachable` finds replaced by `grown[id(tensor)]`, where given."""
    def swap(x):
        return grown.get(id(x), x) if isinstance(x, torch.Tensor) else x

    def arg(v):
        if type(v) is tuple:
            return tuple(swap(x) for x in v)
        return {k: swap(x) for k, x in v.items()} if type(v) is dict else swap(v)
    return tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()}


def _size_one_dims(model: nn.Module, args: tuple, kwargs: dict) -> list:
    """(input name, tensor, dim) of every size-1 dim that `_auto_shapes` makes Dim.AUTO and
    `_enlarged` can grow. torch.export specialises size 1, so an example with a batch (or
    sequence) of one would fix it: `_export` captures these dims at size 2. Dims of float inputs
    come first, and an input's last dims before its first: the likelier broadcast dims (a mask's
    (1, 1, T, T)), which `_export` gives up first."""
    params = inspect.signature(model.forward).parameters
    names = {}
    for name, v in inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments.items():
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, tuple) else [(None, v)]
        for k, x in items:
            if isinstance(x, torch.Tensor) and x.dim():
                keyword = params[name].kind is inspect.Parameter.VAR_KEYWORD
                names.setdefault(id(x), name if k is None else k if keyword else f"{name}[{k!r}]")
    units, seen = [], set()
    for t in _reachable(args, kwargs):
        if id(t) in names and id(t) not in seen:
            seen.add(id(t))
            units += [(names[id(t)], t, d) for d in range(t.dim()) if t.shape[d] == 1]
    return sorted(units, key=lambda u: (not (u[1].is_floating_point() or u[1].is_complex()), -u[2]))


def _export(model: nn.Module, args: tuple, kwargs: dict, notes: list) -> fx.GraphModule:
    """torch.export with every dim of every top-level tensor input Dim.AUTO, captured where the
    example has size 1 at size 2 (its own values repeated: `_size_one_dims`), then propagated at
    the example's own sizes, which the plan sees. When the model does not capture so (a size-1 dim
    that broadcasts, or that the model needs): none grown (the example's own sizes, where export
    fixes them at 1; a failure there is not the sizes'), then every size-1 dim but one grown, in
    turn, the first that captures kept, else none, with a note naming the dims kept at 1; a model
    that cannot export dynamically at all is captured at the example's static shapes, with a note."""
    units = _size_one_dims(model, args, kwargs)

    def dynamic(grow):
        sizes = {}
        for i in grow:
            _, t, d = units[i]
            sizes.setdefault(id(t), (t, {}))[1][d] = 2
        big_args, big_kwargs = _enlarged(args, kwargs, {k: resized(t, s) for k, (t, s) in sizes.items()})
        ep = torch.export.export(model, big_args, big_kwargs, dynamic_shapes=_auto_shapes(model, big_args, big_kwargs),
                                 strict=False)
        gm = ep.module()
        mark_dynamic(gm)
        propagate(gm, placeholder_inputs(gm, "export", args, kwargs))   # the example's sizes: what rules see
        return gm

    def attempt(grow):
        try:
            return dynamic(grow), None
        except Exception as e:  # noqa: BLE001 - fewer grown dims are tried next; failures are noted below
            return None, e

    every = grow = list(range(len(units)))
    with quiet_fake_tensor():
        gm, error = attempt(every)
        if gm is None and units:
            fixed, static_error = attempt([])        # the example's sizes: its size-1 dims stay 1
            if fixed is None:
                error = static_error                  # not the sizes: the model does not export dynamically
            else:
                for left in every if len(every) > 1 else ():
                    grow = [i for i in every if i != left]
                    gm, _ = attempt(grow)
                    if gm is not None:
                        break
                if gm is None:
                    gm, grow = fixed, []
    if gm is None:
        notes.append(f"capture with dynamic batch/sequence sizes failed ({type(error).__name__}: {first_line(error, 160)}); "
                     "the module accepts only the example's shapes")
        gm = torch.export.export(model, args, kwargs, strict=False).module()
    elif len(grow) < len(units):
        kept = ", ".join(f"{name} dim {d}" for i, (name, _, d) in enumerate(units) if i not in grow)
        notes.append(f"the model did not capture with size 2 at {kept} (size 1 in the example; "
                     f"{type(error).__name__}: {first_line(error, 120)}): the module takes only size 1 there")
    _keep_all_names(gm, model)
    return gm


def _meta_inputs(model: nn.Module, args: tuple, kwargs: dict):
    """For a model built on the meta device: its example inputs moved to meta (so that capture
    allocates nothing and devices agree) and the device the inputs will really live on (their
    own when not meta, else CPU); (None, None) for a model with real tensors."""
    if not has_meta(model):
        return None, None
    devices = {a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_meta}
    meta = lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a      # noqa: E731
    return (tuple(meta(a) for a in args), {k: meta(v) for k, v in kwargs.items()}), \
        next(iter(devices)) if len(devices) == 1 else torch.device("cpu")


def _retarget_meta_device(gm: fx.GraphModule, device: torch.device) -> None:
    """torch.export records the devices of tensors made in forward (arange(..., device=x.device));
    captured on meta they would be made on meta at run time: make them on `device`."""
    hits = []

    def fix(a):
        if isinstance(a, torch.device) and a.type == "meta":
            hits.append(a)
            return device
        return a
    for sub in gm.modules():                   # higher-order ops keep their graphs in submodules
        if not isinstance(sub, fx.GraphModule):
            continue
        before_sub = len(hits)
        for n in sub.graph.nodes:
            before = len(hits)
            args, kwargs = fx.node.map_aggregate(n.args, fix), fx.node.map_aggregate(n.kwargs, fix)
            if len(hits) > before:
                n.args, n.kwargs = args, kwargs
        if len(hits) > before_sub:
            sub.recompile()


def _passes(model: nn.Module, args: tuple, kwargs: dict, name: str) -> bool:
    """Whether the example inputs give forward's argument `name` (by keyword or position)."""
    if name in kwargs:
        return True
    try:
        return name in inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def _without_kv_cache(model: nn.Module, args: tuple, kwargs: dict, notes: list):
    """A Hugging Face config with `use_cache` on (its default) makes forward return a key/value
    cache object that no tracer can output: capture the training graph, with the cache off in
    every config the model holds (T5's stacks keep their own copies) for the duration, unless the
    inputs pass use_cache themselves."""
    configs = {}
    if not _passes(model, args, kwargs, "use_cache"):
        for m in model.modules():
            config = getattr(m, "config", None)
            if getattr(config, "use_cache", None) is True and id(config) not in configs:
                configs[id(config)] = (config, type(m).__name__)
    turned = []
    try:
        for config, owner in configs.values():
            try:
                config.use_cache = False
            except Exception:  # noqa: BLE001 - a config that refuses keeps its value
                continue
            turned.append((config, owner))
        if turned:
            notes.append(f"use_cache is on in the config of {', '.join(sorted({o for _, o in turned}))}: captured "
                         "without the key/value cache (a training graph; the output's past_key_values is None)")
        yield
    finally:
        for config, _ in turned:
            config.use_cache = True


@contextlib.contextmanager
def _in_mode(model: nn.Module, train: bool):
    """Capture the training graph (or with `train=False` the evaluation graph) whatever mode
    `model` is in: a tracer bakes the mode into dropout's train flag, attention's dropout_p, batch
    norm's training and every `if self.training:` branch. The rewriter also makes the first three
    follow the module's train() / eval() (nn.dropout); the parallel module runs the evaluation
    graph in eval mode (autoshard.signatures), so the branches are the model's in either mode."""
    modes = {m: m.training for m in model.modules()}
    model.train(train)
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


@contextlib.contextmanager
def apart():
    """Trace apart from the caller's context: no active dispatch mode (a CommDebugMode, a
    FakeTensorMode) and no global module hooks (a ModuleTracker's) see the tracer's calls, which
    they would count, or break on (a symbolic_trace Proxy is not a tensor)."""
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _disable_current_modes
    hooks = [getattr(nn_module, n) for n in ("_global_forward_pre_hooks", "_global_forward_hooks",
                                             "_global_backward_pre_hooks", "_global_backward_hooks",
                                             "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")]
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:
        with _disable_current_modes():
            yield
    finally:
        for h, items in zip(hooks, saved):
            h.clear()
            h.update(items)


def _once_per_layer(fn, model: nn.Module, args: tuple, kwargs: dict, notes: list, run_on=None) -> fx.GraphModule:
    """`fn`'s capture of `model`, tracing each run of identical layers once (autoshard.repeats):
    the model cut to the first two layers of each run, the rest written in as copies of the
    second; the whole model traced instead, with a note, when they are not a pure repetition.
    `run_on`: the device a meta capture's tensors are made on at run time (retargeted before the
    copies are made, so that they inherit it)."""
    found = repeats.tail_runs(model)
    if not found:
        return fn(model, args, kwargs, notes)
    mine = []
    try:
        with repeats.cut(model, found):
            gm = fn(model, args, kwargs, mine)
        if run_on is not None:
            _retarget_meta_device(gm, run_on)
        written = repeats.expand(gm, model, found)
    except repeats.RepeatError as e:
        notes.append(f"the repeated layers were traced one by one: {first_line(e, 160)}")
        return fn(model, args, kwargs, notes)
    _keep_all_names(gm, model)
    gm.graph.lint()
    gm.meta["autoshard_stale_code"] = True       # recompiled once, by capture, after its last change
    notes.extend(mine)
    traced = sum(2 * k for _, _, k in found)
    notes.append(f"{written + traced} repeated layers traced as {traced} "
                 f"({', '.join(f'{n}.{keys[0]}..{keys[-1]}' + (f' every {k}' if k > 1 else '') for n, keys, k in found)})")
    return gm


def capture(model: nn.Module, example_inputs=None, *, tracer: str = "auto", tokens: int = 512,
            kwargs: dict | None = None, train: bool = True, once: bool = True) -> Captured:
    """Capture `model` with `tracer` ("symbolic_trace", "export" or "auto": the first that works);
    `kwargs` are keyword inputs beside positional `example_inputs`; `train`: the training graph
    (the default, what a plan is made for) or the evaluation graph; `once`: trace each run of
    identical layers once (autoshard.repeats) rather than layer by layer."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"autoshard needs an nn.Module, got {type(model).__name__}")
    if tracer not in ("auto", "symbolic_trace", "export"):
        raise ValueError(f"tracer must be 'auto', 'symbolic_trace' or 'export', got {tracer!r}")
    args, given = _split_inputs(example_inputs)
    kwargs = {**given, **(kwargs or {})}
    notes = []
    if not args and not kwargs:
        args = synthesize_inputs(model, tokens)
        notes.append(f"no example inputs: planned for a synthesised input of shape {tuple(args[0].shape)}")
    errors = []
    order = ["symbolic_trace", "export"] if tracer == "auto" else [tracer]
    on_meta, run_on = _meta_inputs(model, args, kwargs)
    with apart(), _without_kv_cache(model, args, kwargs, notes), _in_mode(model, train), \
            constant_list_indices() if on_meta else contextlib.nullcontext():
        for name in order:
            try:
                fn = _symbolic if name == "symbolic_trace" else _export
                gm = _once_per_layer(fn, model, *(on_meta or (args, kwargs)), notes, run_on) if once else \
                    fn(model, *(on_meta or (args, kwargs)), notes)
                stale = gm.meta.pop("autoshard_stale_code", False)     # expanded: retargeted before
                if on_meta and not stale:
                    _retarget_meta_device(gm, run_on)
                if unfuse_head_views(gm) + unmerge_batch_heads(gm) + regroup_blocks(gm) or stale:
                    gm.recompile()
                return Captured(gm, name, args, kwargs, notes)
            except Exception as e:  # noqa: BLE001 - every tracer failure is reported below
                errors.append((name, e))
    lines = [f"could not capture {type(model).__name__}:"]
    for name, e in errors:
        lines.append(f"  {name} failed: {type(e).__name__}: {first_line(e)}")
    lines.append("  try: pass example_inputs matching forward(), use tracer='export' for models with "
                 "data-dependent Python control flow, or make the failing code traceable")
    raise CaptureError("\n".join(lines)) from errors[-1][1]
