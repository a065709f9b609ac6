"""Rewrite: a `Plan` -> this rank's `torch.fx.GraphModule`.

Takes the Plan and the captured graph; hands on the rank's module with its shards, collectives
and local ops (`rewriter`, `local_ops`, `outputs`), checked on fake tensors (`verify`), its blocks
kept as modules (`blocks`) and every other call signature served on first use (`signatures`).
"""
from .rewriter import rewrite

__all__ = ["rewrite"]
