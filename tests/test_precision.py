"""Mixed precision: the parallel module under the recipes people train with gives what the
single-process model gives under the same recipe (autoshard.rewrite.signatures keys every call by
its precision and captures it under that recipe).

Recipes: `torch.autocast("cpu", bfloat16)` and `float16` around forward with fp32 weights (the
Hugging Face Trainer's bf16=True / fp16=True), and bf16 weights (`.to(torch.bfloat16)`); models: a
Hugging Face LLaMA (grouped K/V heads) and GPT-2 (fused Conv1D q/k/v), both through torch.export,
and a plain module through symbolic_trace and through export; train (loss and every gradient,
their dtypes included) and eval mode (outputs). Under bf16 autocast the collectives move bf16
where the model computes in bf16 (with bf16 weights, half the fp32 step's bytes): the bytes
counted equal that call's plan's prediction. `autoshard.amp.GradScaler`: an inf in one rank's shard skips the step on every
rank. Tolerances are the low precision's own: a row-parallel sum of two bf16 partial products
rounds differently from one bf16 matmul. Four recipe x model cases run by default, all twelve
with `-m slow`.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import refs

TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


class Plain(nn.Module):
    """Embedding -> pre-norm MLP block -> vocabulary head -> cross entropy."""

    def __init__(self, vocab=96, h=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.norm = nn.LayerNorm(h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _build(name):
    import hf_models
    if name.startswith("plain"):
        torch.manual_seed(0)
        idx = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
        return Plain(), {"idx": idx, "targets": idx.roll(1, 1)}
    return hf_models.llama(num_hidden_layers=2) if name == "llama" else hf_models.gpt2()


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _recipe(recipe):
    if recipe == "bf16_weights":
        return contextlib.nullcontext(), torch.bfloat16
    dtype = torch.bfloat16 if recipe == "autocast_bf16" else torch.float16
    return torch.autocast("cpu", dtype), dtype


def _close(got, want, dtype, what):
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    scale = want.detach().abs().max().item()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=TOL[dtype], atol=TOL[dtype] * scale + 1e-6,
                               msg=lambda m: f"{what}: {m}")


def _case(rank, p, name, recipe, train):
    import autoshard
    from autoshard.runtime.collectives import count_comm
    from autoshard.rewrite.signatures import precision
    model, kw = _build(name)
    model.train(train)
    tracer = "symbolic_trace" if name == "plain" else "export"
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(copy.deepcopy(model), p, kw, tracer=tracer)
    context, dtype = _recipe(recipe)
    if recipe == "bf16_weights":
        ref.to(torch.bfloat16)
        gm.to(torch.bfloat16)
    with context:
        want = _loss(ref(**kw))
    with context, count_comm() as counted:
        got = _loss(gm(**kw))
        if train:
            got.backward()
    _close(got, want, dtype, f"{name} {recipe}: loss")
    if not train:
        return None
    want.backward()
    grads = autoshard.collect_state_dict(gm, refs.grads(gm, remove_duplicate=False))
    for k, g in refs.grads(ref, remove_duplicate=False).items():
        _close(grads[k], g, dtype, f"{name} {recipe}: grad of {k}")
    with context:
        key = (True, gm._autoshard_signatures.first.key, precision(gm))
    plan = gm._autoshard_signatures.plans[key]
    return counted.bytes, plan.comm_bytes, gm._autoshard_plan.comm_bytes


FAST = {("llama", "autocast_bf16"), ("gpt2", "bf16_weights"), ("plain", "autocast_fp16"), ("plain_export", "autocast_bf16")}
CASES = [pytest.param(n, r, marks=() if (n, r) in FAST else pytest.mark.slow)
         for n in ("llama", "gpt2", "plain", "plain_export") for r in ("autocast_bf16", "autocast_fp16", "bf16_weights")]


@pytest.mark.parametrize("name,recipe", CASES)
def test_recipe_equals_the_model(dist2, name, recipe):
    dist2.run(_case, name, recipe, True)
    dist2.run(_case, name, recipe, False)


def test_bytes_follow_the_dtype(dist2):
    """bf16 weights: every collective moves bf16, half the fp32 step's bytes. bf16 autocast: the
    linear layers' outputs are bf16 but LLaMA's residual stream stays fp32 (the embedding is
    fp32 and the residual add promotes), and the plan reduces the stream there: fewer bytes, each
    one predicted."""
    counted, predicted, fp32 = dist2.run(_case, "llama", "bf16_weights", True)[0]
    assert counted == pytest.approx(predicted) == pytest.approx(fp32 / 2)
    counted, predicted, fp32 = dist2.run(_case, "llama", "autocast_bf16", True)[0]
    assert counted == pytest.approx(predicted) and counted < fp32, (counted, predicted, fp32)


@pytest.mark.slow
def test_recipe_at_world_4(dist4):
    dist4.run(_case, "llama", "autocast_bf16", True)


def _planned_apart(rank, p, planned_under, parallelized_under):
    """A plan captured under one recipe and parallelized under another: parallelize rewrites and
    checks the plan under the recipe it was captured under (torch.export bakes it into the graph),
    the module serves that recipe with the plan's own graph and the other on first use; both equal
    the model under the same recipe."""
    import autoshard
    model, kw = _build("plain")
    def recipes(name):
        return contextlib.nullcontext() if name == "fp32" else _recipe(name)[0]
    with recipes(planned_under):
        plan = autoshard.plan(model, p, kw, tracer="export")
    assert plan.autocast == ((("cpu", torch.bfloat16),) if planned_under != "fp32" else ()), plan.autocast
    assert ("captured under                    torch.autocast('cpu', torch.bfloat16)" in str(plan)) == \
        (planned_under != "fp32"), str(plan)
    with recipes(parallelized_under):
        gm = autoshard.parallelize(copy.deepcopy(model), p, kw, plan=plan)
    graphs = []
    for recipe in (planned_under, parallelized_under, "fp32"):
        ref = copy.deepcopy(model)
        with recipes(recipe):
            got, want = gm(**kw), ref(**kw)
        got.backward(), want.backward()
        dtype = torch.bfloat16 if recipe != "fp32" else torch.float32
        _close(got, want, dtype, f"{recipe}: loss")
        grads = autoshard.collect_state_dict(gm, refs.grads(gm))
        for k, g in refs.grads(ref).items():
            _close(grads[k], g, dtype, f"{recipe}: grad of {k}")
        gm.zero_grad(set_to_none=True)
        graphs.append(len(gm._autoshard_signatures.served))
    return graphs


@pytest.mark.parametrize("planned_under,parallelized_under", [("autocast_bf16", "fp32"), ("fp32", "autocast_bf16")])
def test_plan_captured_under_another_recipe(dist2, planned_under, parallelized_under):
    """Used to fail inside parallelize ("the plan cannot run": a dtype assertion of the export
    graph run under the other recipe)."""
    for graphs in dist2.run(_planned_apart, planned_under, parallelized_under):
        assert graphs == [1, 2, 2], graphs          # the plan's recipe served by its own graph


def _overflow(rank, p):
    """fp16 autocast with autoshard.amp.GradScaler: an inf in rank 1's shard of one weight skips
    the step on every rank and halves every rank's scale; the next, clean step is taken."""
    import autoshard
    model, kw = _build("plain")
    gm = autoshard.parallelize(model, p, kw)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    scaler = autoshard.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    with torch.autocast("cpu", torch.float16):
        loss = gm(**kw)
    scaler.scale(loss).backward()
    if rank == 1:
        gm.fc1.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(v, gm.state_dict()[k]) for k, v in before.items())
    scale = scaler.get_scale()
    opt.zero_grad()
    with torch.autocast("cpu", torch.float16):
        loss = gm(**kw)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    stepped = not torch.equal(before["fc1.weight"], gm.state_dict()["fc1.weight"])
    return skipped, scale, stepped


def test_grad_scaler_skips_on_every_rank(dist2):
    assert dist2.run(_overflow) == [(True, 2.0 ** 7, True)] * 2


def _fsdp_mixed(rank, world):
    """(dp 2, tp 2): fully_shard per block and at the root with MixedPrecisionPolicy(param_dtype=
    bf16, reduce_dtype=fp32), as torchtitan trains: each data-parallel rank's half batch gives, over
    the dp group, the loss and every gradient of the model computing in bf16 on the whole batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    import autoshard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, kw = _build("llama")
    model.train()
    ref = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.cat([kw["input_ids"], kw["input_ids"].roll(3, 1)])          # 4 sequences, 2 per dp rank
    d = mesh["dp"].get_local_rank()
    mine = {"input_ids": ids[2 * d:2 * d + 2], "labels": ids[2 * d:2 * d + 2]}
    gm = autoshard.parallelize(model, 2, mine, group=mesh["tp"], tracer="export")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in autoshard.blocks_of(gm).values():
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(gm, mesh=mesh["dp"], mp_policy=policy)
    loss = gm(**mine).loss
    loss.backward()
    both = loss.detach().float().clone()
    dist.all_reduce(both, group=mesh["dp"].get_group())
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    _close(both / 2, want.float(), torch.bfloat16, "loss")
    full = {n: (t.grad.full_tensor() if isinstance(t.grad, DTensor) else t.grad) for n, t in gm.named_parameters()}
    full = autoshard.collect_state_dict(gm, full)
    for name, t in ref.named_parameters():
        _close(full[name].to(torch.bfloat16), t.grad, torch.bfloat16, f"grad of {name}")
    return True


def test_fsdp2_mixed_precision_2x2(dist4):
    assert all(dist4.run(_fsdp_mixed, timeout=600))
