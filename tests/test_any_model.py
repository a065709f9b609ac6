"""Models the planner once crashed on, and inputs of other shapes.

Each model is parallelized at world 2 and 4 (gloo), called at the example's shape and at two
others, and compared with the single-process model in output and every gradient: a layer whose
sizes do not divide (a replicated input split locally), an ALiBi-style bias broadcast against
head-split scores, weights used as `x @ w.T`, q/k norms over a split projection (LayerNorm and a
hand-written RMSNorm), a cat of two column-parallel outputs feeding a row-parallel layer, view
sizes from shape arithmetic, a factorised embedding, and a Partial tensor plus a number. Then,
in one process: what the plans look like (no gathers where a rule now avoids them, batch and
sequence dims never split), an input of another rank refused by name, and a plan that cannot
run refused inside parallelize.
"""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.errors import CaptureError, ShardingError


class NoDivide(nn.Module):
    """90 does not divide by 4: split at torch.chunk's boundaries (23, 23, 23, 21)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(24, 90), nn.Linear(90, 36)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class LocalSplit(nn.Module):
    """3 does not split over 4 ranks (fewer features than ranks): the first
    layer goes row-parallel on a locally split input."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, 3), nn.Linear(3, 36)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Alibi(nn.Module):
    """Fused q/k/v attention with a (1, heads, T, T) bias added to head-split scores."""

    def __init__(self, h=64, heads=4):
        super().__init__()
        self.qkv, self.o, self.heads = nn.Linear(h, 3 * h), nn.Linear(h, h), heads
        self.register_buffer("slopes", torch.linspace(0.1, 1.0, heads).view(1, heads, 1, 1))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, -1))
        pos = torch.arange(T)
        bias = self.slopes * (pos.view(1, 1, 1, T) - pos.view(1, 1, T, 1)).float()
        y = ((q @ k.transpose(-1, -2)) / 4.0 + bias).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Transposed(nn.Module):
    """Weights stored [in, out]-transposed and used as `x @ w.T`."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(128, 32) / 6), nn.Parameter(torch.randn(32, 128) / 11)

    def forward(self, x):
        return (x @ self.w1.T).relu() @ self.w2.T


class RMS(nn.Module):
    """RMSNorm written out as Hugging Face models do (a mean over the hidden dim)."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class QKNorm(nn.Module):
    """Norms over the whole q and k projections, before the heads split (OLMo-2, Qwen3 style)."""

    def __init__(self, h=256, heads=8):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.qn, self.kn, self.heads = nn.LayerNorm(h), RMS(h), heads
        with torch.no_grad():
            self.qn.weight.uniform_(0.5, 1.5)
            self.qn.bias.normal_()

    def forward(self, x):
        B, T, C = x.shape
        q = self.qn(self.q(x)).view(B, T, self.heads, -1).transpose(1, 2)
        k = self.kn(self.k(x)).view(B, T, self.heads, -1).transpose(1, 2)
        v = self.v(x).view(B, T, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class CatRow(nn.Module):
    """Two column-parallel branches concatenated into one row-parallel layer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(512, 64)

    def forward(self, x):
        return self.c(torch.cat([F.gelu(self.a(x)), self.b(x)], -1))


class ShapeArithmetic(nn.Module):
    """Head sizes and view sizes computed from shapes at run time (of the input, and of one output
    of a split, which is sharded); split by a list of sizes."""

    def __init__(self, h=64, heads=4):
        super().__init__()
        self.qkv, self.o, self.heads = nn.Linear(h, 3 * h), nn.Linear(h, h), heads

    def forward(self, x):
        q, k, v = self.qkv(x).split([x.shape[-1]] * 3, -1)
        hd = q.shape[-1] // self.heads              # the size of a split's (sharded) output

        def heads(t):
            return t.reshape(x.shape[0], x.shape[1], self.heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return self.o(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class Factorised(nn.Module):
    """ALBERT-style embedding (width 32 < hidden 128, then a projection) and a loss inside."""

    def __init__(self, vocab=2048):
        super().__init__()
        self.emb, self.proj = nn.Embedding(vocab, 32), nn.Linear(32, 128)
        self.fc1, self.fc2, self.head = nn.Linear(128, 512), nn.Linear(512, 128), nn.Linear(128, vocab)

    def forward(self, idx, targets):
        h = self.proj(self.emb(idx))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten(), ignore_index=0, label_smoothing=0.1)


class PartialPlusNumber(nn.Module):
    """A row-parallel output without bias, then `+ 1.0`: the number must be added once."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return (self.fc2(F.gelu(self.fc1(x))) + 1.0) * 2.0


class Variance(nn.Module):
    """A hand-written standardisation over a column-parallel output (torch.var over the split dim)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        h = self.up(x)
        h = (h - h.mean(-1, keepdim=True)) / torch.sqrt(torch.var(h, dim=-1, keepdim=True) + 1e-5)
        return self.down(F.gelu(h))


def _feat(*shape):
    return lambda g: (torch.randn(*shape, generator=g),)


def _ids(batch, seq, vocab=2048):
    return lambda g: (torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g))


# name -> (class, example input maker, two other input makers)
CASES = {
    "no_divide": (NoDivide, _feat(6, 24), [_feat(3, 24), _feat(1, 24)]),
    "alibi": (Alibi, _feat(2, 16, 64), [_feat(3, 8, 64), _feat(1, 7, 64)]),
    "transposed": (Transposed, _feat(2, 8, 32), [_feat(3, 5, 32), _feat(1, 1, 32)]),
    "qk_norm": (QKNorm, _feat(2, 128, 256), [_feat(1, 64, 256), _feat(3, 9, 256)]),
    "cat_row": (CatRow, _feat(2, 64, 64), [_feat(3, 5, 64), _feat(1, 1, 64)]),
    "shape_arithmetic": (ShapeArithmetic, _feat(2, 16, 64), [_feat(3, 8, 64), _feat(1, 5, 64)]),
    "factorised": (Factorised, _ids(2, 64), [_ids(3, 9), _ids(1, 5)]),
    "partial_plus_number": (PartialPlusNumber, _feat(4, 64), [_feat(2, 64), _feat(7, 64)]),
    "variance": (Variance, _feat(4, 512, 64), [_feat(1, 33, 64), _feat(2, 7, 64)]),
}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-3)).item()


def _run_cases(rank, p, names):
    """Every case on every rank: [{name: (max output error, max gradient error, dims)}]."""
    out = {}
    for name in names:
        cls, example, others = CASES[name]
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(0)
        model = cls()
        ref = copy.deepcopy(model)
        gm = autoshard.parallelize(model, p, example(g))
        refs = dict(ref.named_parameters())
        oerr = gerr = 0.0
        for make in [example] + others:
            args = make(g)
            for m in (gm, ref):
                m.zero_grad(set_to_none=True)
            y, want = gm(*args), ref(*args)
            oerr = max(oerr, _rel(y, want))
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            (want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum().backward()
            grads = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters()})
            assert set(grads) == set(refs)
            gerr = max(gerr, *(_rel(grads[k], refs[k].grad) for k in refs))
        out[name] = (oerr, gerr, dict(gm._autoshard_plan.dims))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_models_equal_at_every_shape(world, dist2, dist4):
    pool = dist2 if world == 2 else dist4
    results = pool.run(_run_cases, list(CASES), timeout=300)
    for name, (oerr, gerr, dims) in results[0].items():
        assert oerr < 1e-5 and gerr < 1e-4, (name, world, oerr, gerr, dims)
    sharded = {name for name, (_, _, dims) in results[0].items() if any(d is not None for d in dims.values())}
    assert sharded == set(CASES), set(CASES) - sharded           # every model is split somewhere


# ----------------------------------------------------------------------------- plans, in one process

def _plan(name, p):
    cls, example, _ = CASES[name]
    torch.manual_seed(0)
    return autoshard.plan(cls(), p, example(torch.Generator().manual_seed(1)))


def test_rules_avoid_gathers():
    torch.manual_seed(0)       # at 4k tokens a norm's (..., 1) statistics are far cheaper than gathers
    qk = autoshard.plan(QKNorm(), 4, (torch.randn(4, 1024, 256),))
    assert {d.strategy for k, d in qk.nodes.items() if "norm" in k or k.startswith("mean")} >= {"split_norm",
                                                                                                "partial_mean"}
    assert "all_gather" not in qk.comm_by_kind
    assert {k: qk.dims[k] for k in ("q", "k", "v", "o")} == {"q": -1, "k": -1, "v": -1, "o": 0}
    cat = _plan("cat_row", 2)
    assert dict(cat.dims) == {"a": -1, "b": -1, "c": 0} and set(cat.comm_by_kind) == {"all_reduce"}
    assert str(cat.layouts["c.weight"]) == "S(1)x2"        # rank r holds its block of each branch
    var = _plan("variance", 2)
    assert {d.strategy for k, d in var.nodes.items() if k.startswith("var")} == {"split_var"}
    assert dict(var.dims) == {"up": -1, "down": 0} and "all_gather" not in var.comm_by_kind
    t = _plan("transposed", 2)
    assert t.params_per_rank * 2 == t.params_total


@pytest.mark.parametrize("name", ["alibi", "qk_norm", "factorised"])
def test_batch_and_sequence_never_split(name):
    plan = _plan(name, 2)
    gm = plan.graph_module
    for n in gm.graph.nodes:
        d = plan.nodes.get(n.name)
        free = n.meta.get("autoshard_dynamic", frozenset())
        if d is not None and isinstance(d.output, autoshard.Shard) and isinstance(free, frozenset):
            assert d.output.dim not in free, (n.name, d.output, free)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(n.meta["autoshard_dynamic"] for n in placeholders)


def test_input_of_another_size_is_refused_by_name():
    gm = autoshard.parallelize(NoDivide(), 4, (torch.randn(6, 24),), rank=1)
    with pytest.raises(ShardingError, match=r"input 'x' has shape \(6, 23\).*\(\*, 24\)"):
        gm(torch.randn(6, 23))
    with pytest.raises(CaptureError, match=r"call with \(x=float32\[2, 5, 23\]\) could not be captured"):
        gm(torch.randn(2, 5, 23))          # 3-D: another signature, which the model itself cannot run


def test_a_plan_that_cannot_run_fails_inside_parallelize():
    model = LocalSplit()
    plan = autoshard.plan(model, 4, (torch.randn(6, 256),))
    assert any(r.src != r.dst and not r.forward for r in plan.redistributions)    # the local split
    broken = dataclasses.replace(plan, redistributions=())
    with pytest.raises(ShardingError, match=r"rank 0 of 4: .*linear.*local input shapes"):
        autoshard.parallelize(model, 4, plan=broken, rank=0)


class Methods(nn.Module):
    """`x.permute(...)` and `w.t()` as Tensor methods (call_method nodes)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        return (x @ self.w.t()).view(2, 8, 4, 16).permute(0, 2, 1, 3)


def test_tensor_methods_map_dims_like_functions():
    from autoshard.capture.trace import capture
    from autoshard.planner.problem import Problem
    cap = capture(Methods(), (torch.randn(2, 8, 32),))
    prob = Problem(cap.gm, 2, autoshard.CostModel())
    maps = {n.target: {(str(s.inputs[0]), str(s.output)) for s in prob.strats[i]}
            for i, n in enumerate(prob.nodes) if n.op == "call_method"}
    assert ("S(2)", "S(1)") in maps["permute"] and ("S(1)", "S(2)") in maps["permute"]   # heads, not batch
    assert ("S(2)", "S(0)") not in maps["permute"]
    assert maps["t"] >= {("S(0)", "S(1)"), ("S(1)", "S(0)")}
