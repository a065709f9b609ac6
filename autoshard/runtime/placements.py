"""Placements of a tensor across the ranks of a tensor-parallel group (DTensor's vocabulary).

`Shard(dim, chunks)` splits `dim` into `chunks` equal blocks and splits each block evenly over
the ranks; a rank holds the concatenation of its piece of every block.  `chunks=1` is the
ordinary contiguous split; `chunks=3` is a fused q/k/v weight where each rank holds whole heads
of q, k and v.  Dims are always stored non-negative.

A contiguous shard (`chunks=1`) of a dim that does not divide by the degree follows
`torch.chunk`'s boundaries, as DTensor does: every rank holds ceil(n/p) but the last ones, which
hold what is left (50257 on 4 ranks: 12565, 12565, 12565, 12562). Where those boundaries would
leave a rank empty (12 heads on 8 ranks: torch.chunk makes 6 chunks of 2), the split is balanced
instead: the first n mod p ranks hold one more (2, 2, 2, 2, 1, 1, 1, 1), which is Megatron's
and vLLM's way with heads; such a shard is no DTensor (`dtensor_boundaries`). Fewer units than
ranks are refused (`splits`). A layout table (a module's `_autoshard_layouts`) records such a
shard with its global size (`Shard(d, size=n)`), since a rank's shard alone no longer tells it.
`unit=u` cuts the dim in whole units of u elements (heads of a projection's output features: 14
heads of 64 on 4 ranks hold 4, 4, 4 and 2 heads, not 3.5 each); it is only set where the units
do not divide by the degree (else the split is the even one).
A strided shard in whole units cuts every block so (`block_sizes`): GPT-2's fused q/k/v of 12
heads of 64 on 8 ranks is `Shard(d, 3, unit=64)`, each rank holding 2 or 1 heads of q, of k and
of v (2, 2, 2, 2, 1, 1, 1, 1); a strided shard in elements stays even.
Blocks of unequal sizes (`parts`, the sizes in elements) are a fused projection whose parts
differ: grouped attention's q / k / v in one weight (40 query and 10 kv heads of 128 on 2 ranks:
`Shard(d, 3, parts=(5120, 1280, 1280))`, 20 query heads and 5 kv heads a rank, matching heads),
each block cut as above. A part of fewer units than ranks in such a shard in whole units is cut in
elements (Falcon-7B's 71 query heads and one K/V head of 64 on 8 ranks: `Shard(d, 3, unit=64,
parts=(4544, 64, 64))`, 9, ..., 9, 8 query heads and 8 features of K and of V a rank): its pieces
are no heads, and the part is gathered where it is cut out (`rules.shape`), as K and V of a
projection of their own would be.

`Shard(d, replicas=m)` is a shard held by groups of ranks (an activation's layout, never a
parameter's): the dim split over p/m groups of m consecutive ranks, every rank of a group holding
the group's piece, its gradient a summand per rank within the group: K and V of 4 kv heads on 8
ranks, each head on the 2 ranks whose query heads read it (`groups_of`). `Shard(d, nest=m)` splits
over those groups first and then each group's piece over its m ranks: where the heads do not
divide, the query heads that read one group's kv heads stay in that group (28 query heads of 4
kv groups on 8 ranks: 4, 3, 4, 3, 4, 3, 4, 3, not torch.chunk's 4, 4, 4, 4, 3, 3, 3, 3).
`Shard(d, unit=u, cover=g)` is held by the ranks that read it (an activation's layout), where no
such groups exist: the dim's units (of u elements) are each read by g units of a dim split as
`chunk_sizes` does (K/V heads and the g query heads of each), and rank r holds every unit its
share reads; neighbours overlap (2 kv heads of 6 query heads on 3 ranks: heads 0, 0-1, 1;
`cover_ranges`), each holding a summand of the gradient, as in a group.

`Shard(d, chunks, groups=G)` holds a dim of `chunks` equal blocks in G consecutive groups
(CodeGen's fused projection: 4 model-parallel groups of q, v and k, `Shard(d, 12, groups=4)`):
the groups go to the ranks in order, G / p whole groups a rank, or each group to p / G consecutive
ranks that split each of its blocks evenly (`block_sizes`: a rank's share of the other groups'
blocks is empty). Only `regroup` reads it (the planner never moves it): a parameter's layout and
its projection's output.

`ReplicatePartialGrad` ("Rp") is a Replicate whose gradient may stay Partial: every rank holds
the whole tensor, and in backward each rank holds a summand of its gradient. It is how fewer
key/value heads than ranks are replicated (Megatron's and vLLM's replicated K/V heads): K and V
are computed whole on every rank, each rank slices the heads its query heads read (a slice whose
gradient is zero-padded: a Partial gradient, no collective), and the Partial gradients are
summed where they meet: with the input's all-reduce, which column-parallel q already needs, and
either in an all-reduce of the replicated K/V weights' gradients or in the reduce-scatter that
is the backward of gathering K and V from split weights (`ShardGathered`), whichever the cost
model finds cheaper.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .sizes import (block_sizes, blocks_of, chunk_fills, chunk_sizes, chunk_start, cover_ranges,  # noqa: F401
                    piece_sizes)


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the full tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class ReplicatePartialGrad(Replicate):
    """Every rank holds the full tensor; its gradient may come back as a summand per rank
    (Partial). An op reading it whole must send back Partial gradients; a slice of it sends back
    its piece zero-padded. A parameter held so has its gradient all-reduced. With `cut` = g, a
    K/V weight whose projection computes only the rows of the heads this rank's queries read
    (its output `Shard(d, unit=head, cover=g)`): a layout of its own, so the search prices it apart."""

    cut: int = 1

    def __str__(self) -> str:
        return "Rp" if self.cut == 1 else f"Rpc{self.cut}"


@dataclass(frozen=True)
class Shard:
    """Rank r holds block r of `dim` (of every one of `chunks` blocks, when chunks > 1; the
    blocks are equal, or of the sizes `parts` lists). With `replicas` = m the dim is split over
    p / m groups of m consecutive ranks, every rank of group r // m holding that group's piece,
    and in backward each of them a summand of its gradient (`groups_of`)."""

    dim: int
    chunks: int = 1
    size: int | None = None      # the global size of `dim` where it does not divide (layout tables)
    unit: int = 1                # elements per indivisible unit of `dim` (a head's features)
    parts: tuple | None = None   # the blocks' sizes where they differ (a grouped q/k/v: q, k, v features)
    replicas: int = 1            # consecutive ranks holding the same piece (an activation only)
    nest: int = 1                # split over p / nest groups of ranks first, then within each group
    groups: int = 1              # the `chunks` blocks in this many consecutive groups, one per group of ranks
    cover: int = 1               # held by every rank that reads it, g = cover readers' units a unit (an activation only)

    def __post_init__(self):
        if self.dim < 0:
            raise ValueError(f"Shard dim must be normalised to >= 0, got {self.dim}")
        if self.chunks < 1:
            raise ValueError(f"Shard chunks must be >= 1, got {self.chunks}")
        if self.unit < 1:
            raise ValueError(f"Shard unit must be >= 1, got {self.unit}")
        if self.replicas < 1 or self.nest < 1:
            raise ValueError(f"Shard replicas and nest must be >= 1, got {self.replicas}, {self.nest}")
        if self.groups < 1 or self.chunks % self.groups or (self.groups > 1 and (self.parts is not None or self.unit > 1
                                                                                 or self.nest > 1 or self.replicas > 1)):
            raise ValueError(f"Shard groups={self.groups} must divide chunks={self.chunks}, in equal blocks in elements")
        if self.parts is not None and (len(self.parts) != self.chunks or min(self.parts) < 1):
            raise ValueError(f"Shard parts {self.parts} must be {self.chunks} positive block sizes")
        if self.parts is not None and len(set(self.parts)) == 1:
            object.__setattr__(self, "parts", None)          # equal blocks: the plain strided shard
        if self.cover < 1 or (self.cover > 1 and (self.chunks, self.parts, self.replicas, self.nest)
                              != (1, None, 1, 1)):
            raise ValueError(f"Shard cover={self.cover} holds one contiguous dim, not blocks or groups of ranks")

    def __str__(self) -> str:
        s = f"S({self.dim})" if self.chunks == 1 else f"S({self.dim})x{self.chunks}"
        if self.parts is not None:
            s = f"S({self.dim})x({','.join(str(q) for q in self.parts)})"
        s = s if self.unit == 1 else f"{s}/{self.unit}"
        s = s if self.nest == 1 else f"{s}n{self.nest}"
        s = s if self.groups == 1 else f"{s}g{self.groups}"
        s = s if self.cover == 1 else f"{s}c{self.cover}"
        return s if self.replicas == 1 else f"{s}r{self.replicas}"

    @property
    def blocking(self) -> dict:
        """How the dim is cut into blocks, as the keywords of `block_sizes`, `piece_sizes`,
        `pieces.split_along` and `pieces.cat_along`: one spelling for every place that sizes, cuts
        or joins this shard."""
        return dict(chunks=self.chunks, unit=self.unit, parts=self.parts, nest=self.nest, groups=self.groups,
                    cover=self.cover)

    def __repr__(self) -> str:
        size = "" if self.size is None else f", size={self.size}"
        unit = "" if self.unit == 1 else f", unit={self.unit}"
        parts = "" if self.parts is None else f", parts={self.parts}"
        replicas = "" if self.replicas == 1 else f", replicas={self.replicas}"
        nest = "" if self.nest == 1 else f", nest={self.nest}"
        groups = "" if self.groups == 1 else f", groups={self.groups}"
        cover = "" if self.cover == 1 else f", cover={self.cover}"
        return f"Shard(dim={self.dim}, chunks={self.chunks}{size}{unit}{parts}{replicas}{nest}{groups}{cover})"


@dataclass(frozen=True, repr=False)
class ShardGathered(Shard):
    """A weight stored as `Shard`, whose op gathers its output whole with a Partial gradient
    (`ReplicatePartialGrad`): K/V of fewer heads than ranks computed split, all-gathered, and
    their gradients reduce-scattered back; with `within` = m, gathered within groups of m ranks
    only (the output `Shard(d, replicas=m)`); with `cut` = g, gathered whole and cut to the heads
    this rank's queries read (the output `Shard(d, unit=head, cover=g)`). A layout of its own so
    the search can choose it (each gather its own choice); it is stored, saved and loaded exactly
    as the `Shard` it is (`stored`)."""

    within: int = 1
    cut: int = 1

    def __str__(self) -> str:
        return super().__str__() + "g" + (str(self.within) if self.within > 1 else "") + \
            (f"c{self.cut}" if self.cut > 1 else "")

    def __repr__(self) -> str:
        within = "" if self.within == 1 else f", within={self.within}"
        cut = "" if self.cut == 1 else f", cut={self.cut}"
        return f"ShardGathered({super().__repr__()[len('Shard('):-1]}{within}{cut})"


def stored(placement):
    """How a parameter of `placement` is held and saved: the plain Shard / Replicate it is."""
    if isinstance(placement, ShardGathered):
        return Shard(placement.dim, size=placement.size, **placement.blocking)
    if isinstance(placement, ReplicatePartialGrad):
        return REPLICATE
    return placement


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the tensor is their sum (pending all-reduce)."""

    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial
REPLICATE = Replicate()
REPLICATE_PG = ReplicatePartialGrad()
PARTIAL = Partial()


def shares(n: int, placement, world_size: int) -> tuple | None:
    """`block_sizes` of a dim of `n` held with the Shard `placement` (`[block][rank]`; the ranks of a
    group of `replicas` hold the same share)."""
    groups, m = groups_of(placement, world_size)
    sizes = block_sizes(n, groups, **placement.blocking)
    if sizes is None or m == 1:
        return sizes
    return tuple(tuple(block[r // m] for r in range(world_size)) for block in sizes)


def held_by_groups(placement) -> bool:
    """Whether `placement` is a shard held by groups of ranks (`Shard(d, replicas=m)`)."""
    return isinstance(placement, Shard) and placement.replicas > 1


def groups_of(placement, world_size: int) -> tuple[int, int]:
    """(groups, ranks a group) of a Shard: p ranks in p / m groups of m = `replicas` consecutive
    ranks that hold the same piece (K and V of fewer heads than ranks, each head on the ranks
    whose query heads read it); (p, 1) for an ordinary shard."""
    m = placement.replicas if isinstance(placement, Shard) else 1
    if m > 1 and world_size % m:
        raise ValueError(f"{placement}: {m} replicas do not divide {world_size} ranks")
    return world_size // m, m


def held_by_readers(placement) -> bool:
    """Whether `placement` is a shard held by the ranks that read it (`Shard(d, cover=g)`)."""
    return isinstance(placement, Shard) and placement.cover > 1


def cover_cut(n: int, src: Shard, dst, world_size: int) -> tuple | None:
    """(start, length) per rank of the piece of `dst` (a contiguous shard of the same dim) within
    the piece each rank holds of `src` (held by the ranks that read it), where every rank's piece
    of `dst` lies inside its piece of `src` (the query heads inside the K/V heads they read: a
    local slice); else None."""
    if not isinstance(dst, Shard) or dst.dim != src.dim or held_by_readers(dst) or dst.replicas > 1 or \
            (dst.chunks, dst.parts, dst.groups) != (1, None, 1):
        return None
    have, want = cover_ranges(n, world_size, src.unit, src.cover), shares(n, dst, world_size)
    if have is None or want is None:
        return None
    out, start = [], 0
    for (lo, hi), size in zip(have, want[0]):
        if not lo <= start <= start + size <= hi:
            return None
        out.append((start - lo, size))
        start += size
    return tuple(out)


def dtensor_boundaries(shape, placement, world_size: int) -> bool:
    """Whether a `placement` of a tensor of `shape` cuts it where DTensor's `Shard` does: a
    contiguous shard in elements at torch.chunk's boundaries (so a DTensor, or DCP's DTensor
    resharding, can hold it). A strided shard, a shard in whole units (heads), one split over
    groups of ranks first or held by groups, and a balanced split (where torch.chunk would leave
    a rank empty) cannot."""
    if not isinstance(placement, Shard) or placement.chunks != 1 or placement.unit != 1 or placement.nest != 1 \
            or placement.replicas != 1 or placement.groups != 1 or placement.cover != 1:
        return False
    return chunk_fills(int(shape[placement.dim]), world_size)


def unit_of(placement) -> int:
    return placement.unit if isinstance(placement, Shard) else 1


def splits(shape, placement: Placement, world_size: int) -> bool:
    """Whether `placement` can hold a tensor of `shape`, shards allowed to differ in size
    (`block_sizes`: `chunk_sizes`' boundaries in every block, no rank left empty); `divides` asks
    for equal ones."""
    if not isinstance(placement, Shard):
        return True
    if placement.dim >= len(shape):
        return False
    return shares(shape[placement.dim], placement, world_size) is not None


def is_even(shape, placement: Placement, world_size: int) -> bool:
    """Whether every rank holds an equal shard of equal blocks (always true of Replicate and
    Partial): the layout every collective and writer handles without padding or block sizes."""
    if not isinstance(placement, Shard):
        return True
    if placement.parts is not None or placement.groups > 1 or placement.cover > 1:   # the general layout
        return False
    groups, _ = groups_of(placement, world_size)
    return int(shape[placement.dim]) % (groups * placement.chunks * placement.unit) == 0


def local_shape(shape, placement: Placement, world_size: int, rank: int | None = None) -> tuple[int, ...]:
    """The shape rank `rank` holds of a tensor of `shape` with `placement` (rank None: the
    largest shard, what a plan prices)."""
    shape = tuple(int(s) for s in shape)
    if not isinstance(placement, Shard):
        return shape
    d = placement.dim
    if d >= len(shape):
        raise ValueError(f"dim {d} of {placement} is out of range for shape {shape}")
    groups, m = groups_of(placement, world_size)
    try:
        sizes = piece_sizes(shape[d], groups, **placement.blocking)
    except ValueError as e:
        raise ValueError(f"dim {d}: {e}") from None
    return shape[:d] + (max(sizes) if rank is None else sizes[rank // m],) + shape[d + 1:]


def local_numel(shape, placement: Placement, world_size: int) -> int:
    """Elements of the largest shard a rank holds of a tensor of `shape` with `placement`."""
    n = 1
    for s in local_shape(shape, placement, world_size):
        n *= s
    return n


def maybe_local_shape(shape, placement: Placement, world_size: int, rank: int | None = None) -> tuple[int, ...] | None:
    """`local_shape`, or None where `placement` cannot hold `shape` (a view of a plan may ask)."""
    try:
        return local_shape(shape, placement, world_size, rank)
    except ValueError:
        return None


def divides(shape, placement: Placement, world_size: int) -> bool:
    """Whether `placement` can hold a tensor of `shape` on `world_size` ranks with equal shards."""
    if not isinstance(placement, Shard):
        return True
    if placement.cover > 1:
        return False                      # overlapping pieces: never the equal shards this asks for
    if placement.parts is not None:
        sizes = maybe_local_shape(shape, placement, world_size, 0), maybe_local_shape(shape, placement, world_size, -1)
        return sizes[0] is not None and sizes[0] == sizes[1]
    return placement.dim < len(shape) and shape[placement.dim] % (groups_of(placement, world_size)[0] * placement.chunks) == 0


def padded(nbytes: float, shape, placement: Placement, world_size: int) -> float:
    """The bytes a collective moves for a tensor of `nbytes` held with `placement`: an uneven
    shard is padded to the largest rank's size (ceil(n/p) x p instead of n)."""
    if not isinstance(placement, Shard) or placement.dim >= len(shape) or is_even(shape, placement, world_size):
        return nbytes
    n = int(shape[placement.dim])
    return nbytes * local_shape(shape, placement, world_size)[placement.dim] * groups_of(placement, world_size)[0] / n


def layout_of(shape, placement: Placement, world_size: int):
    """`placement` as a layout table records it: with the global size where shards differ."""
    if isinstance(placement, Shard) and not is_even(shape, placement, world_size):
        return replace(placement, size=int(shape[placement.dim]))
    return placement


def global_shape(local, layout: Placement, world_size: int) -> tuple[int, ...]:
    """The global shape of a tensor a rank holds `local` of, by its layout table entry."""
    shape = [int(s) for s in local]
    if isinstance(layout, Shard):
        groups = groups_of(layout, world_size)[0]          # (a piece held by groups of ranks: once a group)
        shape[layout.dim] = layout.size if layout.size is not None else shape[layout.dim] * groups
    return tuple(shape)
