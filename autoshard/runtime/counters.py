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


# the functional collectives (torch.distributed._functional_collectives: DTensor's) -> ring kind
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


@contextlib.contextmanager
def count_functional():
    """Count the functional collectives dispatched inside the block (what DTensor and other engines
    built on `torch.distributed._functional_collectives` send), forward and backward, in the
    same ring bytes as `count_comm`, so that another engine's plan is measured as ours is."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode
    counter = CommCounter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ns, _, name = func._schema.name.partition("::")
            kind = _FUNCTIONAL.get(name) if ns == "_c10d_functional" else None
            if kind is not None:
                p = {"all_gather": lambda: args[1], "reduce_scatter": lambda: args[2],
                     "all_to_all": lambda: len(args[1]),
                     "all_reduce": lambda: dist.get_world_size(_resolve_process_group(args[2]))}[kind]()
                nbytes = args[0].nbytes * (p if kind in ("all_gather", "all_to_all") else 1)
                counter.events.append(CommEvent(name, kind, "", ring_bytes(kind, nbytes, int(p))))
            return out

    with _Count():
        yield counter
