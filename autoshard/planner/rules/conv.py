"""Convolutions (channel-parallel), and the spatial ops around them (pooling, padding).

A convolution is a linear map over channels applied at every position, so it splits like a
linear layer along its channel dim (1 for a batched (N, C, ...) input, 0 for an unbatched one):
- column: input Replicate, weight and bias split on the out-channel dim, output split on the
  channel dim (groups == 1);
- row: input split on the channel dim, weight split on its in-channel dim (dim 1), output
  Partial; with a bias the op reduces itself and adds the bias once (groups == 1);
- grouped (groups g > 1, g % p == 0): each rank holds g / p whole groups, so input, weight,
  bias and output are all split on channels and the local op runs with groups = g / p: no
  communication (depthwise convolutions).
No batch split: capture keeps batch dims dynamic, and the planner never splits those.
Pooling and padding act on the spatial dims only: a split channel or batch dim passes through.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ...capture.ops import CONV_OPS, conv_groups
from .linear import column_row
from .registry import PARTIAL, NodeInfo, Shard, register_rule

aten = torch.ops.aten

# op -> index of its `groups` argument; every op takes (input, weight, bias, ...) first
def channel_dim(info: NodeInfo, x, w) -> int:
    """1 for a batched input (N, C, *spatial), 0 for an unbatched one (C, *spatial)."""
    return len(info.shape(x)) - (len(info.shape(w)) - 2) - 1


def conv_flops(node) -> float:
    """Forward + backward flops: 3 x 2 * output elements * (in-channels per group x kernel)."""
    out, w = node.meta.get("val"), node.args[1].meta.get("val")
    return 6.0 * out.numel() * w[0].numel()


@register_rule(*CONV_OPS, family="conv")
def _conv(info):
    node = info.node
    if node.target is aten.convolution.default and (len(node.args) < 7 or node.args[6]):
        return []                                  # transposed: weight is (in, out / g, ...)
    x, w = node.args[0], node.args[1]
    b = info.arg(2, "bias")
    b = b if b in info.inputs else None
    if not (info.is_tensor(x) and info.is_tensor(w)):
        return []
    p, g = info.world_size, conv_groups(node)
    ch = channel_dim(info, x, w)
    if g == 1:
        return column_row(info, x, w, b, x_dim=ch, out_dim=ch, w_out_dim=0, w_in_dim=1)
    if g % p:
        return []
    m = {x: Shard(ch), w: Shard(0)}                # whole groups per rank (channels divide then too)
    if b is not None:
        m[b] = Shard(0)
    return [info.req(m, "grouped", Shard(ch), compute=1 / p, dim=-1)]


# spatial ops: op -> number of trailing spatial dims they act on
_POOLS = {}
for _n in (1, 2, 3):
    for _name in ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"):
        for _op in (getattr(F, f"{_name}{_n}d"), getattr(aten, f"{_name}{_n}d").default):
            _POOLS[_op] = _n
    for _cls in ("MaxPool", "AvgPool", "AdaptiveAvgPool", "AdaptiveMaxPool"):
        _POOLS[getattr(nn, f"{_cls}{_n}d")] = _n
_LINEAR_POOLS = {op for op, _ in _POOLS.items()
                 if "avg" in getattr(op, "__name__", str(op)).lower()}       # a sum of summands stays one


def _leading(info: NodeInfo, spatial: int, *, partial: bool):
    """Strategies of an op on the last `spatial` dims: a split leading dim passes through."""
    x = info.inputs[0]
    shape, out = info.shape(x), info.out_shape
    if shape is None or not isinstance(out, tuple) or len(out) != len(shape):
        return []
    found = [info.req({x: Shard(d)}, f"shard({d})", Shard(d))
             for d in range(len(shape) - spatial) if shape[d] > 1 and shape[d] == out[d]]
    if partial:
        found.append(info.req({x: PARTIAL}, "partial", PARTIAL))
    return found


@register_rule(*_POOLS)
def _pool(info):
    op = type(info.module) if info.module is not None else info.node.target
    if not info.is_tensor(info.node):              # return_indices=True: (values, indices)
        return []
    return _leading(info, _POOLS[op], partial=op in _LINEAR_POOLS)


@register_rule(F.pad, aten.pad.default, aten.constant_pad_nd.default)
def _pad(info):
    pad = info.arg(1, "pad")
    if not isinstance(pad, (tuple, list)) or len(pad) % 2:
        return []
    return _leading(info, len(pad) // 2, partial=False)
