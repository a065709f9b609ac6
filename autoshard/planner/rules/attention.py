"""scaled_dot_product_attention: heads (dim -3) sharded in q, k, v and the output, or in q and the
output with one K/V head broadcast to them whole."""
import torch
import torch.nn.functional as F

from .registry import REPLICATE, NodeInfo, Shard, register_rule

aten = torch.ops.aten


@register_rule(F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
def _sdpa(info: NodeInfo):
    q, k, v = info.node.args[:3]
    nd = len(info.shape(q))
    if nd < 3:
        return []
    h = nd - 3
    same = len({info.shape(t)[h] for t in (q, k, v)}) == 1        # unequal shards line up only then
    mask = info.arg(3, "attn_mask")
    found = []
    one = info.shape(k)[h] == info.shape(v)[h] == 1 < info.shape(q)[h]
    # the heads split as torch.chunk does, or over groups of ranks first (the query heads of the
    # kv heads each group gathers: `NodeInfo.shards`)
    for nest in (1, *(info.replica_candidates if same else ())):
        mapping = {q: Shard(h, nest=nest), k: Shard(h, nest=nest), v: Shard(h, nest=nest)}
        if mask in info.inputs:
            ms = info.shape(mask)
            a = h - (nd - len(ms))
            if a >= 0 and ms[a] > 1:
                mapping[mask] = Shard(a, nest=nest)
        found.append(info.req(mapping, "heads", Shard(h, nest=nest), compute=1 / info.world_size, uneven=same))
        if one and nest == 1:
            # one K/V head broadcast over the query heads (Falcon-7B's multi-query attention): read
            # whole on every rank, its gradient a summand from each rank's query heads (Partial)
            found.append(info.req({**mapping, k: REPLICATE, v: REPLICATE}, "heads", Shard(h),
                                  compute=1 / info.world_size, uneven=True))
    return found
