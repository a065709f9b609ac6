"""Functional twins of the parallel layers (TorchShard's `torchshard.nn.functional`).

They take this rank's shards of the weights (see `autoshard.nn` for layers that make them) and
the TorchShard `dim` convention: None = plain torch op, -1/1 = column (output features split),
0 = row (input features split).  `masked_embedding` and `vocab_parallel_cross_entropy` are the
pieces the graph rewriter emits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction

from ..errors import ShardingError
from ..runtime.collectives import copy_to, gather_from, reduce_from, scatter_to
from ..runtime.groups import get_group
from ..runtime.placements import chunk_sizes, chunk_start
from ..runtime.state_dict import get_parallel_dim, register_parallel_attribute
from .common import check_dim
from .cross_entropy import vocab_parallel_cross_entropy

__all__ = ["parallel_linear", "parallel_embedding", "parallel_cross_entropy", "masked_embedding",
           "vocab_parallel_cross_entropy", "bias_share", "regroup"]


def _is_column_sharded(x) -> bool:
    return get_parallel_dim(x) in (-1, 1)


def _row_input(input, weight, group):
    """This rank's block of the features of a row-parallel linear's input.

    As in TorchShard, an input labelled parallel_dim -1/1 is this rank's block already and one
    without is split.  TorchShard also labels a *gathered* (whole) tensor with its dim (-1), so a
    labelled input whose last dim is the full feature count is split as well: the size tells the
    two apart whenever the group has more than one rank."""
    p = torch.distributed.get_world_size(get_group(group))
    local, n = weight.size(1), input.size(-1)
    if _is_column_sharded(input) and n == local:
        return input
    if n == local * p:
        return scatter_to(input, -1, group=group)
    raise ShardingError(
        f"row-parallel linear: input of shape {tuple(input.shape)} (parallel_dim {get_parallel_dim(input)}) "
        f"has {n} features, but the weight shard {tuple(weight.shape)} expects {local} (this rank's block, "
        f"labelled parallel_dim -1) or {local * p} (the whole input, split here)")


def _column_input(input, weight, group):
    """The whole input of a column-parallel linear: used as is (TorchShard ignores its label), or
    all-gathered when it is labelled -1/1 and holds 1/p of the features (a column-parallel output)."""
    full, n = weight.size(1), input.size(-1)
    if _is_column_sharded(input) and n != full:
        p = torch.distributed.get_world_size(get_group(group))
        if n * p == full:
            return gather_from(input, -1, group=group)
    if n != full:
        raise ShardingError(
            f"column-parallel linear: input of shape {tuple(input.shape)} (parallel_dim "
            f"{get_parallel_dim(input)}) has {n} features, but the weight shard {tuple(weight.shape)} expects {full}")
    return input


def parallel_linear(input, weight, bias=None, dim=None, group=None):
    """`F.linear` with a column (-1/1: weight dim 0 and bias split) or row (0: weight dim 1) shard.

    Column: the input is whole (gathered first if it is a labelled -1 block), the output is
    this rank's block of the output features, labelled parallel_dim -1.  Row: the input is
    used as is if it is labelled -1 (a block), else split; the output is all-reduced, the
    (unsplit) bias added once, and it is labelled None."""
    dim = check_dim(dim, "parallel_linear")
    if weight.dim() != 2:
        raise ShardingError(f"parallel_linear: weight must be 2-D, got shape {tuple(weight.shape)}")
    if dim is None:
        return F.linear(input, weight, bias)
    if dim == 0:
        x = _row_input(input, weight, group)
        out = reduce_from(F.linear(x, weight), group=group, inplace=True)   # sums the fresh matmul output
        if bias is not None:
            out = out + bias
        register_parallel_attribute(out, None)
        return out
    out = F.linear(copy_to(_column_input(input, weight, group), group=group), weight, bias)
    register_parallel_attribute(out, -1)
    return out


class _BiasShare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, world_size):
        return bias / world_size

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def bias_share(bias, world_size: int):
    """This rank's share of a bias added to a row-parallel output left Partial: bias / p, so the
    ranks' summands add it once. Its gradient is the output gradient's sum, which every rank
    holds whole (the gradient of a sum is each summand's), so it is passed back as it is: the
    replicated bias gets its full gradient on every rank with no collective."""
    return _BiasShare.apply(bias, world_size)


def regroup(x, groups: int, chunks: int):
    """The last dim of `x`, `groups` consecutive groups of `chunks` equal blocks (CodeGen's fused
    q / v / k in 4 model-parallel groups), reordered block by block: block 0 of every group, then
    block 1 of every group, ... (q of every group, then v, then k: one block after another, as
    Phi-3's fused projection lays them out). A capture normal form (`normalize.regroup_blocks`);
    one FX node, so the planner sees the reorder as one op (`rules.shape`)."""
    if groups == 1:
        return x
    return x.unflatten(-1, (groups, chunks, -1)).transpose(-3, -2).flatten(-3)


torch.fx.wrap("regroup")


def _global_padding_idx(padding_idx, num_embeddings: int):
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ShardingError(f"padding_idx {padding_idx} is out of range for {num_embeddings} embeddings")
    return padding_idx % num_embeddings


def masked_embedding(input, weight, padding_idx=None, group=None, *, max_norm=None, norm_type=2.0,
                     scale_grad_by_freq=False, sparse=False, num_embeddings=None):
    """This rank's partial sum of a vocabulary-split lookup: rows outside the shard give zeros.

    `weight` is this rank's rows [rank*V/p, (rank+1)*V/p) of the full table, or, with
    `num_embeddings=V` where p does not divide V, its rows at torch.chunk's boundaries;
    `padding_idx` is in full-vocabulary numbering and only the rank holding that row treats it
    as padding."""
    pg = get_group(group)
    p, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    rows = weight.size(0)
    total = rows * p if num_embeddings is None else int(num_embeddings)
    start = chunk_start(total, rank, p)
    if rows != chunk_sizes(total, p)[rank]:
        raise ShardingError(f"masked_embedding: rank {rank} holds {rows} rows, but {total} embeddings on {p} ranks "
                            f"give it {chunk_sizes(total, p)[rank]}")
    padding_idx = _global_padding_idx(padding_idx, total)
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else None
    outside = (input < start) | (input >= start + rows)
    if max_norm is not None:
        with torch.no_grad():
            torch.embedding_renorm_(weight, (input[~outside] - start).contiguous(), max_norm, norm_type)
    table, fill = weight, 0
    if scale_grad_by_freq:                       # masked tokens must not count towards row 0
        if sparse:
            raise ShardingError("vocabulary-split embedding: scale_grad_by_freq with sparse=True is not supported")
        table, fill = torch.cat([weight, weight.new_zeros(1, weight.size(1))]), rows
    idx = (input - start).masked_fill(outside, fill)
    out = F.embedding(idx, table, local_pad, None, norm_type, scale_grad_by_freq, sparse)
    return out.masked_fill(outside.unsqueeze(-1), 0)


def parallel_embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                       scale_grad_by_freq=False, sparse=False, num_embeddings=None, dim=None, group=None):
    """`F.embedding` over a vocabulary (dim 0: masked lookup + all-reduce) or hidden (dim 1/-1:
    lookup + all-gather) shard of the table; the output is the full, replicated embedding."""
    dim = check_dim(dim, "parallel_embedding")
    if dim is None:
        return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if dim == 0:
        p = torch.distributed.get_world_size(get_group(group))
        if num_embeddings is not None and num_embeddings != weight.size(0) * p:
            raise ShardingError(
                f"parallel_embedding: num_embeddings {num_embeddings} != weight shard rows "
                f"{weight.size(0)} x {p} ranks")
        partial = masked_embedding(input, weight, padding_idx, group, max_norm=max_norm, norm_type=norm_type,
                                   scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        return reduce_from(partial, group=group, inplace=True)
    if max_norm is not None:
        raise ShardingError("parallel_embedding: max_norm needs whole rows; it is not supported with a "
                            "hidden-split (dim=1/-1) embedding")
    out = F.embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)
    return gather_from(out, -1, group=group)


def parallel_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                           reduction="mean", label_smoothing=0.0, group=None):
    """`F.cross_entropy`, switching to the vocabulary-parallel loss when `input` carries
    parallel_dim -1/1 (the output of a column-parallel linear), as TorchShard does."""
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if _is_column_sharded(input):
        return vocab_parallel_cross_entropy(input, target, weight, ignore_index, reduction,
                                            label_smoothing, group)
    return F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
