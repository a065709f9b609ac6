"""TorchShard-compatible parallel layers: ParallelLinear, ParallelEmbedding, RegisterParallelDim.

Each layer initialises the full weight exactly as its torch.nn twin would (same RNG use), then
keeps this rank's shard: with the same seed, a rank's parameters are slices of the twin's.
Parameters carry TorchShard's `parallel_dim` / `order_type`; the layer also keeps its layout
table (`_autoshard_layouts`) and group key (`_autoshard_group`), which survive deep copies.
"""
from __future__ import annotations

import torch
from torch import nn

from ..runtime.state_dict import register_parallel_dim
from . import functional as PF
from .common import check_dim, convert_modules, group_info, install_shards


class _ParallelLayer(nn.Module):
    """Shared set-up: dim check, group lookup (only when sharded), shard installation."""

    order_type = 0

    def _setup(self, dim, group) -> None:
        self.dim = dim
        check_dim(dim, self._describe())
        self._size, self._rank, self._autoshard_group = 1, 0, None
        if dim is not None:
            self._autoshard_group, self._size, self._rank = group_info(group, self._describe())

    def _install(self, fulls: dict, requires_grad: bool = True) -> None:
        install_shards(self, fulls, self.order_type, self._size, self._rank, requires_grad)

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


class ParallelLinear(_ParallelLayer):
    """`torch.nn.Linear` split by column (dim -1/1: output features) or row (dim 0: input features).

    Column: weight [out/p, in], bias [out/p], output carries parallel_dim -1.  Row: weight
    [out, in/p], bias [out] not split and added once after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dim=None, group=None,
                 device=None, dtype=None, *, _weight=None, _bias=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._setup(dim, group)
        if _weight is None:
            self._install(self._full_init(bias, device, dtype))
        else:
            self._install({"weight": _weight, "bias": _bias})

    def _full_init(self, bias, device, dtype) -> dict:
        full = nn.Linear(self.in_features, self.out_features, bias, device=device, dtype=dtype)
        return {"weight": full.weight, "bias": full.bias}

    def reset_parameters(self) -> None:
        """Re-initialise like `torch.nn.Linear.reset_parameters` on the full weight, keep the shard."""
        self._install(self._full_init(self.bias is not None, self.weight.device, self.weight.dtype))

    def forward(self, input):
        return PF.parallel_linear(input, self.weight, self.bias, self.dim, group=self._autoshard_group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={getattr(self, 'bias', None) is not None}, dim={self.dim}")

    @classmethod
    def convert_parallel_linear(cls, module, dim=None, group=None):
        """Replace every `torch.nn.Linear` in `module` by a ParallelLinear holding this rank's shard
        of its current weights (returns a new layer when `module` itself is a Linear).  Weights tied
        between converted layers become separate Parameters."""
        return convert_modules(module, nn.Linear, lambda m: cls(
            m.in_features, m.out_features, m.bias is not None, dim, group,
            device=m.weight.device, dtype=m.weight.dtype, _weight=m.weight, _bias=m.bias))


class ParallelEmbedding(_ParallelLayer):
    """`torch.nn.Embedding` split by vocabulary (dim 0: masked lookup + all-reduce; `padding_idx`
    only on the rank holding that row) or hidden size (dim 1/-1: lookup + all-gather)."""

    order_type = 1

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, max_norm=None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight=None, _freeze: bool = False, device=None, dtype=None, dim=None, group=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings {num_embeddings}")
            padding_idx %= num_embeddings
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self._setup(dim, group)
        full = self._full_init(device, dtype) if _weight is None else _weight
        if tuple(full.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"{self._describe()}: _weight of shape {tuple(full.shape)} does not match "
                             f"({num_embeddings}, {embedding_dim})")
        self._install({"weight": full}, requires_grad=not _freeze)

    def _full_init(self, device, dtype):
        return nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                            device=device, dtype=dtype).weight

    def reset_parameters(self) -> None:
        """Re-initialise like `torch.nn.Embedding.reset_parameters` on the full table, keep the shard."""
        self._install({"weight": self._full_init(self.weight.device, self.weight.dtype)},
                      self.weight.requires_grad)

    def forward(self, input):
        return PF.parallel_embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                                     self.scale_grad_by_freq, self.sparse, self.num_embeddings, self.dim,
                                     group=self._autoshard_group)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + f", dim={self.dim}"

    @classmethod
    def convert_parallel_embedding(cls, module, dim=None, group=None):
        """Replace every `torch.nn.Embedding` in `module` by a ParallelEmbedding split on `dim`
        holding this rank's shard of its current table."""
        return convert_modules(module, nn.Embedding, lambda m: cls(
            m.num_embeddings, m.embedding_dim, m.padding_idx, m.max_norm, m.norm_type,
            m.scale_grad_by_freq, m.sparse, _weight=m.weight, _freeze=not m.weight.requires_grad,
            dim=dim, group=group))


class RegisterParallelDim(nn.Module):
    """Set TorchShard's `parallel_dim` on a tensor (or each tensor of a list/tuple) and return it."""

    def __init__(self, dim=None):
        super().__init__()
        self.dim = check_dim(dim, "RegisterParallelDim")

    def forward(self, x):
        for t in (x if isinstance(x, (list, tuple)) else [x]):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"RegisterParallelDim expects tensors, got {type(t).__name__}")
            register_parallel_dim(t, self.dim)
        return x

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
