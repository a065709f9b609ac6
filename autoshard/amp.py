"""Mixed precision across the group: a GradScaler whose overflow check every rank agrees on.

With tensor parallelism each rank unscales only its own shards' gradients, so an inf in one
rank's shard is seen by that rank alone: a per-process `torch.amp.GradScaler` would skip the step
there and take it elsewhere, and the replicated parameters (norms, biases) would diverge.
`GradScaler` sums the found-inf flag over the process group (by default every rank: the
tensor-parallel group and its data-parallel replicas) before `step` and `update`, so every rank
skips, and backs off its scale, together. It is PyTorch's `ShardedGradScaler` (FSDP's) with the
whole world as its group and the device taken from the machine.

    scaler = autoshard.amp.GradScaler()
    with torch.autocast("cuda", torch.float16):
        loss = gm(**batch).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)          # skipped on every rank when any rank's gradients overflowed
    scaler.update()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["GradScaler"]


class GradScaler(ShardedGradScaler):
    """`torch.amp.GradScaler` whose found-inf is summed over `process_group` (None: every rank)."""

    def __init__(self, device: str | None = None, *, process_group=None, **kwargs):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, process_group=process_group if process_group is not None else dist.group.WORLD,
                         **kwargs)
