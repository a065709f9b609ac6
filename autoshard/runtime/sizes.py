"""Sizes of the pieces a split dim is cut into: every rank's share of every block.

One table for every cut (`placements` holds the placements that name these cuts): torch.chunk's
boundaries (`chunk_sizes`), balanced where those would leave a rank empty, in whole units;
blocks of equal or unequal sizes, each split so (`block_sizes`); blocks split over groups of
ranks first (`nest`), or in grouped blocks (`groups`); and the overlapping pieces of a dim held by
the ranks that read it (`cover_ranges`).
"""
from __future__ import annotations

from functools import lru_cache

import torch


def chunk_sizes(n: int, world_size: int, unit: int = 1) -> list[int]:
    """Every rank's size of a dim of `n` split over `world_size` ranks at torch.chunk's
    boundaries: ceil(n/p) each, the last ranks what is left (equal shares when p divides n);
    where those would leave a rank empty (12 on 8: six chunks of 2), balanced instead: the first
    n mod p ranks one more (2, 2, 2, 2, 1, 1, 1, 1). With `unit`, in whole units of that many
    elements. One rule for every split, so that a dim of heads and the features it is viewed
    from have the same boundaries; the first rank's share is always the largest."""
    units = int(n) // unit
    if units >= world_size and not chunk_fills(units, world_size):
        base, extra = divmod(units, world_size)
        return [(base + (r < extra)) * unit for r in range(world_size)]
    c = -(-units // world_size)
    return [max(0, min(c, units - r * c)) * unit for r in range(world_size)]


def blocks_of(n: int, chunks: int = 1, parts=None) -> list[int] | None:
    """The sizes of the blocks a dim of `n` is cut into: `parts`, or `chunks` equal ones (None
    where they do not fit `n`)."""
    if parts is not None:
        return list(parts) if sum(parts) == n and len(parts) == chunks else None
    return [n // chunks] * chunks if n % chunks == 0 else None


def block_sizes(n: int, world_size: int, chunks: int = 1, unit: int = 1, parts=None, nest: int = 1,
                groups: int = 1, cover: int = 1) -> tuple | None:
    """Every rank's share of each block of a dim of `n` (`sizes[block][rank]`: `chunk_sizes` of the
    block, in `unit`s), or None where `Shard(d, chunks, unit=unit, parts=parts)` cannot hold it:
    a block that is no whole number of units, a rank left empty, or a strided shard in elements
    (`unit=1`) whose blocks do not divide. A rank's piece is its share of every block: GPT-2's
    fused q/k/v of 12 heads on 8 ranks is `Shard(d, 3, unit=64)`, each block cut 2, 2, 2, 2, 1, 1,
    1, 1 heads; a grouped q/k/v of 40 query and 10 kv heads of 128 on 2 ranks is
    `Shard(d, 3, parts=(5120, 1280, 1280))`, 20 query heads and 5 of k and of v each. With
    `nest` = m a block is cut over p / m groups of m consecutive ranks first, then each group's
    piece over its ranks: 28 query heads on 8 ranks in 4 groups of 2 (Qwen2-7B's 4 kv groups)
    hold 4, 3, 4, 3, 4, 3, 4, 3 heads, each pair the 7 that read one kv head (`Shard(d, nest=2)`).
    With `groups` = G the `chunks` equal blocks lie in G consecutive groups (`grouped_sizes`); with
    `cover` the ranks' overlapping pieces (`cover_ranges`: one block whose shares sum past n)."""
    compiling = torch.compiler.is_compiling()              # traced uncached: dynamo warns at a cache
    if cover > 1:
        if (chunks, parts, nest, groups) != (1, None, 1, 1):
            return None
        ranges = (cover_ranges.__wrapped__ if compiling else cover_ranges)(int(n), world_size, unit, cover)
        return None if ranges is None else (tuple(b - a for a, b in ranges),)
    if groups > 1:
        return (_grouped_sizes.__wrapped__ if compiling else _grouped_sizes)(int(n), world_size, chunks, groups)
    return (_block_sizes.__wrapped__ if compiling else _block_sizes)(
        int(n), world_size, chunks, unit, None if parts is None else tuple(parts), nest)


@lru_cache(maxsize=1024)
def _grouped_sizes(n: int, world_size: int, chunks: int, groups: int) -> tuple | None:
    """`block_sizes` of `Shard(d, chunks, groups=G)`: the dim is G consecutive groups of chunks / G
    equal blocks each (CodeGen's `qkv_proj`: 4 model-parallel groups of q, v and k). The groups go
    to the ranks in order: G / p whole groups a rank where p divides G, else each group to p / G
    consecutive ranks, each of its blocks split evenly over them (16 heads on 8 ranks: rank r
    holds half of group r // 2's q, of its v and of its k, and nothing of the other groups).
    None where neither divides, or a block does not split evenly."""
    blocks = blocks_of(n, chunks)
    if blocks is None:
        return None
    per = chunks // groups
    if groups % world_size == 0:
        held = groups // world_size
        return tuple(tuple(b if (i // per) // held == r else 0 for r in range(world_size))
                     for i, b in enumerate(blocks))
    m = world_size // groups
    if world_size % groups or blocks[0] % m:
        return None
    return tuple(tuple(b // m if r // m == i // per else 0 for r in range(world_size)) for i, b in enumerate(blocks))


@lru_cache(maxsize=4096)
def _block_sizes(n: int, world_size: int, chunks: int, unit: int, parts, nest: int = 1) -> tuple | None:
    """`block_sizes`, memoised (the planner asks it for every parameter and edge it prices)."""
    blocks = blocks_of(n, chunks, parts)
    if blocks is None or world_size % nest:
        return None
    out = []
    for block in blocks:
        if block % unit or (chunks > 1 and unit == 1 and block % world_size):
            return None
        if parts is not None and unit > 1 and block // unit < world_size:
            if nest > 1:
                return None
            out.append(tuple(chunk_sizes(block, world_size)))      # fewer units than ranks: in elements
            continue
        sizes = tuple(s for group in chunk_sizes(block, world_size // nest, unit)
                      for s in chunk_sizes(group, nest, unit))
        if min(sizes) == 0:
            return None
        out.append(sizes)
    return tuple(out)


def piece_sizes(n: int, world_size: int, chunks: int = 1, unit: int = 1, parts=None, nest: int = 1,
                groups: int = 1, cover: int = 1) -> list[int]:
    """Every rank's size along the split dim of `Shard(d, chunks, unit=unit, parts=parts)` of a
    dim of `n` (its share of every block); a ValueError where that shard cannot hold `n`."""
    sizes = block_sizes(n, world_size, chunks, unit, parts, nest, groups, cover)
    if sizes is None:
        raise ValueError(f"size {n} does not divide into {parts or chunks} chunk(s) x {world_size} ranks"
                         + (f" in units of {unit}" if unit > 1 else "") + " without leaving a rank empty")
    return [sum(block[r] for block in sizes) for r in range(world_size)]


@lru_cache(maxsize=1024)
def cover_ranges(n: int, world_size: int, unit: int = 1, cover: int = 1) -> tuple | None:
    """Each rank's [start, stop) of a dim of `n` held by the ranks that read it
    (`Shard(d, unit=unit, cover=g)`): its n / unit units are each read by g units of a dim split
    as `chunk_sizes` does (K/V heads, and the g query heads of each), and a rank holds every unit
    its share reads: 2 kv heads of 6 query heads on 3 ranks are heads [0, 1), [0, 2), [1, 2).
    None where the dim is no whole number of at least 2 units, or a share would be empty."""
    units = n // unit
    reads = chunk_sizes(units * cover, world_size)
    if n % unit or units < 2 or min(reads) == 0:
        return None
    starts = [sum(reads[:r]) for r in range(world_size)]
    return tuple(((a // cover) * unit, -(-(a + s) // cover) * unit) for a, s in zip(starts, reads))


def chunk_fills(n: int, world_size: int) -> bool:
    """Whether torch.chunk's boundaries (ceil(n/p) each) give every one of p ranks a part of n."""
    return (world_size - 1) * -(-n // world_size) < n


def chunk_start(n: int, rank: int, world_size: int, unit: int = 1) -> int:
    """Where rank `rank`'s block of a dim of `n` starts (torch.chunk's boundaries)."""
    return sum(chunk_sizes(n, world_size, unit)[:rank])
