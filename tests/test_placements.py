"""placements.boxes: a rank's pieces of a global tensor, checked against the split collect/relocate use."""
import pytest
import torch

from autoshard.placements import split_along
from autoshard.placements import PARTIAL, Replicate, Shard, boxes


@pytest.mark.parametrize("shape,pl,p", [((12, 6), Shard(0, 3), 2), ((12, 6), Shard(1), 3), ((12, 8), Shard(0), 4),
                                        ((5,), Replicate(), 2), ((24, 4), Shard(0, 3), 4), ((4, 6, 8), Shard(2, 2), 2)])
def test_boxes_rebuild_each_rank_piece(shape, pl, p):
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    pieces = split_along(t, pl.dim, p, pl.chunks) if isinstance(pl, Shard) else [t] * p
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
        boxes((10, 4), Shard(0), 0, 4)
    with pytest.raises(ValueError, match="Partial"):
        boxes((4,), PARTIAL, 0, 2)
