"""placements.boxes: a rank's pieces of a global tensor, checked against the split collect/relocate use."""
import pytest
import torch

from autoshard.placements import split_along
from autoshard.placements import PARTIAL, Replicate, Shard, boxes


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
    from autoshard.placements import chunk_sizes, global_shape, layout_of, local_shape, splits
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
