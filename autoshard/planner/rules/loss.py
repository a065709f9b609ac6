"""Cross entropy: vocabulary-parallel over logits sharded on the class dim (1)."""
from ...capture.ops import LOSS_OPS
from .registry import REPLICATE, NodeInfo, Shard, register_rule


@register_rule(*LOSS_OPS)
def _cross_entropy(info: NodeInfo):
    logits, target = info.inputs[0], info.inputs[1]
    shape = info.shape(logits)
    if len(shape) < 2:
        return []
    n = 1
    for i, s in enumerate(shape):
        if i != 1:
            n *= s
    floats = n * 4
    # an all-reduce (max) of n floats, then one of the sum of exp and the target logit (2n floats)
    comm = [("all_reduce", floats), ("all_reduce", 2 * floats)]
    return [info.req({logits: Shard(1), target: REPLICATE}, "vocab", REPLICATE, comm=comm,
                     compute=1 / info.world_size, dim=-1, uneven=True)]
