"""Parallel layers and the vocabulary-parallel loss against their torch.nn twins (fp32, 1e-5)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.runtime.collectives import count_comm
from autoshard.errors import ProcessGroupError, ShardingError
from autoshard.nn import ParallelCrossEntropyLoss, ParallelEmbedding, ParallelLinear, RegisterParallelDim
from autoshard.nn.init import shard_init_helper_
from refs import close, ref_piece, seeded


def _run_pair(ref, mod, x, upstream_ref, upstream):
    """Forward both, backward with the given upstream gradients; returns (ref out, out, ref x, x)."""
    xr, xm = x.clone().requires_grad_(x.is_floating_point()), x.clone().requires_grad_(x.is_floating_point())
    yr, ym = ref(xr), mod(xm)
    (yr * upstream_ref).sum().backward()
    (ym * upstream).sum().backward()
    return yr, ym, xr, xm


# ----------------------------------------------------------------------------- linear

def _linear(rank, p, dim, bias):
    torch.manual_seed(0)
    ref = nn.Linear(8, 12, bias=bias)
    torch.manual_seed(0)
    m = ParallelLinear(8, 12, bias=bias, dim=dim)
    col = dim in (-1, 1)
    wdim = 0 if col else 1
    x, grad = seeded(1, (5, 3, 8)), seeded(2, (5, 3, 12))
    yr, ym, xr, xm = _run_pair(ref, m, x, grad, ref_piece(grad, -1, p, rank) if col else grad)
    split = (lambda t, d: ref_piece(t, d, p, rank)) if dim is not None else (lambda t, d: t)
    close(ym, split(yr, -1) if col else yr)
    close(xm.grad, xr.grad)
    close(m.weight, split(ref.weight, wdim))
    close(m.weight.grad, split(ref.weight.grad, wdim))
    if bias:
        close(m.bias, split(ref.bias, 0) if col else ref.bias)
        close(m.bias.grad, split(ref.bias.grad, 0) if col else ref.bias.grad)
        assert (m.bias.parallel_dim, m.bias.order_type) == (dim, 0)
    assert (m.weight.parallel_dim, m.weight.order_type) == (dim, 0)
    assert autoshard.get_parallel_dim(ym) == (-1 if col else None)
    return True


def _row_takes_sharded_input(rank, p):
    torch.manual_seed(0)
    ref, row = nn.Linear(8, 6), None
    torch.manual_seed(0)
    row = ParallelLinear(8, 6, dim=0)
    x = seeded(1, (4, 8))
    piece = ref_piece(x, -1, p, rank).requires_grad_()
    autoshard.register_parallel_dim(piece, -1)
    with count_comm() as c:
        y = row(piece)
    close(y, ref(x))
    assert c.by_kind == {"all_reduce": (1, c.bytes)}          # used as is: no scatter, no gather
    y.sum().backward()
    xr = x.clone().requires_grad_()
    ref(xr).sum().backward()
    return close(piece.grad, ref_piece(xr.grad, -1, p, rank))


def _mlp(rank, p):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Identity(), nn.Linear(16, 8))
    torch.manual_seed(0)
    m = nn.Sequential(ParallelLinear(8, 16, dim=-1), nn.ReLU(), RegisterParallelDim(-1), ParallelLinear(16, 8, dim=0))
    x, grad = seeded(1, (6, 8)), seeded(2, (6, 8))
    with count_comm() as c:
        yr, ym, xr, xm = _run_pair(ref, m, x, grad, grad)
    close(ym, yr)
    close(xm.grad, xr.grad)
    for (name, pr), pm in zip(ref.named_parameters(), m.parameters()):
        layout = autoshard.layouts(m).get(name)
        close(pm.grad, pr.grad if layout is None else ref_piece(pr.grad, layout.dim, p, rank))
    n = x.nbytes
    assert c.by_direction == {"forward": (1, (p - 1) / p * 2 * n), "backward": (1, (p - 1) / p * 2 * n)}
    return True


# ----------------------------------------------------------------------------- embedding

def _embedding(rank, p, dim, padding_idx, extra):
    torch.manual_seed(0)
    ref = nn.Embedding(16, 8, padding_idx=padding_idx, **extra)
    torch.manual_seed(0)
    m = ParallelEmbedding(16, 8, padding_idx=padding_idx, dim=dim, **extra)
    wdim = {None: None, 0: 0, 1: 1, -1: 1}[dim]
    split = (lambda t: t) if wdim is None else (lambda t: ref_piece(t, wdim, p, rank))
    close(m.weight, split(ref.weight))
    idx = torch.tensor([[13, 2, 0, 15, 13], [7, 8, 2, 2, 9], [1, 13, 14, 8, 3]])
    yr, ym, _, _ = _run_pair(ref, m, idx, seeded(3, (3, 5, 8)), seeded(3, (3, 5, 8)))
    close(ym, yr)
    close(m.weight.grad, split(ref.weight.grad))
    close(m.weight.detach(), split(ref.weight.detach()))          # max_norm renormalised the same rows
    assert (m.weight.parallel_dim, m.weight.order_type) == (dim, 1)
    return True


# ----------------------------------------------------------------------------- cross entropy

def _loss_case(rank, p, reduction, ndim, weighted, smoothing, ignore_index):
    n_classes = 12
    shape = (6, n_classes) if ndim == 2 else (3, n_classes, 4)
    logits = seeded(5, shape) * 3
    target = torch.randint(0, n_classes, shape[:1] + shape[2:], generator=torch.Generator().manual_seed(6))
    target.view(-1)[::4] = ignore_index
    weight = torch.rand(n_classes, generator=torch.Generator().manual_seed(7)) + 0.5 if weighted else None
    kw = dict(weight=weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)
    lr = logits.clone().requires_grad_()
    ref = F.cross_entropy(lr, target, **kw)
    ls = ref_piece(logits, 1, p, rank).requires_grad_()
    autoshard.register_parallel_dim(ls, -1)
    out = ParallelCrossEntropyLoss(**kw)(ls, target)
    close(out, ref)
    upstream = seeded(8, ref.shape) if reduction == "none" else torch.tensor(0.7)
    (ref * upstream).sum().backward()
    (out * upstream).sum().backward()
    return close(ls.grad, ref_piece(lr.grad, 1, p, rank))


def _loss_grid(rank, p, reduction, ndim):
    for weighted in (False, True):
        for smoothing in (0.0, 0.2):
            for ignore_index in (-100, 3):
                _loss_case(rank, p, reduction, ndim, weighted, smoothing, ignore_index)
    return True


def _loss_edges(rank, p):
    logits = seeded(5, (4, 8))
    target = torch.full((4,), -100)
    ls = ref_piece(logits, 1, p, rank)
    autoshard.register_parallel_dim(ls, -1)
    close(ParallelCrossEntropyLoss()(ls, target), F.cross_entropy(logits, target), equal_nan=True)
    target = torch.tensor([1, 2, 3, 4])
    plain = ParallelCrossEntropyLoss()(logits, target)                # no parallel_dim: F.cross_entropy
    close(plain, F.cross_entropy(logits, target))
    assert ParallelCrossEntropyLoss(reduction="none")(ls, target).shape == (4,)
    with pytest.raises(ShardingError, match="weight of shape \\(5,\\) must hold all 8 classes"):
        ParallelCrossEntropyLoss(weight=torch.ones(5))(ls, target)
    with pytest.raises(ShardingError, match="target out of range"):
        ParallelCrossEntropyLoss()(ls, torch.tensor([1, 2, 3, 8]))
    return True


def _lm_head(rank, p):
    torch.manual_seed(0)
    ref = nn.Linear(8, 16)
    torch.manual_seed(0)
    head = ParallelLinear(8, 16, dim=-1)
    x, target = seeded(1, (10, 8)), torch.arange(10) % 16
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.cross_entropy(ref(xr), target, label_smoothing=0.1).backward()
    with count_comm() as c:
        loss = ParallelCrossEntropyLoss(label_smoothing=0.1)(head(xm), target)
        loss.backward()
    close(loss, F.cross_entropy(ref(x), target, label_smoothing=0.1))
    close(xm.grad, xr.grad)
    close(head.weight.grad, ref_piece(ref.weight.grad, 0, p, rank))
    assert c.by_direction["forward"][0] == 2 and c.by_direction["backward"] == (1, (p - 1) / p * 2 * x.nbytes)
    return True


# ----------------------------------------------------------------------------- init, convert, errors

def _init_helper(rank, p):
    m = ParallelLinear(8, 12, dim=-1)
    e = ParallelEmbedding(16, 8, dim=0)
    row = ParallelLinear(8, 12, dim=0)
    torch.manual_seed(100 + rank)                                 # ranks differ: rank 0's draw wins
    shard_init_helper_(nn.init.kaiming_normal_, m.weight, a=0, mode="fan_in", nonlinearity="leaky_relu")
    shard_init_helper_(nn.init.normal_, e.weight, std=0.5)
    shard_init_helper_(nn.init.constant_, row.bias, val=0.1)
    torch.manual_seed(100)
    full_w = nn.init.kaiming_normal_(torch.empty(12, 8), a=0, mode="fan_in", nonlinearity="leaky_relu")
    full_e = nn.init.normal_(torch.empty(16, 8), std=0.5)
    close(m.weight, ref_piece(full_w, 0, p, rank))
    close(e.weight, ref_piece(full_e, 0, p, rank))
    return close(row.bias, torch.full((12,), 0.1))


def _convert(rank, p):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 4), nn.Embedding(10, 4))
    model = ParallelLinear.convert_parallel_linear(copy.deepcopy(ref), dim=-1)
    model = ParallelEmbedding.convert_parallel_embedding(model, dim=0)
    assert isinstance(model[0], ParallelLinear) and isinstance(model[3], ParallelEmbedding)
    for key, value in model.state_dict().items():
        close(value, ref_piece(ref.state_dict()[key], 0, p, rank))
    single = ParallelLinear.convert_parallel_linear(ref[2], dim=0)
    return isinstance(single, ParallelLinear) and close(single.weight, ref_piece(ref[2].weight, 1, p, rank))


def _errors(rank, p):
    with pytest.raises(ShardingError, match=r"ParallelLinear\(in_features=8, out_features=7.*weight.*size 7 of dim 0"):
        ParallelLinear(8, 7, dim=-1)
    with pytest.raises(ShardingError, match=r"ParallelLinear\(in_features=7, out_features=8.*size 7 of dim 1"):
        ParallelLinear(7, 8, dim=0)
    with pytest.raises(ShardingError, match=r"ParallelEmbedding\(15, 8, dim=0\) weight.*size 15 of dim 0"):
        ParallelEmbedding(15, 8, dim=0)
    row = ParallelLinear(8, 4, dim=0)
    bad = torch.zeros(3, 2)
    autoshard.register_parallel_dim(bad, -1)
    with pytest.raises(ShardingError, match=r"row-parallel linear: input of shape \(3, 2\).*expects 4"):
        row(bad)
    with pytest.raises(ShardingError, match="hidden-split"):
        ParallelEmbedding(8, 8, max_norm=1.0, dim=1)(torch.tensor([1]))
    return True


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("bias", [True, False])
def test_parallel_linear_matches_linear(dist2, dim, bias):
    assert all(dist2.run(_linear, dim, bias))


def test_parallel_linear_world4(dist4):
    assert all(dist4.run(_linear, -1, True)) and all(dist4.run(_linear, 0, True))


def test_row_linear_uses_sharded_input_as_is(dist2):
    assert all(dist2.run(_row_takes_sharded_input))


def test_column_row_mlp_matches_and_communicates_like_megatron(dist2):
    assert all(dist2.run(_mlp))


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("padding_idx", [None, 13, -3, 2])
def test_parallel_embedding_matches_embedding(dist2, dim, padding_idx):
    assert all(dist2.run(_embedding, dim, padding_idx, {}))


@pytest.mark.parametrize("dim,extra", [(0, {"scale_grad_by_freq": True}), (1, {"scale_grad_by_freq": True}),
                                       (0, {"max_norm": 1.0})])
def test_parallel_embedding_options(dist2, dim, extra):
    assert all(dist2.run(_embedding, dim, 13, extra))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_vocab_parallel_cross_entropy_matches(dist2, reduction, ndim):
    assert all(dist2.run(_loss_grid, reduction, ndim))


def test_vocab_parallel_cross_entropy_world4(dist4):
    assert all(dist4.run(_loss_grid, "mean", 3))


def test_cross_entropy_edge_cases(dist2):
    assert all(dist2.run(_loss_edges))


def test_lm_head_with_parallel_loss(dist2):
    assert all(dist2.run(_lm_head))


def test_shard_init_helper(dist2):
    assert all(dist2.run(_init_helper))


def test_convert_parallel_layers(dist2):
    assert all(dist2.run(_convert))


def test_layer_errors_name_module_and_sizes(dist2):
    assert all(dist2.run(_errors))


def test_unsharded_layers_need_no_process_group():
    torch.manual_seed(0)
    ref = nn.Linear(4, 6)
    torch.manual_seed(0)
    m = ParallelLinear(4, 6)
    x = torch.randn(2, 4)
    close(m(x), ref(x))
    with pytest.raises(ProcessGroupError, match=r"ParallelLinear\(in_features=4, out_features=6.*needs a process group"):
        ParallelLinear(4, 6, dim=-1)
    with pytest.raises(ShardingError, match="must be one of None, 0, 1, -1; got 2"):
        ParallelLinear(4, 6, dim=2)
    with pytest.raises(ShardingError, match="got 3"):
        RegisterParallelDim(3)
