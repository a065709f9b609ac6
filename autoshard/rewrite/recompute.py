"""Activation checkpointing of the blocks a plan recomputes (`Plan.checkpointed`, chosen under a
memory budget): each block's forward runs under `torch.utils.checkpoint` (non-reentrant), which
keeps only its inputs and runs it again in backward. torch's checkpoint replays torch's default
generators; autoshard's dropout draws from its own streams (`runtime.rng`), so the recomputation
sets those to the states the forward started from (`rng.replaying`) and the masks are the same."""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from ..errors import ShardingError
from ..runtime import rng


def _recomputed(forward, device):
    def context_fn():
        states = rng.stream_states(device)
        return contextlib.nullcontext(), rng.replaying(states, device)

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    run.recomputes = forward
    return run


def recompute_blocks(gm: fx.GraphModule, names) -> None:
    """Make each block of `names` (a submodule of `gm` kept as a module of its own) recompute its
    activations in backward."""
    for name in names:
        try:
            block = gm.get_submodule(name)
        except AttributeError:
            block = None
        if not isinstance(block, fx.GraphModule) or block is gm:
            raise ShardingError(f"the plan recomputes {name!r} in backward, but the parallel module does not keep "
                                f"it as a module of its own (blocks=...: keep it, or plan without memory_budget)")
        if getattr(block.forward, "recomputes", None) is not None:
            continue
        device = next((t.device for t in block.parameters()), torch.device("cpu"))
        block.forward = _recomputed(block.forward, device)
