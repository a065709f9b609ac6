"""Pipeline-parallel planning: where to cut the blocks into stages, and what a schedule costs.

Pure Python (no process group; torch is imported only to read Interleaved1F1B's order): the
runtime sits on `torch.distributed.pipelining`, and before building any stage the planner chooses the cuts
(`balance`, or the user's pinned ones through `check_split`) and compare schedules and microbatch
counts by their timeline (`simulate`, against the textbook `ideal_bubble`).

The timeline replays each rank's compute actions in the order torch executes them: GPipe and 1F1B
as `ScheduleGPipe` / `Schedule1F1B._step_microbatches` run them (written out here; torch's own
`pipeline_order` IR for 1F1B is not usable: on the last rank it lists F1..FM, not F0..FM-1), and
Interleaved1F1B from torch itself (`ScheduleInterleaved1F1B(...).pipeline_order`, built from
stand-in stages). Transfers are a latency between stages on different ranks; they never occupy a
rank (torch posts them asynchronously). With equal stages and no transfers every schedule meets
`ideal_bubble`, Interleaved1F1B only from M >= pp (below, a microbatch's trip through all stages
is the critical path).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ..errors import ShardingError
from ..runtime.pipeline import SCHEDULES

__all__ = ["SCHEDULES", "Timeline", "balance", "check_schedule", "check_split", "ideal_bubble",
           "orders", "simulate"]

MULTI = ("Interleaved1F1B", "InterleavedZeroBubble")      # several stages a rank, order from torch


def balance(costs: Sequence[float], parts: int, *, first: float = 0.0,
            last: float = 0.0) -> tuple[int, ...]:
    """Cut blocks of predicted seconds `costs` into `parts` contiguous non-empty stages; the first
    stage also pays `first` (the embedding), the last `last` (head and loss). Returns each stage's
    first block index. The slowest stage is as fast as possible (exactly); among such cuts the one
    with the smallest sum of squared stage totals (the most even); remaining ties deterministic."""
    costs = [float(c) for c in costs]
    n = len(costs)
    if parts < 1:
        raise ValueError(f"balance: parts must be >= 1, got {parts}")
    if any(not c >= 0.0 for c in costs) or not first >= 0.0 or not last >= 0.0:
        raise ValueError(f"balance: costs, first and last must be >= 0 (got min cost "
                         f"{min(costs, default=0.0)}, first={first}, last={last})")
    if parts > n:
        raise ShardingError(f"pipeline: cannot cut into {parts} stages but the model has {n} "
                            f"blocks (each stage needs at least one block)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def total(i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first if i == 0 else 0.0) + (last if j == n else 0.0)

    def fits(cap: float) -> bool:
        # Every group holds its blocks, group 0 block 0, the last group block n-1: each must fit.
        if max(costs) > cap or total(0, 1) > cap or total(n - 1, n) > cap:
            return False
        # Positions reachable by g groups form [g, reach]; extend greedily, never onto block n-1.
        reach = 0
        for _ in range(parts - 1):
            start, reach = reach, min(reach + 1, n - 1)
            while reach < n - 1 and total(start, reach + 1) <= cap:
                reach += 1
        return total(reach, n) <= cap

    values = sorted({total(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(values) - 1  # values[-1] is the whole model: always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    cap = values[lo]

    # Fewest squares among the cuts whose stages all fit under the optimal cap.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        ends = [n] if k == parts else range(k, n - (parts - k) + 1)
        for j in ends:
            for i in range(j - 1, k - 2, -1):
                t = total(i, j)
                if t > cap:
                    break
                score = best[k - 1][i] + t * t
                if score < best[k][j]:
                    best[k][j], back[k][j] = score, i
    if best[parts][n] == inf:  # cannot happen: `fits` and this loop test the same totals
        raise RuntimeError(f"balance: no cut of {n} blocks into {parts} stages under {cap}")
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = back[k][j]
        starts.append(j)
    return tuple(reversed(starts))


def check_split(split: Sequence[int], n: int, parts: int) -> tuple[int, ...]:
    """A user's pinned cuts of `n` blocks into `parts` stages, as start indices. `split` is either
    start indices, read so when its first entry is 0 ((0, 3, 6): strictly increasing, last < n),
    or blocks per stage ((3, 3, 2): each >= 1, sum n); a count is never 0, so the two never mix."""
    if parts < 1:
        raise ValueError(f"pipeline: parts must be >= 1, got {parts}")
    if parts > n:
        raise ShardingError(f"pipeline: cannot cut into {parts} stages but the model has {n} "
                            f"blocks (each stage needs at least one block)")
    try:
        if isinstance(split, (str, bytes)) or any(isinstance(x, bool) for x in split):
            raise TypeError
        values = [operator.index(x) for x in split]
    except TypeError:
        raise ShardingError(f"pipeline: split must be a list of ints (start indices or blocks per "
                            f"stage), got {split!r}") from None
    if len(values) != parts:
        raise ShardingError(f"pipeline: split {values} has {len(values)} entries but the pipeline "
                            f"has {parts} stages")
    if values[0] == 0:
        if any(b <= a for a, b in zip(values, values[1:])) or values[-1] >= n:
            raise ShardingError(f"pipeline: split {values} read as start indices must increase "
                                f"strictly from 0 and stay below the model's {n} blocks")
        return tuple(values)
    if any(c < 1 for c in values) or sum(values) != n:
        raise ShardingError(f"pipeline: split {values} read as blocks per stage must hold at least "
                            f"one block each and {n} in all (they sum to {sum(values)})")
    starts = [0]
    for c in values[:-1]:
        starts.append(starts[-1] + c)
    return tuple(starts)


@dataclass(frozen=True)
class Timeline:
    """One training step's pipeline timeline: its length and what each rank spent computing."""
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]

    @property
    def per_rank(self) -> tuple[float, ...]:
        """Each rank's idle fraction of the step."""
        return tuple(i / self.makespan if self.makespan > 0 else 0.0 for i in self.idle)

    @property
    def bubble(self) -> float:
        """Mean idle fraction over the ranks."""
        return sum(self.per_rank) / len(self.per_rank)


def _check_sizes(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> None:
    """A known schedule, positive sizes, one stage a rank for the schedules that run one."""
    if schedule not in SCHEDULES:
        raise ShardingError(f"pipeline: unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if pp < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ValueError(f"pipeline: pp={pp}, microbatches={microbatches} and stages_per_rank="
                         f"{stages_per_rank} must all be >= 1")
    if schedule not in MULTI and stages_per_rank != 1:
        raise ShardingError(f"pipeline: {schedule} runs one stage per rank, not {stages_per_rank} "
                            f"(Interleaved1F1B runs several)")


def check_schedule(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> None:
    """Raise ShardingError where torch's schedule class would refuse these sizes: GPipe and 1F1B
    hold one stage per rank, 1F1B wants microbatches >= pp, Interleaved1F1B microbatches a
    multiple of its rounds, max(1, microbatches // pp)."""
    _check_sizes(schedule, pp, microbatches, stages_per_rank)
    if schedule == "1F1B" and microbatches < pp:
        raise ShardingError(f"pipeline: torch's 1F1B needs at least as many microbatches as "
                            f"stages: {microbatches} microbatches for {pp} stages")
    rounds = max(1, microbatches // pp)
    if schedule in MULTI and microbatches % rounds:
        raise ShardingError(f"pipeline: torch's Interleaved1F1B needs the {microbatches} "
                            f"microbatches to be a multiple of its rounds, max(1, {microbatches} "
                            f"// {pp}) = {rounds}")


def ideal_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Textbook idle fraction (pp-1) / (stages_per_rank*M + pp-1): equal stages, no transfers."""
    if schedule not in SCHEDULES or schedule == "InterleavedZeroBubble":
        raise ShardingError(f"pipeline: no textbook bubble for schedule {schedule!r}; one of {SCHEDULES[:3]}")
    if schedule != "Interleaved1F1B" and stages_per_rank != 1:
        raise ShardingError(f"pipeline: {schedule} runs one stage per rank, not {stages_per_rank}")
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def orders(schedule: str, pp: int, microbatches: int,
           stages_per_rank: int = 1) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Each rank's compute actions ("F" or "B", stage, microbatch) in the order torch runs them."""
    m = microbatches
    if schedule == "GPipe":  # ScheduleGPipe: every forward, then every backward
        return tuple(tuple([("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)])
                     for r in range(pp))
    if schedule == "1F1B":  # Schedule1F1B: min(M, pp - rank) forwards, then B, F, B, F, ...
        out = []
        for r in range(pp):
            warm = min(m, pp - r)
            ops = [("F", r, i) for i in range(warm)]
            for b in range(m):
                ops.append(("B", r, b))
                if warm + b < m:
                    ops.append(("F", r, warm + b))
            out.append(tuple(ops))
        return tuple(out)
    return _interleaved(pp, m, stages_per_rank, schedule)


@lru_cache(maxsize=64)
def _interleaved(pp: int, m: int, v: int, schedule: str = "Interleaved1F1B") -> tuple:
    """Torch's own order ("F", "B"; the zero-bubble schedule's "I" and "W": a backward split into
    the input's gradient and the weights')."""
    from types import SimpleNamespace

    import torch.nn as nn
    from torch.distributed.pipelining import schedules as S

    cls = S.ScheduleInterleaved1F1B if schedule == "Interleaved1F1B" else S.ScheduleInterleavedZeroBubble
    # The constructor reads only these attributes of rank 0's stages; the order covers every rank.
    stages = [SimpleNamespace(num_stages=pp * v, stage_index=k * pp, group_size=pp, group_rank=0,
                              is_first=k == 0, is_last=k * pp == pp * v - 1, submod=nn.Module())
              for k in range(v)]
    try:
        order = cls(stages, m).pipeline_order
    except ValueError as e:
        raise ShardingError(f"pipeline: {schedule} at {pp} ranks, {v} stages per rank, {m} "
                            f"microbatches: {e}") from None
    kinds = {"F", "B", "I", "W"}
    return tuple(tuple((a.computation_type.value, a.stage_index, a.microbatch_index)
                       for a in order[r] if a is not None and a.computation_type.value in kinds)
                 for r in range(pp))


def simulate(schedule: str, pp: int, microbatches: int, forward: Sequence[float],
             backward: Sequence[float], *, stages_per_rank: int = 1,
             send: float = 0.0) -> Timeline:
    """Replay one step: stage s on rank s % pp, each rank running its actions in torch's order,
    each as soon as its rank is free and its inputs are there. F(s, m) waits for F(s-1, m),
    B(s, m) for F(s, m) and B(s+1, m); `send` seconds more across ranks. `forward[s]` and
    `backward[s]` are one microbatch's seconds on stage s. Sizes torch would refuse (see
    `check_schedule`) are simulated anyway where the order is defined (1F1B with M < pp)."""
    _check_sizes(schedule, pp, microbatches, stages_per_rank)
    n = pp * stages_per_rank
    fwd, bwd = [float(t) for t in forward], [float(t) for t in backward]
    if len(fwd) != n or len(bwd) != n:
        raise ShardingError(f"pipeline: {pp} ranks x {stages_per_rank} stages per rank = {n} "
                            f"stages, but got {len(fwd)} forward and {len(bwd)} backward times")
    if any(not t >= 0.0 for t in fwd + bwd) or not send >= 0.0:
        raise ValueError("pipeline: stage times and send must be >= 0")
    plan = orders(schedule, pp, microbatches, stages_per_rank)
    back = "I" if schedule == "InterleavedZeroBubble" else "B"
    done: dict[tuple[str, int, int], float] = {}
    free, busy, pos = [0.0] * pp, [0.0] * pp, [0] * pp
    left = sum(len(ops) for ops in plan)
    while left:
        moved = False
        for r in range(pp):
            while pos[r] < len(plan[r]):
                kind, s, m = plan[r][pos[r]]
                if kind == "F":
                    deps = [(("F", s - 1, m), s - 1)] if s > 0 else []
                elif kind == "W":                          # the weights' gradient: after the input's
                    deps = [(("I", s, m), s)]
                else:                                      # "B", or "I" (the input's gradient)
                    deps = [(("F", s, m), s)] + ([((back, s + 1, m), s + 1)] if s < n - 1 else [])
                if any(d not in done for d, _ in deps):
                    break
                ready = max([done[d] + (send if t % pp != r else 0.0) for d, t in deps],
                            default=0.0)
                took = fwd[s] if kind == "F" else bwd[s] if kind == "B" else bwd[s] / 2
                done[(kind, s, m)] = free[r] = max(free[r], ready) + took
                busy[r] += took
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = {r: plan[r][pos[r]] for r in range(pp) if pos[r] < len(plan[r])}
            raise ShardingError(f"pipeline: {schedule} at {pp} ranks, {microbatches} "
                                f"microbatches deadlocks; next actions per rank: {stuck}")
    makespan = max(free)
    return Timeline(makespan, tuple(busy), tuple(makespan - b for b in busy))
