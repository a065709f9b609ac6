"""TorchShard's API under `import autoshard as ts`: its communication functions (values,
gradients and the `parallel_dim` labels its layers read), a hybrid stack of ParallelLinear layers
joined by `ts.distributed.gather` as TorchShard's own test builds it, and a converted model
under DDP with the column-parallel cross entropy, each against a single-process reference.
(TorchShard's whole suite runs with `benchmarks/torchshard_suite.py`.)"""
import copy

import torch
import torch.distributed as dist
from torch import nn

import autoshard as ts
from refs import close, ref_piece, seeded

HYBRID = [0, 0, 1, None, -1, 0, 0, -1, None, -1, 1, 0, None, 0, -1]     # TorchShard's "hybrid2" stack


def _labels(t):
    return getattr(t, ts._PARALLEL_DIM, "absent"), getattr(t, ts._ORDER_TYPE, "absent")


def _comm(rank, p):
    assert (ts._PARALLEL_DIM, ts._ORDER_TYPE) == ("parallel_dim", "order_type")
    assert ts.distributed.get_group_size() == p
    full, up = seeded(1, (6, 8)), seeded(2, (6, 8))

    x = full.clone().requires_grad_()                        # scatter: own block, labelled dim; bwd all-gather
    s = ts.distributed.scatter(x, dim=-1)
    close(s, ref_piece(full, -1, p, rank))
    assert _labels(s) == (-1, 0)
    (s * ref_piece(up, -1, p, rank)).sum().backward()
    close(x.grad, up)

    piece = ref_piece(full, 0, p, rank).clone().requires_grad_()   # gather: whole, labelled dim; bwd own block
    g = ts.distributed.gather(piece, dim=0)
    close(g, full)
    assert _labels(g) == (0, 0)
    (g * up).sum().backward()
    close(piece.grad, ref_piece(up, 0, p, rank))

    mine = (full + rank).requires_grad_()                    # reduce: sum in a new tensor, labelled None; bwd identity
    r = ts.distributed.reduce(mine)
    close(r, sum(full + k for k in range(p)))
    close(mine.detach(), full + rank)
    assert _labels(r) == (None, 0)
    (r * up).sum().backward()
    close(mine.grad, up)

    y = full.clone().requires_grad_()                        # copy: identity, unlabelled; bwd all-reduce
    c = ts.distributed.copy(y)
    close(c, full)
    assert _labels(c)[0] == "absent"
    (c * (up + rank)).sum().backward()
    close(y.grad, sum(up + k for k in range(p)))

    ints = torch.arange(3) + 3 * rank                        # no-grad path, integer tensors
    assert torch.equal(ts.distributed.gather(ints, dim=0), torch.arange(3 * p))
    assert _labels(ts.distributed.scatter(full, dim=0)) == (0, 0)
    return True


def _stack(rank, p, relabel):
    """TorchShard's LinearStackModel (hybrid2): x through 15 ParallelLinear layers; a column
    layer's output is gathered along the layer's dim and, with `relabel`, re-labelled 'None' as
    TorchShard's test does; without, the gathered tensor (labelled -1) goes on as is."""
    torch.manual_seed(100 + rank)                            # ranks draw differently: the helper must agree them
    feats = (8, 16)
    layers = [ts.nn.ParallelLinear(feats[i % 2], feats[(i + 1) % 2], dim=d) for i, d in enumerate(HYBRID)]
    for m in layers:
        ts.nn.init.shard_init_helper_(nn.init.xavier_normal_, m.weight)
        ts.nn.init.shard_init_helper_(nn.init.uniform_, m.bias)
    refs = []
    for m in layers:
        full = ts.collect_state_dict(m, m.state_dict())
        ref = nn.Linear(m.in_features, m.out_features)
        ref.load_state_dict(full)
        refs.append(ref)
        if m.dim is None:                                    # replicated weights equal on every rank
            every = [torch.empty_like(m.weight) for _ in range(p)]
            dist.all_gather(every, m.weight.detach())
            assert all(torch.equal(w, every[0]) for w in every), f"replicated {m} differs across ranks"
    x, up = seeded(3, (3, 8)), seeded(4, (3, 16))
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = xr
    for ref in refs:
        yr = ref(yr)
    ym = xm
    for d, m in zip(HYBRID, layers):
        ym = m(ym)
        if ts.get_parallel_dim(ym) in (-1, 1):
            ym = ts.distributed.gather(ym, dim=d)
            if relabel:
                setattr(ym, ts._PARALLEL_DIM, "None")
    close(ym, yr)
    (yr * up).sum().backward()
    (ym * up).sum().backward()
    close(xm.grad, xr.grad)
    for m, ref in zip(layers, refs):
        for name, layout in [("weight", m._autoshard_layouts.get("weight")), ("bias", m._autoshard_layouts.get("bias"))]:
            want = getattr(ref, name).grad
            close(getattr(m, name).grad, want if layout is None else ref_piece(want, layout.dim, p, rank))
    return True


class _ConvLinear(nn.Module):
    """TorchShard's ConvLinearModel: a 1x1 conv on per-rank rows, gathered before a
    column-parallel fc."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, kernel_size=1)
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        x = torch.flatten(self.conv(x), 1)
        if isinstance(self.fc, ts.nn.ParallelLinear) and self.fc.dim in (-1, 1):
            x = ts.distributed.gather(x, dim=0)
        return self.fc(x)


def _ddp_column_cross_entropy(rank, p):
    torch.manual_seed(0)
    ref = _ConvLinear()
    model = copy.deepcopy(ref)
    ts.nn.ParallelLinear.convert_parallel_linear(model, dim=-1)           # in place, as TorchShard's test
    assert sorted(model._ddp_params_and_buffers_to_ignore) == ["fc.bias", "fc.weight"]
    ddp = nn.parallel.DistributedDataParallel(model)
    close(model.fc.weight, ref_piece(ref.fc.weight, 0, p, rank))        # DDP left this rank's shard alone
    xs = [seeded(10 + k, (3, 8, 1, 1)) for k in range(p)]
    ts_ = [torch.randint(0, 16, (3,), generator=torch.Generator().manual_seed(20 + k)) for k in range(p)]
    logits = ddp(xs[rank])
    assert ts.get_parallel_dim(logits) == -1
    loss = ts.nn.ParallelCrossEntropyLoss(reduction="none")(logits, ts.distributed.gather(ts_[rank], dim=0))
    loss.sum().backward()
    ref_loss = nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ts_), reduction="none")
    ref_loss.sum().backward()
    close(loss, ref_loss)
    close(model.fc.weight.grad, ref_piece(ref.fc.weight.grad, 0, p, rank))   # not averaged with other shards
    close(model.fc.bias.grad, ref_piece(ref.fc.bias.grad, 0, p, rank))
    close(model.conv.weight.grad, ref.conv.weight.grad / p)                 # DDP averages the replicated layer
    return True


def test_torchshard_communication_functions(dist2):
    assert all(dist2.run(_comm))


def test_hybrid_linear_stack_matches_torch(dist2):
    assert all(dist2.run(_stack, True)) and all(dist2.run(_stack, False))


def test_converted_model_under_ddp_with_column_parallel_loss(dist2):
    assert all(dist2.run(_ddp_column_cross_entropy))
