"""Bytes a collective sends and the counters that record them at run time.

`ring_bytes` is the one definition of what a ring collective of n bytes sends per rank (the plan
predicts with it, the counters measure with it); `kind@m` names a collective run within groups of
m consecutive ranks. `count_comm()` records every autoshard collective run inside its block,
forward and backward, as `CommEvent`s of a `CommCounter`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from .groups import subgroup_of

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")



def ring_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends in a ring `kind` collective on a tensor of `nbytes` bytes.

    `nbytes` is the full tensor; in an all_to_all a rank holds 1/p of it and sends (p-1)/p of that.
    `kind@m` is that collective within groups of m consecutive ranks, on the group's m/p of the
    tensor (`in_groups`: K/V heads gathered onto the ranks whose query heads read them)."""
    kind, m = split_kind(kind)
    if m is not None:
        return ring_bytes(kind, nbytes * m / world_size, m)
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    p = int(world_size)
    if p <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (p - 1) / p, "all_to_all": (p - 1) / p / p}.get(kind, (p - 1) / p)
    return factor * nbytes


def in_groups(kind: str, m: int) -> str:
    """The name of collective `kind` run within groups of m consecutive ranks (`ring_bytes`)."""
    return kind if m == 1 else f"{kind}@{m}"


def split_kind(kind: str) -> tuple[str, int | None]:
    """(collective, ranks a group) of a `kind@m` name; (kind, None) for the whole group's."""
    base, _, m = kind.partition("@")
    return (base, int(m)) if m else (base, None)


@dataclass
class CommEvent:
    """One collective call: which function, ring kind, direction and per-rank ring bytes."""

    op: str
    kind: str
    direction: str          # "forward" | "backward"
    bytes: float


@dataclass(eq=False)
class CommCounter:
    """Collectives recorded while a `count_comm()` block was active (this process only)."""

    events: list = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.events)

    @property
    def bytes(self) -> float:
        return sum(e.bytes for e in self.events)

    @property
    def by_kind(self) -> dict:
        """kind -> (calls, bytes)."""
        return self._group_by("kind")

    @property
    def by_direction(self) -> dict:
        """"forward" / "backward" -> (calls, bytes)."""
        return self._group_by("direction")

    def _group_by(self, attr: str) -> dict:
        out: dict = {}
        for e in self.events:
            calls, nbytes = out.get(getattr(e, attr), (0, 0.0))
            out[getattr(e, attr)] = (calls + 1, nbytes + e.bytes)
        return out


_ACTIVE: list[CommCounter] = []      # global, not thread-local: CUDA backward runs on other threads


@contextlib.contextmanager
def count_comm():
    """Count every autoshard collective run inside the block, forward and backward (nestable)."""
    counter = CommCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def record(op: str, kind: str, direction: str, nbytes: int, p: int, group=None) -> None:
    if _ACTIVE:
        m = subgroup_of(group)
        kind = kind if m is None else in_groups(kind, m)       # named as the plan names it
        event = CommEvent(op, kind, direction, ring_bytes(kind, nbytes, p))     # (p = m: the same bytes)
        for counter in _ACTIVE:
            counter.events.append(event)
