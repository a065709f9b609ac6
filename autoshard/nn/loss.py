"""ParallelCrossEntropyLoss: TorchShard's loss, with the vocabulary-parallel path done exactly."""
from __future__ import annotations

from torch import nn
from torch.nn import _reduction

from ..runtime.groups import register_group
from . import functional as PF


class ParallelCrossEntropyLoss(nn.Module):
    """`torch.nn.CrossEntropyLoss` that uses the vocabulary-parallel cross entropy when its input
    carries parallel_dim -1/1 (a column-parallel linear's output) and `F.cross_entropy` otherwise.

    `weight` is the full (C,) class-weight vector on every rank; `group` is kept as its registry
    key, so the module deep-copies and pickles."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, group=None):
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = _reduction.legacy_get_string(size_average, reduce)
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.group = group if group is None or isinstance(group, str) else register_group(group)

    def forward(self, input, target):
        return PF.parallel_cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                                         reduction=self.reduction, label_smoothing=self.label_smoothing,
                                         group=self.group)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}")
