"""Convolutions sharded on channels (autoshard/rules/conv.py), in real gloo runs.

Each case builds a small convolutional model, parallelizes it at world 2 or 4 with the named
tracer, and compares with the single-process model: forward output, cross-entropy loss and every
gradient (collected with collect_state_dict), fp32 1e-5 relative; then the state dict collects
to the model's and relocates back. The parent asserts what the plan chose: out-channel
("column") and in-channel ("row") splits of a CNN, a depthwise conv kept channel-parallel with
local groups, Conv1d (with a reflect-padded conv) and Conv3d, an unbatched input (channels on dim
0), a row split with a bias, and convolutions whose channels or groups do not divide (replicated,
or autoshard's own error when pinned).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.errors import ShardingError
from autoshard.runtime.placements import Shard
from refs import close_to_scale as _close, grads as _grads


# ----------------------------------------------------------------------------- models

class CNN(nn.Module):
    """Conv2d 3->32, ReLU, Conv2d 32->64, ReLU, global average pool, linear head."""

    def __init__(self, c1=32, c2=64, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.head = nn.Linear(c2, classes)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class DepthwiseBlock(nn.Module):
    """Stem conv, depthwise conv (groups = channels), pointwise 1x1 conv, pool, head."""

    def __init__(self, c=32, groups=None, out=64, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.dw = nn.Conv2d(c, c, 5, padding=2, groups=groups or c)
        self.pw = nn.Conv2d(c, out, 1)
        self.head = nn.Linear(out, classes)

    def forward(self, x):
        x = F.gelu(self.dw(self.stem(x)))
        return self.head(F.adaptive_avg_pool2d(self.pw(x), 1).flatten(1))


class Conv1dNet(nn.Module):
    """Conv1d with reflect padding (F.pad then conv), max pool, Conv1d, pool, head."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv1d(8, 32, 5, padding=2, padding_mode="reflect")
        self.conv2 = nn.Conv1d(32, 64, 3, padding=1)
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        x = F.max_pool1d(F.relu(self.conv1(x)), 2)
        return self.head(F.adaptive_avg_pool1d(F.relu(self.conv2(x)), 1).flatten(1))


class Conv3dNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv3d(2, 16, 3, padding=1)
        self.conv2 = nn.Conv3d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(F.adaptive_avg_pool3d(x, 1).flatten(1))


class Unbatched(nn.Module):
    """A (C, L) input: the channel dim is 0."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 32, 3, padding=1)
        self.conv2 = nn.Conv1d(32, classes, 3, padding=1)

    def forward(self, x):
        return self.conv2(F.relu(self.conv1(x))).transpose(0, 1)       # (L, classes) logits


class Odd(nn.Module):
    """30 channels: no split at degree 4."""

    def __init__(self, classes=8):
        super().__init__()
        self.conv = nn.Conv2d(3, 30, 3, padding=1)
        self.head = nn.Linear(30, classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


def _images(shape, seed, classes=10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x, torch.randint(classes, (shape[0],), generator=g)


def _build(name):
    """(model, input, class targets) for a case name."""
    torch.manual_seed(0)
    if name == "cnn":
        return (CNN(),) + _images((4, 3, 16, 16), 1)
    if name == "depthwise":
        return (DepthwiseBlock(),) + _images((4, 3, 16, 16), 2)
    if name == "groups2":                       # 2 groups of 16 channels: not whole groups at 4
        return (DepthwiseBlock(groups=2),) + _images((4, 3, 16, 16), 2)
    if name == "conv1d":
        return (Conv1dNet(),) + _images((4, 8, 64), 3)
    if name == "conv3d":
        return (Conv3dNet(),) + _images((2, 2, 8, 8, 8), 4)
    if name == "unbatched":
        x, _ = _images((4, 48), 5)
        return Unbatched(), x, torch.randint(10, (48,), generator=torch.Generator().manual_seed(6))
    if name == "odd":
        return (Odd(),) + _images((4, 3, 12, 12), 7, classes=8)
    raise KeyError(name)


# ----------------------------------------------------------------------------- checks (on every rank)

def _run_case(name, world_size, tracer, pin):
    model, x, y = _build(name)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, world_size, (x,), tracer=tracer, pin=pin)
    out, ref_out = gm(x), ref(x)
    _close(out, ref_out, f"{name}: output")
    loss, ref_loss = F.cross_entropy(out, y), F.cross_entropy(ref_out, y)
    _close(loss, ref_loss, f"{name}: loss")
    loss.backward()
    ref_loss.backward()
    collected, expected = autoshard.collect_state_dict(gm, _grads(gm)), _grads(ref)
    assert set(collected) == set(expected), (sorted(collected), sorted(expected))
    for key, g in expected.items():
        _close(collected[key], g, f"{name}: grad of {key}")
    if name == "cnn":                         # batch, height and width stay free (both tracers)
        other = torch.randn(3, 3, 12, 10, generator=torch.Generator().manual_seed(8))
        _close(gm(other), ref(other), f"{name}: output at another batch and image size")
    full = autoshard.collect_state_dict(gm, gm.state_dict())                 # state-dict round trip
    assert list(full) == list(ref.state_dict()), (list(full), list(ref.state_dict()))
    for key, value in ref.state_dict().items():
        _close(full[key], value, f"{name}: state_dict {key}")
    gm.load_state_dict(autoshard.relocate_state_dict(gm, full))
    again = autoshard.collect_state_dict(gm, gm.state_dict())
    assert all(torch.equal(again[k], v) for k, v in full.items()), f"{name}: relocate/collect round trip"
    plan = gm._autoshard_plan
    attrs = {k: (getattr(t, "parallel_dim", None), getattr(t, "order_type", None))
             for k, t in gm.named_parameters() if getattr(t, "parallel_dim", None) is not None}
    local_groups = {n.name: n.args[6] for n in gm.graph.nodes
                    if n.op == "call_function" and n.target in (F.conv2d, torch.ops.aten.conv2d.default)
                    and len(n.args) > 6}
    return dict(dims=dict(plan.dims), strategies={d.module: d.strategy for d in plan.nodes.values() if d.module},
                layouts={k: v for k, v in autoshard.layouts(gm).items()}, attrs=attrs, groups=local_groups,
                ratio=plan.params_per_rank / plan.params_total)


def _cases(rank, world_size, cases):
    """Every case on every rank (one pool run serves them all); rank 0's records."""
    return [_run_case(name, world_size, tracer, pin) for name, tracer, pin in cases]


# ----------------------------------------------------------------------------- tests

TRACERS = ("symbolic_trace", "export")


@pytest.fixture(scope="module")
def world2(dist2):
    cases = [("cnn", t, None) for t in TRACERS] + [
        ("depthwise", "export", None), ("conv1d", "symbolic_trace", None), ("conv3d", "export", None),
        ("unbatched", "symbolic_trace", None), ("cnn", "symbolic_trace", {"conv2": 0}),
        ("cnn", "export", {"conv2": 0})]
    return dict(zip([c[0] + "/" + c[1] + ("/pinned" if c[2] else "") for c in cases], dist2.run(_cases, cases)[0]))


@pytest.fixture(scope="module")
def world4(dist4):
    cases = [("cnn", t, None) for t in TRACERS] + [("depthwise", "symbolic_trace", None),
                                                   ("groups2", "export", None), ("odd", "symbolic_trace", None)]
    return dict(zip([c[0] + "/" + c[1] for c in cases], dist4.run(_cases, cases)[0]))


@pytest.mark.parametrize("tracer", TRACERS)
def test_cnn_convs_are_sharded(world2, world4, tracer):
    for ws, rec in ((2, world2[f"cnn/{tracer}"]), (4, world4[f"cnn/{tracer}"])):
        assert rec["dims"]["conv1"] == -1 and rec["dims"]["conv2"] in (-1, 0), (ws, rec["dims"])
        assert rec["layouts"]["conv1.weight"] == Shard(0) and rec["layouts"]["conv1.bias"] == Shard(0), rec["layouts"]
        assert rec["ratio"] < 0.6 if ws == 2 else rec["ratio"] < 0.35, (ws, rec["ratio"])
        assert rec["attrs"]["conv1.weight"] == (-1, 0), rec["attrs"]      # TorchShard: an [out, in] column split


@pytest.mark.parametrize("tracer", TRACERS)
def test_row_split_with_bias(world2, tracer):
    rec = world2[f"cnn/{tracer}/pinned"]
    assert rec["dims"]["conv2"] == 0 and rec["strategies"]["conv2"] == "row", rec
    assert rec["layouts"]["conv2.weight"] == Shard(1) and "conv2.bias" not in rec["layouts"], rec["layouts"]
    assert rec["attrs"]["conv2.weight"] == (0, 0), rec["attrs"]             # TorchShard: an [out, in] row split


@pytest.mark.parametrize("ws, key", [(2, "depthwise/export"), (4, "depthwise/symbolic_trace")])
def test_depthwise_runs_with_local_groups(world2, world4, ws, key):
    rec = (world2 if ws == 2 else world4)[key]
    assert rec["strategies"]["dw"] == "grouped" and rec["layouts"]["dw.weight"] == Shard(0), rec
    assert rec["strategies"]["stem"] == "column" and rec["strategies"]["pw"] in ("row", "column"), rec["strategies"]
    assert 32 // ws in rec["groups"].values(), rec["groups"]                # the local op: groups = 32 / p


def test_conv1d_conv3d_unbatched(world2):
    for key in ("conv1d/symbolic_trace", "conv3d/export", "unbatched/symbolic_trace"):
        rec = world2[key]
        assert rec["dims"]["conv1"] is not None and rec["dims"]["conv2"] is not None, (key, rec["dims"])
    assert world2["unbatched/symbolic_trace"]["layouts"]["conv1.weight"] == Shard(0)


def test_channels_or_groups_that_do_not_divide(world4):
    """30 channels at degree 4 are split at torch.chunk's boundaries (8, 8, 8, 6); 2 groups run
    replicated (exact, checked on the ranks); a pin that asks for a split of them is autoshard's
    error naming the module and its sizes."""
    assert world4["odd/symbolic_trace"]["dims"]["conv"] == -1
    assert world4["odd/symbolic_trace"]["layouts"]["conv.weight"] == Shard(0, size=30)
    assert world4["groups2/export"]["dims"]["dw"] is None
    model, x, _ = _build("groups2")
    with pytest.raises(ShardingError, match=r"'dw'.*\(32, 16, 5, 5\).*4 shards"):
        autoshard.parallelize(model, 4, (x,), rank=0, tracer="export", pin={"dw": -1})
