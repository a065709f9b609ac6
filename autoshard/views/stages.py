"""The printed pipeline plan: one row per stage (its rank, blocks, predicted times and memory),
then the schedule's predicted step time and bubble."""
from __future__ import annotations

from tabulate import tabulate

from .report import fmt_bytes


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
        rows.append([s, s % pp.pp, _blocks(names) + extra, f"{pp.forward[s] * 1e3:.3f}", f"{pp.backward[s] * 1e3:.3f}",
                     fmt_bytes(pp.memory[s]), sent])
    table = tabulate(rows, headers=["stage", "pp rank", "blocks", "fwd ms", "bwd ms", "peak (est.)", "sends"])
    lines = [f"pipeline: {len(pp.stages)} stages on pp {pp.pp} x tp {pp.tp} x dp {pp.dp}, schedule {pp.schedule}, "
             f"{pp.microbatches} microbatches",
             table,
             f"predicted step {pp.step_time * 1e3:.3f} ms (one microbatch per stage per action), bubble "
             f"{pp.bubble:.1%} (per rank: {', '.join(f'{x:.1%}' for x in pp.idle)}), slowest stage "
             f"{pp.balance:.3f}x the mean" + (f"; planned in {pp.seconds:.2f} s" if pp.seconds else "")]
    return "\n".join(lines)
