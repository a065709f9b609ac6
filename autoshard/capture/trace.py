"""Capture a model as a torch.fx GraphModule whose nodes carry FakeTensor shapes.

Two tracers, one normal form: parameters are `get_attr` nodes feeding ops.
- `torch.fx.symbolic_trace`-style tracing that inlines nn.Linear and nn.Embedding (a tied weight
  becomes one parameter used by two ops) and keeps other torch.nn modules as leaves, so dropout
  still follows train()/eval();
- `torch.export.export(..., strict=False).module()`: aten-level, for models FX cannot trace.
Shapes come from FakeTensor propagation of the example inputs: no real compute; the dims that
follow the inputs' batch and sequence sizes are marked by `dynamic`. Each run of identical layers
is traced once (`repeats`), the graph is put in autoshard's normal forms (`normalize`) and
recompiled once, here, after its last change.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import CaptureError, first_line
from ..runtime.autocast import autocast_state
from . import repeats
from .duplicates import merge_duplicates
from .experts import experts_as_one_op
from .dynamic import export_dynamic, mark_by_probes
from .masks import eager_masks
from .normalize import (constant_list_indices, regroup_blocks, unfuse_head_views, ungroup_kv_heads,
                        unmerge_batch_heads)
from .shapes import placeholder_inputs


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
    autocast: tuple = ()            # the caller's torch.autocast when captured (autocast_state)


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
    mark_by_probes(gm, placeholder_inputs(gm, "symbolic_trace", args, kwargs), notes)
    return gm


def _export(model: nn.Module, args: tuple, kwargs: dict, notes: list) -> fx.GraphModule:
    """torch.export with dynamic batch and sequence sizes (`dynamic.export_dynamic`), every name kept."""
    gm = export_dynamic(model, args, kwargs, notes)
    _keep_all_names(gm, model)
    return gm


def fake_mode_of(module: nn.Module):
    """The FakeTensorMode of a model whose tensors are fake (`recipe_copy`), else None."""
    from torch._subclasses.fake_tensor import FakeTensor
    t = next(iter(module.parameters()), None)
    return t.fake_mode if isinstance(t, FakeTensor) else None


def recipe_copy(on_meta: nn.Module, like: dict, fake: bool = True) -> nn.Module:
    """A copy of `on_meta` (a model on the meta device) whose tensors have the dtype that `like`
    (name -> (dtype, device): the parallel module's) gives them: with `fake`, fake tensors (no
    memory) on those devices, what a capture under the caller's precision recipe runs on (autocast
    applies to tensors of a real device only, so a meta capture would miss its casts); else on
    meta, what its graph is rewritten and checked on."""
    import copy
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = copy.deepcopy(on_meta)
    made = {}
    with mode if fake else contextlib.nullcontext():
        for prefix, m in model.named_modules(remove_duplicate=False):
            for table in (m._parameters, m._buffers):
                for k, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        dtype, device = like.get(f"{prefix}.{k}" if prefix else k, (t.dtype, t.device))
                        dtype = dtype if t.is_floating_point() else t.dtype
                        device = "meta" if not fake else "cpu" if device.type == "meta" else device
                        new = torch.empty(t.shape, dtype=dtype, device=device)
                        made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                    table[k] = made[id(t)]
    return model


def _meta_inputs(model: nn.Module, args: tuple, kwargs: dict):
    """For a model built on the meta device: its example inputs moved to meta (so that capture
    allocates nothing and devices agree) and the device the inputs will really live on (their
    own when not meta, else CPU); for a `recipe_copy`, the inputs as its fake tensors and None;
    (None, None) for a model with real tensors. Tensors inside tuples, lists and dicts (a
    generation step's cache) are moved too."""
    mode = fake_mode_of(model)
    if mode is not None:
        return pytree.tree_map_only(torch.Tensor, mode.from_tensor, (tuple(args), dict(kwargs))), None
    if not has_meta(model):
        return None, None
    devices = {a.device for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and not a.is_meta}
    return pytree.tree_map_only(torch.Tensor, lambda a: a.to("meta"), (tuple(args), dict(kwargs))), \
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


def _passed(model: nn.Module, args: tuple, kwargs: dict) -> set:
    """The names of forward's arguments the example inputs give (by keyword or position)."""
    try:
        return set(kwargs) | set(inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return set(kwargs)


@contextlib.contextmanager
def _without_kv_cache(model: nn.Module, args: tuple, kwargs: dict, notes: list):
    """A Hugging Face config with `use_cache` on (its default) makes forward return a key/value
    cache object that no tracer can output: capture the training graph, with the cache off in
    every config the model holds (T5's stacks keep their own copies) for the duration, unless the
    inputs pass use_cache themselves."""
    configs = {}
    if "use_cache" not in _passed(model, args, kwargs):
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
    graph in eval mode (autoshard.rewrite.signatures), so the branches are the model's in either mode."""
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


def _normalised(gm: fx.GraphModule, run_on, expanded: bool = False) -> fx.GraphModule:
    """`gm` in autoshard's normal forms (autoshard.capture.normalize), its code recompiled once after the
    last change: a meta capture's devices retargeted to `run_on` (before the layer copies were
    written, when `expanded`), then the normal forms."""
    if run_on is not None and not expanded:
        _retarget_meta_device(gm, run_on)
    if merge_duplicates(gm) + unfuse_head_views(gm) + unmerge_batch_heads(gm) + regroup_blocks(gm) + \
            ungroup_kv_heads(gm) or expanded:
        _recompile_later(gm)
    return gm


def _recompile_later(gm: fx.GraphModule) -> None:
    """`gm.recompile()` on first use rather than now: called, or its `code` or text read. A plan reads
    the graph, not its code, and a parallel module writes its own (the 80-layer LLaMA's code took 0.3
    s to write). The class is gm's own (fx makes one per module), so only gm waits."""
    cls = type(gm)

    def forward(self, *args, **kwargs):
        self.recompile()                   # (sets the class's forward to the code written)
        return self(*args, **kwargs)

    def written(self):
        if type(self).forward is forward:
            self.recompile()
        return self._code

    def text(self):
        written(self)
        return fx.GraphModule.__str__(self)

    cls.forward, cls.code, cls.__str__ = forward, property(written), text


def _once_per_layer(fn, model: nn.Module, args: tuple, kwargs: dict, notes: list, run_on=None) -> fx.GraphModule:
    """`fn`'s capture of `model` in normal form, tracing each run of identical layers once
    (autoshard.capture.repeats): the model cut to the first two layers of each run, the rest written in as
    copies of the second; the whole model traced instead, with a note, when they are not a pure
    repetition. `run_on`: the device a meta capture's tensors are made on at run time (retargeted
    before the copies are made, so that they inherit it)."""
    found = repeats.tail_runs(model)
    if not found:
        return _normalised(fn(model, args, kwargs, notes), run_on)
    mine = []
    try:
        with repeats.cut(model, found):
            gm = fn(model, args, kwargs, mine)
        if run_on is not None:
            _retarget_meta_device(gm, run_on)
        written = repeats.expand(gm, model, found)
    except repeats.RepeatError as e:
        notes.append(f"the repeated layers were traced one by one: {first_line(e, 160)}")
        return _normalised(fn(model, args, kwargs, notes), run_on)
    _keep_all_names(gm, model)
    gm.graph.lint()
    notes.extend(mine)
    traced = sum(2 * k for _, _, k in found)
    notes.append(f"{written + traced} repeated layers traced as {traced} "
                 f"({', '.join(f'{n}.{keys[0]}..{keys[-1]}' + (f' every {k}' if k > 1 else '') for n, keys, k in found)})")
    return _normalised(gm, run_on, expanded=True)


def capture(model: nn.Module, example_inputs=None, *, tracer: str = "auto", tokens: int = 512,
            kwargs: dict | None = None, train: bool = True, once: bool = True) -> Captured:
    """Capture `model` with `tracer` ("symbolic_trace", "export" or "auto": the first that works);
    `kwargs` are keyword inputs beside positional `example_inputs`; `train`: the training graph
    (the default, what a plan is made for) or the evaluation graph; `once`: trace each run of
    identical layers once (autoshard.capture.repeats) rather than layer by layer."""
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
            experts_as_one_op(model, notes), \
            eager_masks(_passed(model, args, kwargs)), \
            constant_list_indices() if on_meta else contextlib.nullcontext():
        for name in order:
            try:
                fn = _symbolic if name == "symbolic_trace" else _export
                gm = _once_per_layer(fn, model, *(on_meta or (args, kwargs)), notes, run_on) if once else \
                    _normalised(fn(model, *(on_meta or (args, kwargs)), notes), run_on)
                return Captured(gm, name, args, kwargs, notes, autocast_state())
            except Exception as e:  # noqa: BLE001 - every tracer failure is reported below
                errors.append((name, e))
    lines = [f"could not capture {type(model).__name__}:"]
    for name, e in errors:
        lines.append(f"  {name} failed: {type(e).__name__}: {first_line(e)}")
    lines.append("  try: pass example_inputs matching forward(), use tracer='export' for models with "
                 "data-dependent Python control flow, or make the failing code traceable")
    raise CaptureError("\n".join(lines)) from errors[-1][1]
