"""Mode-following ops of a rewritten module: dropout on autoshard's streams, batch norm.

A captured graph bakes the mode of capture time into its ops (`aten.dropout(x, p, train=True)`,
`aten.batch_norm(..., training=True, ...)` under torch.export; `F.dropout(x, p, False)` under
symbolic_trace of a model in eval mode). The rewriter replaces each such op by a call of one
of these small modules, so `gm.train()` / `gm.eval()` switch them exactly as they switch the
original model's `nn.Dropout` and `nn.BatchNorm`, whichever mode the model was captured in.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime import rng
from ..runtime.pieces import split_along
from ..runtime.placements import Shard, global_shape, groups_of, held_by_groups, held_by_readers

MASKS = ("independent", "single_process")


class ParallelDropout(nn.Module):
    """Dropout of one activation of a tensor-parallel module.

    Follows `self.training`. A replicated activation draws its mask from the replicated stream
    (identical on every rank); a sharded one (`shard` = its Shard placement) from the sharded
    stream (independent per rank), or, with `masks="single_process"`, takes its slice of the
    full mask drawn from the replicated stream: the mask a single process would draw (torch's
    dropout is `bernoulli_(1 - p)` of the input's shape, then scaled by 1 / (1 - p)). A piece
    several ranks hold (K/V heads held by groups of ranks or by the ranks that read them) always
    takes its slice of the full mask, so that they hold the same values."""

    def __init__(self, p: float, shard: Shard | None = None, world_size: int = 1, rank: int = 0,
                 masks: str = "independent"):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if masks not in MASKS:
            raise ValueError(f"masks must be one of {MASKS}, got {masks!r}")
        self.p, self.shard, self.world_size, self.rank, self.masks = float(p), shard, world_size, rank, masks

    def extra_repr(self) -> str:
        where = f"sharded {self.shard}" if self.shard is not None else "replicated"
        return f"p={self.p}, {where}, masks={self.masks}"

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        sharded = self.shard is not None and self.world_size > 1
        if sharded and (self.masks == "single_process" or held_by_groups(self.shard) or held_by_readers(self.shard)):
            full = list(global_shape(x.shape, self.shard, self.world_size))
            noise = x.new_empty(full).bernoulli_(1.0 - self.p, generator=rng.generator("replicated", x.device))
            groups, m = groups_of(self.shard, self.world_size)        # (the ranks of a group: one piece)
            # a copy of this rank's piece: a view would keep the whole mask alive until backward
            noise = split_along(noise, self.shard.dim, groups, uneven=True, **self.shard.blocking)[self.rank // m].clone()
        else:
            g = rng.generator("sharded" if sharded else "replicated", x.device)
            noise = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=g)
        return x * noise.div_(1.0 - self.p)


class ParallelAttention(nn.Module):
    """scaled_dot_product_attention whose dropout follows `self.training` (dropout_p then, 0 in
    eval) and runs on autoshard's streams: the sharded stream when the attention probabilities
    are split (`shard` splits a batch or head dim of the output), else the replicated one
    (attention draws its mask from the default generator, which `rng.fork` swaps). With
    `masks="single_process"` and split probabilities, the attention runs as torch's math kernel
    does, with this rank's slice of the full mask drawn from the replicated stream."""

    def __init__(self, dropout_p: float, shard: Shard | None, aten_op: bool, world_size: int = 1, rank: int = 0,
                 masks: str = "independent"):
        super().__init__()
        if masks not in MASKS:
            raise ValueError(f"masks must be one of {MASKS}, got {masks!r}")
        self.dropout_p, self.shard, self.aten_op = float(dropout_p), shard, aten_op
        self.world_size, self.rank, self.masks = world_size, rank, masks

    def extra_repr(self) -> str:
        where = f"sharded {self.shard}" if self.shard is not None else "replicated"
        return f"dropout_p={self.dropout_p}, {where}, masks={self.masks}"

    def _split_dim(self, query) -> int | None:
        """The dim of the probabilities (batch..., heads, L, S) that is split, if any: the output's
        split dim when it is a batch or head dim (a split feature dim leaves them whole)."""
        if self.shard is None or self.world_size == 1:
            return None
        d = self.shard.dim % query.dim()
        return d if d < query.dim() - 2 else None

    def forward(self, query, key, value, *args, **kwargs):
        fn = torch.ops.aten.scaled_dot_product_attention.default if self.aten_op else F.scaled_dot_product_attention
        p = self.dropout_p if self.training else 0.0
        args = list(args)
        if len(args) > 1:
            args[1] = p
        else:
            kwargs["dropout_p"] = p
        if p == 0.0:
            return fn(query, key, value, *args, **kwargs)
        split = self._split_dim(query)
        if split is not None and self.masks == "single_process":
            return self._math(query, key, value, p, split, *args, **kwargs)
        with rng.fork("replicated" if split is None else "sharded", query.device):
            return fn(query, key, value, *args, **kwargs)

    def _math(self, q, k, v, p, split, attn_mask=None, dropout_p=None, is_causal=False, *, scale=None,
              enable_gqa=False):
        """Attention as torch's math kernel computes it (scores, mask, softmax, dropout as
        `bernoulli_(1 - p) / (1 - p)` over the probabilities' shape), with the full mask drawn on
        the replicated stream and sliced along `split`: the single-process model's mask."""
        if enable_gqa and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
        scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
        if is_causal:
            keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        probs = scores.softmax(-1)
        probs = torch.where(scores.isneginf().all(-1, keepdim=True), 0.0, probs)   # fully masked rows: 0
        full = list(probs.shape)
        full[split] = self.shard.size if self.shard.size is not None else full[split] * self.world_size
        noise = probs.new_empty(full).bernoulli_(1.0 - p, generator=rng.generator("replicated", q.device))
        noise = split_along(noise, split, self.world_size, uneven=True, **self.shard.blocking)[self.rank]
        return (probs * noise.div_(1.0 - p)) @ v


class ModeBatchNorm(nn.Module):
    """`F.batch_norm` with training = this module's mode (batch statistics and running-stat
    updates in train mode, running statistics in eval mode), for a captured batch-norm op."""

    def __init__(self, momentum, eps: float):
        super().__init__()
        self.momentum, self.eps = momentum, eps

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}, eps={self.eps}"

    def forward(self, x, weight=None, bias=None, running_mean=None, running_var=None):
        training = self.training or running_mean is None
        return F.batch_norm(x, running_mean, running_var, weight, bias, training,
                            0.0 if self.momentum is None else self.momentum, self.eps)


class TrainOnly(nn.Module):
    """An in-place update that runs in train mode only (a batch norm's num_batches_tracked += 1)."""

    def forward(self, buffer, value):
        return buffer.add_(value) if self.training else buffer
