"""The pipeline plan: predicted time of each block from a tensor-parallel Plan, the cuts that
balance the stages (autoshard.planner.stages.balance), and what the schedule then costs.

A node's time is its share of the step's compute (`cost.flops`, divided by the degree where the plan
splits it) plus the collectives the plan runs for it; a block's time is the sum over its nodes; the
nodes before the first block (embeddings) are the first stage's, those after the last (final norm,
head, loss) the last stage's, those between two blocks the later block's. Forward is a third of
a node's time, backward two thirds (the cost model's 3 x 2 flops per multiply-add). A stage's
memory: its parameters with their gradient and optimizer state, plus its blocks' saved activations
for each microbatch the schedule holds in flight on that rank.
"""
from __future__ import annotations

from ..capture.ops import kinds
from ..capture.repeats import owner
from ..errors import ShardingError
from ..plan import PipelinePlan
from ..runtime.placements import Replicate, Shard
from .cost import flops
from .stages import balance, check_split, simulate


def _node_seconds(plan, node, p: int) -> float:
    cost = plan.cost_model
    dec = plan.nodes.get(node.name)
    share = 1.0 if dec is None or isinstance(dec.output, Replicate) or p == 1 else 1.0 / p
    seconds = cost.compute_time(flops(node, None) * share)
    if dec is not None:
        seconds += sum(cost.comm_time(kind, nbytes, p) for kind, nbytes in dec.comm)
    return seconds


def _redistribution_seconds(plan, p: int) -> dict:
    out: dict = {}
    for r in plan.redistributions:
        t = sum(plan.cost_model.comm_time(k, r.nbytes, p) for k in r.forward + r.backward)
        out[r.node] = out.get(r.node, 0.0) + t
    return out


def _param_bytes(plan, node, p: int) -> float:
    v = node.meta.get("val")
    if not hasattr(v, "numel"):
        return 0.0
    layout = plan.layouts.get(node.target)
    return v.numel() * v.element_size() / (1 if layout is None or isinstance(layout, Replicate) else p)


def block_costs(plan, names: list) -> tuple:
    """(first, per-block seconds, last, per-block parameter bytes, first bytes, last bytes) of one
    training step of one microbatch on a rank of `plan` (the tensor-parallel plan at that size). A
    parameter read outside the blocks counts where it is read: before the first block (the
    embedding: the first stage), after the last (final norm, head: the last stage), both for a
    tied embedding and head, else with the block it feeds."""
    if not names:
        raise ShardingError("pipeline: the model has no blocks to cut into stages (no ModuleList / Sequential of "
                            "layers of one class); name them with blocks=")
    by_len = frozenset(names)
    p = plan.world_size
    comm = _redistribution_seconds(plan, p)
    index = {n: i for i, n in enumerate(names)}
    costs, params = [0.0] * len(names), [0.0] * len(names)
    first = last = first_bytes = last_bytes = 0.0
    pending = 0.0
    nodes = list(plan.graph_module.graph.nodes)
    where: dict = {}                        # node -> block index, or "first" / "last" for the skeleton
    seen_block = False
    for node in nodes:
        block = owner(node, by_len) if node.op not in ("placeholder", "output") else None
        if block in index:
            seen_block = True
            where[node] = index[block]
        elif node.op != "get_attr":
            where[node] = "pending" if seen_block else "first"
    after = {n for n in reversed(nodes) if where.get(n) == "pending"}
    for n in reversed(nodes):               # skeleton nodes after the last block are the last stage's
        if isinstance(where.get(n), int):
            break
        if n in after:
            where[n] = "last"
    counted: set = set()
    for node in nodes:
        if node.op == "get_attr":
            if node.target not in plan.layouts or node.target in counted:
                continue
            counted.add(node.target)
            size = _param_bytes(plan, node, p)
            homes = {where.get(u, "last") for u in node.users}
            homes = {h if h != "pending" else _next_block(u, where, nodes) for h, u in
                     ((where.get(u, "last"), u) for u in node.users)}
            for h in homes:
                if h == "first":
                    first_bytes += size
                elif h == "last":
                    last_bytes += size
                else:
                    params[h] += size
            continue
        seconds = _node_seconds(plan, node, p) + comm.get(node.name, 0.0)
        w = where.get(node)
        if isinstance(w, int):
            costs[w] += seconds + pending
            pending = 0.0
        elif w == "first":
            first += seconds
        elif w == "last":
            last += seconds
        else:
            pending += seconds
    return first, costs, last, params, first_bytes, last_bytes


def _next_block(node, where: dict, nodes: list) -> int:
    """The block after `node` in graph order (a skeleton node between two blocks goes with the later)."""
    at = nodes.index(node)
    return next((where[n] for n in nodes[at:] if isinstance(where.get(n), int)), len(nodes))


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, stages_per_rank: int) -> int:
    """Microbatches whose activations a rank holds at once for one of its stages: GPipe all of
    them; 1F1B those of its warm-up plus one; interleaved, the warm-up spread over its stages."""
    if schedule == "GPipe":
        return microbatches
    if stages_per_rank == 1:
        return min(microbatches, pp - rank)
    warmup = (stages_per_rank - 1) * pp + 2 * (pp - 1 - rank) + 1
    return min(microbatches, -(-warmup // stages_per_rank) + 1)


def plan_pipeline(plan, names: list, *, pp: int, dp: int = 1, microbatches: int, schedule: str,
                  stages_per_rank: int = 1, split=None, parts=None, send_bandwidth=None,
                  seconds: float = 0.0) -> PipelinePlan:
    """Cut the blocks `names` of `plan`'s model (at one microbatch) into pp x stages_per_rank stages.

    `parts` ({block: its children}): where cutting at whole blocks leaves the slowest stage over 1%
    slower than cutting between blocks' children would (80 layers and a head on 8 stages: one stage
    holds 11 layers), the blocks a cut falls inside are cut between their children (in call order:
    a layer's norm, attention, norm, MLP), which then become blocks of their own."""
    stages = pp * stages_per_rank
    if stages > len(names):
        raise ShardingError(f"pipeline: {stages} stages (pp {pp} x {stages_per_rank} a rank) but the model has "
                            f"{len(names)} blocks ({names[0]} .. {names[-1]}): a stage holds at least one block; "
                            "use fewer stages")
    graph = _Graph(plan)
    units = [(n,) for n in names]
    cut = _cut(plan, units, stages, split)
    pieces = graph.parts(parts or {}) if split is None else {}
    if pieces:
        fine = [h for n in names for h in pieces.get(n, [(n,)])]
        finer = _cut(plan, fine, stages, None)
        if max(finer["totals"]) < 0.99 * max(cut["totals"]):
            cut = finer
    groups, totals, bounds, units = cut["groups"], cut["totals"], cut["bounds"], cut["units"]
    first, costs, last, params, first_bytes, last_bytes = cut["costs"]
    forward = tuple(t / 3 for t in totals)
    backward = tuple(2 * t / 3 for t in totals)
    hidden = [graph.live_bytes(graph.start(units[b])) for b in bounds[1:-1]]
    bandwidth = send_bandwidth or plan.cost_model.bandwidth
    send = max(hidden, default=0) / bandwidth + plan.cost_model.latency if stages > 1 else 0.0
    timeline = simulate(schedule, pp, microbatches, forward, backward, stages_per_rank=stages_per_rank, send=send)
    state = plan.cost_model.state_factor
    acts, acts_first, acts_last = _activations(plan, first, costs, last)
    memory = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        held = sum(params[a:b]) + (first_bytes if s == 0 else 0) + (last_bytes if s == stages - 1 else 0)
        saved = sum(acts[a:b]) + (acts_first if s == 0 else 0) + (acts_last if s == stages - 1 else 0)
        flight = in_flight(schedule, pp, s % pp, microbatches, stages_per_rank)
        memory.append(int(held * state + flight * saved))
    return PipelinePlan(schedule=schedule, pp=pp, tp=plan.world_size, dp=dp, microbatches=microbatches,
                        stages_per_rank=stages_per_rank, stages=tuple(groups), forward=forward, backward=backward,
                        memory=tuple(memory), sent_bytes=tuple(int(b) for b in hidden), step_time=timeline.makespan,
                        bubble=timeline.bubble, idle=tuple(timeline.per_rank), seconds=seconds, tensor_parallel=plan)


def _cut(plan, units: list, stages: int, split) -> dict:
    """The cut of `units` (each a tuple of modules: a block, or a half of one) into `stages`:
    balanced, or as `split` pins; each stage's group names a whole block by itself."""
    names = [m for u in units for m in u]
    costs = block_costs(plan, names)
    at, per_unit, params = 0, [], []
    for u in units:
        per_unit.append(sum(costs[1][at:at + len(u)]))
        params.append(sum(costs[3][at:at + len(u)]))
        at += len(u)
    first, last = costs[0], costs[2]
    starts = check_split(split, len(units), stages) if split is not None else \
        balance(per_unit, stages, first=first, last=last)
    bounds = list(starts) + [len(units)]
    totals = [sum(per_unit[a:b]) for a, b in zip(bounds, bounds[1:])]
    totals[0] += first
    totals[-1] += last
    groups = [_coarsen(units[a:b]) for a, b in zip(bounds, bounds[1:])]
    return {"groups": groups, "totals": totals, "bounds": bounds, "units": units,
            "costs": (first, per_unit, last, params, costs[4], costs[5])}


def _coarsen(units: list) -> tuple:
    """A stage's modules: a block all of whose parts the stage holds by its own name."""
    out = []
    held: dict = {}
    for u in units:
        held[getattr(u, "block", None)] = held.get(getattr(u, "block", None), 0) + 1
    for u in units:
        block = getattr(u, "block", None)
        if block is not None and held[block] == u.of:
            if block not in out:
                out.append(block)
        else:
            out.extend(u)
    return tuple(out)


class _Graph:
    """The plan's captured graph read for cuts: node order, free values, live bytes at a point."""

    def __init__(self, plan):
        self.plan = plan
        self.nodes = list(plan.graph_module.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.free, self.params = kinds(plan.graph_module, plan.graph_module.graph)

    def start(self, unit: tuple) -> int:
        """Where `unit` (its modules) begins: its first node in graph order."""
        by_len = frozenset(unit)
        return next(i for i, n in enumerate(self.nodes)
                    if n.op not in ("placeholder", "output", "get_attr") and owner(n, by_len) is not None)

    def live_bytes(self, at: int) -> float:
        """Bytes a rank holds of the values made before node `at` and read from it on: what a stage
        cut there sends (free values are recomputed, parameters held)."""
        total = 0.0
        for n in self.nodes[:at]:
            if n in self.free or n in self.params or n.op == "output":
                continue
            if any(self.pos[u] >= at and u.op != "output" for u in n.users):
                v = n.meta.get("val")
                if hasattr(v, "numel"):
                    dec = self.plan.nodes.get(n.name)
                    split = dec is not None and isinstance(dec.output, Shard) and self.plan.world_size > 1
                    total += v.numel() * v.element_size() / (self.plan.world_size if split else 1)
        return total

    def parts(self, parts: dict) -> dict:
        """{block: its children that run ops, each a unit, in call order} for blocks of two or more."""
        names = frozenset(c for cs in parts.values() for c in cs)
        first_at: dict = {}
        for i, n in enumerate(self.nodes):
            if n.op not in ("placeholder", "output", "get_attr"):
                c = owner(n, names)
                if c is not None and c not in first_at:
                    first_at[c] = i
        out = {}
        for block, children in parts.items():
            called = sorted((c for c in children if c in first_at), key=first_at.get)
            if len(called) > 1:
                out[block] = [_Part((c,), block, len(called)) for c in called]
        return out


class _Part(tuple):
    """A child of a block (one of `of`): it becomes a block of its own when a cut falls inside its block."""

    def __new__(cls, children, block: str, of: int):
        self = super().__new__(cls, children)
        self.block, self.of = block, of
        return self


def _activations(plan, first: float, costs: list, last: float) -> tuple:
    """Saved activations of one microbatch (per block, before the blocks, after them): the plan's
    step total apportioned by time (blocks alike save alike; the head's logits go with the head)."""
    memory = plan.memory
    total = getattr(memory, "activations", 0) if memory is not None else 0
    whole = (first + sum(costs) + last) or 1.0
    return [total * c / whole for c in costs], total * first / whole, total * last / whole
