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
from refs import close_to_scale, grads_match, hf_step_matches  # noqa: E402

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


def _case(rank, p, family, experts, way, train, routed=None, seq=16, latency=None):
    from autoshard.planner.cost import CostModel
    model, kw = hf_models.moe(family, experts, seq=seq)
    model.train(train)
    if routed is not None:
        _route_to(model, routed)
    pins = {n: WAYS[way] for n in _experts_of(model)} if way in WAYS else {}
    ref = copy.deepcopy(model)
    cost = {} if latency is None else dict(cost_model=CostModel(latency=latency))
    gm = autoshard.parallelize(model, p, kw, tracer="export", pin=pins, **cost)
    plan = gm._autoshard_plan
    chosen = _strategies(plan)
    assert set(chosen) >= set(_experts_of(model)), (chosen, plan.report())
    ways = {chosen[n] for n in _experts_of(model)}
    assert ways == {way} if way in WAYS else ways <= set(WAYS), (way, chosen)      # the chosen: never whole
    _no_expert_gathered(plan, model)
    what = f"{family} {experts} experts at {p}, {way}, {'train' if train else 'eval'}"
    counted = hf_step_matches(gm, ref, kw, what)          # loss, logits, every gradient
    assert counted == pytest.approx(plan.comm_bytes, rel=1e-9), (what, counted, plan.comm_by_kind)
    return [r.node for r in plan.redistributions if r.via is not None and not r.forward]


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


def test_view_of_a_gather_reduce_scattered(dist2):
    """DeepSeek-V3 at 32 tokens, latency free: layer 0's post-attention norm output is gathered for
    the shared expert (its backward a reduce-scatter of their Partial gradients) and the experts
    read a view of it, reusing that gather. Their Partial gradient joins the reduce-scatter as it
    is; all-reduced first, it was counted once per rank (layer 0's gradients up to 88% off)."""
    reused = dist2.run(_case, "deepseek_v3", 8, "chosen", True, None, 32, 0.0, timeout=600)[0]
    assert reused, "the plan no longer reuses a gather for a view: the case is not exercised"


def test_rank_without_tokens(dist4):
    """8 experts on 4 ranks, every token routed among experts 0-2: rank 1 gets none for expert 3,
    ranks 2 and 3 none at all; exact both ways."""
    for way in WAYS:
        dist4.run(_case, "mixtral", 8, way, True, 3, timeout=600)


def _generate_case(rank, p, family):
    """Greedy generation with the key/value cache equals the single-process model's tokens."""
    model, kw = hf_models.moe(family, 8)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    gm.eval()
    ids = kw["input_ids"][:, :6]
    options = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    return gm.generate(ids, **options).tolist(), ref.generate(ids, **options).tolist()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_generates(family, dist2):
    for got, want in dist2.run(_generate_case, family, timeout=600):
        assert got == want


def _save_case(rank, p, path, way):
    """2 AdamW steps at degree p with the experts placed `way`, then a sharded checkpoint; returns
    the full state dict (rank 0) to compare with the resumed one."""
    model, kw = hf_models.moe("mixtral", 8)
    model.train()
    gm = autoshard.parallelize(model, p, kw, tracer="export", pin={n: WAYS[way] for n in _experts_of(model)})
    held = [t.shape for n, t in gm.named_parameters() if n.endswith("experts.down_proj")]
    assert held and all(s[0] == (8 // p if way == "expert_parallel" else 8) for s in held), held
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    for _ in range(2):
        gm(**kw).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    autoshard.checkpoint.save({"model": msd, "optim": osd}, path)
    full = autoshard.collect_state_dict(gm, gm.state_dict())      # (a collective: every rank calls it)
    return full if rank == 0 else None


def _resume_case(rank, p, path, way):
    model, kw = hf_models.moe("mixtral", 8, seed=3)          # other weights: the checkpoint's must win
    model.train()
    gm = autoshard.parallelize(model, p, kw, tracer="export", pin={n: WAYS[way] for n in _experts_of(model)})
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    sd = {"model": msd, "optim": osd}
    autoshard.checkpoint.load(sd, path)
    autoshard.checkpoint.set_state_dict(gm, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    steps = {k: v["step"] for k, v in opt.state.items()}
    return (full if rank == 0 else None), sorted({float(s) for s in steps.values()})


def test_expert_parallel_checkpoint_resumes_at_another_degree(dist2, dist4, tmp_path):
    """Saved expert-parallel at 2 ranks (4 experts a rank), resumed expert-tensor-parallel at 4:
    every tensor equal, the optimizer's steps carried over."""
    path = str(tmp_path / "ep2")
    saved = dist2.run(_save_case, path, "expert_parallel", timeout=600)[0]
    resumed, steps = dist4.run(_resume_case, path, "expert_tensor", timeout=600)[0]
    assert steps == [2.0]
    assert saved.keys() == resumed.keys()
    for k in saved:
        torch.testing.assert_close(resumed[k], saved[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_memory_budget_on_moe():
    """A budget below the plain plan's peak (activations dominate at 512 tokens): a plan that fits
    it, the experts still never gathered."""
    model, kw = hf_models.moe("mixtral", 8, batch=4, seq=128)
    model.train()
    plain = autoshard.plan(model, 2, kw, tracer="export")
    budget = int(plain.memory.peak * 0.9)
    fit = autoshard.plan(model, 2, kw, tracer="export", memory_budget=budget)
    assert fit.memory.peak <= budget, (fit.memory, budget)
    _no_expert_gathered(fit, model)
    assert set(_strategies(fit).values()) <= set(WAYS), _strategies(fit)


class _TinyMoE(torch.nn.Module):
    """A mixture-of-experts LM no transformers model is: an embedding, a softmax top-2 router, one
    transformers experts module of the given layout (`test_moe_op.experts_class`) on the residual
    stream, and a head with its loss."""

    def __init__(self, **layout):
        super().__init__()
        from test_moe_op import E, H, _Config, experts_class
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, H)
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = experts_class(**layout)(_Config())
        self.head = torch.nn.Linear(H, 64)

    def forward(self, ids, labels):
        x = self.emb(ids)
        flat = x.view(-1, x.shape[-1])
        w, idx = torch.topk(torch.softmax(self.router(flat), dim=-1), 2, dim=-1)
        y = (flat + self.experts(flat, idx, w)).view_as(x)
        return torch.nn.functional.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


def _layout_case(rank, p, layout, way, tracer):
    from refs import close_grads, grads
    model = _TinyMoE(**layout).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, (ids, ids), tracer=tracer, pin={"experts": WAYS[way]})
    assert gm._autoshard_plan.tracer == tracer
    with count_comm() as c:
        loss = gm(ids, ids)
        loss.backward()
    want = ref(ids, ids)
    want.backward()
    close_to_scale(loss, want, f"{layout} {way}: loss")
    close_grads(autoshard.collect_state_dict(gm, grads(gm)), grads(ref), f"{layout} {way}")
    assert c.bytes == pytest.approx(gm._autoshard_plan.comm_bytes, rel=1e-9)
    return True


@pytest.mark.parametrize("layout,way,tracer", [
    (dict(bias=True), "expert_tensor", "symbolic_trace"),   # the down bias added as bias / p; view_as of a split x
    (dict(bias=True, transposed=True), "expert_parallel", "export"),
    (dict(gated=False, bias=True, transposed=True), "expert_tensor", "export"),
    (dict(transposed=True, bias=True, own_gate=True), "expert_parallel", "symbolic_trace"),   # GPT-OSS's gate
])
def test_expert_layouts_exact(layout, way, tracer, dist2):
    dist2.run(_layout_case, layout, way, tracer, timeout=300)


def test_own_gate_is_never_split():
    """A module's own gate may read an expert's features together: only whole experts are placed."""
    model = _TinyMoE(transposed=True, bias=True, own_gate=True)
    ids = torch.zeros(2, 12, dtype=torch.long)
    with pytest.raises(autoshard.errors.ShardingError, match="cannot pin 'experts' to dim -1"):
        autoshard.plan(model, 2, (ids, ids), pin={"experts": -1})


def _sequence_case(rank, p, family):
    """Sequence parallelism on an MoE model: the stream split on tokens between layers, the
    experts' input gathered (its gradient reduce-scattered: the router's region sends Partial
    gradients, its weight's gradient all-reduced), their Partial output reduce-scattered onto the
    tokens; exact, bytes as planned, fewer activations than without."""
    from autoshard.planner.cost import CostModel
    model, kw = hf_models.moe(family, 8, seq=32)
    model.train()
    pins = {}
    for i in range(2):      # attention as Megatron splits it (at this size the search keeps parts whole)
        a = f"model.layers.{i}.self_attn"
        pins.update({f"{a}.q_proj": -1, f"{a}.k_proj": -1, f"{a}.v_proj": -1, f"{a}.o_proj": 0})
    options = dict(pin=pins, cost_model=CostModel(latency=0.0), tracer="export")
    plain = autoshard.plan(model, p, kw, **options)
    plan = autoshard.plan(model, p, kw, sequence_parallel=True, **options)
    assert plan.sequence_parallel > 0, plan.notes
    assert plan.memory.activations < plain.memory.activations
    assert set(_strategies(plan).values()) <= set(WAYS)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, plan=plan)
    with count_comm() as c:
        out = gm(**kw)
        out.loss.backward()
    assert c.by_kind.get("reduce_scatter", (0, 0))[0] > 0, c.by_kind
    want = ref(**kw)
    want.loss.backward()
    close_to_scale(out.loss, want.loss, f"{family} sequence parallel: loss")
    grads_match(gm, ref, f"{family} sequence parallel")
    assert c.bytes == pytest.approx(plan.comm_bytes, rel=1e-9), (c.by_kind, plan.comm_by_kind)
    return True


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_sequence_parallel(family, dist2):
    dist2.run(_sequence_case, family, timeout=600)


def _memory_case(rank, p, way):
    """plan.memory against what torch's MemTracker measures of a step (the experts save only their
    inputs, and each rank holds its experts' weights, gradients and AdamW state)."""
    import refs
    model, kw = hf_models.moe("mixtral", 8, batch=2, seq=128)
    model.train()
    gm = autoshard.parallelize(model, p, kw, tracer="export", pin={n: WAYS[way] for n in _experts_of(model)})
    plan = gm._autoshard_plan
    peak, _ = refs.measured_step_peak(gm, lambda m: m(**kw).loss)
    return plan.memory.peak, peak


@pytest.mark.parametrize("way", list(WAYS))
def test_moe_predicted_peak_is_measured_peak(way, dist2):
    for predicted, measured in dist2.run(_memory_case, way, timeout=600):
        assert abs(predicted - measured) <= 0.05 * measured, (way, predicted, measured)
