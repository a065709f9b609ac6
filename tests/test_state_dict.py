"""collect / relocate round trips (tied aliases, strided chunks, dst), errors, DDP x TP training."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import distributed as ad
from autoshard.errors import ShardingError
from autoshard.nn import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from autoshard.runtime.state_dict import torchshard_layout
from refs import close, ref_piece, seeded


class Tied(nn.Module):
    """Vocabulary-split embedding tied to a column-parallel LM head, plus an MLP and a norm."""

    def __init__(self, parallel=True):
        super().__init__()
        emb, lin = (ParallelEmbedding, ParallelLinear) if parallel else (nn.Embedding, nn.Linear)
        kw = {"dim": 0} if parallel else {}
        col = {"dim": -1} if parallel else {}
        self.wte = emb(16, 8, **kw)
        self.fc1 = lin(8, 12, **col)
        self.fc2 = lin(12, 8, **kw)
        self.norm = nn.LayerNorm(8)
        self.head = lin(8, 16, bias=False, **col)
        self.head.weight = self.wte.weight


def _pair():
    torch.manual_seed(0)
    ref = Tied(parallel=False)
    torch.manual_seed(0)
    return ref, Tied()


def _check_full(full, ref):
    assert list(full) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        close(full[key], value)
    return True


def _check_local(local, model):
    assert list(local) == list(model.state_dict())
    for key, value in model.state_dict().items():
        close(local[key], value)
    return True


# ----------------------------------------------------------------------------- cases

def _round_trip(rank, p):
    ref, model = _pair()
    assert set(autoshard.layouts(model)) == {"wte.weight", "head.weight", "fc1.weight", "fc1.bias", "fc2.weight"}
    _check_full(autoshard.collect_state_dict(model, model.state_dict()), ref)
    _check_local(autoshard.relocate_state_dict(model, ref.state_dict()), model)
    _check_full(autoshard.collect_state_dict(copy.deepcopy(model), model.state_dict()), ref)
    assigned = Tied()
    assigned.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert autoshard.get_parallel_dim(assigned.fc1.weight) is None     # attributes gone, table kept
    return _check_full(autoshard.collect_state_dict(assigned, assigned.state_dict()), ref)


def _torchshard_attributes_only(rank, p):
    """A plain module marked only with TorchShard attributes, with a tied alias."""
    full_w, full_b = seeded(0, (8, 6)), seeded(1, (8,))
    model = nn.ModuleDict({"a": nn.Linear(6, 8 // p), "b": nn.Linear(6, 8 // p)})
    model.a.weight = nn.Parameter(ref_piece(full_w, 0, p, rank))
    model.a.bias = nn.Parameter(ref_piece(full_b, 0, p, rank))
    for t in (model.a.weight, model.a.bias):
        autoshard.register_parallel_attribute(t, -1, 0)
    model.b.weight, model.b.bias = model.a.weight, model.a.bias
    full = autoshard.collect_state_dict(model, model.state_dict())
    for key in full:
        close(full[key], full_w if key.endswith("weight") else full_b)
    names = autoshard.register_ddp_parameters_to_ignore(model)
    return names == ["a.weight", "a.bias", "b.weight", "b.bias"] and model._ddp_params_and_buffers_to_ignore == names


def _strided(rank, p):
    full = {"weight": seeded(0, (12, 4)), "bias": seeded(1, (12,))}
    model = nn.Linear(4, 12 // p)
    for name, value in full.items():
        setattr(model, name, nn.Parameter(ref_piece(value, 0, p, rank, chunks=3)))
    model._autoshard_layouts = {"weight": autoshard.Shard(0, 3), "bias": autoshard.Shard(0, 3)}
    model._autoshard_group = "world"
    collected = autoshard.collect_state_dict(model, model.state_dict())
    for name, value in full.items():
        close(collected[name], value)
    return _check_local(autoshard.relocate_state_dict(model, collected), model)


def _to_one_rank(rank, p, dst):
    ref, model = _pair()
    full = autoshard.collect_state_dict(model, model.state_dict(), dst=dst)
    return _check_full(full, ref) if rank == dst else full == {}


def _prefix_and_errors(rank, p):
    ref, model = _pair()
    prefixed = {"module." + k: v for k, v in model.state_dict().items()}
    full = autoshard.collect_state_dict(model, prefixed, prefix="module.")
    _check_full({k[len("module."):]: v for k, v in full.items()}, ref)
    with pytest.raises(ShardingError, match=r"key 'module.wte.weight' \(prefix ''\) matches no entry of Tied"):
        autoshard.collect_state_dict(model, prefixed)
    with pytest.raises(ShardingError, match=r"key 'wte.weight' \(prefix 'module.'\)"):
        autoshard.relocate_state_dict(model, ref.state_dict(), prefix="module.")
    with pytest.raises(ShardingError, match=r"relocate_state_dict: 'fc1.weight' has shape \(6, 8\) but the full"):
        autoshard.relocate_state_dict(model, {"fc1.weight": model.fc1.weight})
    with pytest.raises(ShardingError, match=r"collect_state_dict: 'fc2.weight' has shape \(8, 12\) but this rank"):
        autoshard.collect_state_dict(model, {"fc2.weight": ref.fc2.weight})
    return True


def _ddp_2tp_x_2dp(rank, p):
    """World 4 as TP groups {0,1}, {2,3} and DP groups {0,2}, {1,3}; DDP over WORLD."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ad.init_process_group(2)
    dp_rank = rank // 2
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Identity(), nn.Linear(16, 4))
    torch.manual_seed(0)
    model = nn.Sequential(ParallelLinear(8, 16, dim=-1), nn.ReLU(), RegisterParallelDim(-1),
                          ParallelLinear(16, 4, dim=0))
    assert autoshard.register_ddp_parameters_to_ignore(model) == ["0.weight", "0.bias", "3.weight"]
    ddp = DDP(model)
    x, y = seeded(1, (8, 8)), seeded(2, (8, 4))
    mine = slice(4 * dp_rank, 4 * dp_rank + 4)
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        for module, optim, xs, ys in ((ddp, opt, x[mine], y[mine]), (ref, ref_opt, x, y)):
            optim.zero_grad()
            F.mse_loss(module(xs), ys).backward()
            optim.step()
    return _check_full(autoshard.collect_state_dict(model, model.state_dict()), ref)


# ----------------------------------------------------------------------------- tests

def test_collect_relocate_round_trip_with_tied_alias(dist2):
    assert all(dist2.run(_round_trip))


def test_round_trip_world4(dist4):
    assert all(dist4.run(_round_trip))


def test_torchshard_attributes_with_tied_alias(dist2):
    assert all(dist2.run(_torchshard_attributes_only))


@pytest.mark.parametrize("world", ["dist2", "dist4"])
def test_strided_chunks_round_trip(world, request):
    assert all(request.getfixturevalue(world).run(_strided))


@pytest.mark.parametrize("dst", [0, 1])
def test_collect_to_one_rank(dist2, dst):
    assert all(dist2.run(_to_one_rank, dst))


def test_prefix_unknown_keys_and_shapes(dist2):
    assert all(dist2.run(_prefix_and_errors))


def test_ddp_over_tensor_parallel_matches_full_batch_training(dist4):
    assert all(dist4.run(_ddp_2tp_x_2dp))


def test_slice():
    pieces = autoshard.slice(torch.empty(3, 10), 2, dim=-1)
    assert [tuple(t.shape) for t in pieces] == [(3, 5), (3, 5)]
    assert all(t.is_contiguous() for t in autoshard.slice(torch.empty(3, 10), 2, contiguous=True))
    with pytest.raises(ShardingError, match=r"shape \(3, 10\): size 3 of dim 0 does not divide into 1 chunk\(s\) x 2"):
        autoshard.slice(torch.empty(3, 10), 2, dim=0)


def test_torchshard_layout_rules():
    S = autoshard.Shard
    assert torchshard_layout(-1, 0, 2) == S(0) and torchshard_layout(1, 0, 1) == S(0)
    assert torchshard_layout(0, 0, 2) == S(1) and torchshard_layout(0, 0, 1) is None
    assert torchshard_layout(0, 1, 2) == S(0) and torchshard_layout(-1, 1, 2) == S(1)
    assert torchshard_layout(None, 0, 2) is None
    with pytest.raises(ShardingError, match="got 2"):
        torchshard_layout(2, 0, 2)


def test_layouts_without_process_group():
    m = nn.Linear(4, 4)
    assert autoshard.collect_state_dict(m, m.state_dict()).keys() == m.state_dict().keys()   # nothing sharded
    autoshard.register_parallel_attribute(m.weight, 0, 0)
    assert autoshard.layouts(m) == {"weight": autoshard.Shard(1)}
    m._autoshard_layouts = {"weight": autoshard.Shard(0, 2)}
    assert autoshard.layouts(copy.deepcopy(m)) == {"weight": autoshard.Shard(0, 2)}
