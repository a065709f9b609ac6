"""What a parallel module does for the training loops that drive it: its gradients averaged over
data-parallel replicas, their norm over every shard, and a DDP wrap across its shards refused.

`Replicas(module, dp)`: at the end of each backward that reaches the module's parameters, their
gradients are averaged over the data-parallel group `dp` (one flat all-reduce per dtype), as
transformers' tensor-parallel models reduce theirs (FSDP2 over `dp_shard`) when the Trainer or
accelerate runs them without a DDP wrap. `no_sync()` / `set_requires_gradient_sync(False)` defer
it to the next backward outside them (gradient accumulation: the accumulated sum is averaged
once). Nothing is done for gradients that are DTensors (fully_shard reduces those), nor while a
DDP wrap reduces them (the module registered for DDP with `register_ddp_parameters_to_ignore`,
or run inside a DDP over its data-parallel ranks).

`grad_norm(module, norm_type)`: the norm of all the module's gradients as one process would
compute it over the full model: each sharded gradient's part summed over the tensor-parallel
group, each replicated one counted once (a local norm, as `clip_grad_norm_` computes over a
rank's tensors, misses the other ranks' shards and differs between ranks, so the replicated
weights would be clipped differently and drift apart).

`refuse_ddp(module, ddp, pg)`: a DistributedDataParallel over ranks of the module's
tensor-parallel group averages different shards (and broadcast rank 0's shards at its
construction): a ProcessGroupError naming it, unless the sharded tensors are ignored by DDP.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..errors import ProcessGroupError
from .state_dict import layouts

__all__ = ["Replicas", "grad_norm", "clip_grad_norm_", "refuse_ddp"]


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


class Replicas:
    """The data-parallel gradient average of one parallel module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, dp):
        self.dp, self.size = dp, dist.get_world_size(dp)
        self.module = weakref.ref(module)
        self.sync, self.pending, self.under_ddp = True, False, False
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, _param) -> None:
        if self.pending or not self.sync or self.under_ddp:
            return
        module = self.module()
        if module is None or "_ddp_params_and_buffers_to_ignore" in module.__dict__:
            return
        self.pending = True
        torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """Average every (non-DTensor) gradient of the module over the data-parallel group."""
        self.pending = False
        module = self.module()
        if module is None:
            return
        buckets: dict = {}
        for p in module.parameters():
            if p.grad is not None and not _is_dtensor(p.grad):
                buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in buckets.values():
            flat = _flatten_dense_tensors(grads)
            flat.div_(self.size)
            dist.all_reduce(flat, group=self.dp)
            for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(f)

    @contextlib.contextmanager
    def no_sync(self):
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


def _parts(module):
    """(sharded grads, replicated grads) of `module`'s parameters (tied ones once)."""
    table = layouts(module)
    sharded, replicated = [], []
    for name, p in module.named_parameters():
        if p.grad is not None:
            (sharded if name in table else replicated).append(p.grad.detach())
    return sharded, replicated


def _power_sum(grads, norm_type: float, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads])
    return norms.max() if norm_type == float("inf") else (norms ** norm_type).sum()


def grad_norm(module, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """The total `norm_type` norm of `module`'s gradients over every shard (see the docstring)."""
    from .groups import device_of, get_group
    pg = get_group(group if group is not None else module.__dict__.get("_autoshard_group"))
    norm_type = float(norm_type)
    sharded, replicated = _parts(module)
    device = (sharded or replicated or [torch.zeros(())])[0].device
    mine = _power_sum(sharded, norm_type, device)
    comm = mine.to(device_of(pg))
    dist.all_reduce(comm, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM, group=pg)
    rest = _power_sum(replicated, norm_type, device)
    if norm_type == float("inf"):
        return torch.maximum(comm.to(device), rest)
    return (comm.to(device) + rest) ** (1.0 / norm_type)


def clip_grad_norm_(module, max_norm: float, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """Scale `module`'s gradients so that their total norm over every shard is at most
    `max_norm` (torch.nn.utils.clip_grad_norm_ over the full model); returns that norm."""
    total = grad_norm(module, norm_type, group)
    params = [p for p in module.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def refuse_ddp(module, ddp, pg) -> None:
    """Raise where DistributedDataParallel `ddp` spans two or more ranks of `pg` and averages the
    module's sharded tensors (they are not in its ignore list)."""
    ranks = dist.get_process_group_ranks(ddp.process_group)
    tp = dist.get_process_group_ranks(pg)
    shared = sorted(set(ranks) & set(tp))
    if len(shared) < 2:
        return
    sharded = set(layouts(module))
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ()) | \
        set(module.__dict__.get("_ddp_params_and_buffers_to_ignore", ()))
    if not sharded or sharded <= ignored:
        return
    raise ProcessGroupError(
        f"this module runs inside a DistributedDataParallel over ranks {ranks}, which include ranks {shared} of "
        f"its tensor-parallel group {tp}: DDP would average different shards ({len(sharded - ignored)} sharded "
        f"tensors, e.g. {sorted(sharded - ignored)[:2]}) and its construction broadcast rank {ranks[0]}'s shards. "
        "Do not wrap it in DDP: it averages its gradients over its data-parallel replicas itself "
        "(autoshard.distributed.init_process_group(tensor_parallel_size) forms them), or wrap it in DDP over "
        "the data-parallel group only (process_group=autoshard.distributed.get_data_parallel_group()), or call "
        "autoshard.register_ddp_parameters_to_ignore(module) before wrapping it over the world")
