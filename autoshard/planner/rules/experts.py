"""A mixture of experts' expert computations (`autoshard::experts`, capture's normal form).

Two ways to split them, both exact, both leaving the layer's output Partial (each rank a summand,
reduced like a dense MLP's row-parallel output), with the tokens, routing indices and routing
weights replicated (their gradients come back Partial):
- "expert_parallel" (TorchShard dim 0): each rank holds E / p whole experts (`Shard(0)` of every
  expert weight and bias, at torch.chunk's boundaries where E does not divide) and computes only
  the slots routed to them;
- "expert_tensor" (dim -1): every expert's FFN split as a dense MLP is, its up projection on the
  intermediate dim (the gate and up halves each split: `Shard(d, 2)`) and its down projection
  on its input dim; a down bias replicated and added as bias / p.
No strategy gathers an expert weight: the op's own rule offers none.
"""
from ...nn.experts import ACT, DOWN, DOWN_BIAS, EXPERTS_OPS, GATED, TRANSPOSED, UP, UP_BIAS, elementwise
from .registry import PARTIAL, REPLICATE, NodeInfo, Shard, register_rule


def expert_args(node):
    """(up, down, up_bias, down_bias, gated, transposed) of an experts node."""
    a = node.args
    return a[UP], a[DOWN], a[UP_BIAS], a[DOWN_BIAS], a[GATED], a[TRANSPOSED]


@register_rule(*EXPERTS_OPS, family="experts")
def _experts(info: NodeInfo):
    up, down, ub, db, gated, transposed = expert_args(info.node)
    p = info.world_size
    biases = [b for b in (ub, db) if b is not None]
    found = [info.req({up: Shard(0), down: Shard(0), **{b: Shard(0) for b in biases}}, "expert_parallel", PARTIAL,
                      compute=1 / p, dim=0, uneven=True)]
    if not elementwise(info.node.args[ACT]):
        return found                 # a gate of the module's own, or an unknown activation, may read the features together
    inner_up, inner_down = (2, 1) if transposed else (1, 2)
    chunks = 2 if gated else 1          # the gate's two halves, each split (transformers' default gate chunks)
    m = {up: Shard(inner_up, chunks), down: Shard(inner_down)}
    if ub is not None:
        m[ub] = Shard(1, chunks)
    if db is not None:
        m[db] = REPLICATE
    found.append(info.req(m, "expert_tensor", PARTIAL, compute=1 / p, dim=-1,
                          grads=None if db is None else {db: REPLICATE}))
    return found


def experts_flops(node) -> float:
    """Forward, backward and backward's recomputation of the experts' FFNs: 4 x 2 x slots x
    (the up and down weights' elements per expert)."""
    up, down = (node.args[UP].meta["val"], node.args[DOWN].meta["val"])
    slots = node.args[0].meta["val"].shape[0] * node.args[1].meta["val"].shape[-1]
    return 8.0 * slots * (up[0].numel() + down[0].numel())
