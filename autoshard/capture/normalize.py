"""Capture's normal forms: graphs rewritten, equal in value, into forms the rules can split.

A fused projection cut into its parts after a view into heads (`unfuse_head_views`):
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

Batch and heads merged for `bmm` (`unmerge_batch_heads`): BLOOM computes its scores as
`alibi.baddbmm(q.reshape(b * H, s, d), k.reshape(b * H, s, d).transpose(-1, -2))` and views them
back as `[b, H, s, s]`. Heads merged under the batch cannot be split over the ranks (the merged
dim's shards would be strided by a batch size that varies), so the pass keeps them apart: the
same products as a 4-d `matmul` of the tensors before the merge, the bias (alibi: `[H, 1, s]`
repeated b times) broadcast over the batch, `baddbmm`'s beta and alpha as products.

Parts of groups (`regroup_blocks`): CodeGen lays its fused `qkv_proj` out in 4 model-parallel
groups, each its heads' q, v and k (`mp_num = 4`), views the output as `[b, s, 4, 3 * 256]`,
splits the last dim into q, v and k and merges (group, features) into heads. At 8 ranks a rank's
2 heads are half of one group's q, v and k: a shard of two dims of that view, which no
placement holds. The pass takes the parts from `regroup(x, 4, 3)` instead (q of every group, then
v, then k: `nn.functional.regroup`), sliced one after another as Phi-3's `qkv_proj` is, and the
heads views read those slices. The planner holds the projection in grouped blocks
(`Shard(d, 12, groups=4)`) that `regroup` turns into the parts split block by block.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from ..nn.functional import regroup
from .dynamic import DYNAMIC, dynamic_dims
from .shapes import fetch_attr

aten = torch.ops.aten

VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
UNGROUPED = "autoshard_ungrouped_kv"    # meta key of an sdpa `ungroup_kv_heads` wrote without enable_gqa
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


def _set_meta(node: fx.Node, like: fx.Node, val, dynamic) -> None:
    """A new node's meta: `like`'s (its module stack, source), with its own value and dynamic dims."""
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val", DYNAMIC)}
    node.meta["val"] = val
    node.meta[DYNAMIC] = dynamic


def _constant(gm: fx.GraphModule, node) -> list | None:
    """The values of a 1-D integer constant tensor node (a lifted `get_attr`, through the copies
    export puts around it), else None."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in PASS_THROUGH:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    t = fetch_attr(gm, node.target)
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
                _set_meta(part, user, aten.slice.Tensor(xv, nd - 2, start * head_dim, stop * head_dim), dynamic_dims(x))
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


MERGES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
BMMS = (aten.bmm.default, aten.baddbmm.default)


def _shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(x) for x in v.shape) if isinstance(v, torch.Tensor) else None


def _unmerged(n, b: int, h: int):
    """How to rebuild a `[b * h, x, y]` operand as `[b, h, x, y]` (or `[1, h, x, y]`, broadcast):
    a list of steps from a 4-d source, applied in order; None where it is no such merge."""
    steps = []
    while True:
        shape = _shape(n)
        if n.op != "call_function" or shape is None:
            return None
        if n.target in MERGES and len(shape) == 3 and _shape(n.args[0]) == (b, h, *shape[1:]):
            return n.args[0], steps[::-1]
        if n.target is aten.transpose.int and len(shape) == 3 and sorted(a % 3 for a in n.args[1:]) == [1, 2]:
            steps.append(("transpose",))
        elif n.target is aten.repeat.default and list(n.args[1]) [1:] == [1, 1] and _shape(n.args[0]) == (h, *shape[1:]):
            return n.args[0], [("unsqueeze",)] + steps[::-1]          # the bias, the same for every batch row
        elif n.target in (aten.to.dtype, aten._to_copy.default):
            steps.append(("like", n))
        else:
            return None
        n = n.args[0]


def _apply(gm: fx.GraphModule, src: fx.Node, steps, before: fx.Node) -> fx.Node:
    """The 4-d operand: `src` with `steps` applied (meta computed on its fake value)."""
    out = src
    for step in steps:
        with gm.graph.inserting_before(before):
            if step[0] == "transpose":
                new = gm.graph.call_function(aten.transpose.int, (out, -1, -2))
                dyn = _swap(dynamic_dims(out), 2, 3)
            elif step[0] == "unsqueeze":
                new = gm.graph.call_function(aten.unsqueeze.default, (out, 0))
                dyn = frozenset(d + 1 for d in dynamic_dims(out))
            else:
                like = step[1]
                new = gm.graph.call_function(like.target, (out, *like.args[1:]), dict(like.kwargs))
                dyn = dynamic_dims(out)
        _set_meta(new, before, new.target(out.meta["val"], *new.args[1:], **new.kwargs), dyn)
        out = new
    return out


def _swap(dims, a: int, b: int) -> frozenset:
    return frozenset(b if d == a else a if d == b else d for d in dims)


def unmerge_batch_heads(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every `bmm` / `baddbmm` over batch x heads merged (`[b * H, x, y]`
    operands made by merging `[b, H, x, y]`, the result only viewed back as `[b, H, x, y]`) as a
    4-d `matmul` of the unmerged operands (a baddbmm's bias broadcast, beta and alpha applied as
    products). Returns how many were rewritten (the caller recompiles)."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in BMMS or not n.users:
            continue
        out = _shape(n)
        backs = list(n.users)
        if out is None or any(u.target not in MERGES or len(_shape(u) or ()) != 4 for u in backs):
            continue
        b, h = _shape(backs[0])[:2]
        if b * h != out[0] or b < 1 or h < 2 or any(_shape(u) != (b, h, *out[1:]) for u in backs):
            continue
        bias = n.target is aten.baddbmm.default
        operands = [n.args[1], n.args[2], n.args[0]] if bias else [n.args[0], n.args[1]]
        found = [_unmerged(x, b, h) if isinstance(x, fx.Node) else None for x in operands]
        if any(f is None for f in found) or any(st and st[0][0] == "unsqueeze" for _, st in found[:2]):
            continue                      # (only the bias may be one tensor repeated over the batch)
        back = backs[0]
        a4, b4 = (_apply(gm, src, steps, n) for src, steps in found[:2])
        with gm.graph.inserting_before(n):
            prod = gm.graph.call_function(aten.matmul.default, (a4, b4))
        prod.meta = dict(back.meta)
        prod.meta["val"] = aten.matmul.default(a4.meta["val"], b4.meta["val"])
        result = prod
        if bias:
            beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
            c4 = _apply(gm, *found[2], n)
            with gm.graph.inserting_before(n):
                if alpha != 1:
                    prod = gm.graph.call_function(aten.mul.Tensor, (prod, alpha))
                    prod.meta = dict(result.meta)
                    prod.meta["val"] = result.meta["val"] * alpha
                if beta != 1:
                    scaled = gm.graph.call_function(aten.mul.Tensor, (c4, beta))
                    scaled.meta = dict(c4.meta)
                    scaled.meta["val"] = c4.meta["val"] * beta
                    c4 = scaled
                result = gm.graph.call_function(aten.add.Tensor, (c4, prod))
            result.meta = dict(back.meta)
            result.meta["val"] = aten.add.Tensor(c4.meta["val"], prod.meta["val"])
        for u in backs:
            u.replace_all_uses_with(result)
            gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        done += 1
    if done:                              # the merges left unread (only those: nothing else is touched)
        gm.graph.eliminate_dead_code(is_impure_node=lambda x: x.op != "call_function" or x.target not in
                                     (*MERGES, aten.transpose.int, aten.repeat.default, aten.to.dtype,
                                      aten._to_copy.default))
    return done


SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def _merges_groups(n: fx.Node, lead: tuple, features: int) -> bool:
    """Whether `n` views a `[*lead, G, c]` part as `[*lead, heads, head_dim]` (G * c features)."""
    out = _shape(n)
    return n.op == "call_function" and n.target in VIEWS and out is not None and len(out) == len(lead) + 2 \
        and out[:len(lead)] == lead and out[-2] * out[-1] == features


def regroup_blocks(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every view of a tensor's last dim into (G groups, features) whose one
    reader splits the features into K equal parts, each part only viewed as heads (merging G
    and its features): the parts become slices of `regroup(x, G, K)`, the heads views read them.
    Returns how many were rewritten (the caller recompiles)."""
    done = 0
    for view in list(gm.graph.nodes):
        if view.op != "call_function" or view.target not in VIEWS or not isinstance(view.args[0], fx.Node):
            continue
        x, xs, vs = view.args[0], _shape(view.args[0]), _shape(view)
        if xs is None or vs is None or len(vs) != len(xs) + 1 or len(vs) < 3 or vs[:-2] != xs[:-1] \
                or vs[-2] < 2 or len(view.users) != 1:
            continue
        split = next(iter(view.users))
        lead, g, width = vs[:-2], vs[-2], vs[-1]
        if split.op != "call_function" or split.target not in SPLITS or len(split.args) < 3 \
                or split.args[2] % len(vs) != len(vs) - 1:
            continue
        sizes = split.args[1] if isinstance(split.args[1], (list, tuple)) else None
        c = split.args[1] if isinstance(split.args[1], int) else (sizes[0] if sizes and len(set(sizes)) == 1 else None)
        if not c or width % c or width // c < 2:
            continue
        k = width // c
        getters = list(split.users)
        if any(u.target is not operator.getitem or not all(_merges_groups(r, lead, g * c) for r in u.users)
               for u in getters):
            continue
        with gm.graph.inserting_before(split):
            grouped = gm.graph.call_function(regroup, (x, g, k))
        _set_meta(grouped, view, regroup(x.meta["val"], g, k), dynamic_dims(x))
        for u in getters:
            i = u.args[1]
            with gm.graph.inserting_before(split):
                part = gm.graph.call_function(aten.slice.Tensor, (grouped, len(xs) - 1, i * g * c, (i + 1) * g * c))
            _set_meta(part, u, aten.slice.Tensor(grouped.meta["val"], len(xs) - 1, i * g * c, (i + 1) * g * c),
                      dynamic_dims(x))
            for r in list(u.users):
                r.replace_input_with(u, part)
            gm.graph.erase_node(u)
        gm.graph.erase_node(split)
        gm.graph.erase_node(view)
        done += 1
    return done


def _size_arg(gm: fx.GraphModule, x: fx.Node, d: int, before: fx.Node):
    """Dim `d` of `x` as a graph argument: the int where it is static, else a `sym_size` node."""
    size = x.meta["val"].shape[d]
    if isinstance(size, int) and d not in dynamic_dims(x):
        return size
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(aten.sym_size.int, (x, d))
    node.meta["val"] = size
    return node


def ungroup_kv_heads(gm: fx.GraphModule) -> int:
    """Rewrite, in place, each `scaled_dot_product_attention(q, k, v, enable_gqa=True)` whose K/V
    have fewer heads than q (transformers' call when it builds no mask) into the explicit form it
    uses with a mask (`repeat_kv`): K and V unsqueezed, expanded over each group and reshaped to
    q's heads, the sdpa without `enable_gqa`. Same values (sdpa repeats the K/V heads so itself);
    the rules split that form (K/V heads gathered or replicated where ranks outnumber them).
    The sdpa is marked (`UNGROUPED`): each rank's module calls it grouped again where its K and V
    still come straight from that form (`autoshard.rewrite.grouped`).
    Returns how many were rewritten (the caller recompiles)."""
    done, made = 0, {}
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default \
                or not n.kwargs.get("enable_gqa", False):
            continue
        q, k, v = n.args[:3]
        qv, kv = q.meta.get("val"), k.meta.get("val")
        if qv is None or kv is None or qv.dim() != 4 or not all(isinstance(t.shape[1], int) for t in (qv, kv)):
            continue
        hq, hkv = qv.shape[1], kv.shape[1]
        if hkv == hq or hq % hkv:
            continue
        g = hq // hkv
        repeated = []
        for t in (k, v):
            b, s, d = (_size_arg(gm, t, i, n) for i in (0, 2, 3))
            with gm.graph.inserting_before(n):
                u = gm.graph.call_function(aten.unsqueeze.default, (t, 2))
                e = gm.graph.call_function(aten.expand.default, (u, [b, hkv, g, s, d]))
                r = gm.graph.call_function(aten.reshape.default, (e, [b, hq, s, d]))
            dyn = dynamic_dims(t)
            key = id(t.meta["val"]), id(qv), dyn       # (a layer written as a copy shares its values: made once)
            if key not in made:
                uv = aten.unsqueeze.default(t.meta["val"], 2)
                ev = aten.expand.default(uv, list(uv.shape[:2]) + [g] + list(uv.shape[3:]))
                rv = aten.reshape.default(ev, [*qv.shape[:2], *t.meta["val"].shape[2:]])
                made[key] = (uv, ev, rv), (t.meta["val"], qv)     # the key's values kept: their ids stay theirs
            (uv, ev, rv), _ = made[key]
            _set_meta(u, n, uv, frozenset(i + (i >= 2) for i in dyn))
            _set_meta(e, n, ev, frozenset(i + (i >= 2) for i in dyn))
            _set_meta(r, n, rv, dyn)
            repeated.append(r)
        n.args = (q, *repeated, *n.args[3:])
        n.kwargs = {key: val for key, val in n.kwargs.items() if key != "enable_gqa"}
        n.meta[UNGROUPED] = True
        done += 1
    return done


def repeat_chain(node) -> tuple | None:
    """(reshape, expand, unsqueeze, t) where `node` is `ungroup_kv_heads`' form
    reshape(expand(unsqueeze(t, 2), ...), ...), each step read by the next only (and `node` by one
    reader), else None."""
    chain, x = [], node
    for target in (aten.reshape.default, aten.expand.default, aten.unsqueeze.default):
        if not isinstance(x, fx.Node) or x.op != "call_function" or x.target is not target or len(x.users) != 1:
            return None
        if target is aten.unsqueeze.default and x.args[1] != 2:
            return None
        chain.append(x)
        x = x.args[0]
    return (*chain, x) if isinstance(x, fx.Node) else None
