"""Normalisations, softmax and reductions: sharding is kept on the dims they do not reduce."""
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...capture.ops import LAYER_NORMS, NORM_ARGS, VAR_OPS, norm_dim, norm_params, var_args
from .registry import PARTIAL, REPLICATE, NodeInfo, Shard, register_rule

aten = torch.ops.aten


def keep_dims(info: NodeInfo, src, reduced: set, *, keepdim=True, partial_sum=None):
    """Shard any dim not in `reduced` (contiguously, or as a K/V piece held by the ranks that read
    it: Qwen3's per-head norm of keys cut to their readers' heads); a sum (or mean, rescaled by the
    rewriter) over a sharded dim gives a Partial result: `partial_sum` names that strategy."""
    shape = info.shape(src)
    found = []
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        if d in reduced:
            if partial_sum:       # a sum's summands are exact whatever the sizes; a mean's rescale is not
                found.append(info.req({src: Shard(d)}, partial_sum, PARTIAL, uneven=partial_sum == "partial"))
            continue
        out = d if keepdim else d - sum(1 for r in reduced if r < d)
        for pl in (Shard(d), *info.cover_shards(d, shape[d])):
            found.append(info.req({src: pl}, f"shard({out})", replace(pl, dim=out), uneven=True))
    return found


@register_rule(*NORM_ARGS)
def _layer_norm(info):
    x = info.node.args[0]
    nd = len(info.shape(x))
    nshape = info.arg(1, "normalized_shape")
    k = len(nshape) if isinstance(nshape, (tuple, list)) else 1
    found = keep_dims(info, x, set(range(nd - k, nd)))
    if k == 1:       # the normalised dim split: statistics all-reduced as (..., 1), fwd and bwd
        m = {x: Shard(nd - 1)}
        m.update({a: Shard(0) for a in norm_params(info.node) if a in info.inputs})
        stats = info.val(x).numel() // info.shape(x)[-1] * info.val(x).element_size()
        passes = 2 if info.node.target in LAYER_NORMS else 1
        found.append(info.req(m, "split_norm", Shard(nd - 1), compute=1 / info.world_size,
                              comm=[("all_reduce", stats)] * (2 * passes)))
    return found


@register_rule(nn.LayerNorm, nn.RMSNorm)
def _layer_norm_module(info):
    x = info.inputs[0]
    nd = len(info.shape(x))
    return keep_dims(info, x, set(range(nd - len(info.module.normalized_shape), nd)))


@register_rule(F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
               torch.Tensor.log_softmax, aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
               aten.log_softmax.int, nn.Softmax)
def _softmax(info):
    x = info.inputs[0]
    nd = len(info.shape(x))
    dim = info.module.dim if info.module is not None else info.arg(1, "dim")
    return keep_dims(info, x, {norm_dim(int(dim), nd)})


def _reduced_dims(info, nd):
    dim = info.arg(1, "dim")
    if dim is None:
        return set(range(nd))
    dims = dim if isinstance(dim, (tuple, list)) else [dim]
    return {norm_dim(int(d), nd) for d in dims}


@register_rule(torch.sum, torch.Tensor.sum, aten.sum.dim_IntList, aten.sum.default)
def _sum(info):
    x = info.inputs[0]
    nd = len(info.shape(x))
    keep = bool(info.arg(2, "keepdim", False))
    return keep_dims(info, x, _reduced_dims(info, nd), keepdim=keep, partial_sum="partial") + \
        [info.req({x: PARTIAL}, "partial", PARTIAL)]


@register_rule(torch.mean, torch.Tensor.mean, aten.mean.dim, aten.mean.default)
def _mean(info):
    x = info.inputs[0]
    nd = len(info.shape(x))
    keep = bool(info.arg(2, "keepdim", False))
    return keep_dims(info, x, _reduced_dims(info, nd), keepdim=keep, partial_sum="partial_mean") + \
        [info.req({x: PARTIAL}, "partial", PARTIAL)]


@register_rule(*VAR_OPS)
def _var(info):
    """A variance over a split dim: mean and centred squares summed over the ranks (2 all-reduces
    forward, the mean's 1 backward), the result whole; other dims keep their split."""
    x = info.inputs[0]
    nd = len(info.shape(x))
    parsed = var_args(info.node)
    if parsed is None:
        return []
    d = norm_dim(parsed[0], nd)
    found = keep_dims(info, x, {d}, keepdim=parsed[2])
    stats = info.val(info.node).numel() * info.val(x).element_size()
    found.append(info.req({x: Shard(d)}, "split_var", REPLICATE, comm=[("all_reduce", stats)] * 3))
    return found
