"""A step without backward (generation): the outputs it holds (the cache: `held_nodes`), and K
and V computed whole cut to each rank's heads before the cache is written.

Where the training plan leaves a K or V projection's output whole on every rank (a fused q/k/v
split in rows that do not follow its heads, Falcon's groups fewer than ranks, a tiny model
whose attention trains whole), a node-by-node choice has no reason to cut it before the cache
write: the price of a whole cache shows only at the graph's output. So, in a step without
backward, the ops between the last projection and a cache output (`cache_chain`) may read a
whole input cut to an even shard of a heads dim for nothing (no backward to price), and such a
shard counts 1/p of their work (`held_share`): the first op with work cuts K and V by heads,
the cache holds each rank's heads, and attention reads them split. A K or V of fewer heads than
ranks is cut so to the heads its readers' queries read (`free_cut`).
"""
from __future__ import annotations

import torch.fx as fx

from ..capture.dynamic import dynamic_dims
from ..capture.ops import flat_outputs
from ..runtime.placements import Replicate, Shard, held_by_readers
from .rules.registry import family_of


def held_nodes(nodes, idx, positions) -> frozenset:
    """The node indices of the graph's flat outputs at `positions` (held: returned as they are)."""
    if not positions:
        return frozenset()
    flat = flat_outputs(nodes)
    return frozenset(idx[flat[k]] for k in positions if isinstance(flat[k], fx.Node))


def cache_chain(prob) -> frozenset:
    """Node indices from which a held output (a cache) is reached through ops other than
    projections and embeddings, and the tensors their other readers read beside them (the
    queries attention reads with the keys)."""
    if not prob.inference or not prob.held:
        return frozenset()
    def between(j):          # an op after the projections (not a projection or embedding itself)
        return prob.kind[j] == "op" and family_of(prob.nodes[j]) not in ("matmul", "embedding")

    chain, stack = set(), list(prob.held)
    while stack:
        j = stack.pop()
        if j not in chain and between(j):
            chain.add(j)
            stack.extend(prob.ins[j])
    readers = {u for j in chain for u in prob.users[j] if u not in chain and prob.kind[u] == "op"}
    return frozenset(chain | {k for u in readers for k in prob.ins[u] if between(k)})


def projected(prob) -> frozenset:
    """The cache chain's tensors computed from a projection's output (K and V on their way to the
    cache, not the rotary tables or masks that meet them)."""
    out = set()
    for j in sorted(prob.cache_chain):
        if any(i in out or family_of(prob.nodes[i]) == "matmul" for i in prob.ins[j]):
            out.add(j)
    return frozenset(out)


def heads_shard(prob, j: int, placement) -> bool:
    """Whether `placement` is an even shard of a dim of tensor j that can hold heads: not its last
    (a head's features), not a dim whose size follows the inputs (batch, tokens), of p or more."""
    if type(placement) is not Shard or placement != Shard(placement.dim):
        return False
    v = prob.val[j]
    return placement.dim != v.dim() - 1 and placement.dim not in dynamic_dims(prob.nodes[j]) and \
        int(v.shape[placement.dim]) >= prob.p


def free_cut(prob, j: int, src, req) -> bool:
    """Whether tensor j goes from `src` to `req` by a local slice with nothing to price, in a step
    without backward: a whole tensor of the cache chain cut to an even heads shard, or a whole K
    or V (`projected`) of fewer heads than ranks cut to the heads its readers' queries read
    (`Shard(d, unit, cover=g)`, in units of a K/V head, not of the query heads it expands to)."""
    if not prob.free_cuts or type(src) is not Replicate:
        return False
    if held_by_readers(req):
        heads = int(prob.val[j].shape[req.dim]) // req.unit
        return j in prob.projected and req.unit != req.cover and 1 < heads < prob.p
    return j in prob.cache_chain and heads_shard(prob, j, req)


def held_share(prob, i: int, s) -> float:
    """The share of node i's work a rank does under strategy s: 1/p for a heads shard of the cache
    chain's output in a step without backward, else the strategy's own."""
    if i in prob.cache_chain and heads_shard(prob, i, s.output):
        return min(s.compute, 1 / prob.p)
    return s.compute
