"""Dim reversal: `aten.numpy_T` (`tensor.T`), which torch.export emits for `x @ self.weight.T`
(Falcon's FalconLinear) and which is no transpose/permute node. A shard of input dim d becomes
a shard of output dim ndim-1-d, so a weight used through `.T` shards like any other."""
from __future__ import annotations

import torch

from .registry import register_rule
from .shape import mapped

aten = torch.ops.aten


@register_rule(aten.numpy_T.default)
def _numpy_t(info):
    src = info.inputs[0]
    nd = len(info.shape(src))
    return mapped(info, src, {d: (nd - 1 - d, True) for d in range(nd)})
