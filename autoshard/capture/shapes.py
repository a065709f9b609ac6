"""Shapes of a captured graph: which dims follow the inputs, and fake-tensor propagation.

A node's `meta["autoshard_dynamic"]` (`DYNAMIC`) lists the dims of its value whose size follows
the inputs' batch / sequence lengths (`dynamic_dims`): read from torch.export's symbolic sizes
(`mark_dynamic`), or for symbolic_trace found by probing, a FakeTensorProp of inputs grown along
each dim (`probe_each_dim`, `mark_changed`). The planner never shards such a dim, and the
rewritten module accepts any size there. Also the graph's flat inputs (`placeholder_inputs`) and
the scalars read from tensors (`.item()`), which fake tensors cannot give (`stand_in_scalar`).
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..errors import CaptureError


DYNAMIC = "autoshard_dynamic"        # node.meta key: dims whose size follows the inputs' sizes


def fetch_attr(gm, target: str):
    """The object at dotted path `target` of `gm` (a parameter, buffer, constant or submodule)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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


def placeholder_inputs(gm: fx.GraphModule, tracer: str, args: tuple, kwargs: dict, placeholders=None) -> list:
    """The example inputs in the order of `gm`'s placeholders (`placeholders`: those nodes, when
    the caller already holds them)."""
    if tracer == "export":
        return fx._pytree.tree_flatten_spec((args, kwargs), gm._in_spec)
    if placeholders is None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for n in placeholders[len(args):]:
        if n.target in kwargs:
            flat.append(kwargs[n.target])
        elif n.args:
            flat.append(n.args[0])
        else:
            raise CaptureError(f"no example value for input {n.target!r} of {type(gm).__name__}")
    return flat


_SCALAR_READS = {torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default, torch.Tensor.item}


def stand_in_scalar(x):
    """What a fake tensor's `.item()` stands for while propagating shapes: a number of its type
    (a value read from a tensor, like DeBERTa's scale, only enters arithmetic)."""
    if x.dtype == torch.bool:
        return True
    return 1.0 if x.is_floating_point() else 1


def reads_scalar(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _SCALAR_READS) or (n.op == "call_method" and n.target == "item")


class _ShapeProp(FakeTensorProp):
    """FakeTensorProp that reads `.item()` of a fake tensor as a stand-in number."""

    def run_node(self, n):
        if reads_scalar(n):
            n.meta["val"] = stand_in_scalar(self.env[n.all_input_nodes[0]])
            return n.meta["val"]
        return super().run_node(n)


@contextlib.contextmanager
def quiet_fake_tensor():
    """A probe that fails is expected: keep FakeTensor's error log of the failing meta op quiet."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def keeping_scalars(module: nn.Module):
    """Restore `module`'s one-element buffers afterwards: FakeTensorMode runs ops on real tensors
    of one element for real (constant propagation), so a shape propagation through a batch norm
    in train mode would count its `num_batches_tracked` up on the model itself."""
    saved = [(b, b.clone()) for b in module.buffers() if b is not None and not b.is_meta and b.numel() <= 1]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def propagate(gm: fx.GraphModule, flat: list) -> None:
    """node.meta['val'] = FakeTensor of the example's concrete shapes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in flat]
    with keeping_scalars(gm), mode:
        _ShapeProp(gm, mode).propagate(*fake)


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
