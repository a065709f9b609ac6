"""Check a rewritten per-rank graph before anyone runs it: FakeTensor propagation of local shapes.

`parallelize` calls `check_local_graph` on every rank's module: the example inputs run through
the graph on fake tensors with this rank's parameter shards, and each collective is replaced by
the shape change it makes (an all-gather multiplies its dim by the degree, a scatter divides
it). A plan that could not run fails here, inside `parallelize`, with a `ShardingError` that
names the node and the shapes, never at the user's first step.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ..capture.shapes import keeping_scalars, placeholder_inputs, reads_scalar, stand_in_scalar
from ..errors import ShardingError, first_line
from ..nn import functional as PF
from ..nn.norm import sharded_layer_norm, sharded_rms_norm, sharded_var
from ..runtime import collectives as C
from ..runtime.groups import subgroup_size
from ..runtime.pieces import cat_along, split_along
from ..runtime.sequence import gathered_linears


def _within(group, p: int, rank: int) -> tuple[int, int]:
    """(size, rank) of this rank in `group`: the tensor-parallel group's, or a `subgroup`'s."""
    m = subgroup_size(group)
    return (p, rank) if m is None else (m, rank % m)


def _gather(p, rank):
    def fn(x, dim, chunks=1, group=None, size=None, unit=1, parts=None, nest=1):
        if size is None:
            return cat_along([x] * _within(group, p, rank)[0], dim, chunks)
        shape = list(x.shape)
        shape[dim] = size
        return x.new_empty(shape)
    return fn


def _scatter(p, rank):
    def fn(x, dim, chunks=1, group=None, unit=1, parts=None, nest=1):
        n, r = _within(group, p, rank)
        return split_along(x, dim, n, chunks, what="tensor", uneven=True, unit=unit, parts=parts, nest=nest)[r]
    return fn


def _all_to_all(p, rank):
    return lambda x, src_dim, dst_dim, group=None: split_along(cat_along([x] * p, src_dim), dst_dim, p)[rank]


def _gathered_linears(p, rank):
    def fn(x, dim, *params, group=None, size=None, forms=(), flat=False, **cut):
        whole = _gather(p, rank)(x, dim, group=group, size=size)
        whole = whole.reshape(-1, whole.size(-1)) if flat else whole
        return tuple(torch.addmm(b, whole, w) if f == "addmm" else F.linear(whole, w, b)
                     for w, b, f in zip(params[0::2], params[1::2], forms))
    return fn


def _vocab_ce(p, rank):
    def fn(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, group=None,
           num_classes=None):
        return F.cross_entropy(logits, target, reduction=reduction)
    return fn


# collective -> (p, rank) -> a function computing its local output shape on fake tensors
_LOCAL = {
    C.copy_to: lambda p, rank: (lambda x, group=None: x),
    C.reduce_from: lambda p, rank: (lambda x, group=None, inplace=False: x),
    C.scatter_to: _scatter,
    C.slice_partial: _scatter,
    C.reduce_scatter: _scatter,
    C.gather_from: _gather,
    C.all_gather: _gather,
    C.all_to_all: _all_to_all,
    gathered_linears: _gathered_linears,
    C.to_dtensor: lambda p, rank: (lambda x, dim, group=None, size=None: x),      # the local block is what it holds
    PF.masked_embedding: lambda p, rank: (lambda input, weight, padding_idx=None, group=None, **kw:
                                          F.embedding(input, weight)),
    PF.vocab_parallel_cross_entropy: _vocab_ce,
    sharded_layer_norm: lambda p, rank: (lambda x, shape, weight=None, bias=None, eps=1e-5, group=None:
                                         F.layer_norm(x, x.shape[-1:], weight, bias, eps)),
    sharded_rms_norm: lambda p, rank: (lambda x, shape, weight=None, eps=None, group=None:
                                       F.rms_norm(x, x.shape[-1:], weight, eps)),
    sharded_var: lambda p, rank: (lambda x, dim, correction=1, keepdim=False, group=None:
                                  x.var(dim, keepdim=keepdim)),
}


def register_local_shape(fn, make) -> None:
    """Teach the check the local output of a collective-running function: `make(p, rank)`
    returns a function with `fn`'s signature that computes it on fake tensors."""
    _LOCAL[fn] = make


def _shapes(v):
    if isinstance(v, torch.Tensor):
        return tuple(v.shape)
    if isinstance(v, (tuple, list)):
        return type(v)(_shapes(x) for x in v)
    return v


class _LocalShapes(fx.Interpreter):
    """Runs a rank's graph on fake tensors, collectives replaced by their shape changes."""

    def __init__(self, gm, p, rank, mode, device):
        super().__init__(gm)
        self.p, self.rank, self.mode, self.device = p, rank, mode, device
        self.local = {fn: make(p, rank) for fn, make in _LOCAL.items()}

    def get_attr(self, target, args, kwargs):
        t = super().get_attr(target, args, kwargs)
        if isinstance(t, torch.Tensor) and t.is_meta and self.device.type != "meta":
            with self.mode:          # a meta model not loaded yet: a fake tensor on the inputs' device
                return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return t

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        meta = {k: t for k, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta}
        if meta and self.device.type != "meta":     # a leaf module of a meta model: its tensors faked likewise
            with self.mode:
                fake = {k: torch.empty(t.shape, dtype=t.dtype, device=self.device) for k, t in meta.items()}
            return torch.func.functional_call(module, fake, tuple(args), kwargs)
        return super().call_module(target, args, kwargs)

    def run_node(self, n):
        if reads_scalar(n):
            return stand_in_scalar(self.env[n.all_input_nodes[0]])
        try:
            with self.mode:
                return super().run_node(n)
        except ShardingError as e:
            raise ShardingError(f"rank {self.rank} of {self.p} cannot run {n.format_node()}: {e}") from e
        except Exception as e:  # noqa: BLE001 - any failure is a plan that cannot run
            ins = {a.name: _shapes(self.env.get(a)) for a in n.all_input_nodes}
            raise ShardingError(f"the plan cannot run on rank {self.rank} of {self.p}: {n.format_node()} fails "
                                f"with local input shapes {ins}: {type(e).__name__}: "
                                f"{first_line(e) or type(e).__name__}") from e

    def call_function(self, target, args, kwargs):
        fn = self.local.get(target)
        if fn is not None:
            return fn(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def check_local_graph(gm: fx.GraphModule, plan, rank: int) -> None:
    """Propagate the plan's example inputs through rank `rank`'s module on fake tensors;
    raise ShardingError naming the first node whose local shapes do not fit."""
    args, kwargs = plan.example
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = placeholder_inputs(gm, plan.tracer, args, kwargs)
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in flat]
    device = next((a.device for a in flat if isinstance(a, torch.Tensor)), torch.device("cpu"))
    with torch.no_grad(), keeping_scalars(gm):
        _LocalShapes(gm, plan.world_size, rank, mode, device).run(*fake)
