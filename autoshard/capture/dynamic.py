"""Which dims follow the inputs' batch and sequence sizes: `node.meta["autoshard_dynamic"]`.

The planner never splits these dims and the rewritten module accepts any size there. torch.export
finds them itself (every input dim `Dim.AUTO`, symbolic sizes in the node values: `mark_dynamic`);
a dim of size 1 in the example is captured at size 2 (export specialises 0 and 1), and kept at 1,
with a note, where the model does not run so (`export_dynamic`). For symbolic_trace the graph is
propagated again at other sizes and what changed is dynamic (`mark_by_probes`).
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim

from ..errors import first_line
from .shapes import placeholder_inputs, propagate, quiet_fake_tensor


DYNAMIC = "autoshard_dynamic"        # node.meta key: dims whose size follows the inputs' sizes


def dynamic_dims(node) -> frozenset | tuple:
    """The dims of a node's value (a frozenset, or a tuple of them for a multi-output node)
    whose size varies with the inputs' batch / sequence lengths; none for a non-node argument."""
    return node.meta.get(DYNAMIC, frozenset()) if isinstance(node, fx.Node) else frozenset()


def _symbolic_dims(v):
    if isinstance(v, (tuple, list)):
        return tuple(_symbolic_dims(x) for x in v)
    if not isinstance(v, torch.Tensor):
        return frozenset()
    out = set()
    for d, size in enumerate(v.shape):
        if isinstance(size, torch.SymInt):
            try:
                expr = size.node.shape_env.replace(size.node.expr)
            except Exception:  # noqa: BLE001 - no shape env: treat as varying
                expr = size.node.expr
            if not expr.is_number:
                out.add(d)
    return frozenset(out)


def mark_dynamic(gm: fx.GraphModule) -> None:
    """Record, from symbolic node values, which dims vary with the inputs."""
    for n in gm.graph.nodes:
        dims = _symbolic_dims(n.meta.get("val"))
        if dims:
            n.meta[DYNAMIC] = dims
        else:
            n.meta.pop(DYNAMIC, None)


def input_dynamic_dims(t: torch.Tensor) -> list[int]:
    """Dims of an input left free for symbolic_trace: all of an index tensor's, all but the
    feature (last) dim of a float one."""
    if t.dim() == 0:
        return []
    if t.is_floating_point() or t.is_complex():
        return list(range(t.dim() - 1))
    return list(range(t.dim()))


def resized(t: torch.Tensor, sizes: dict) -> torch.Tensor:
    """`t` with size `sizes[d]` at each dim d, made of its own values repeated (or cut) along d,
    so that token ids stay valid ids: an input at other sizes for a capture or a probe."""
    with torch.no_grad():
        out = t
        for d, n in sizes.items():
            out = out.index_select(d, torch.arange(n, device=t.device) % t.shape[d])
    return out.requires_grad_(t.requires_grad) if out is not t and t.requires_grad else out


def _probe_size(n: int) -> int:
    """Another size for a free dim of size `n`: 1 (which torch.export specialises, and a batch of one
    is the example users give) becomes 2, 2 becomes 3, a longer one loses one; 0 stays."""
    return n if n == 0 else 2 if n == 1 else 3 if n == 2 else n - 1


def probe(a, dims=None):
    """An input like `a` whose free dims (`dims`, default input_dynamic_dims) have other sizes."""
    if not isinstance(a, torch.Tensor):
        return a
    sizes = {d: _probe_size(a.shape[d]) for d in (input_dynamic_dims(a) if dims is None else dims)}
    sizes = {d: n for d, n in sizes.items() if n != a.shape[d]}
    return resized(a, sizes) if sizes else a


def probe_each_dim(gm: fx.GraphModule, flat: list):
    """When the joint probe fails (an image (N, C, H, W) whose channels meet a convolution's
    weight, a mask whose size-1 dim broadcasts): probe every dim of every input alone (the last one
    too: an image's width), then all that ran together; (the node shapes of that run, or None when
    no dim may change; the free dims of each input)."""
    free = [[] for _ in flat]
    for i, a in enumerate(flat):
        for d in range(a.dim()) if isinstance(a, torch.Tensor) else ():
            if a.shape[d] > 0:
                try:
                    propagate(gm, [probe(b, [d]) if j == i else b for j, b in enumerate(flat)])
                    free[i].append(d)
                except Exception:  # noqa: BLE001 - this dim is fixed by the model
                    pass
    if not any(free):
        return None, free
    try:
        propagate(gm, [probe(a, dims) for a, dims in zip(flat, free)])
    except Exception:  # noqa: BLE001 - free one at a time, not together: keep the example's sizes
        return None, [[] for _ in flat]
    return shapes_of(gm), free


def shapes_of(gm: fx.GraphModule) -> dict:
    def shape(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape)
        return tuple(shape(x) for x in v) if isinstance(v, (tuple, list)) else None
    return {n: shape(n.meta.get("val")) for n in gm.graph.nodes}


def mark_changed(gm: fx.GraphModule, probe_shapes: dict) -> None:
    """Dims whose size differs between the probe's propagation and the example's are dynamic."""
    def changed(a, b):
        if isinstance(a, tuple) and a and isinstance(a[0], (tuple, type(None))):
            return tuple(changed(x, y) for x, y in zip(a, b))
        if a is None or b is None or len(a) != len(b):
            return frozenset()
        return frozenset(d for d, (x, y) in enumerate(zip(a, b)) if x != y)
    now = shapes_of(gm)
    for n in gm.graph.nodes:
        dims = changed(now[n], probe_shapes.get(n))
        if any(dims) if isinstance(dims, tuple) else dims:
            n.meta[DYNAMIC] = dims
        else:
            n.meta.pop(DYNAMIC, None)


def mark_by_probes(gm: fx.GraphModule, flat: list, notes: list) -> None:
    """symbolic_trace's dynamic dims: the graph propagated at other batch / sequence sizes (every
    input's free dims at once, else each dim alone) beside the example's sizes; the dims whose size
    changed are marked, and the graph is left with the example's shapes (what the rules see)."""
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


def export_dynamic(model: nn.Module, args: tuple, kwargs: dict, notes: list) -> fx.GraphModule:
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
    return gm
