"""Fake-tensor shapes of a captured graph: `node.meta["val"]` for every node.

`propagate` runs the graph on fake tensors of the example's sizes (no real compute, the model's
one-element buffers kept as they were); also the graph's flat inputs (`placeholder_inputs`), an
object at a dotted path (`fetch_attr`) and the scalars read from tensors (`.item()`), which fake
tensors cannot give (`stand_in_scalar`). Which dims follow the inputs' sizes: `dynamic`.
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


def fetch_attr(gm, target: str):
    """The object at dotted path `target` of `gm` (a parameter, buffer, constant or submodule)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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
