"""Layer and RMS norms over a hidden dim split across the ranks (a norm over a split q or k).

Each rank holds a block of the normalised dim; the statistics are sums over every rank's block,
all-reduced as (..., 1) tensors, never the activation. The sum's backward is an all-reduce too:
every rank's gradient of the statistic covers only its own block.
"""
from __future__ import annotations

import torch

from ..runtime import collectives as C
from ..runtime.groups import get_group


def _sum_over_ranks(x, group):
    """fwd: all-reduce; bwd: all-reduce (each rank's gradient of the sum is a partial one)."""
    return C.reduce_from(C.copy_to(x, group=group), group=group)


def _global_size(normalized_shape) -> int:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"a split norm normalises one (the last) dim, got normalized_shape {shape}")
    return int(shape[0])


def sharded_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, group=None):
    """F.layer_norm of the full last dim, from this rank's block of it (two-pass statistics)."""
    n = _global_size(normalized_shape)
    mean = _sum_over_ranks(x.sum(-1, keepdim=True), group) / n
    xc = x - mean
    var = _sum_over_ranks(xc.pow(2).sum(-1, keepdim=True), group) / n
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def sharded_rms_norm(x, normalized_shape, weight=None, eps=None, group=None):
    """F.rms_norm of the full last dim, from this rank's block of it."""
    n = _global_size(normalized_shape)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    ms = _sum_over_ranks(x.pow(2).sum(-1, keepdim=True), group) / n
    y = x * torch.rsqrt(ms + eps)
    return y * weight if weight is not None else y


def sharded_var(x, dim: int, correction=1, keepdim=False, group=None):
    """torch.var over `dim` of the full tensor, from this rank's block of that dim (two passes).

    The result is whole on every rank and so is its gradient: the sum of squares is an
    all-reduce with an identity backward; the mean, used by each rank's block, all-reduces its
    gradient too."""
    n = x.size(dim) * torch.distributed.get_world_size(get_group(group))
    mean = _sum_over_ranks(x.sum(dim, keepdim=True), group) / n
    var = C.reduce_from((x - mean).pow(2).sum(dim, keepdim=True), group=group) / (n - correction)
    return var if keepdim else var.squeeze(dim)
