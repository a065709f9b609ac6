"""TorchShard-compatible parallel layers (`torchshard.nn`): ParallelLinear, ParallelEmbedding,
ParallelCrossEntropyLoss, RegisterParallelDim, and their functional twins."""
from . import functional, init
from .layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from .loss import ParallelCrossEntropyLoss

__all__ = ["ParallelLinear", "ParallelEmbedding", "ParallelCrossEntropyLoss", "RegisterParallelDim",
           "functional", "init"]
