"""Ops with weights: linear / addmm (column, row, batch pass-through), matmul, embedding.

Column: input Replicate (its gradient comes back Partial), weight split on its output dim,
output sharded on the last dim. Row: input sharded on the last dim, weight split on its
input dim, output Partial; with a bias the op either reduces itself and adds the bias once, or
stays Partial with each rank adding bias / p (`nn.functional.bias_share`: the bias's gradient is
the whole output gradient every rank holds, so no collective), so that two row-parallel results
can be summed before one all-reduce (parallel attention and MLP with biases: GPT-NeoX, Phi-2).
"""
from dataclasses import replace

import torch
import torch.nn.functional as F

from ...runtime.counters import in_groups
from ...runtime.placements import ReplicatePartialGrad, cover_ranges, padded, splits
from .registry import PARTIAL, REPLICATE, REPLICATE_PG, NodeInfo, Shard, ShardGathered, may_differ, register_rule

aten = torch.ops.aten


def _bytes(info: NodeInfo, n=None) -> int:
    v = info.val(info.node if n is None else n)
    return v.numel() * v.element_size()


def column_row(info: NodeInfo, x, w, b, *, x_dim: int, out_dim: int, w_out_dim: int, w_in_dim: int) -> list:
    """Column and row strategies of a map over features (x's `x_dim`, the output's `out_dim`)
    with weight W (output features on `w_out_dim`, input features on `w_in_dim`) and bias b:
    linear layers and convolutions."""
    p = info.world_size
    found = []
    size = info.shape(w)[w_out_dim]
    for pl in info.shards(w_out_dim, size) + info.group_shards(w_out_dim, size):   # a fused projection's blocks
        m = {x: REPLICATE, w: pl}
        if b is not None:
            m[b] = replace(pl, dim=0)
        found.append(info.req(m, "column", replace(pl, dim=out_dim), compute=1 / p, dim=-1, uneven=may_differ(pl)))
    for pl in info.shards(w_in_dim, info.shape(w)[w_in_dim]):       # k > 1: the input is k pieces, each split
        found += _row(info, {x: replace(pl, dim=x_dim), w: pl}, b, uneven=may_differ(pl))
    return found


def _row(info: NodeInfo, m: dict, b, *, uneven: bool) -> list:
    """Row strategies on split input features (`m`): the output Partial (a bias, if any, added as
    bias / p on every rank, its gradient whole), and with a bias also reduced inside the op with
    the bias added once after the all-reduce (what a consumer that needs the sum whole reads)."""
    p = info.world_size
    found = [info.req(m, "row", PARTIAL, compute=1 / p, dim=0, uneven=uneven,
                      grads=None if b is None else {b: REPLICATE})]
    if b is not None:
        found.append(info.req(m, "row", REPLICATE, compute=1 / p, dim=0, uneven=uneven,
                              comm=[("all_reduce", _bytes(info))]))
    return found


def matmul_family(info: NodeInfo, x, w, b, *, w_out_dim: int, w_in_dim: int):
    """Strategies of y = x @ W (+ b) where W's output features lie on `w_out_dim`."""
    p = info.world_size
    out_nd = len(info.out_shape)
    found = column_row(info, x, w, b, x_dim=len(info.shape(x)) - 1, out_dim=out_nd - 1,
                       w_out_dim=w_out_dim, w_in_dim=w_in_dim)
    for d in range(out_nd - 1):              # batch dims pass through with a replicated weight
        if info.out_shape[d] > 1:            # (on the tokens of a sequence-parallel stream at any size)
            found.append(info.req({x: Shard(d)}, f"shard({d})", Shard(d), compute=1 / p,
                                  uneven=info.tokens and d == out_nd - 2))
    if info.fewer_units(info.shape(w)[w_out_dim]):
        found += whole_heads(info, x, w, b, w_out_dim)
    return found


def whole_heads(info: NodeInfo, x, w, b, w_out_dim: int) -> list:
    """Fewer output heads than ranks (K and V of grouped attention): the output whole on every
    rank with its gradient left Partial (`REPLICATE_PG`), to be sliced by the heads each rank's
    queries read. Two ways, priced by the cost model:
    - "column_gather_pg": the weight split (1/p of it per rank), the output all-gathered and its
      gradient reduce-scattered back (tokens x K/V features each way);
    - "replicate_pg": the weight replicated (Megatron's replicated K/V heads) and its gradient
      all-reduced (hidden x K/V features): fewer bytes when a step has more tokens than the
      hidden size, at the memory of a replicated weight.
    - "column_gather_groups": the weight split, the output all-gathered within groups of m ranks
      (`Shard(d, replicas=m)`), each group holding the K/V heads its ranks' queries read, its
      gradient reduce-scattered within the group: (m-1)/(p-1) of the bytes of "column_gather_pg"
      at m-1 ring steps (4 kv heads on 8 ranks: groups of 2, each gathering one head, 1/7).
    Where there are no such groups (2 kv heads on 3 ranks), the output may be held by the ranks
    whose queries read each head (`Shard(d, unit=head, cover=g)`, `cover_heads`).
    (Replicating the weight and all-reducing the output's gradient moves the bytes of the first
    with the memory of the second: never cheaper, not offered.)"""
    params = [w] + ([b] if b is not None else [])
    last = len(info.out_shape) - 1
    split = {x: REPLICATE, w: ShardGathered(w_out_dim), **({b: ShardGathered(0)} if b is not None else {})}
    found, out = [], _bytes(info)
    if splits(info.out_shape, Shard(last), info.world_size):   # (4 classes on 8 ranks: a rank would hold none)
        out = padded(out, info.out_shape, Shard(last), info.world_size)    # (cut in elements: 6, 6, 4)
        found.append(info.req(split, "column_gather_pg", REPLICATE_PG, grads={x: PARTIAL}, compute=1 / info.world_size,
                              dim=-1, uneven=True, comm=[("all_gather", out), ("reduce_scatter", out)]))
    found.append(info.req({x: REPLICATE, **{q: REPLICATE_PG for q in params}}, "replicate_pg", REPLICATE_PG,
                          grads={x: PARTIAL, **{q: PARTIAL for q in params}}))
    m = info.group_size(info.shape(w)[w_out_dim])
    if m is not None:
        within = {w: ShardGathered(w_out_dim, within=m), **({b: ShardGathered(0, within=m)} if b is not None else {})}
        found.append(info.req({x: REPLICATE, **within}, "column_gather_groups", Shard(len(info.out_shape) - 1, replicas=m),
                              grads={x: PARTIAL}, compute=1 / info.world_size, dim=-1,
                              comm=[(in_groups("all_gather", m), out), (in_groups("reduce_scatter", m), out)]))
    else:
        found += cover_heads(info, x, w, b, w_out_dim, out)
    return found


def cover_heads(info: NodeInfo, x, w, b, w_out_dim: int, gathered: float) -> list:
    """K/V of fewer heads than ranks with no groups of ranks to hold them (2 kv heads on 3 ranks:
    query heads 0-1, 2-3 and 4-5 read kv head 0, both, and 1): the output held by the ranks whose
    queries read each head (`Shard(d, unit=head, cover=g)`, g query heads a kv head), each rank
    computing, caching and reading only those, in two ways:
    - "replicate_cover": the weight replicated (`ReplicatePartialGrad(cut=g)`), each rank's
      projection computing its heads' rows only, the weight's gradient (each rank's rows, zeros
      elsewhere) all-reduced: no collective forward (a decode step moves nothing for K/V);
    - "column_gather_cover": the weight split (`ShardGathered(d, cut=g)`), the output all-gathered
      and cut to the rank's heads, its gradient's summands reduce-scattered back (the bytes of
      "column_gather_pg").
    In a step without backward (`info.inference`: generation) the weight's gradient placement
    means nothing, so either way also reads a weight stored alike in the layouts training gave it
    (whole: `REPLICATE` or `REPLICATE_PG`; split: `ShardGathered(d)`): a K/V projection trained
    whole still caches only the rank's heads.
    The head is the largest unit the graph cuts the features into."""
    p, size, last = info.world_size, info.shape(w)[w_out_dim], len(info.out_shape) - 1
    heads = [u for u in info.unit_candidates if 1 < u <= size and size % u == 0 and size // u > 1]
    if not heads:
        return []
    unit, params = max(heads), [w] + ([b] if b is not None else [])
    found = []
    for g in info.cover_candidates:
        ranges = cover_ranges(size, p, unit, g)
        if ranges is None:
            continue
        share = sum(hi - lo for lo, hi in ranges) / (p * size)      # a rank's mean share of the rows
        held = Shard(last, unit=unit, cover=g)
        whole = ReplicatePartialGrad(cut=g)
        found.append(info.req({x: REPLICATE, **{q: whole for q in params}}, "replicate_cover", held,
                              grads={x: PARTIAL, **{q: PARTIAL for q in params}}, compute=share, uneven=True))
        split = {w: ShardGathered(w_out_dim, cut=g), **({b: ShardGathered(0, cut=g)} if b is not None else {})}
        found.append(info.req({x: REPLICATE, **split}, "column_gather_cover", held, grads={x: PARTIAL},
                              compute=1 / p, dim=-1, uneven=True,
                              comm=[("all_gather", gathered), ("reduce_scatter", gathered)]))
        if info.inference:            # no backward: no gradient placed, none priced
            for whole in (REPLICATE, REPLICATE_PG):
                found.append(info.req({x: REPLICATE, **{q: whole for q in params}}, "replicate_cover", held,
                                      grads={x: REPLICATE, **{q: whole for q in params}}, compute=share, uneven=True))
            split = {w: ShardGathered(w_out_dim), **({b: ShardGathered(0)} if b is not None else {})}
            found.append(info.req({x: REPLICATE, **split}, "column_gather_cover", held, grads={x: REPLICATE},
                                  compute=1 / p, dim=-1, uneven=True, comm=[("all_gather", gathered)]))
    return found


@register_rule(F.linear, aten.linear.default, family="matmul")
def _linear(info):
    x, w = info.node.args[0], info.node.args[1]
    b = info.arg(2, "bias")
    return matmul_family(info, x, w, b if b in info.inputs else None, w_out_dim=0, w_in_dim=1)


@register_rule(aten.addmm.default, torch.addmm, family="matmul")
def _addmm(info):
    b, x, w = info.node.args[:3]
    if len(info.shape(b)) != 1:
        return []
    return matmul_family(info, x, w, b, w_out_dim=1, w_in_dim=0)


@register_rule(torch.matmul, torch.Tensor.matmul, operator_matmul := __import__("operator").matmul,
               torch.bmm, torch.Tensor.bmm, aten.matmul.default, aten.bmm.default, aten.mm.default, torch.mm,
               family="matmul")
def _matmul(info):
    a, b = info.node.args[0], info.node.args[1]
    sa, sb, so = info.shape(a), info.shape(b), info.out_shape
    if len(sa) < 2 or len(sb) < 2:
        return []
    p = info.world_size
    found = [
        info.req({a: Shard(len(sa) - 2), b: REPLICATE}, "rows", Shard(len(so) - 2), compute=1 / p, uneven=True),
        info.req({a: REPLICATE, b: Shard(len(sb) - 1)}, "column", Shard(len(so) - 1), compute=1 / p, dim=-1,
                 uneven=True),
        info.req({a: Shard(len(sa) - 1), b: Shard(len(sb) - 2)}, "row", PARTIAL, compute=1 / p, dim=0, uneven=True),
    ]
    for u in info.units(sb[-1]):
        found.append(info.req({a: REPLICATE, b: Shard(len(sb) - 1, unit=u)}, "column", Shard(len(so) - 1, unit=u),
                              compute=1 / p, dim=-1, uneven=True))
    for u in info.units(sa[-1]):
        found.append(info.req({a: Shard(len(sa) - 1, unit=u), b: Shard(len(sb) - 2, unit=u)}, "row", PARTIAL,
                              compute=1 / p, dim=0, uneven=True))
    for pl in info.part_shards(len(sb) - 1, sb[-1]):          # `x @ w.T` of a fused projection (Falcon's)
        found.append(info.req({a: REPLICATE, b: pl}, "column", replace(pl, dim=len(so) - 1), compute=1 / p, dim=-1,
                              uneven=may_differ(pl)))
    for pl in info.part_shards(len(sa) - 1, sa[-1]):
        found.append(info.req({a: replace(pl, dim=len(sa) - 1), b: replace(pl, dim=len(sb) - 2)}, "row", PARTIAL,
                              compute=1 / p, dim=0, uneven=may_differ(pl)))
    if len(sa) == len(sb) == len(so):       # shared batch dims
        for d in range(len(so) - 2):
            if sa[d] == sb[d] == so[d] > 1:
                found.append(info.req({a: Shard(d), b: Shard(d)}, f"shard({d})", Shard(d), compute=1 / p,
                                      uneven=True))
            for x, y, sx, sy in ((a, b, sa, sb), (b, a, sb, sa)):
                if sx[d] == so[d] > 1 == sy[d]:   # broadcast over the other's dim (one K/V head, Falcon's)
                    found.append(info.req({x: Shard(d), y: REPLICATE}, f"shard({d})", Shard(d), compute=1 / p,
                                          uneven=True))
    return found


def embedding_strategies(info: NodeInfo, idx, w):
    """Vocabulary split (masked lookup, output Partial) or hidden split (output sharded)."""
    p = info.world_size
    last = len(info.out_shape) - 1
    return [
        info.req({idx: REPLICATE, w: Shard(0)}, "vocab", PARTIAL, compute=1 / p, dim=0, uneven=True),
        info.req({idx: REPLICATE, w: Shard(1)}, "hidden", Shard(last), compute=1 / p, dim=1, uneven=True),
    ]


@register_rule(F.embedding, family="embedding")
def _embedding(info):
    return embedding_strategies(info, info.node.args[0], info.arg(1, "weight"))


@register_rule(aten.embedding.default, family="embedding")
def _aten_embedding(info):
    return embedding_strategies(info, info.node.args[1], info.node.args[0])
