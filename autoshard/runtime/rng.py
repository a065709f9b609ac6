"""The random streams of a parallel module's dropout, owned by autoshard (Megatron's two streams).

Replicated regions (an activation every rank of the tensor-parallel group holds whole) draw from
a generator seeded `seed` on every rank of the group, so their masks, and so the replicated
parameters they train, stay identical on every rank whatever the user does with torch's global
generators. Sharded regions (attention probabilities split by heads, an MLP hidden split by
columns) draw from a generator seeded `seed + 2718 + tensor-parallel rank`, so the shards of one
activation get independent masks, as Megatron's `model_parallel_cuda_manual_seed` arranges.

`parallelize` synchronises the seed over the group (rank 0's `torch.initial_seed()` unless
`manual_seed` set one, which must then agree on every rank); `manual_seed(seed)` restarts both
streams. One pair of streams per process and device: a process serves one tensor-parallel group.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..errors import ProcessGroupError
from .groups import device_of, get_rank, is_initialized

SHARDED_OFFSET = 2718            # Megatron's offset of the tensor-parallel stream
STREAMS = ("replicated", "sharded")

_STATE: dict = {"seed": None, "rank": 0, "stage": 0}
_GENERATORS: dict = {}            # (stream, device) -> torch.Generator


def manual_seed(seed: int, rank: int | None = None) -> None:
    """Restart autoshard's streams at `seed` (call it with the same seed on every rank of a
    tensor-parallel group, as `torch.manual_seed`). `rank` (default: this process's rank in its
    tensor-parallel group) offsets the sharded stream."""
    if rank is None:
        rank = _tp_rank()
    _STATE.update(seed=int(seed), rank=int(rank))
    _GENERATORS.clear()


def reset() -> None:
    """Forget the seed and the streams (the next `parallelize` synchronises a new seed)."""
    _STATE.update(seed=None, rank=0, stage=0)
    _GENERATORS.clear()


def offset_stage(offset: int) -> None:
    """Draw this process's streams at `seed + offset` (a pipeline rank's: Megatron's seed + 100 x
    pipeline rank, so that stages draw different masks), the seed itself unchanged: the ranks of a
    tensor-parallel group still agree on it, and `manual_seed` keeps the offset."""
    _STATE["stage"] = int(offset)
    _GENERATORS.clear()


def initial_seed() -> int | None:
    """The seed of autoshard's streams (None until `manual_seed` or `parallelize` set it)."""
    return _STATE["seed"]


def _tp_rank() -> int:
    return get_rank() if is_initialized() else 0


def synchronise(pg, rank: int) -> int:
    """Make the seed the same on every rank of `pg`: rank 0's `torch.initial_seed()` when no rank
    set one; an error naming the ranks when `manual_seed` was called with different seeds."""
    dev = device_of(pg)
    mine = _STATE["seed"]
    have = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=dev)
    every = [torch.zeros_like(have) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(every, have, group=pg)
    seeds = [int(t.item()) for t in every]
    if len(set(seeds)) > 1 and -1 not in seeds:
        raise ProcessGroupError(f"autoshard.manual_seed was called with different seeds on the ranks of the "
                                f"tensor-parallel group ({seeds}); replicated dropout masks would differ")
    if -1 in seeds:              # some rank has none: everyone takes rank 0's seed (or initial seed)
        seed = torch.tensor([seeds[0] if seeds[0] != -1 else torch.initial_seed() % 2 ** 63],
                            dtype=torch.int64, device=dev)
        dist.broadcast(seed, src=dist.get_global_rank(pg, 0), group=pg)
        manual_seed(int(seed.item()), rank)
    else:
        _STATE["rank"] = rank
    return _STATE["seed"]


def ensure_seeded(rank: int) -> None:
    """Without a process group (a module built for inspection): this process's initial seed."""
    if _STATE["seed"] is None:
        manual_seed(torch.initial_seed() % 2 ** 63, rank)


def generator(stream: str, device) -> torch.Generator:
    """The generator of `stream` ("replicated" or "sharded") on `device`."""
    device = torch.device(device)
    key = (stream, device)
    g = _GENERATORS.get(key)
    if g is None:
        if _STATE["seed"] is None:
            ensure_seeded(_tp_rank())
        seed = _STATE["seed"] + _STATE["stage"] + (SHARDED_OFFSET + _STATE["rank"] if stream == "sharded" else 0)
        g = _GENERATORS[key] = torch.Generator(device=device).manual_seed(seed)
    return g


@contextlib.contextmanager
def fork(stream: str, device):
    """Run the block on `stream`'s generator in place of torch's default generator of `device`
    (for random ops that take no generator, e.g. attention's dropout), leaving the default
    generator as it was (Megatron's CudaRNGStatesTracker.fork, for CPU and CUDA)."""
    device = torch.device(device)
    g = generator(stream, device)
    default = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    saved = default.get_state()
    default.set_state(g.get_state())
    try:
        yield
    finally:
        g.set_state(default.get_state())
        default.set_state(saved)


def get_rng_state() -> dict:
    """The streams' seed and states (for a checkpoint): {"seed", "rank", (stream, device): state}."""
    return {"seed": _STATE["seed"], "rank": _STATE["rank"], "stage": _STATE["stage"],
            "states": {f"{s}@{d}": g.get_state() for (s, d), g in _GENERATORS.items()}}


def set_rng_state(state: dict) -> None:
    """Restore what `get_rng_state` returned."""
    manual_seed(state["seed"], state["rank"])
    _STATE["stage"] = state.get("stage", 0)
    for key, st in state["states"].items():
        s, _, d = key.partition("@")
        generator(s, d).set_state(st)


def stream_states(device) -> dict:
    """The states of both streams on `device` now (made if new): what a recomputation replays."""
    return {s: generator(s, device).get_state() for s in STREAMS}


@contextlib.contextmanager
def replaying(states: dict, device):
    """Run the block with the streams of `device` at `states` (a forward's, from `stream_states`),
    then put them back where they were: a recomputed forward draws the same dropout masks."""
    now = stream_states(device)
    for s, st in states.items():
        generator(s, device).set_state(st)
    try:
        yield
    finally:
        for s, st in now.items():
            generator(s, device).set_state(st)
