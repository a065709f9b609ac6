"""scaled_dot_product_attention: heads (dim -3) sharded in q, k, v and the output."""
import torch
import torch.nn.functional as F

from .registry import NodeInfo, Shard, register_rule

aten = torch.ops.aten


@register_rule(F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
def _sdpa(info: NodeInfo):
    q, k, v = info.node.args[:3]
    nd = len(info.shape(q))
    if nd < 3:
        return []
    h = nd - 3
    mapping = {q: Shard(h), k: Shard(h), v: Shard(h)}
    mask = info.arg(3, "attn_mask")
    if mask in info.inputs:
        ms = info.shape(mask)
        a = h - (nd - len(ms))
        if a >= 0 and ms[a] > 1:
            mapping[mask] = Shard(a)
    same = len({info.shape(t)[h] for t in (q, k, v)}) == 1        # unequal shards line up only then
    return [info.req(mapping, "heads", Shard(h), compute=1 / info.world_size, uneven=same)]
