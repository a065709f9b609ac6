"""Planner: a captured graph -> a `Plan` (the search over TorchShard's parallel dims).

Takes the GraphModule of `autoshard.capture`; the rules (`rules/`, one file per op family) give
each node's strategies, the cost model (`cost`) prices them, `problem` lays the graph out as arrays,
`decisions` groups the parameters that decide together, `search` finds an assignment and `build`
freezes it: hands on the Plan that `autoshard.rewrite` and the views read.
"""
from .build import build_plan, plan_graph

__all__ = ["build_plan", "plan_graph"]
