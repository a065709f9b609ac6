"""Capture's normal form for a fused projection cut into its parts after a view into heads.

Falcon-7B's multi-query attention computes q, k and v in one projection of 71 + 1 + 1 heads, views
the output as heads, `[b, s, 73, 64]`, and takes the parts from the heads dim: `qkv[..., :-2, :]`,
`qkv[..., [-2], :]`, `qkv[..., [-1], :]`. No split of that view can keep the 71 query heads split
over the ranks while the one K/V head (fewer heads than ranks) is whole on every rank. Taken
before the view, the same parts are slices of the projection's features, `qkv[..., :4544]`
viewed as `[b, s, 71, 64]` and so on: the form of Phi-3's fused `qkv_proj`, which the planner
splits part by part (each rank its query heads, K and V gathered where they are cut out).

`unfuse_head_views` rewrites a graph so, in place: a view of the last dim into (heads, head_dim)
whose every reader takes a contiguous range of heads (a slice, a `select`, an index by a
constant list of consecutive heads) becomes, for each reader, a slice of the features viewed
as that range of heads. Values are the same; an index's copy becomes a view, which a captured
(functional) graph cannot tell apart.

`constant_list_indices` makes such a list index readable on a model built on the meta device:
torch makes the index tensor of `x[..., [-2], :]` on x's device, so torch.export lifts it as a
constant without values; made on the CPU instead (an index tensor may live there whatever x's
device), its values are kept.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from .shapes import DYNAMIC, dynamic_dims

aten = torch.ops.aten

VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
PASS_THROUGH = (aten.lift_fresh_copy.default, aten.detach.default, aten.detach_.default, aten.clone.default)


class constant_list_indices(TorchFunctionMode):
    """While active, `x[..., [i, j], :]` on a meta tensor x indexes with a CPU tensor made from the
    list (the same values, the same op), so that a capture keeps the list's values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            idx = args[1]
            items = idx if isinstance(idx, tuple) else (idx,)
            if any(_int_list(e) for e in items):
                items = tuple(torch.tensor(e, dtype=torch.long) if _int_list(e) else e for e in items)
                return func(args[0], items if isinstance(idx, tuple) else items[0])
        return func(*args, **(kwargs or {}))


def _int_list(e) -> bool:
    return isinstance(e, list) and bool(e) and all(isinstance(i, int) and not isinstance(i, bool) for i in e)


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _constant(gm: fx.GraphModule, node) -> list | None:
    """The values of a 1-D integer constant tensor node (a lifted `get_attr`, through the copies
    export puts around it), else None."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in PASS_THROUGH:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    t = _attr(gm, node.target)
    if not isinstance(t, torch.Tensor) or t.is_meta or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
        return None
    return [int(i) for i in t.tolist()]


def _heads_taken(gm: fx.GraphModule, user: fx.Node, nd: int, heads: int) -> tuple | None:
    """(first head, end, keep the heads dim) of a reader that takes a contiguous range of the
    heads dim (nd - 2) of a `nd`-dim view, else None."""
    t, a = user.target, list(user.args)
    if t is aten.slice.Tensor:
        a += [0, None, None, 1][len(a) - 1:]
        dim, start, stop, step = a[1], a[2], a[3], a[4]
        if dim % nd != nd - 2 or step != 1 or not all(isinstance(x, int) or x is None for x in (start, stop)):
            return None
        start, stop, _ = slice(start, stop).indices(heads)
        return (start, stop, True) if start < stop else None
    if t is aten.select.int and a[1] % nd == nd - 2 and isinstance(a[2], int):
        i = a[2] % heads
        return i, i + 1, False
    if t is aten.index.Tensor:
        idx = list(a[1])
        if len(idx) != nd - 1 or any(i is not None for i in idx[:-1]):
            return None
        values = _constant(gm, idx[-1])
        if not values or any(not -heads <= v < heads for v in values):
            return None
        values = [v % heads for v in values]
        if values != list(range(values[0], values[0] + len(values))):
            return None
        return values[0], values[-1] + 1, True
    return None


def unfuse_head_views(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every view of a tensor's last dim into (heads, head_dim) whose readers
    all take contiguous ranges of heads: each reader becomes a slice of the features viewed as its
    heads. Returns how many views were rewritten (the caller recompiles)."""
    done = 0
    for view in list(gm.graph.nodes):
        if view.op != "call_function" or view.target not in VIEWS or not isinstance(view.args[0], fx.Node):
            continue
        x, shape = view.args[0], view.args[1]
        xv, vv = x.meta.get("val"), view.meta.get("val")
        if not isinstance(xv, torch.Tensor) or not isinstance(vv, torch.Tensor) or not isinstance(shape, (list, tuple)):
            continue
        nd, heads, head_dim = vv.dim(), int(vv.shape[-2]) if vv.dim() >= 2 else 0, int(vv.shape[-1]) if vv.dim() else 0
        if xv.dim() != nd - 1 or nd < 3 or heads < 2 or head_dim < 2 or tuple(xv.shape[:-1]) != tuple(vv.shape[:-2]) \
                or int(xv.shape[-1]) != heads * head_dim or len(shape) != nd \
                or any(s == -1 for s in shape[:-2]) or not view.users:
            continue
        taken = {u: _heads_taken(gm, u, nd, heads) for u in view.users}
        if any(r is None for r in taken.values()):
            continue
        for user, (start, stop, keep) in taken.items():
            with gm.graph.inserting_before(user):
                part = gm.graph.call_function(aten.slice.Tensor, (x, nd - 2, start * head_dim, stop * head_dim))
                part.meta = {k: v for k, v in user.meta.items() if k not in ("val", DYNAMIC)}
                part.meta["val"] = aten.slice.Tensor(xv, nd - 2, start * head_dim, stop * head_dim)
                part.meta[DYNAMIC] = dynamic_dims(x)
                heads_shape = [*shape[:-2], stop - start, head_dim] if keep else [*shape[:-2], head_dim]
                viewed = gm.graph.call_function(aten.view.default, (part, heads_shape))
                viewed.meta = dict(user.meta)
            user.replace_all_uses_with(viewed)
            index = user.args[1][-1] if user.target is aten.index.Tensor else None
            gm.graph.erase_node(user)
            while isinstance(index, fx.Node) and index.op == "call_function" and not index.users:
                nxt = index.args[0]
                gm.graph.erase_node(index)        # the index constant's copies, now unread
                index = nxt
        gm.graph.erase_node(view)
        done += 1
    return done
