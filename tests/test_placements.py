"""pieces.boxes: a rank's pieces of a global tensor, checked against the split collect/relocate use."""
import pytest
import torch

from autoshard.runtime.pieces import split_along
from autoshard.runtime.placements import PARTIAL, Replicate, Shard
from autoshard.runtime.pieces import boxes


@pytest.mark.parametrize("shape,pl,p", [((12, 6), Shard(0, 3), 2), ((12, 6), Shard(1), 3), ((12, 8), Shard(0), 4),
                                        ((5,), Replicate(), 2), ((24, 4), Shard(0, 3), 4), ((4, 6, 8), Shard(2, 2), 2),
                                        ((257, 3), Shard(0), 3), ((3, 10), Shard(1), 4), ((7, 5), Shard(0), 2)])
def test_boxes_rebuild_each_rank_piece(shape, pl, p):
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    pieces = split_along(t, pl.dim, p, pl.chunks, uneven=True) if isinstance(pl, Shard) else [t] * p
    covered = torch.zeros(shape, dtype=torch.int64)
    for r in range(p):
        local = torch.full_like(pieces[r], -1)
        for b in boxes(shape, pl, r, p):
            local[b.local_index()] = t[b.global_index()]
            covered[b.global_index()] += 1
        assert torch.equal(local, pieces[r])
    assert torch.all(covered == (p if isinstance(pl, Replicate) else 1))


def test_boxes_errors():
    with pytest.raises(ValueError, match="does not divide"):
        boxes((3, 4), Shard(0), 0, 4)          # fewer rows than ranks: one would be empty
    with pytest.raises(ValueError, match="does not divide"):
        boxes((10, 4), Shard(0, 2), 0, 4)      # a strided shard must divide
    with pytest.raises(ValueError, match="Partial"):
        boxes((4,), PARTIAL, 0, 2)


def test_uneven_sizes_follow_torch_chunk():
    """torch.chunk's boundaries (DTensor's): ceil(n/p) each, the last ranks what is left; where
    those leave a rank empty (10 on 8: five chunks of 2), balanced: the first n mod p one more."""
    from autoshard.runtime.placements import chunk_sizes, global_shape, layout_of, local_shape, splits
    for n in (257, 50257, 10, 7, 64):
        for p in (2, 3, 4, 8):
            if n < p:
                assert not splits((n,), Shard(0), p)
                continue
            want = [c.numel() for c in torch.arange(n).chunk(p)]
            if len(want) < p:
                want = [n // p + (r < n % p) for r in range(p)]
            assert chunk_sizes(n, p) == want, (n, p)
            assert splits((n,), Shard(0), p)
    assert local_shape((257, 4), Shard(0), 3) == (86, 4) and local_shape((257, 4), Shard(0), 3, rank=2) == (85, 4)
    assert layout_of((257, 4), Shard(0), 3) == Shard(0, 1, 257) and layout_of((258, 4), Shard(0), 3) == Shard(0)
    assert global_shape((85, 4), Shard(0, 1, 257), 3) == (257, 4) and global_shape((86, 4), Shard(0), 3) == (258, 4)


def test_shards_held_by_groups_of_ranks():
    """`Shard(d, replicas=m)`: p/m groups of m consecutive ranks, each group's piece held by all of
    its ranks (4 kv heads on 8 ranks, groups of 2: rank r holds head r // 2); priced and gathered
    within the group (`kind@m`); never a stored tensor's layout."""
    from autoshard.runtime.collectives import ring_bytes
    from autoshard.runtime.placements import ShardGathered, divides, is_even, local_shape, shares, stored
    pl = Shard(2, replicas=2)
    assert [local_shape((2, 16, 1024), pl, 8, r)[2] for r in range(8)] == [256] * 8
    assert shares(1024, pl, 8) == ((256,) * 8,)
    assert local_shape((4, 6), Shard(1, replicas=2), 4, 3) == (4, 3)
    assert is_even((4, 6), Shard(1, replicas=2), 4) and divides((4, 6), Shard(1, replicas=2), 4)
    assert not divides((4, 6), Shard(1), 4)
    assert str(pl) == "S(2)r2" and "replicas=2" in repr(pl)
    with pytest.raises(ValueError, match="stored"):
        boxes((4, 8), Shard(1, replicas=2), 0, 4)
    with pytest.raises(ValueError, match="replicas"):
        Shard(0, replicas=0)
    g = ShardGathered(0, within=2)
    assert str(g) == "S(0)g2" and "within=2" in repr(g) and stored(g) == Shard(0)
    n = 1 << 20       # an all-gather within groups of 2 of 8 ranks: of the group's quarter, one half sent
    assert ring_bytes("all_gather@2", n, 8) == ring_bytes("all_gather", n / 4, 2) == n / 8
    assert ring_bytes("reduce_scatter@4", n, 8) == 3 * n / 8


def test_strategies_on_group_shards_stay_exact():
    """An op reading a shard held by groups of ranks may only pass it on as such (a sum over its
    dim, or a whole result, would count each group's piece m times); a parameter is never held so."""
    from autoshard.planner.rules.registry import OpStrategy, closed_groups
    g, s = Shard(1, replicas=2), Shard(1)
    assert closed_groups(OpStrategy("shard(1)", g, (g, Replicate())))
    assert not closed_groups(OpStrategy("partial", PARTIAL, (g,)))
    assert not closed_groups(OpStrategy("replicate", Replicate(), (g,)))
    assert not closed_groups(OpStrategy("shard(1)", s, (g,)))
    assert not closed_groups(OpStrategy("shard(1)", g, (s,)))
    assert not closed_groups(OpStrategy("column_gather_groups", g, (Replicate(), Shard(0))))       # no gather
    assert closed_groups(OpStrategy("column_gather_groups", g, (Replicate(), Shard(0)), comm=(("all_gather@2", 8),)))
    assert not closed_groups(OpStrategy("blocks(1)", g, (Shard(1, 3),), comm=(("all_gather@4", 8),)))


def test_group_shards_move_only_to_the_ranks_own_pieces():
    """A group's piece is cut to each rank's own (a local slice, the gradient zero-padded: still a
    summand within the group); no other redistribution reads or makes one."""
    from autoshard.runtime.transitions import partial_grad_edge, redistribute
    from autoshard.runtime.placements import REPLICATE_PG
    g = Shard(1, replicas=2)
    assert redistribute(g, g) == ((), ()) and redistribute(g, Shard(1)) == ((), ())
    for other in (Replicate(), PARTIAL, Shard(2), Shard(1, replicas=4), Shard(1, 2)):
        assert redistribute(g, other) is None and redistribute(other, g) is None
    assert partial_grad_edge(REPLICATE_PG, g, PARTIAL, False) is None
