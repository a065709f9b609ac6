"""Element-wise ops: unary, binary with broadcasting, activations, dropout.

A sharded output dim needs every input that has that dim (not broadcast) sharded the same way;
broadcast inputs stay Replicate. Linear ops also carry Partial (sum of summands).
"""
import math
import operator
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import PARTIAL, REPLICATE, NodeInfo, may_differ, register_rule

aten = torch.ops.aten


def elementwise(info: NodeInfo, partial_inputs=None):
    """Strategies of an element-wise op; `partial_inputs` lists inputs that may be Partial
    (all of them at once for a sum-like op, one of them for a product-like op)."""
    out = info.out_shape
    if out is None:
        return []
    tensors = [n for n in info.inputs if info.is_tensor(n)]
    found = []
    for d, size in enumerate(out):
        if size == 1:
            continue
        for pl in info.shards(d, size):
            mapping = {}
            for n in tensors:
                s = info.shape(n)
                a = d - (len(out) - len(s))
                if a >= 0 and s[a] == size:
                    mapping[n] = replace(pl, dim=a)
            if mapping:
                found.append(info.req(mapping, f"shard({d})", pl, uneven=may_differ(pl)))
    for group in partial_inputs or ():
        if group and all(n in tensors for n in group):
            found.append(info.req({n: PARTIAL for n in group}, "partial", PARTIAL))
    return found


UNARY_LINEAR = [
    operator.neg, torch.neg, torch.Tensor.neg, aten.neg.default, torch.Tensor.contiguous, torch.Tensor.clone,
    torch.clone, aten.clone.default, aten.alias.default, torch.Tensor.float, torch.Tensor.to, torch.Tensor.type,
    torch.Tensor.half, torch.Tensor.bfloat16, aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout,
    torch.Tensor.detach, aten.detach.default, aten.contiguous.default,
]
UNARY = [
    F.gelu, F.relu, F.silu, torch.tanh, torch.sigmoid, torch.exp, torch.rsqrt, torch.sqrt, torch.abs,
    torch.relu, F.tanh, F.sigmoid, torch.Tensor.relu, torch.Tensor.tanh, torch.Tensor.sigmoid, torch.Tensor.exp,
    torch.Tensor.rsqrt, torch.Tensor.sqrt, torch.Tensor.pow, torch.pow, torch.Tensor.abs, torch.cos, torch.sin,
    torch.Tensor.cos, torch.Tensor.sin, torch.Tensor.masked_fill, torch.masked_fill,
    torch.Tensor.triu, torch.Tensor.tril, F.softplus, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid,
    nn.Identity, aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.rsqrt.default, aten.sqrt.default,
    aten.exp.default, aten.cos.default, aten.sin.default, aten.abs.default, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.where.self, torch.where, aten.native_dropout.default,
    aten.erf.default, torch.erf, torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clamp_, torch.Tensor.clip,
    torch.Tensor.clip_, aten.clamp.default, aten.clamp_.default, aten.clip.default, aten.clip_.default,
]
SUMS = [operator.add, operator.sub, operator.iadd, operator.isub, torch.add, torch.sub, torch.Tensor.add,
        torch.Tensor.sub, torch.Tensor.add_, torch.Tensor.sub_, aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor,
        aten.sub_.Tensor]
PRODUCTS = [operator.mul, operator.imul, torch.mul, torch.Tensor.mul, torch.Tensor.mul_, aten.mul.Tensor,
            aten.mul_.Tensor, aten.mul.Scalar, aten.mul_.Scalar]
QUOTIENTS = [operator.truediv, torch.div, torch.Tensor.div, torch.Tensor.div_, aten.div.Tensor,
             aten.div.Scalar, aten.div.Tensor_mode, aten.div_.Tensor, aten.div_.Scalar]   # (in place: Falcon's scores /= ...)


# dropout multiplies by a mask: on a Partial tensor it is linear when every rank draws the same
# mask, which the rewrite's ParallelDropout does for every tensor that is not split (it draws from
# the replicated stream), so summands stay summands (two row-parallel outputs, each dropped out,
# summed before one all-reduce)
DROPOUTS = [F.dropout, torch.dropout, nn.Dropout, aten.dropout.default]


@register_rule(*DROPOUTS)
def _dropout(info):
    x = info.node.args[0] if info.node.args else info.inputs[0]
    return elementwise(info, [[x]] if x in info.inputs else [])


@register_rule(*UNARY_LINEAR)
def _unary_linear(info):
    return elementwise(info, [[n for n in info.inputs if info.is_tensor(n)]])


@register_rule(*UNARY)
def _unary(info):
    return elementwise(info)


@register_rule(torch.Tensor.type_as, aten.type_as.default)
def _type_as(info):
    """`x.type_as(other)` reads only `other`'s dtype: no placement is asked of it (Gemma's norm
    ends with `.type_as(x)` of its own, possibly still Partial, input)."""
    x = info.node.args[0]
    out = [info.req({x: REPLICATE}, "replicate", REPLICATE)] + elementwise(info, [[x]])
    return [replace(s, inputs=tuple(None if n is not x else r for n, r in zip(info.inputs, s.inputs)),
                    grads=tuple(None if n is not x else g for n, g in zip(info.inputs, s.grads)))
            for s in out if s.inputs[info.inputs.index(x)] is not None]


IN_PLACE_SUMS = {operator.iadd, operator.isub, torch.Tensor.add_, torch.Tensor.sub_, aten.add_.Tensor, aten.sub_.Tensor}


@register_rule(*SUMS)
def _sum_like(info):
    # summands plus a number would add it once per rank: only tensors, all Partial, stay Partial
    numbers = any(isinstance(a, (int, float)) and not isinstance(a, bool) and a != 0 for a in info.node.args)
    tensors = [n for n in info.inputs if info.is_tensor(n)]
    found = elementwise(info, [] if numbers else [tensors])
    if not numbers and len(tensors) == 2 and len(set(tensors)) == 2:
        found += _partial_plus_whole(info, tensors)
    return found


def _partial_plus_whole(info, tensors):
    """A Partial summand plus a whole tensor stays Partial: each rank adds its share (1/p) of the
    whole one (`nn.functional.bias_share`, whose gradient is the output's, whole on every rank).
    A word embedding split by vocabulary (Partial) plus replicated token-type embeddings plus a
    position embedding split by rows (Partial) then needs one all-reduce, as Megatron's, instead
    of one for the words and a gather for the positions. Not for the in-place op's own input
    (its storage would hold the share), nor for integer tensors. The division is priced as one
    more element-wise op over the whole operand (so a tie keeps the all-reduce before the sum)."""
    out = info.out_shape
    if out is None:
        return []
    node = info.node
    op = getattr(torch.Tensor, node.target, None) if node.op == "call_method" else node.target
    found = []
    for part, whole in (tensors, tensors[::-1]):
        v = info.val(whole)
        if not v.is_floating_point() or (op in IN_PLACE_SUMS and node.args[0] is whole):
            continue
        share = 1.0 + v.numel() / max(1, math.prod(out))
        found.append(info.req({part: PARTIAL, whole: REPLICATE}, "partial_plus", PARTIAL,
                              grads={whole: REPLICATE}, compute=share))
    return found


@register_rule(*PRODUCTS)
def _product(info):
    tensors = [n for n in info.inputs if info.is_tensor(n)]
    return elementwise(info, [[n] for n in tensors])


@register_rule(*QUOTIENTS)
def _quotient(info):
    first = info.arg(0, "input")
    return elementwise(info, [[first]] if first in info.inputs else [])
