"""The ranks of a tensor-parallel group must be fed the same inputs: checked, not assumed.

Every rank of a tensor-parallel group computes its shard of one batch; ranks fed different
batches (a data loader or `DistributedSampler` split over the whole world, another data order
per rank) would mix them in their collectives and train silently wrong. `check_same_inputs`
compares a fingerprint of the call's inputs over the group (one all_gather of two int64: the
structure's digest and a digest of every tensor's values); where they differ, a second exchange
finds which inputs and ranks differ, and every rank raises `InputMismatchError` naming them.

The fingerprint of a tensor is two int64 checksums of its bits (their sum, and their sum weighted
by position, so another order of the same rows differs too), with wrapping arithmetic: cheap (two
reductions over the inputs, which are token ids of a few KB in a language model) and exact on
every rank alike. `Guard` decides when to check: the first call of each call signature and every
`every`-th call after it (`parallelize(check_inputs=N)`); not while torch.compile or export traces
the module (a collective and a Python branch on its result have no place in a graph).
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..errors import InputMismatchError
from .groups import device_of

__all__ = ["check_same_inputs", "Guard", "fingerprints"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B97F4A7C15                    # an odd multiplier: each input's place in the digest


def _int64(k: int) -> int:
    """`_MIX * k` wrapped to a signed int64."""
    w = (_MIX * k) % (1 << 64)
    return w - (1 << 64) if w >= 1 << 63 else w


def _tensors(arguments) -> list:
    """(name, tensor) of every tensor among a call's arguments ((name, value) pairs), nested ones
    named by their path (`past[0]`)."""
    out = []
    for name, value in arguments:
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                out.append((name + pytree.keystr(path), leaf))
    return out


def _checksums(t: torch.Tensor, device) -> torch.Tensor:
    """[sum, position-weighted sum] of `t`'s bits as int64 (wrapping), on `device`."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    x = t.reshape(-1)
    if x.is_floating_point() or x.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        x = x.contiguous().view(_BITS[x.element_size()])
    x = x.to(device=device, dtype=torch.int64)
    weights = torch.arange(1, 2 * x.numel() + 1, 2, dtype=torch.int64, device=device)
    return torch.stack([x.sum(), (x * weights).sum()]) if x.numel() else torch.zeros(2, dtype=torch.int64,
                                                                                    device=device)


def _structure(named) -> int:
    text = repr([(n, str(t.dtype), tuple(t.shape)) for n, t in named])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def fingerprints(arguments, device="cpu") -> tuple[list, torch.Tensor]:
    """(names, [n, 2] int64 checksums) of the tensors among `arguments`."""
    named = _tensors(arguments)
    if not named:
        return [], torch.zeros(0, 2, dtype=torch.int64, device=device)
    return [n for n, _ in named], torch.stack([_checksums(t, device) for _, t in named])


def check_same_inputs(pg, arguments, what: str = "the module") -> None:
    """Raise InputMismatchError on every rank of `pg` unless all its ranks were given the same
    tensors (names, dtypes, shapes and values) in `arguments` ((name, value) pairs)."""
    device = device_of(pg)
    named = _tensors(arguments)
    names, sums = fingerprints(arguments, device)
    weights = torch.tensor([[_int64(2 * i + 1), _int64(2 * i + 2)] for i in range(len(names))],
                           dtype=torch.int64, device=device).reshape(-1, 2)
    mine = torch.stack([torch.tensor(_structure(named), dtype=torch.int64, device=device),
                        (sums * weights).sum()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(every, mine, group=pg)
    if all(torch.equal(e, every[0]) for e in every):
        return
    # a mismatch: learn which inputs differ, on which ranks (the error path; an object exchange)
    shown = [(n, str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(int(v) for v in s))
             for (n, t), s in zip(named, sums.cpu())]
    seen = [None] * dist.get_world_size(pg)
    dist.all_gather_object(seen, shown, group=pg)
    ranks = [dist.get_global_rank(pg, r) for r in range(len(seen))]
    differ = []
    for name in dict.fromkeys(n for s in seen for n, *_ in s):
        by_rank = [next((x for x in s if x[0] == name), None) for s in seen]
        if any(b != by_rank[0] for b in by_rank):
            groups: dict = {}
            for r, b in zip(ranks, by_rank):
                groups.setdefault(b, []).append(r)
            parts = "; ".join(f"ranks {rs}: " + ("absent" if b is None else f"{b[1]}{list(b[2])}"
                                                 + ("" if len({x[2] for x in groups if x}) > 1 else
                                                    f" checksum {b[3][0] & 0xffffffff:08x}"))
                              for b, rs in groups.items())
            differ.append(f"{name!r} ({parts})")
    raise InputMismatchError(
        f"the ranks {ranks} of {what}'s tensor-parallel group were given different inputs: "
        f"{', '.join(differ) or 'the call differs'}. Every rank of a tensor-parallel group computes its "
        "shard of one batch, so all of them must get the same batch: split the data by data-parallel rank, "
        "not by global rank (autoshard.distributed.data_parallel_rank() / data_parallel_size() give them, "
        "e.g. DistributedSampler(dataset, num_replicas=data_parallel_size(), rank=data_parallel_rank()), "
        "and seed any shuffling alike on every rank)")


class Guard:
    """When a module checks its inputs: the first call of each signature, then every `every`-th
    (`every=0`: the first only; None: never), never while torch.compile or export traces it."""

    def __init__(self, pg, every: int | None, what: str):
        self.pg, self.every, self.what = pg, every, what
        self.calls: dict = {}

    def due(self, key) -> bool:
        if self.every is None or torch.compiler.is_compiling():
            return False
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return n == 0 or (self.every > 0 and n % self.every == 0)

    def __call__(self, key, arguments) -> None:
        if self.due(key):
            check_same_inputs(self.pg, arguments, self.what)
