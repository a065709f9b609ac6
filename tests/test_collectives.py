"""Collectives: forward and backward of each against a single-process reference, counters, FX."""
import pytest
import torch
import torch.distributed as dist
import torch.fx

import autoshard
from autoshard.runtime import collectives as C
from autoshard.errors import ProcessGroupError, ShardingError
import refs
from refs import close, ref_piece

SHAPE = (4, 12, 6)


def seeded(seed, shape=SHAPE):
    return refs.seeded(seed, shape)


# ----------------------------------------------------------------------------- cases (run on every rank)

def _copy_reduce(rank, p):
    x = seeded(0).requires_grad_()
    y = C.copy_to(x)
    close(y, x)
    y.backward(seeded(10 + rank))
    close(x.grad, sum(seeded(10 + r) for r in range(p)))

    x = seeded(20 + rank).requires_grad_()
    y = C.reduce_from(x, group="world")
    close(y, sum(seeded(20 + r) for r in range(p)))
    y.backward(seeded(1))
    close(x.grad, seeded(1))

    # in place (as the rewriter does for a row-parallel matmul's own output): same values and
    # gradients, the input itself holds the sum; where autograd saved the input, backward raises
    a = seeded(20 + rank).requires_grad_()
    h = a * 2
    y = C.reduce_from(h, group="world", inplace=True)
    assert y is h
    close(y, 2 * sum(seeded(20 + r) for r in range(p)))
    y.backward(seeded(1))
    close(a.grad, 2 * seeded(1))
    e = seeded(0).requires_grad_().exp()                # exp saves its output for backward
    z = C.reduce_from(e, group="world", inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    return True


def _scatter_gather(rank, p, dim, chunks):
    full, grad = seeded(0), seeded(1)
    x = full.clone().requires_grad_()
    y = C.scatter_to(x, dim, chunks)
    close(y, ref_piece(full, dim, p, rank, chunks))
    y.backward(ref_piece(grad, dim, p, rank, chunks))
    close(x.grad, grad)

    x = ref_piece(full, dim, p, rank, chunks).requires_grad_()
    y = C.gather_from(x, dim, chunks)
    close(y, full)
    y.backward(grad)
    return close(x.grad, ref_piece(grad, dim, p, rank, chunks))


def _reduce_scatter_all_gather(rank, p, dim, chunks):
    total, grad = sum(seeded(30 + r) for r in range(p)), seeded(1)
    x = seeded(30 + rank).requires_grad_()
    y = C.reduce_scatter(x, dim, chunks)
    close(y, ref_piece(total, dim, p, rank, chunks))
    y.backward(ref_piece(grad, dim, p, rank, chunks))
    close(x.grad, grad)

    full = seeded(0)
    x = ref_piece(full, dim, p, rank, chunks).requires_grad_()
    y = C.all_gather(x, dim, chunks)
    close(y, full)
    y.backward(seeded(40 + rank))
    partial_sum = sum(seeded(40 + r) for r in range(p))
    return close(x.grad, ref_piece(partial_sum, dim, p, rank, chunks))


def _all_to_all(rank, p, src, dst):
    full, grad = seeded(0), seeded(1)
    x = ref_piece(full, src, p, rank).requires_grad_()
    y = C.all_to_all(x, src, dst)
    close(y, ref_piece(full, dst, p, rank))
    y.backward(ref_piece(grad, dst, p, rank))
    return close(x.grad, ref_piece(grad, src, p, rank))


def _group_of_one(rank, p):
    singles = [dist.new_group([r]) for r in range(p)]
    x = seeded(0).requires_grad_()
    with C.count_comm() as c:
        outs = [C.copy_to(x, singles[rank]), C.reduce_from(x, singles[rank]),
                C.gather_from(x, 1, group=singles[rank]), C.all_to_all(x, 0, 1, singles[rank])]
    return all(o is x for o in outs) and c.calls == 0


def _counters(rank, p):
    x = seeded(0, (4, 8)).requires_grad_()
    with C.count_comm() as outer:
        y = C.copy_to(x)
        with C.count_comm() as inner:
            z = C.gather_from(C.scatter_to(y, 1), 1)
            w = C.reduce_from(z)
        w.sum().backward()
    n = x.nbytes
    assert outer.by_direction == {"forward": (2, C.ring_bytes("all_gather", n, p) + C.ring_bytes("all_reduce", n, p)),
                                  "backward": (2, C.ring_bytes("all_gather", n, p) + C.ring_bytes("all_reduce", n, p))}
    assert inner.calls == 2 and inner.by_kind == {"all_gather": (1, C.ring_bytes("all_gather", n, p)),
                                                 "all_reduce": (1, C.ring_bytes("all_reduce", n, p))}
    assert outer.bytes == pytest.approx(2 * (C.ring_bytes("all_gather", n, p) + C.ring_bytes("all_reduce", n, p)))
    assert [e.op for e in outer.events] == ["gather_from", "reduce_from", "scatter_to", "copy_to"]
    return True


class _Traced(torch.nn.Module):
    def forward(self, x):
        return autoshard.runtime.collectives.reduce_from(autoshard.runtime.collectives.copy_to(x) * 2, "world")


def _traced_runs(rank, p):
    gm = torch.fx.symbolic_trace(_Traced())
    x = torch.ones(3, requires_grad=True)
    y = gm(x)
    y.sum().backward()
    return close(y, torch.full((3,), 2.0 * p)) and close(x.grad, torch.full((3,), 2.0 * p))


def _bad_split(rank, p):
    with pytest.raises(ShardingError, match=r"shape \(3, 5\).*size 5 of dim 1.*2 chunk\(s\) x 2 ranks"):
        C.scatter_to(torch.zeros(3, 5), 1, 2)
    with pytest.raises(ShardingError, match=r"shape \(3, 1\).*size 1 of dim 1"):
        C.scatter_to(torch.zeros(3, 1), 1)              # a rank would be left empty
    with pytest.raises(ShardingError, match="dim 2 is out of range"):
        C.scatter_to(torch.zeros(3, 4), 2)
    return True


def _uneven(rank, p, n):
    """Sizes that do not divide: torch.chunk's pieces, padded on the wire and cropped, both ways."""
    x = torch.arange(3.0 * n).reshape(3, n).requires_grad_()
    piece = C.scatter_to(x, 1)
    assert torch.equal(piece, x.detach().chunk(p, 1)[rank])
    (piece * (rank + 1)).sum().backward()                # backward of the scatter: an uneven all-gather
    want = torch.cat([torch.full_like(c, r + 1.0) for r, c in enumerate(x.detach().chunk(p, 1))], 1)
    assert torch.equal(x.grad, want)
    local = piece.detach().clone().requires_grad_()
    whole = C.gather_from(local, 1, size=n)
    assert torch.equal(whole, x.detach())
    whole.backward(torch.ones_like(whole) * 2)
    assert torch.equal(local.grad, torch.full_like(local, 2.0))
    part = C.reduce_scatter(x.detach() * (rank + 1), 1)    # padded equal pieces reduced, own one cropped
    return torch.equal(part, x.detach().chunk(p, 1)[rank] * sum(range(1, p + 1)))


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("n", [5, 7])
def test_uneven_scatter_gather_reduce_scatter(dist3, n):
    assert all(dist3.run(_uneven, n))


def test_copy_to_and_reduce_from(dist2):
    assert all(dist2.run(_copy_reduce))


@pytest.mark.parametrize("dim,chunks", [(0, 1), (1, 1), (-1, 1), (1, 3), (-1, 3), (1, 2)])
def test_scatter_to_and_gather_from(dist2, dim, chunks):
    assert all(dist2.run(_scatter_gather, dim, chunks))


@pytest.mark.parametrize("dim,chunks", [(1, 1), (-1, 1), (1, 3)])
def test_reduce_scatter_and_all_gather(dist2, dim, chunks):
    assert all(dist2.run(_reduce_scatter_all_gather, dim, chunks))


def test_reduce_scatter_and_all_gather_world4(dist4):
    assert all(dist4.run(_reduce_scatter_all_gather, 1, 3))


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1), (-1, 1)])
def test_all_to_all(dist2, src, dst):
    assert all(dist2.run(_all_to_all, src, dst))


def test_group_of_one_is_identity_and_silent(dist2):
    assert all(dist2.run(_group_of_one))


def _matches_comm_debug_mode(rank, p):
    """Our counter agrees with torch's own CommDebugMode on the number of collectives."""
    from torch.distributed.tensor.debug import CommDebugMode

    x = seeded(0, (4, 8)).requires_grad_()
    with CommDebugMode() as torch_counts, C.count_comm() as ours:
        y = C.all_gather(C.reduce_scatter(C.copy_to(x), 1), 1)
        z = C.all_to_all(C.gather_from(C.scatter_to(y, 0), 0), 0, 1)
        C.reduce_from(z).sum().backward()
    assert torch_counts.get_total_counts() == ours.calls == 10, (torch_counts.get_comm_counts(), ours.events)
    return True


def test_counts_agree_with_comm_debug_mode(dist2):
    assert all(dist2.run(_matches_comm_debug_mode))


def test_count_comm_forward_backward_and_nesting(dist2):
    assert all(dist2.run(_counters))


def test_traced_collectives_run(dist2):
    assert all(dist2.run(_traced_runs))


def test_bad_split_errors_name_shape_and_sizes(dist2):
    assert all(dist2.run(_bad_split))


def test_each_collective_is_one_named_fx_node():
    class M(torch.nn.Module):
        def forward(self, x):
            y = autoshard.runtime.collectives.copy_to(x)
            y = autoshard.runtime.collectives.scatter_to(y, 1, chunks=3, group="world")
            y = autoshard.runtime.collectives.all_to_all(y, 1, 0)
            y = autoshard.runtime.collectives.gather_from(y, 0)
            y = autoshard.runtime.collectives.reduce_scatter(y, 1)
            y = autoshard.runtime.collectives.all_gather(y, 1)
            return autoshard.runtime.collectives.reduce_from(y)

    gm = torch.fx.symbolic_trace(M())
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    names = ["copy_to", "scatter_to", "all_to_all", "gather_from", "reduce_scatter", "all_gather", "reduce_from"]
    assert [n.target for n in calls] == [getattr(C, name) for name in names]
    assert calls[1].kwargs == {"chunks": 3, "group": "world"}
    for name in names:
        assert f"autoshard_runtime_collectives_{name}(" in gm.code


def test_imported_by_name_is_also_a_leaf():
    from autoshard.runtime.collectives import copy_to

    class M(torch.nn.Module):
        def forward(self, x):
            return copy_to(x) + 1

    gm = torch.fx.symbolic_trace(M())
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is C.copy_to


def test_ring_bytes():
    assert C.ring_bytes("all_reduce", 1000, 4) == 1500
    assert C.ring_bytes("all_gather", 1000, 4) == 750
    assert C.ring_bytes("reduce_scatter", 1000, 2) == 500
    assert C.ring_bytes("all_to_all", 1000, 2) == 250     # full tensor: a rank sends half of its half
    assert C.ring_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="unknown collective kind"):
        C.ring_bytes("broadcast", 1, 2)


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(ProcessGroupError, match="needs a process group"):
        C.copy_to(torch.zeros(2))


def test_split_and_cat_with_chunks_round_trip():
    x = torch.arange(2 * 12 * 3.0).reshape(2, 12, 3)
    for chunks in (1, 2, 3):
        pieces = C.split_along(x, 1, 2, chunks)
        for r in range(2):
            assert torch.equal(pieces[r], ref_piece(x, 1, 2, r, chunks))
        assert torch.equal(C.cat_along(pieces, 1, chunks), x)
