"""Fused projections sliced into their parts (Phi-3's `qkv_proj` cut with `qkv[..., a:b]`, its
`gate_up_proj` cut with `chunk(2)`): the fused weight is held as a strided shard (every rank
holds its heads of q, of k and of v), each slice takes this rank's piece of its block, and no
activation is gathered between the fused projection and the attention.

Plans in one process (both tracers: `aten.slice` under torch.export, `getitem` with slices whose
bounds are computed from `x.shape` under symbolic_trace); gloo ranks at world 2, 3 and 4 against
the single-process model (loss and every gradient), also for a tiny Hugging Face Phi-3.
"""
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.runtime.collectives import count_comm  # noqa: E402
from refs import block_steps_match, close_to_scale, grads_match  # noqa: E402


class FusedBlock(nn.Module):
    """Attention with one fused q/k/v projection sliced by `x.shape` arithmetic, and a fused
    gate/up projection chunked in two (Phi-3's layout)."""

    def __init__(self, h=48, heads=4):
        super().__init__()
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.gate_up, self.down = nn.Linear(h, 8 * h), nn.Linear(4 * h, h)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(y)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(up * F.silu(gate))


def _x(seed=0, h=48):
    return torch.randn(2, 32, h, generator=torch.Generator().manual_seed(seed))


def _gathered(plan) -> list:
    return [r.node for r in plan.redistributions if "all_gather" in r.forward]


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
@pytest.mark.parametrize("p", [2, 4])
def test_slices_of_a_fused_projection_stay_split(tracer, p):
    plan = autoshard.plan(FusedBlock(), p, (_x(),), tracer=tracer)
    assert plan.dims["qkv"] == -1 and plan.dims["gate_up"] == -1, plan.dims
    assert plan.layouts["qkv.weight"] == autoshard.Shard(0, 3)
    assert plan.layouts["gate_up.weight"] == autoshard.Shard(0, 2)
    fused = {n for n, d in plan.nodes.items() if d.module == "qkv" or d.strategy.startswith(("blocks", "unfuse"))}
    assert fused and not fused & set(_gathered(plan)), plan.report()     # the parts are never gathered
    strategies = {d.strategy for d in plan.nodes.values()}
    assert "blocks(2)" in strategies and "unfuse(2)" in strategies, strategies


def _block_case(rank, p, tracer):
    torch.manual_seed(0)
    model = FusedBlock()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, (_x(),), tracer=tracer)
    block_steps_match(gm, ref, _x, f"{tracer} at {p}")          # the example's shape, then another batch
    return True


@pytest.mark.parametrize("world,tracer", [(2, "export"), (3, "symbolic_trace"), (4, "symbolic_trace"),
                                          (4, "export")])
def test_fused_block_is_exact(world, tracer, request):
    assert all(request.getfixturevalue(f"dist{world}").run(_block_case, tracer, timeout=240))


def _phi3_case(rank, p):
    import hf_models
    model, kw = hf_models.phi3(vocab_size=512, seq=32)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", outputs="sharded")
    plan = gm._autoshard_plan
    fused = [k for k, v in plan.layouts.items() if "qkv_proj.weight" in k or "gate_up_proj.weight" in k]
    assert fused and all(plan.layouts[k] in (autoshard.Shard(0, 3), autoshard.Shard(0, 2)) for k in fused), \
        {k: plan.layouts[k] for k in fused}
    with count_comm() as c:
        res = gm(**kw)
        res.loss.backward()
    want = ref(**kw)
    want.loss.backward()
    close_to_scale(res.loss, want.loss, f"phi3 at {p}: loss")
    grads_match(gm, ref, f"phi3 at {p}")
    return c.bytes == pytest.approx(plan.comm_bytes, rel=1e-9)


@pytest.mark.parametrize("world", [4])
def test_hugging_face_phi3_fused_projections(world, request):
    assert all(request.getfixturevalue(f"dist{world}").run(_phi3_case, timeout=300))
