"""The printed pipeline plan: one row per stage (its rank, blocks, predicted times and memory),
then the schedule's predicted step time and bubble."""
from __future__ import annotations

from tabulate import tabulate

from .report import fmt_bytes


def fmt_seconds(t: float) -> str:
    """`t` seconds in s, ms or us, three significant figures."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(t) >= scale or unit == "us":
            return f"{t / scale:.3g} {unit}"


def _blocks(names: tuple) -> str:
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)})"


def format_pipeline(pp) -> str:
    """`pp` (an autoshard.planner.pipeline.PipelinePlan) as a table and a summary."""
    last = len(pp.stages) - 1
    rows = []
    for s, names in enumerate(pp.stages):
        extra = " + embeddings" if s == 0 else ""
        extra += " + head, loss" if s == last else ""
        sent = fmt_bytes(pp.sent_bytes[s]) if s < last else "-"
        rows.append([s, s % pp.pp, _blocks(names) + extra, fmt_seconds(pp.forward[s]), fmt_seconds(pp.backward[s]),
                     fmt_bytes(pp.memory[s]), sent])
    table = tabulate(rows, headers=["stage", "pp rank", "blocks", "forward", "backward", "peak (est.)", "sends"],
                     disable_numparse=True)
    lines = [f"pipeline: {len(pp.stages)} stages on pp {pp.pp} x tp {pp.tp} x dp {pp.dp}, schedule {pp.schedule}, "
             f"{pp.microbatches} microbatch{'es' if pp.microbatches != 1 else ''} (times: one microbatch)",
             table,
             f"predicted step {fmt_seconds(pp.step_time)}, bubble "
             f"{pp.bubble:.1%} (per rank: {', '.join(f'{x:.1%}' for x in pp.idle)}), slowest stage "
             f"{pp.balance:.3f}x the mean" + (f"; planned in {pp.seconds:.2f} s" if pp.seconds else "")]
    return "\n".join(lines)
