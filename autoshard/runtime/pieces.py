"""Where a rank's pieces of a tensor lie, and tensors cut into rank pieces and put back.

`boxes` maps a parameter's global layout (a `placements` Placement) to the contiguous blocks
this rank holds (loading and checkpoints read and write those); `split_along` / `cat_along` cut a
whole tensor into every rank's piece and join the pieces again (state dicts, the rewrite's
parameters, collectives); `pad_along` grows a smaller shard to the largest for a collective that
needs equal sizes. The sizes come from `placements.block_sizes`: one table for every cut.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ShardingError
from .placements import Partial, Placement, Shard, block_sizes, blocks_of, cover_ranges, local_shape, shares


@dataclass(frozen=True)
class Box:
    """One contiguous block of a rank's shard: `sizes` elements starting at `offsets` in the
    global tensor, stored at `local_offsets` in the rank's local tensor."""

    offsets: tuple
    sizes: tuple
    local_offsets: tuple

    def global_index(self) -> tuple:
        """Slices that select this box from the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def local_index(self) -> tuple:
        """Slices that select this box from the rank's local tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.local_offsets, self.sizes))


def boxes(shape, placement: Placement, rank: int, world_size: int) -> tuple[Box, ...]:
    """Where rank `rank`'s local tensor lies in the global tensor of `shape`: one Box for a
    contiguous shard or a replicated tensor, `chunks` boxes for a strided `Shard(d, chunks)`
    (a fused q/k/v weight: rank r's rows of q, of k and of v). The one map from a parameter's
    global layout to this rank's pieces, shared by loading and checkpoints."""
    shape = tuple(int(s) for s in shape)
    zeros = (0,) * len(shape)
    if isinstance(placement, Partial):
        raise ValueError("a Partial tensor has no boxes: its ranks hold summands, not pieces")
    if not isinstance(placement, Shard):
        return (Box(zeros, shape, zeros),)
    if placement.replicas > 1 or placement.cover > 1:
        raise ValueError(f"{placement} is an activation's layout, never a stored tensor's")
    local = local_shape(shape, placement, world_size, rank)
    d = placement.dim
    out, start, at = [], 0, 0
    for block, sizes in zip(blocks_of(shape[d], placement.chunks, placement.parts), shares(shape[d], placement, world_size)):
        piece = sizes[rank]
        if not piece:                        # a block of a group this rank does not hold
            start += block
            continue
        out.append(Box(zeros[:d] + (start + sum(sizes[:rank]),) + zeros[d + 1:], local[:d] + (piece,) + local[d + 1:],
                       zeros[:d] + (at,) + zeros[d + 1:]))
        start, at = start + block, at + piece
    return tuple(out)


def fill_boxes(local, shape, placement: Placement, rank: int, world_size: int, read):
    """Copy rank `rank`'s boxes of a global tensor of `shape` into `local` (its local tensor):
    `read(global index)` gives one box's values (a slice of a full tensor, of a file), which
    `copy_` converts to `local`'s dtype one box at a time. Returns `local`."""
    for b in boxes(shape, placement, rank, world_size):
        local[b.local_index()].copy_(read(b.global_index()))
    return local


# ----------------------------------------------------------------------------- tensors cut into rank pieces

def checked_dim(dim: int, ndim: int, what: str = "tensor") -> int:
    """`dim` as a non-negative index of an `ndim`-D tensor; a ShardingError when out of range."""
    if not -ndim <= dim < ndim:
        raise ShardingError(f"dim {dim} is out of range for a {ndim}-D {what}")
    return dim % ndim


def split_along(x: torch.Tensor, dim: int, n: int, chunks: int = 1, what: str = "tensor",
                uneven: bool = False, unit: int = 1, parts=None, nest: int = 1, groups: int = 1,
                cover: int = 1) -> list:
    """Split `x` along `dim` into the `n` rank pieces of Shard(dim, chunks): views when chunks=1.

    With chunks > 1 the dim is `chunks` equal blocks, each split over the ranks, and piece r is
    the concatenation of rank r's part of every block. With `uneven` a size that does not divide
    is cut at `block_sizes`' boundaries (torch.chunk's, in `unit`s, in every block); `parts`
    gives blocks of unequal sizes (always cut so); `cover` the overlapping pieces of a dim held by
    the ranks that read it (`placements.cover_ranges`)."""
    dim = checked_dim(dim, x.dim(), what)
    size = x.size(dim)
    if cover > 1:
        ranges = cover_ranges(size, n, unit, cover) if chunks == 1 and parts is None else None
        if ranges is None:
            raise ShardingError(f"{what} of shape {tuple(x.shape)}: size {size} of dim {dim} is not held by the "
                                f"ranks that read it in units of {unit}, {cover} readers a unit, on {n} ranks")
        return [x.narrow(dim, a, b - a) for a, b in ranges]
    if parts is not None or groups > 1 or (uneven and size % (n * chunks * unit)):
        sizes = block_sizes(size, n, chunks, unit, parts, nest, groups)
        if sizes is not None and chunks == 1:
            return list(x.split(sizes[0], dim))
        if sizes is not None:                       # each block cut at its boundaries
            blocks = [b.split(s, dim) for b, s in zip(x.split(blocks_of(size, chunks, parts), dim), sizes)]
            return [torch.cat([b[r] for b in blocks], dim) for r in range(n)]
        if parts is not None or groups > 1:
            raise ShardingError(f"{what} of shape {tuple(x.shape)}: size {size} of dim {dim} does not split "
                                f"into blocks {parts or chunks} x {n} ranks" + (f" in units of {unit}" if unit > 1 else "")
                                + (f" in {groups} groups" if groups > 1 else ""))
    if size % (n * chunks):
        raise ShardingError(
            f"{what} of shape {tuple(x.shape)}: size {size} of dim {dim} does not divide into "
            f"{chunks} chunk(s) x {n} ranks")
    step = size // (n * chunks)
    parts = x.split(step, dim)                      # chunks * n parts, block-major
    if chunks == 1:
        return list(parts)
    return [torch.cat(parts[r::n], dim) for r in range(n)]


def pad_along(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`x` grown with zeros along `dim` to `size` (a smaller shard sent as the largest one)."""
    if x.size(dim) == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.size(dim)
    return torch.cat([x, x.new_zeros(shape)], dim)


def cat_along(pieces, dim: int, chunks: int = 1, parts=None, unit: int = 1, nest: int = 1,
              groups: int = 1, cover: int = 1) -> torch.Tensor:
    """Inverse of `split_along`: the full tensor from the rank pieces in rank order (a rank's
    piece is its share of every block: equal sub-pieces, or its shares of `parts`, or of grouped
    blocks). Overlapping pieces (`cover`) are never joined: nothing gathers such a shard."""
    if cover > 1:
        raise ShardingError("a shard held by the ranks that read it (cover) is cut from, never joined into, a whole")
    dim = checked_dim(dim, pieces[0].dim())
    if chunks == 1:
        return torch.cat(list(pieces), dim)
    if parts is not None or groups > 1:
        n = sum(parts) if parts is not None else sum(p.size(dim) for p in pieces)
        sizes = block_sizes(n, len(pieces), chunks, unit, parts, nest, groups)
        blocks = [p.split([s[r] for s in sizes], dim) for r, p in enumerate(pieces)]
    else:
        blocks = [p.chunk(chunks, dim) for p in pieces]
    return torch.cat([blocks[r][c] for c in range(chunks) for r in range(len(pieces))], dim)
