"""Which collectives turn one placement into another, forward and backward.

Facts about placements that the planner prices (`planner.cost`, `planner.problem`) and the
rewrite inserts (`rewrite.rewriter`): each forward collective's backward is its dual, a Partial
gradient is reduced where its consumer needs it whole or split.
"""
from __future__ import annotations

from functools import lru_cache

from .placements import Partial, Replicate, ReplicatePartialGrad, Shard, held_by_groups, held_by_readers


def grad_of(placement):
    """The placement a gradient must end in for a tensor of this forward placement."""
    if isinstance(placement, ReplicatePartialGrad):
        return Partial()
    return Replicate() if isinstance(placement, Partial) else placement


def partial_grad_edge(src, req, grad, param: bool):
    """(forward kinds, backward kinds) of an edge from a tensor held `ReplicatePartialGrad` or to
    that requirement, None where it cannot run, NotImplemented when neither end is one.

    Only a parameter is read as Rp (it is held so, and its gradient, Partial, is all-reduced
    here: the weight-gradient all-reduce of replicated K/V heads). An Rp activation is read whole
    by ops that send back Partial gradients (nothing to do) or sliced (its piece of the gradient
    zero-padded: Partial, no collective); an op that sends back a whole gradient cannot read it
    (that gradient would be counted p times), and it is never made Partial."""
    rp_src, rp_req = isinstance(src, ReplicatePartialGrad), isinstance(req, ReplicatePartialGrad)
    if not (rp_src or rp_req):
        return NotImplemented
    if held_by_groups(src) or held_by_groups(req) or held_by_readers(src) or held_by_readers(req):
        return None
    if rp_req:
        if not (param and src == req):         # (each Rp layout is read by the strategies that chose it)
            return None
        return (), (("all_reduce",) if isinstance(grad, Partial) else ())
    if param:                          # an Rp parameter is read only by the ops that chose it
        return None
    if isinstance(req, Shard):
        return (), ()
    if isinstance(req, Replicate) and isinstance(grad, Partial):
        return (), ()
    return None


@lru_cache(maxsize=None)
def redistribute(src, dst) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(forward kinds, backward kinds) to turn `src` into `dst`; None if not possible.

    Each forward collective's backward is its dual: all-reduce <-> identity, all-gather <->
    split, slice <-> all-gather, reduce-scatter <-> all-gather, all-to-all <-> all-to-all.
    """
    if src == dst or src is None or dst is None:
        return (), ()
    if held_by_readers(src) or held_by_readers(dst):
        # cut to a contiguous shard of the same dim lying inside each rank's piece (the query
        # heads inside the K/V heads they read: `Problem.redistribution` checks it), its gradient
        # zero-padded, still a summand; a whole tensor is cut to it, its gradient's summands
        # all-reduced (a held cache input: no gradient); nothing else reads it
        if held_by_readers(src):
            cut = isinstance(dst, Shard) and not held_by_readers(dst) and dst.replicas == 1 and dst.dim == src.dim \
                and (dst.chunks, dst.parts, dst.groups) == (1, None, 1)
            return ((), ()) if cut else None
        return ((), ("all_reduce",)) if type(src) is Replicate else None
    if held_by_groups(src) or held_by_groups(dst):
        # a group's piece is only cut to this rank's own (its gradient zero-padded: still a
        # summand within the group) where it lies there (`Problem.nested`); nothing else reads
        # it (see rules.registry.closed_groups)
        cut = held_by_groups(src) and isinstance(dst, Shard) and not held_by_groups(dst) and \
            (dst.dim, dst.chunks, dst.parts) == (src.dim, src.chunks, src.parts)
        return ((), ()) if cut else None
    if isinstance(src, ReplicatePartialGrad) or isinstance(dst, ReplicatePartialGrad):
        # forward: a slice or nothing; backward: see partial_grad_edge
        return None if isinstance(dst, Partial) else ((), ())
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return ("all_reduce",), ()
        return ("reduce_scatter",), ("all_gather",)
    if isinstance(dst, Partial):
        return None
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return ("all_gather",), ()
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return (), ("all_gather",)
    if src.dim == dst.dim or (src.chunks, src.unit, dst.chunks, dst.unit) != (1, 1, 1, 1):
        # other boundaries on the same dim (whole heads), or a strided / whole-unit shard, which an
        # all-to-all's equal contiguous blocks cannot hold: gathered, then cut
        return ("all_gather",), ("all_gather",)
    return ("all_to_all",), ("all_to_all",)


def grad_fix(produced, wanted) -> tuple[str, ...]:
    """Backward collectives that turn a consumer's gradient into the placement it must have."""
    if produced == wanted or produced is None:
        return ()
    if isinstance(produced, Partial):
        return ("all_reduce",) if isinstance(wanted, Replicate) else ("reduce_scatter",)
    if isinstance(produced, Shard) and isinstance(wanted, Replicate):
        return ("all_gather",)
    return ("all_to_all",)


def fused_backward(fwd, grad, req) -> bool:
    """Whether a gather (`fwd` = all-gather to Replicate) whose consumers send back Partial
    gradients takes them back with the all-gather's own dual, one reduce-scatter, instead of an
    all-reduce and a local slice (Megatron's sequence parallelism: the norm output gathered
    before column-parallel projections; half the backward bytes)."""
    return fwd == ("all_gather",) and isinstance(grad, Partial) and isinstance(req, Replicate)
