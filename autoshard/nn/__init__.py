"""TorchShard-compatible parallel layers (`torchshard.nn`), hand-written tensor parallelism.

Takes the tensor-parallel group of `autoshard.distributed`; hands on ParallelLinear,
ParallelEmbedding, ParallelCrossEntropyLoss, RegisterParallelDim and their functional twins, which
the rewritten graphs call too (`functional`, `dropout`, `norm`)."""
from . import functional, init
from .layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from .loss import ParallelCrossEntropyLoss

__all__ = ["ParallelLinear", "ParallelEmbedding", "ParallelCrossEntropyLoss", "RegisterParallelDim",
           "functional", "init"]
