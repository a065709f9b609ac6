"""Megatron's overlap of a column-parallel layer's backward: the input gradient's all-reduce runs
while the weight gradients are computed.

`copy_to(x)` read by linear layers (q, k and v; gate and up; one fc) is, unfused, an identity
whose backward all-reduces the summed input gradient only after every consumer's backward has
run, weight gradients included: nothing is left to compute while the all-reduce runs.
`column_linears(x, group, w1, b1, w2, b2, ...)` is that copy and those layers as one autograd
function (`autoshard.rewrite.overlap` fuses them with parallelize(..., overlap=True)): its
backward sums the input gradient, launches its all-reduce (a functional collective, waited
for later), computes the weight and bias gradients, then waits. Values equal the unfused graph's
(fp32: the input gradient summed in another order); eager and torch.compile alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F

from .collectives import count_eager, functional, resolve

__all__ = ["column_linears"]


class _ColumnLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.biased = group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        """In each gradient's dtype (an autocast forward's: its weights and input cast to it, as
        autograd differentiates the casts), each result cast back to its tensor's dtype."""
        x, *weights = ctx.saved_tensors
        gx = sum((g @ w.to(g.dtype)).to(x.dtype) for g, w in zip(grads, weights))    # each cast first, as unfused
        pending = functional.all_reduce(gx.contiguous(), "sum", ctx.group.group_name)
        flat_x = x.reshape(-1, x.size(-1))
        out = [None, None]
        for g, w, biased in zip(grads, weights, ctx.biased):
            flat = g.reshape(-1, g.size(-1))
            out.append((flat.t() @ flat_x.to(flat.dtype)).to(w.dtype))
            out.append(flat.sum(0).to(w.dtype) if biased else None)
        gx = functional.wait_tensor(pending)
        count_eager("copy_to", "all_reduce", "backward", gx, dist.get_world_size(ctx.group), ctx.group)
        return (gx, None, *out[2:])


def column_linears(x, *params, group=None):
    """The outputs of F.linear(copy_to(x), w_i, b_i) for `params` = (w1, b1, w2, b2, ...) (a bias
    may be None): forward no communication, backward one all-reduce of the input gradient,
    overlapped with the weight gradients. An FX leaf, as the collectives are."""
    for a in (x, *params):
        if isinstance(a, torch.fx.Proxy):
            return a.tracer.create_proxy("call_function", column_linears, (x, *params), {"group": group})
    pg, p = resolve(group)
    if p == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(params[0::2], params[1::2]))
    return _ColumnLinears.apply(x, pg, *params)


torch.fx.wrap("column_linears")
