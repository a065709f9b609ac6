"""Weights tied between an embedding and a head: which decision groups they are, which modules run
their lookups, and which the relaxing step keeps split on the vocabulary (`planner.relax`).
"""
from __future__ import annotations

from ..runtime.placements import Shard
from .decisions import module_of


def tied_heads(prob) -> list:
    """The decision groups whose weight an embedding and a head (any other op) both read."""
    return [g for g, grp in enumerate(prob.groups) if {_is_embedding(prob, a) for a in grp.anchors} == {True, False}]


def vocabulary_heads(prob, state) -> set:
    """Groups tied between an embedding and a head (`tied_heads`), split on the vocabulary: `relax`
    keeps them so. The plan serves decoding too, where such a head's logits are gathered once a
    token (Megatron's bytes) and one split on features all-reduces them, a step's worth more (GPT-2
    at 2 ranks: 2,176 bytes a token against 1,792): a training step's few percent do not pay for it."""
    out = set()
    for g in tied_heads(prob):
        first = prob.groups[g].choices[state.choice[g]][0]
        if isinstance(first, Shard) and first.dim == 0:
            out.add(g)
    return out


def lookups(prob, g) -> list:
    """The modules that run group g's embedding lookups (a weight tied to a head: what a pin of the
    vocabulary split names, `benchmarks/optimality.py --vocabulary`)."""
    return sorted({module_of(prob, a) for a in prob.groups[g].anchors if _is_embedding(prob, a)})


def _is_embedding(prob, i) -> bool:
    n = prob.nodes[i]
    if n.op == "call_module":
        return type(prob.gm.get_submodule(n.target)).__name__ == "Embedding"
    return "embedding" in getattr(n.target, "__name__", str(n.target))
