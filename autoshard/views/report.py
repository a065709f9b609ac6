"""The printed sharding-plan report: one row per parametered or communicating node, then totals."""
from __future__ import annotations

import math

from tabulate import tabulate

from ..capture.shapes import fetch_attr
from ..runtime.counters import ring_bytes
from ..runtime.placements import Replicate, is_even, local_shape


def fmt_bytes(n: float) -> str:
    """`n` bytes as B / KiB / MiB / GiB (one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def memory_line(plan) -> str:
    """The step's memory per rank: the peak, when it occurs, and its parts."""
    m = plan.memory
    text = (f"peak {fmt_bytes(m.peak)} at the {m.peak_at} (parameters {fmt_bytes(m.parameters)}, gradients "
            f"{fmt_bytes(m.gradients)}, optimizer {fmt_bytes(m.optimizer)}, activations {fmt_bytes(m.activations)})")
    if plan.checkpointed:
        text += f"; recomputed in backward: {', '.join(plan.checkpointed)}"
    if plan.sequence_parallel:
        text += f"; sequence parallel: {plan.sequence_parallel} ops split on tokens"
    return text


def _fmt_dim(d) -> str:
    return "None" if d is None else str(d)


def grouped(names) -> str:
    """Names counted, in first-seen order: "topk.default x 96, to.device"."""
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(n if c == 1 else f"{n} x {c}" for n, c in counts.items())


def experts_line(plan, params_of: dict) -> str:
    """How the plan splits each mixture-of-experts layer (`autoshard::experts`), grouped by way."""
    p, gm = plan.world_size, plan.graph_module
    ways = []
    for name, d in plan.nodes.items():
        if d.op.split(".")[0] == "experts" and params_of.get(name):
            e = fetch_attr(gm, params_of[name][0]).shape[0]
            per = {"expert_parallel": f"{math.ceil(e / p)} of {e} experts a rank",
                   "expert_tensor": f"each of {e} experts' FFN split {p} ways"}.get(d.strategy, f"{e} experts whole")
            ways.append(f"{d.strategy} ({per})")
    return f"mixture-of-experts layers: {grouped(ways)}" if ways else ""


def format_plan(plan) -> str:
    """Render `plan` as text (tabulate tables)."""
    p = plan.world_size
    gm = plan.graph_module
    params_of: dict[str, list] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target in plan.layouts:
            for u in n.users:
                params_of.setdefault(u.name, []).append(n.target)
    comm_of: dict[str, list] = {}
    for r in plan.redistributions:
        for c in r.consumers[:1]:
            kinds = "+".join(r.forward) or (f"none, {r.via}'s reused" if r.via else "-")
            back = "+".join(r.backward) or "-"
            comm_of.setdefault(c, []).append(f"{r.node} {r.src}->{r.dst}: fwd {kinds}, bwd {back} ({fmt_bytes(r.ring_bytes(p))})")
    rows = []
    for name, d in plan.nodes.items():
        params = params_of.get(name, [])
        comms = list(comm_of.get(name, []))
        comms += [f"{k} ({fmt_bytes(ring_bytes(k, nb, p))})" for k, nb in d.comm]
        if not params and not comms:
            continue
        full, local, mem = [], [], 0
        for pn in params:
            t = fetch_attr(gm, pn)
            full.append(f"{pn.rpartition('.')[2]} {list(t.shape)}")
            pl = plan.layouts[pn]
            ls = local_shape(t.shape, pl, p)
            if is_even(t.shape, pl, p):
                local.append(str(list(ls)))
            else:               # shards differ: every rank's size of the split dim, in rank order
                sizes = "/".join(str(local_shape(t.shape, pl, p, r)[pl.dim]) for r in range(p))
                local.append(str([sizes if i == pl.dim else s for i, s in enumerate(ls)]).replace("'", ""))
            mem += math.prod(ls) * t.element_size()
        owner = (d.module or params[0].rpartition(".")[0]) if params else ""   # a tied weight: the user
        rows.append([owner or name, d.op, ", ".join(full), ", ".join(local), _fmt_dim(d.dim) if params or d.dim is not None else "",
                     d.strategy, "\n".join(comms), fmt_bytes(mem) if params else ""])
    for consumer, comms in comm_of.items():     # the graph output: gathers of returned tensors
        if consumer not in plan.nodes:
            rows.append([consumer, "output", "", "", "", "", "\n".join(comms), ""])
    table = tabulate(rows, headers=["module / node", "op", "weight (full)", "local", "dim", "strategy",
                                    "collectives inserted (per rank)", "params/rank"], tablefmt="simple")
    kinds = ", ".join(f"{k}: {c} x, {fmt_bytes(b)}" for k, (c, b) in sorted(plan.comm_by_kind.items())) or "none"
    totals = [
        ["tensor-parallel degree", p],
        ["tracer / search", f"{plan.tracer} / {plan.search} ({plan.search_seconds * 1e3:.1f} ms)"],
        ["comm per step per rank (fwd+bwd)", f"{fmt_bytes(plan.comm_bytes)} ({kinds})"],
        ["params per rank / full", f"{plan.params_per_rank:,} / {plan.params_total:,} "
                                   f"({plan.params_per_rank / max(plan.params_total, 1):.2f})"],
        ["estimated step time", f"{plan.step_time * 1e3:.3f} ms (comm {plan.comm_time * 1e3:.3f} ms, "
                                f"compute {plan.compute_time * 1e3:.3f} ms)"],
    ]
    if plan.autocast:
        totals.append(["captured under", ", ".join(f"torch.autocast({d!r}, {t})" for d, t in plan.autocast)])
    if plan.memory is not None:
        totals.append(["memory per rank (training step)", memory_line(plan)])
    if plan.outputs == "sharded":
        split = [f"{k} {v}" for k, v in plan.output_placements.items() if not isinstance(v, Replicate)]
        totals.append(["outputs", "sharded: " + (", ".join(split) + " returned as DTensors" if split else
                                                 "every output is whole")])
    out = [f"autoshard plan ({len(rows)} sharded or communicating nodes)", table, "", tabulate(totals, tablefmt="plain")]
    moe = experts_line(plan, params_of)
    if moe:
        out.append(moe)
    if plan.unsupported:
        out.append("ops with no sharding rule (run whole, a split input gathered first): " +
                   grouped(op for _, _, op in (u.partition(": ") for u in plan.unsupported)))
    for note in plan.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
