"""Vocabulary-parallel cross entropy: logits sharded on the class dim, O(n) extra memory.

Forward: one max all-reduce and one sum all-reduce of an (n, 2) or (n, 3) tensor (sum of exp,
target logit picked by masking, and the class sum for label smoothing), every one of n floats
per row.  Backward is local (softmax minus the target indicator, no one-hot, no
communication); it reuses the saved softmax buffer, so the graph can be run backward once.
Results equal `F.cross_entropy` with `weight`, `ignore_index`, `reduction` and `label_smoothing`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..errors import ShardingError
from ..runtime.collectives import raw_all_reduce
from ..runtime.groups import get_group
from ..runtime.placements import chunk_sizes, chunk_start

_OP = "vocab_parallel_cross_entropy"


def _flatten(logits, target):
    """(rows x local classes) logits and (rows,) target from (C,), (N, C) or (N, C, d1, ...)."""
    if logits.dim() == 1:
        return logits.unsqueeze(0), target.reshape(1)
    expected = (logits.size(0),) + tuple(logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ShardingError(f"{_OP}: target of shape {tuple(target.shape)} does not match logits "
                            f"{tuple(logits.shape)} (expected {expected})")
    return logits.movedim(1, -1).reshape(-1, logits.size(1)), target.reshape(-1)


def _unflatten(grad, shape):
    """Inverse of `_flatten` for a gradient of logits of `shape`."""
    if len(shape) == 1:
        return grad.reshape(shape)
    return grad.reshape((shape[0],) + tuple(shape[2:]) + (shape[1],)).movedim(-1, 1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, smoothing, pg, total):
        p, rank = dist.get_world_size(pg), dist.get_rank(pg)
        z, t = _flatten(logits, target)
        # half-precision logits are computed on in float32, without a float32 copy of them: the
        # max is exact in either, and `z - zmax` promotes to float32 as it subtracts
        dtype = torch.float32 if z.dtype in (torch.float16, torch.bfloat16) else z.dtype
        rows, n_classes = z.shape
        start = chunk_start(total, rank, p)
        valid = t != ignore_index
        if t.device.type == "cpu" and not torch.compiler.is_compiling() and bool((valid & ((t < 0) | (t >= total))).any()):
            raise ShardingError(f"{_OP}: target out of range [0, {total}) (ignore_index {ignore_index})")
        local_t = t - start
        hit = valid & (local_t >= 0) & (local_t < n_classes)
        local_t = local_t.masked_fill(~hit, 0)
        w_local = None if weight is None else weight[start:start + n_classes].to(dtype)

        zmax = z.max(dim=1).values.to(dtype)
        if p > 1:
            zmax = raw_all_reduce(zmax, pg, _OP, reduce_op="max")
        shifted = z - zmax.unsqueeze(1)
        stats = [shifted.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~hit, 0)]
        if smoothing > 0:
            stats.append((shifted * w_local).sum(1) if w_local is not None else shifted.sum(1))
        softmax = shifted.exp_()                                     # reuses the shifted buffer
        stats.insert(0, softmax.sum(1))
        stats = torch.stack(stats, 1)
        if p > 1:
            stats = raw_all_reduce(stats, pg, _OP)
        sum_exp, picked = stats[:, 0], stats[:, 1]
        lse = sum_exp.log()
        if weight is None:
            w_t = valid.to(dtype)
            w_total = float(total)
        else:
            w_t = weight.to(dtype)[t.masked_fill(~valid, 0)].masked_fill(~valid, 0)
            w_total = weight.to(dtype).sum()
        loss = (1 - smoothing) * w_t * (lse - picked)
        if smoothing > 0:
            loss = loss + (smoothing / total) * (lse * w_total - stats[:, 2]).masked_fill(~valid, 0)
        softmax.div_(sum_exp.unsqueeze(1))

        ctx.save_for_backward(softmax, local_t, hit, valid, w_t, w_local)
        ctx.info = (reduction, smoothing, total, w_total, w_t.sum() if reduction == "mean" else None)
        ctx.logits_meta = (tuple(logits.shape), logits.dtype)
        ctx.used = False
        if reduction == "none":
            out = loss.reshape(target.shape)
        elif reduction == "sum":
            out = loss.sum()
        elif reduction == "mean":
            out = loss.sum() / ctx.info[4]
        else:
            raise ShardingError(f"{_OP}: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
        return out.to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError(f"{_OP}: backward can run only once (it reuses its saved softmax); "
                               "do not retain_graph through it")
        ctx.used = True
        softmax, local_t, hit, valid, w_t, w_local = ctx.saved_tensors
        reduction, smoothing, total, w_total, denom = ctx.info
        g = grad_out.to(softmax.dtype).reshape(-1) if reduction == "none" else grad_out.to(softmax.dtype)
        if reduction == "mean":
            g = g / denom
        g = g * valid.to(softmax.dtype)                              # (rows,) or broadcast scalar
        g = g.expand_as(w_t)
        coef = (1 - smoothing) * w_t * g
        grad = softmax.mul_((coef + (smoothing * w_total / total) * g).unsqueeze(1))
        grad.scatter_add_(1, local_t.unsqueeze(1), (-coef).masked_fill(~hit, 0).unsqueeze(1))
        if smoothing > 0:
            per_class = w_local.unsqueeze(0) if w_local is not None else 1.0
            grad.sub_((smoothing / total) * g.unsqueeze(1) * per_class)
        shape, dtype = ctx.logits_meta
        grad = _unflatten(grad, shape).to(dtype)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard, target, weight=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, group=None, num_classes=None):
    """Cross entropy of logits whose class dim 1 is split over the group (rank r holds classes
    [r*C/p, (r+1)*C/p), or, with `num_classes=C` where p does not divide C, its classes at
    torch.chunk's boundaries); the full loss on every rank, equal to `F.cross_entropy` on the
    gathered logits.  `weight` is the full (C,) class-weight vector; `target` holds class indices."""
    pg = get_group(group)
    if target.is_floating_point():
        raise ShardingError(f"{_OP}: class-probability targets are not supported; pass class indices")
    p, rank = dist.get_world_size(pg), dist.get_rank(pg)
    local = logits_shard.size(1 if logits_shard.dim() > 1 else 0)
    total = local * p if num_classes is None else int(num_classes)
    if local != chunk_sizes(total, p)[rank]:
        raise ShardingError(f"{_OP}: rank {rank} holds {local} classes, but {total} classes on {p} ranks give it "
                            f"{chunk_sizes(total, p)[rank]}")
    if weight is not None and tuple(weight.shape) != (total,):
        raise ShardingError(f"{_OP}: weight of shape {tuple(weight.shape)} must hold all {total} classes")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ShardingError(f"{_OP}: label_smoothing must be in [0, 1], got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, weight, ignore_index, reduction,
                                            float(label_smoothing), pg, total)
