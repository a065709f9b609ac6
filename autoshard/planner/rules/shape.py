"""Shape ops: view/reshape family, transpose/permute, expand, split/chunk, indexing, cat, stack, size.

A sharded dim survives a reshape when it is the outermost dim of its group of merged or split
dims (contiguous blocks stay contiguous); strided shards (chunks > 1) only pass through
dims that are kept as they are, and are taken apart by a split or slices along their blocks.
"""
import builtins
import itertools
import math
import operator
from dataclasses import replace

import torch

from ...capture.ops import norm_dim, sliced_range
from ...nn.functional import regroup
from ...runtime.counters import in_groups
from ...runtime.placements import block_sizes, cover_ranges, padded
from .registry import PARTIAL, REPLICATE, REPLICATE_PG, NodeInfo, Shard, may_differ, register_rule, register_shape_op

aten = torch.ops.aten


def view_groups(a, b):
    """Pair dims of shapes a and b into groups with equal products."""
    i = j = 0
    groups = []
    while i < len(a) and j < len(b):
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(i); pa *= a[i]; i += 1
            elif j < len(b):
                gb.append(j); pb *= b[j]; j += 1
            else:
                return None
        groups.append((ga, gb))
    return groups


def view_map(a, b) -> dict:
    """{input dim: (output dim, passthrough)} for dims whose shard survives reshaping a to b."""
    groups = view_groups(tuple(a), tuple(b))
    if groups is None:
        return {}
    out = {}
    for ga, gb in groups:
        ia = [d for d in ga if a[d] > 1]
        ib = [d for d in gb if b[d] > 1]
        if ia and ib:
            out[ia[0]] = (ib[0], len(ia) == 1 and len(ib) == 1)
    return out


def mapped(info: NodeInfo, src, dim_map: dict, *, partial=True):
    """Strategies moving a shard of input `src` along `dim_map` {in dim: (out dim, passthrough)}."""
    found = []
    for d_in, (d_out, passthrough) in dim_map.items():
        for pl in info.shards(d_in, info.shape(src)[d_in]) if passthrough else info.plain_shards(d_in):
            found.append(info.req({src: pl}, f"shard({d_out})", replace(pl, dim=d_out),
                                  uneven=passthrough and may_differ(pl)))
    if partial:
        found.append(info.req({src: PARTIAL}, "partial", PARTIAL))
    return found


def whole_units(info: NodeInfo, src) -> list:
    """Shards in whole units across a reshape that cuts or merges the split dim when the units do
    not divide over the ranks: features [.., 896] viewed as heads [.., 14, 64] are split 4, 4, 4, 2
    heads on 4 ranks as `Shard(-1, unit=64)` in, `Shard(heads)` out (and back for the merge).
    A group's first dim holds the split; its boundaries are the same elements on both sides."""
    a, b = info.shape(src), info.out_shape
    groups = view_groups(tuple(a), tuple(b))
    p, found = info.world_size, []
    for ga, gb in groups or ():
        ia, ib = [d for d in ga if a[d] > 1], [d for d in gb if b[d] > 1]
        if not ia or not ib or (len(ia) == 1 and len(ib) == 1):
            continue
        inner_a = math.prod(a[d] for d in ia[1:])
        inner_b = math.prod(b[d] for d in ib[1:])
        for ua in (1, *info.units(a[ia[0]])):
            atom = ua * inner_a                          # elements of the flat group per unit
            if atom % inner_b or b[ib[0]] % (atom // inner_b):
                continue
            ub = atom // inner_b
            if (a[ia[0]] // ua) % p == 0:
                continue                                 # the even split: plain shards cover it
            for m in (1, *info.replica_candidates):      # (in groups of ranks first: `NodeInfo.shards`)
                found.append(info.req({src: Shard(ia[0], unit=ua, nest=m)}, f"shard({ib[0]})",
                                      Shard(ib[0], unit=ub, nest=m), uneven=True))
    return found


@register_rule(torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.flatten, torch.Tensor.flatten,
               torch.Tensor.unflatten, torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze,
               torch.Tensor.view_as, torch.Tensor.reshape_as, aten.view.default, aten.reshape.default,
               aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
               aten.flatten.using_ints, aten.unflatten.int)
def _view(info):
    src = info.inputs[0]
    return like_other(info, mapped(info, src, view_map(info.shape(src), info.out_shape)) + whole_units(info, src) +
                      readers_units(info, src))


LIKE_OTHER = {torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as}


def like_other(info: NodeInfo, found: list) -> list:
    """`x.view_as(other)` (reshape_as, expand_as) takes `other`'s shape: each rank's view takes its
    local shape, so `other` is read as the output is held (whole where it is whole or Partial),
    and sends back no gradient. Other ops' strategies pass through."""
    if info.node.op != "call_method" or getattr(torch.Tensor, info.node.target, None) not in LIKE_OTHER or \
            len(info.inputs) < 2 or info.inputs[1] is info.inputs[0]:
        return found
    other = info.inputs[1]
    out = []
    for s in found:
        i = info.index(other)
        want = s.output if isinstance(s.output, Shard) else REPLICATE
        out.append(replace(s, inputs=s.inputs[:i] + (want,) + s.inputs[i + 1:],
                           grads=s.grads[:i] + (None,) + s.grads[i + 1:]))
    return out


def readers_units(info: NodeInfo, src) -> list:
    """Shards held by the ranks that read them across a reshape that cuts or merges their dim:
    K/V features [.., 2 * 8] viewed as heads [.., 2, 8] (`Shard(-1, unit=8, cover=g)` in,
    `Shard(heads, cover=g)` out), and K/V heads [b, 2, 3, s, d] expanded to 6 query heads merged
    into [b, 6, s, d] (`Shard(1, cover=3)` in, `Shard(1, unit=3, cover=3)` out): a unit of the
    group's first dim on one side spans whole inner blocks of the other, the same elements."""
    a, b = info.shape(src), info.out_shape
    found = []
    for ga, gb in view_groups(tuple(a), tuple(b)) or ():
        ia, ib = [d for d in ga if a[d] > 1], [d for d in gb if b[d] > 1]
        if not ia or not ib or (len(ia) == 1 and len(ib) == 1):
            continue
        inner_a, inner_b = math.prod(a[d] for d in ia[1:]), math.prod(b[d] for d in ib[1:])
        for atom in sorted({inner_a, inner_b}):          # elements of the flat group per unit
            if atom % inner_a or atom % inner_b:
                continue
            ua, ub = atom // inner_a, atom // inner_b
            for g in info.cover_candidates:
                if cover_ranges(a[ia[0]], info.world_size, ua, g) and cover_ranges(b[ib[0]], info.world_size, ub, g):
                    found.append(info.req({src: Shard(ia[0], unit=ua, cover=g)}, f"shard({ib[0]})",
                                          Shard(ib[0], unit=ub, cover=g), uneven=True))
    return found


@register_rule(torch.Tensor.expand, torch.Tensor.expand_as, aten.expand.default, torch.broadcast_to,
               aten.broadcast_to.default)
def _expand(info):
    src = info.inputs[0]
    s, o = info.shape(src), info.out_shape
    off = len(o) - len(s)
    return like_other(info, mapped(info, src, {a: (a + off, True) for a in range(len(s))
                                               if s[a] == o[a + off] and s[a] > 1}, partial=False))


def _perm(info):
    src = info.inputs[0]
    nd = len(info.shape(src))
    t = info.node.target
    if info.node.op == "call_method":         # x.permute(...) / x.t(): the method, not its name
        t = getattr(torch.Tensor, t)
    if t in (torch.Tensor.permute, torch.permute, aten.permute.default):
        dims = info.node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        perm = [norm_dim(int(d), nd) for d in dims]
    elif t in (torch.Tensor.t, aten.t.default):
        perm = [1, 0] if nd == 2 else [0]
    elif t in (aten.numpy_T.default,) or (t is builtins.getattr and info.node.args[1] == "T"):
        perm = list(reversed(range(nd)))
    elif t is builtins.getattr:                             # .mT: the last two dims swap
        perm = list(range(nd - 2)) + [nd - 1, nd - 2]
    else:
        d0 = norm_dim(int(info.arg(1, "dim0")), nd)
        d1 = norm_dim(int(info.arg(2, "dim1")), nd)
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return mapped(info, src, {perm[j]: (j, True) for j in range(nd)})


register_rule(torch.Tensor.transpose, torch.transpose, aten.transpose.int, torch.Tensor.permute, torch.permute,
              aten.permute.default, torch.Tensor.t, aten.t.default, aten.numpy_T.default)(_perm)


@register_rule(builtins.getattr)
def _getattr(info):
    """`w.T` / `x.mT` (a weight used as `x @ w.T`); other attributes are shape metadata."""
    if info.node.args[1] not in ("T", "mT") or not info.is_tensor(info.node):
        return []
    return _perm(info)


@register_rule(torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk, aten.split.Tensor,
               aten.split_with_sizes.default, aten.chunk.default)
def _split(info):
    src = info.inputs[0]
    shape = info.shape(src)
    outs = info.val(info.node)
    dim = info.arg(2, "dim", 0)
    dim = norm_dim(int(dim), len(shape))
    n = len(outs)
    found = []
    for d in range(len(shape)):
        if d != dim and shape[d] > 1:
            for pl in [*info.plain_shards(d, shape[d]), *(Shard(d, k) for k in info.chunk_candidates)]:
                found.append(info.req({src: pl}, f"shard({d})", tuple(pl for _ in range(n)), uneven=pl.chunks == 1))
    equal = len({tuple(o.shape) for o in outs}) == 1
    if equal and n > 1:  # a strided shard of n blocks splits into n ordinary shards (in whole units)
        found.append(info.req({src: Shard(dim, n)}, f"unfuse({dim})", tuple(Shard(dim) for _ in range(n))))
        for u in info.units(shape[dim] // n):
            found.append(info.req({src: Shard(dim, n, unit=u)}, f"unfuse({dim})",
                                  tuple(Shard(dim, unit=u) for _ in range(n)), uneven=True))
    elif n > 1:          # blocks of unequal sizes (a grouped q/k/v split into q, k and v)
        parts = tuple(int(o.shape[dim]) for o in outs)
        for pl in info.part_shards(dim, shape[dim]):
            if pl.parts == parts:
                found += _parts_taken(info, src, pl, list(parts), list(outs), dim, f"unfuse({dim})")
    found.append(info.req({src: PARTIAL}, "partial", tuple(PARTIAL for _ in range(n))))
    return found


def index_map(idx, nd: int):
    """{in dim: out dim} of dims kept whole by a basic index (ints, full slices, None, ...)."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in idx):
        return None
    used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out, i, j = {}, 0, 0
    for e in idx:
        if e is Ellipsis:
            for _ in range(nd - used):
                out[i] = j; i += 1; j += 1
        elif e is None:
            j += 1
        elif isinstance(e, int):
            i += 1
        else:
            if e == slice(None, None, None):
                out[i] = j
            i += 1; j += 1
    while i < nd:
        out[i] = j; i += 1; j += 1
    return out


def block_slice(size: int, start: int, stop: int, k: int):
    """How many whole blocks of `size` cut into `k` equal ones the range [start:stop] takes, when
    it takes whole blocks only (a fused q/k/v sliced into its parts: Phi-3's qkv_proj), else
    None. Returns (first block, number of blocks)."""
    block = size // k
    if size % k or stop <= start or start % block or (stop - start) % block:
        return None
    return start // block, (stop - start) // block


def blocks_taken(info: NodeInfo, src) -> list:
    """Strategies of a slice that takes whole blocks of a strided shard: Shard(d, k) in, the
    blocks' own pieces out (one block: an ordinary Shard(d); m blocks: Shard(d, m))."""
    shape = info.shape(src)
    cut = sliced_range(info.node, shape)
    if cut is None:
        return []
    d, a, b = cut
    found = []
    for k in info.chunk_candidates:
        taken = block_slice(shape[d], a, b, k)
        if taken is not None:
            found.append(info.req({src: Shard(d, k)}, f"blocks({d})", Shard(d, taken[1])))
            for u in info.units(shape[d] // k):          # blocks in whole heads
                found.append(info.req({src: Shard(d, k, unit=u)}, f"blocks({d})", Shard(d, taken[1], unit=u),
                                      uneven=True))
    for pl in info.part_shards(d, shape[d]):            # blocks of unequal sizes (grouped q / k / v)
        ends = list(itertools.accumulate(pl.parts, initial=0))
        if a in ends and b in ends and a < b:
            i, j = ends.index(a), ends.index(b)
            if j - i == 1:
                found += _parts_taken(info, src, pl, [pl.parts[i]], [info.val(info.node)], d, f"blocks({d})")
            else:
                found.append(info.req({src: pl}, f"blocks({d})", Shard(d, j - i, unit=pl.unit, parts=pl.parts[i:j]),
                                      uneven=True))
    return found


def split_off_heads(info: NodeInfo, size: int, pl: Shard) -> bool:
    """Whether the ranks' shares of a part of `size` features, held as a block of `pl`, are
    pieces of heads (the largest unit the graph cuts the part into): the one kv head of a
    multi-query projection (64 of its 128 features a rank), Phi-3-medium's 10 kv heads on 4
    ranks (2.5 heads a rank). No view into heads can read such a piece; the part is gathered
    where it is cut out. In a shard in whole units a part of fewer units than ranks is such a
    part (cut in elements: Falcon-7B's one K/V head beside 71 query heads on 8 ranks)."""
    if pl.unit > 1:
        return size // pl.unit < info.world_size      # else cut in whole units
    units = [u for u in info.unit_candidates if 1 < u <= size and size % u == 0]
    if not units:
        return False                                  # no heads
    return (size // info.world_size) % max(units) != 0


def _parts_taken(info: NodeInfo, src, pl, parts, outs, dim, name) -> list:
    """A part (or the parts of a split) cut from `Shard(dim, parts=...)`: each its own shard, but
    a part whose shares are pieces of heads (`split_off_heads`) all-gathered whole with its
    gradient Partial (`REPLICATE_PG`, reduce-scattered back), as a projection of that part alone
    would ("column_gather_pg"): the gather is of the part, before anything grows it. Where the
    other parts split evenly (the query heads: each rank's piece then lies in its group's), such
    a part may instead be gathered within groups of ranks (`Shard(dim, replicas=m)`, as
    "column_gather_groups"): Phi-3-medium's 10 kv heads at 4 ranks, 5 a pair."""
    split_off = [split_off_heads(info, q, pl) for q in parts]
    even = all((q // pl.unit) % info.world_size == 0 for q in pl.parts if not split_off_heads(info, q, pl))
    found = []
    for grouped in (False, True):
        placed, comm = [], []
        for q, v, off in zip(parts, outs, split_off):
            nbytes = v.numel() * v.element_size()
            m = info.group_size(q) if grouped and off and even else None
            if m is not None:
                placed.append(Shard(dim, replicas=m))
                comm += [(in_groups("all_gather", m), nbytes), (in_groups("reduce_scatter", m), nbytes)]
            elif off:
                placed.append(REPLICATE_PG)
                nbytes = padded(nbytes, v.shape, Shard(dim), info.world_size)     # (cut in elements: 6, 6, 4)
                comm += [("all_gather", nbytes), ("reduce_scatter", nbytes)]
            else:
                placed.append(Shard(dim, unit=pl.unit))
        output = tuple(placed) if isinstance(info.val(info.node), (tuple, list)) else placed[0]
        s = info.req({src: pl}, name, output, uneven=True, comm=comm)
        if not found or s != found[0]:
            found.append(s)
    return found


@register_rule(operator.getitem)
def _getitem(info):
    src = info.node.args[0]
    if not info.is_tensor(src):
        return []      # picking from a tuple: the search forwards the element's placement
    m = index_map(info.node.args[1], len(info.shape(src)))
    if m is None:
        return []
    return mapped(info, src, {a: (b, True) for a, b in m.items()}) + blocks_taken(info, src)


@register_rule(aten.index.Tensor)
def _index(info):
    """`x[..., idx, :]` (advanced indexing, `aten.index.Tensor`): a shard of a dim the index does
    not touch passes through (Falcon's `qkv[:, :, :, [-2]]` keeps a split of its groups); the
    index tensors stay whole."""
    src = info.node.args[0]
    indices = list(info.node.args[1])
    nd = len(info.shape(src))
    used = [i for i, ix in enumerate(indices) if ix is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        return []                  # indices apart: their dims move to the front
    idx_nd = max(len(info.shape(ix)) if info.is_tensor(ix) else 0 for ix in (indices[i] for i in used))
    shift = idx_nd - len(used)
    keep = {d: (d if d < used[0] else d + shift, True) for d in range(nd) if d not in used}
    return mapped(info, src, keep, partial=True)


@register_rule(aten.slice.Tensor, aten.select.int)
def _slice(info):
    src = info.inputs[0]
    shape = info.shape(src)
    dim = norm_dim(int(info.arg(1, "dim", 0)), len(shape))
    drop = info.node.target is aten.select.int
    keep = {}
    for d in range(len(shape)):
        if d != dim:
            keep[d] = (d - 1 if drop and d > dim else d, True)
    if info.node.target is aten.slice.Tensor and tuple(info.out_shape) == shape:
        keep[dim] = (dim, True)
    return mapped(info, src, keep) + (blocks_taken(info, src) if not drop else [])


@register_rule(torch.cat, torch.concat, aten.cat.default)
def _cat(info):
    tensors = [n for n in info.inputs if info.is_tensor(n)]
    nd = len(info.out_shape)
    dim = norm_dim(int(info.arg(1, "dim", 0)), nd)
    found = []
    same_rank = all(len(info.shape(n)) == nd for n in tensors)
    for d in range(nd):
        if d != dim and info.out_shape[d] > 1 and same_rank:
            for pl in info.plain_shards(d, info.out_shape[d]) + info.cover_shards(d, info.out_shape[d]):
                found.append(info.req({n: pl for n in tensors}, f"shard({d})", pl, uneven=True))
    # equal pieces each split along the cat dim: every rank holds its block of each piece, which
    # is the strided shard Shard(dim, n) of the result (a row-parallel layer consumes it as is)
    if same_rank and len(tensors) > 1 and len({info.shape(n)[dim] for n in tensors}) == 1:
        found.append(info.req({n: Shard(dim) for n in tensors}, f"stack({dim})", Shard(dim, len(tensors))))
    found.append(info.req({n: PARTIAL for n in tensors}, "partial", PARTIAL))
    return found


@register_rule(torch.stack, aten.stack.default)
def _stack(info):
    """`torch.stack` (GPT-J's rotate_every_two: `stack((-x2, x1), dim=-1)`): a shard of a dim every
    input holds alike moves to that dim of the result (one later where it lies past the new dim)."""
    tensors = [n for n in info.inputs if info.is_tensor(n)]
    nd = len(info.out_shape)
    dim = norm_dim(int(info.arg(1, "dim", 0)), nd)
    found = []
    if len({info.shape(n) for n in tensors}) != 1:
        return found
    for d in range(nd - 1):
        out = d if d < dim else d + 1
        if info.out_shape[out] > 1:
            for pl in info.plain_shards(d, info.out_shape[out]) + info.cover_shards(d, info.out_shape[out]):
                found.append(info.req({n: pl for n in tensors}, f"shard({out})", replace(pl, dim=out), uneven=True))
    found.append(info.req({n: PARTIAL for n in tensors}, "partial", PARTIAL))
    return found


register_shape_op(torch.Tensor.size, torch.Tensor.dim, builtins.getattr, aten.sym_size.int, torch.Tensor.numel,
                  aten.sym_numel.default, aten._assert_tensor_metadata.default)


@register_rule(regroup)
def _regroup(info):
    """`regroup(x, G, K)`, grouped blocks reordered one block after another: x held in grouped
    blocks (`Shard(-1, G * K, groups=G)`, each group of ranks its group's share of every block)
    gives the one-after-another layout split block by block (`Shard(-1, K)`); each rank reorders
    its own groups (`local_ops`: regroup(x, G / p, K), nothing where a rank holds one group or
    less). Batch dims pass through; Partial stays Partial (a permutation)."""
    x, g, k = info.node.args[0], int(info.node.args[1]), int(info.node.args[2])
    out, p = info.out_shape, info.world_size
    last = len(out) - 1
    found = [info.req({x: Shard(d)}, f"shard({d})", Shard(d), uneven=True) for d in range(last) if out[d] > 1]
    grouped = Shard(last, g * k, groups=g)
    if g > 1 and block_sizes(out[last], p, g * k, groups=g) is not None and block_sizes(out[last], p, k) is not None:
        found.append(info.req({x: grouped}, "regroup", Shard(last, k), compute=1 / p))
    found.append(info.req({x: PARTIAL}, "partial", PARTIAL))
    return found
