"""Pipeline stages cut from a rank's graph: the skeleton that calls one module per block
(autoshard.rewrite.blocks) split at block boundaries into one GraphModule per stage.

Every node of the skeleton is one of three kinds:
- *free*: computed from the model's inputs and buffers only, by pure ops (position ids, rotary
  tables, masks, sizes): recomputed by each stage that reads it, never sent (sending a rotary
  table costs bytes, recomputing it a few element-wise ops; sizes cannot be sent at all);
- a *parameter* read (`get_attr`): held by every stage that reads it (a tied embedding and head:
  the first and the last stage, whose gradients the runtime sums);
- any other op: it runs on one stage, the block's own for a block call, else the latest stage of
  its inputs (the embedding on the first stage, the final norm, head and loss on the last).

What a stage computes and a later stage reads is sent: stage s returns, in graph order, every
such value it holds (its own or passed on from earlier stages), and stage s+1 takes them as its
positional inputs, then the model's own inputs by keyword (every stage gets the microbatch's
inputs, as `autoshard_x_<k>`, from which it recomputes the free values). The last stage returns the loss (training) or
every output of the model (evaluation). The nodes are the rank's own, collectives included, so
each stage is exactly that part of the tensor-parallel module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..capture.ops import kinds
from ..errors import ShardingError

ANYWHERE = -1                     # a parameter read: placed with each reader


@dataclass(frozen=True)
class StageGraphs:
    """One graph's cut: a GraphModule per stage, what crosses each boundary, who reads what."""

    modules: tuple                # fx.GraphModule per stage
    sent: tuple                   # per boundary s -> s+1: names of the values sent
    readers: dict                 # parameter target -> stages that read it
    output_leaves: int            # how many outputs the last stage returns


def input_name(k: int) -> str:
    """A stage's name for the model's k-th input (no clash with a schedule's own keywords)."""
    return f"autoshard_x_{k}"


def _loss_leaf(leaves: list, is_loss) -> int:
    found = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node) and is_loss(i)]
    if not found:
        raise ShardingError("pipeline: the model returns no scalar loss for this call (the last stage's loss is what "
                            "the schedule backpropagates): pass the labels / targets the model computes its loss from")
    return found[0]


def cut(root: nn.Module, graph: fx.Graph, stage_of: dict, stages: int, *, loss_only: bool, is_loss,
        name: str = "Stage") -> StageGraphs:
    """Cut `graph` (nodes' targets in `root`) into `stages` GraphModules; `stage_of`: block name ->
    stage. `loss_only`: the last stage returns the loss leaf alone (`is_loss(i)`: whether the
    i-th output leaf is the scalar loss), else every output leaf."""
    free, params = kinds(root, graph)
    nodes = list(graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    leaves, _ = pytree.tree_flatten(out_node.args[0])
    if loss_only:
        leaves = [leaves[_loss_leaf(leaves, is_loss)]]
    place: dict = {}
    for n in nodes:
        if n in free or n.op == "output":
            continue
        if n in params:
            place[n] = ANYWHERE
            continue
        before = [place[i] for i in n.all_input_nodes if i not in free and place[i] != ANYWHERE]
        if n.op == "call_module" and n.target in stage_of:
            s = stage_of[n.target]
            late = [i for i in n.all_input_nodes if i not in free and place[i] > s]
            if late:
                raise ShardingError(f"pipeline: block {n.target} (stage {s}) reads {late[0].name}, which is computed "
                                    f"on stage {place[late[0]]}: the blocks are not in the order the model calls them")
            place[n] = s
        else:
            place[n] = max(before, default=0)
    last = stages - 1
    # what each stage needs: its own nodes, the free and parameter nodes they read, the values sent to it
    readers: dict = {}
    reads_at = {}                                    # node -> latest stage that reads it
    for n in nodes:
        if n.op == "output":
            for leaf in leaves:
                if isinstance(leaf, fx.Node):
                    reads_at[leaf] = max(reads_at.get(leaf, 0), last)
            continue
        if n in free or place[n] == ANYWHERE:
            continue
        for i in n.all_input_nodes:
            reads_at[i] = max(reads_at.get(i, 0), place[n])
    sent = []
    for s in range(last):
        sent.append([n for n in nodes if n in place and place[n] != ANYWHERE and place[n] <= s
                     and reads_at.get(n, -1) > s])
    modules = []
    originals = [n for n in nodes if n.op == "placeholder"]
    for s in range(stages):
        mine = [n for n in nodes if n in place and place[n] == s]
        needed = set(mine)
        stack = list(mine) + ([leaf for leaf in leaves if isinstance(leaf, fx.Node)] if s == last else []) \
            + (sent[s] if s < last else [])
        while stack:                                 # the free and parameter nodes this stage reads
            n = stack.pop()
            for i in n.all_input_nodes:
                if i not in needed and (i in free or place.get(i) == ANYWHERE):
                    needed.add(i)
                    stack.append(i)
        g = fx.Graph()
        env: dict = {}
        for k, v in enumerate(sent[s - 1] if s > 0 else []):
            env[v] = g.placeholder(f"autoshard_in_{k}")
        for k, p in enumerate(originals):
            env[p] = g.placeholder(input_name(k), default_value=None)
        for n in nodes:
            if n.op in ("placeholder", "output") or n not in needed or n in env:
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
            if n in params:
                readers.setdefault(n.target, set()).add(s)
        if s < last:
            result = tuple(env[v] for v in sent[s])
        else:
            missing = [leaf.name for leaf in leaves if isinstance(leaf, fx.Node) and leaf not in env]
            if missing:
                raise ShardingError(f"pipeline: the outputs {missing} are not computed by the last stage")
            result = tuple(env[leaf] if isinstance(leaf, fx.Node) else leaf for leaf in leaves)
            result = result[0] if loss_only else result
        g.output(result)
        g.lint()
        modules.append(fx.GraphModule(root, g, class_name=f"{name}{s}"))
    return StageGraphs(tuple(modules), tuple(tuple(v.name for v in b) for b in sent),
                       {k: tuple(sorted(v)) for k, v in readers.items()}, len(leaves))
