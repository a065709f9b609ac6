"""Mixtures of experts: experts placed on ranks (expert parallel) or each expert's FFN split
(expert tensor parallel), never gathered.

Gloo ranks at world 2, 3 and 4 against the single-process model, for tiny Mixtral, Qwen2-MoE
(a gated shared expert), Qwen3-MoE and DeepSeek-V3 (sigmoid routing over expert groups, a shared
expert, multi-head latent attention) of 8 and 16 experts: the loss, the logits and every
gradient, in train and eval mode, with each strategy forced by a pin and with the one the cost
model chooses; the bytes counted at run time equal the plan's, and no expert weight is ever
gathered. A routing that sends a rank no token for one of its experts (or for any) still
matches.
"""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
import hf_models  # noqa: E402
from autoshard.runtime.collectives import count_comm  # noqa: E402
from autoshard.runtime.placements import Shard  # noqa: E402
from refs import close_to_scale, grads_match  # noqa: E402

WAYS = {"expert_parallel": 0, "expert_tensor": -1}


def _experts_of(model):
    return [n for n, m in model.named_modules() if hasattr(m, "down_proj") and getattr(m.down_proj, "dim", None)
            and m.down_proj.dim() == 3]


def _strategies(plan) -> dict:
    return {d.module: d.strategy for d in plan.nodes.values() if d.strategy in WAYS or
            (d.module or "").endswith(".experts")}


def _no_expert_gathered(plan, model):
    """No collective of the plan moves an expert weight (or anything made from one alone)."""
    experts = {n for n in _experts_of(model)}
    for r in plan.redistributions:
        d = plan.nodes.get(r.node)
        assert not (d and d.module in experts and "all_gather" in r.forward), (r, plan.report())
    for d in plan.nodes.values():
        if d.module in experts and d.strategy in WAYS:
            assert all(not isinstance(pl, Shard) or pl.dim != 0 or d.strategy == "expert_parallel"
                       for pl in d.inputs if pl is not None)


def _route_to(model, n):
    """Every router of `model` (Mixtral's: logits, scores, indices) sends its tokens to experts
    0 .. n-1 only (indices mod n): the model's own routing, narrowed, in both copies alike."""
    import types
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            def forward(self, x, _orig=type(m).forward):
                logits, scores, index = _orig(self, x)
                return logits, scores, index % n
            m.forward = types.MethodType(forward, m)


def _step(gm, ref, kw, what):
    with count_comm() as c:
        out = gm(**kw)
        out.loss.backward()
    want = ref(**kw)
    want.loss.backward()
    close_to_scale(out.loss, want.loss, f"{what}: loss")
    close_to_scale(out.logits, want.logits, f"{what}: logits")
    grads_match(gm, ref, what)
    plan = gm._autoshard_plan
    assert c.bytes == pytest.approx(plan.comm_bytes, rel=1e-9), (what, c.by_kind, plan.comm_by_kind)
    return c.bytes


def _case(rank, p, family, experts, way, train, routed=None):
    model, kw = hf_models.moe(family, experts)
    model.train(train)
    if routed is not None:
        _route_to(model, routed)
    pins = {n: WAYS[way] for n in _experts_of(model)} if way in WAYS else {}
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", pin=pins)
    plan = gm._autoshard_plan
    chosen = _strategies(plan)
    assert set(chosen) >= set(_experts_of(model)), (chosen, plan.report())
    if way in WAYS:
        assert {chosen[n] for n in _experts_of(model)} == {way}, (way, chosen)
    _no_expert_gathered(plan, model)
    what = f"{family} {experts} experts at {p}, {way}, {'train' if train else 'eval'}"
    _step(gm, ref, kw, what)
    return {n: chosen[n] for n in _experts_of(model)}


@pytest.mark.parametrize("world,family,experts,way,train", [
    (2, "mixtral", 8, "expert_parallel", True),
    (3, "mixtral", 8, "expert_tensor", False),
    (4, "qwen2_moe", 16, "chosen", True),
    (3, "qwen3_moe", 16, "expert_parallel", True),
    (4, "deepseek_v3", 8, "expert_tensor", True),
    (2, "deepseek_v3", 16, "chosen", False),
])
def test_moe_exact(world, family, experts, way, train, request):
    request.getfixturevalue(f"dist{world}").run(_case, family, experts, way, train, timeout=600)


def test_rank_without_tokens(dist4):
    """8 experts on 4 ranks, every token routed among experts 0-2: rank 1 gets none for expert 3,
    ranks 2 and 3 none at all; exact both ways."""
    for way in WAYS:
        dist4.run(_case, "mixtral", 8, way, True, 3, timeout=600)
