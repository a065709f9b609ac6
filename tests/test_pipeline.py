"""Pipeline stages cut by autoshard and run by torch.distributed.pipelining (autoshard.pipeline):
three optimizer steps on gloo ranks against the unsharded model trained on the whole batch, every
step's loss, every gradient of the first step and every parameter after; GPipe, 1F1B and the
interleaved schedule; tensor parallelism inside the stages; tied embedding and head across stages;
dropout; evaluation; checkpoints moved between layouts; errors by name."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.errors import ShardingError
from hf_models import bert, gpt2, llama
from models import GPT
from refs import close_to_scale

STEPS = 3
LR = 0.05
# SGD, not AdamW: an attention's key bias has a gradient of exactly zero in exact arithmetic (softmax
# ignores a constant added to a row), so its computed gradient is rounding noise that AdamW's
# normalisation turns into steps of the learning rate's size, different in any two summation orders


def _gpt(tied=True, blocks=4, dropout=0.0):
    torch.manual_seed(0)
    model = GPT(vocab=128, h=64, heads=4, blocks=blocks, seq=16, tied=tied)
    if dropout:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout
    return model


def _gpt_batch(batch=8):
    idx = torch.randint(0, 128, (batch, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 128, (batch, 16), generator=torch.Generator().manual_seed(2))
    return (idx, tgt)


def _hf(name, batch=8):
    build = {"llama": llama, "gpt2": gpt2, "bert": bert}[name]
    model, kw = build(batch=batch, num_hidden_layers=4) if name != "gpt2" else build(batch=batch, n_layer=4)
    model.train()
    if name == "bert":            # the same number of masked positions in every microbatch (see docs: the
        labels = torch.full_like(kw["input_ids"], -100)     # loss is the mean of the microbatches' means)
        labels[:, ::4] = kw["input_ids"][:, ::4]
        kw["labels"] = labels
    return model, kw


def _loss(model, example):
    out = model(**example) if isinstance(example, dict) else model(*example)
    return out if isinstance(out, torch.Tensor) else out.loss


def _call(pipe, example):
    return pipe.step(**example) if isinstance(example, dict) else pipe.step(*example)


def _mesh(world, pp, tp, dp=1):
    from torch.distributed.device_mesh import init_device_mesh
    dims, names = [], []
    for n, size in (("pp", pp), ("dp", dp), ("tp", tp)):
        if size > 1 or n == "pp":
            dims.append(size)
            names.append(n)
    assert dist.get_world_size() == world
    return init_device_mesh("cpu", tuple(dims), mesh_dim_names=tuple(names))


def _model(name):
    if name in ("gpt", "gpt3", "gpt8"):
        return _gpt(blocks={"gpt": 4, "gpt3": 3, "gpt8": 8}[name]), _gpt_batch()
    return _hf(name)


def _part(example, r, n):
    """Data-parallel rank r's rows of the batch."""
    def rows(x):
        return x.chunk(n)[r] if isinstance(x, torch.Tensor) else x
    return {k: rows(v) for k, v in example.items()} if isinstance(example, dict) else tuple(rows(x) for x in example)


def _whole(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_matches(rank, world, name, pp, tp, schedule, spr, microbatches, tracer="auto", dp=1, fsdp=False):
    """Train the pipeline and the unsharded model (on the whole batch) side by side; compare on
    this rank's stages."""
    model, example = _model(name)
    ref = copy.deepcopy(model)
    mesh = _mesh(world, pp, tp, dp)
    mine = _part(example, mesh["dp"].get_local_rank(), dp) if dp > 1 else example
    pipe = autoshard.pipeline(model, mine, mesh=mesh, microbatches=microbatches, schedule=schedule,
                              stages_per_rank=spr, tracer=tracer)
    if fsdp:                                    # FSDP2 over "dp" per block; the rest averaged by the pipeline
        from torch.distributed.fsdp import fully_shard
        for block in autoshard.blocks_of(pipe).values():
            fully_shard(block, mesh=mesh["dp"])
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        loss = _call(pipe, mine)
        if dp > 1:                              # the batch's loss: the mean of the data-parallel ranks'
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss = loss / dp
        want = _loss(ref, example)
        want.backward()
        close_to_scale(loss, want, f"{name} step {step} loss")
        if step == 0:                          # every gradient this rank holds, whole, against the reference
            held = {n: None if p.grad is None else _whole(p.grad) for n, p in pipe.named_parameters()}
            assert all(g is not None for g in held.values()), [n for n, g in held.items() if g is None]
            grads = autoshard.collect_state_dict(pipe, held)
            rgrads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
            for n, g in grads.items():
                close_to_scale(g, rgrads[n], f"{name} grad of {n}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    full = autoshard.collect_state_dict(pipe, {k: _whole(v) for k, v in pipe.state_dict().items()})
    want = ref.state_dict()
    for k, v in full.items():
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k} after: {m}")
    return sorted(full), [len(s) for s in pipe.plan.stages], pipe.plan.stages


def _covers_model(results, model_keys):
    held = set().union(*(set(r[0]) for r in results))
    assert held == set(model_keys), sorted(set(model_keys) ^ held)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_gpt_tied_pp2(dist2, schedule):
    out = dist2.run(_train_matches, "gpt", 2, 1, schedule, 1, 4, timeout=300)
    _covers_model(out, _gpt().state_dict())
    assert out[0][1] == [2, 2]
    assert "wte.weight" in out[0][0] and "wte.weight" in out[1][0]      # the tied weight on both ends


def test_cut_inside_a_block(dist2):
    """3 blocks on 2 stages: whole blocks leave one stage twice the other's work, so the middle block
    is cut between its children (they become blocks of their own), exactly."""
    out = dist2.run(_train_matches, "gpt3", 2, 1, "1F1B", 1, 4, timeout=300)
    _covers_model(out, _gpt(blocks=3).state_dict())
    stages = out[0][2]
    assert stages[0][0] == "blocks.0" and stages[1][-1] == "blocks.2"
    inside = [n for group in stages for n in group if n.startswith("blocks.1.")]
    assert inside and {n.split(".")[2] for n in inside} <= {m for m, _ in _gpt(blocks=3).blocks[1].named_children()}
    assert any(n.startswith("blocks.1.") for n in stages[0]) and any(n.startswith("blocks.1.") for n in stages[1])


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_gpt_interleaved_four_stages_on_two_ranks(dist2, schedule):
    out = dist2.run(_train_matches, "gpt", 2, 1, schedule, 2, 4, timeout=300)
    _covers_model(out, _gpt().state_dict())
    assert out[0][1] == [1, 1, 1, 1]


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hf_pp2(dist2, name):
    out = dist2.run(_train_matches, name, 2, 1, "1F1B", 1, 2, "export", timeout=400)
    _covers_model(out, _hf(name)[0].state_dict())


@pytest.mark.slow
def test_llama_pp2_dp2(dist4):
    """Data parallelism beside the pipeline: each data-parallel rank runs half the batch, the
    gradients are averaged over "dp" after the schedule."""
    out = dist4.run(_train_matches, "llama", 2, 1, "1F1B", 1, 2, "export", 2, timeout=500)
    _covers_model(out, _hf("llama")[0].state_dict())


@pytest.fixture(scope="module")
def dist8():
    from launcher import RankPool
    pool = RankPool(8)
    yield pool
    pool.close()


@pytest.mark.slow
def test_llama_pp2_dp2_tp2_fsdp2(dist8):
    """8 ranks: pipeline x FSDP2 (per block, over "dp") x tensor parallel."""
    out = dist8.run(_train_matches, "llama", 2, 2, "1F1B", 1, 2, "export", 2, True, timeout=900)
    _covers_model(out, _hf("llama")[0].state_dict())


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hf_pp2_tp2(dist4, name):
    out = dist4.run(_train_matches, name, 2, 2, "1F1B", 1, 2, "export", timeout=500)
    _covers_model(out, _hf(name)[0].state_dict())


def test_gpt_pp4_gpipe(dist4):
    out = dist4.run(_train_matches, "gpt", 4, 1, "GPipe", 1, 4, timeout=400)
    _covers_model(out, _gpt().state_dict())


def test_gpt_pp4_interleaved(dist4):
    out = dist4.run(_train_matches, "gpt8", 4, 1, "Interleaved1F1B", 2, 4, timeout=400)
    _covers_model(out, _gpt(blocks=8).state_dict())
    assert out[0][1] == [1] * 8


# ----------------------------------------------------------------------------- errors

def _refused(rank, world, what):
    mesh = _mesh(world, 2, 1)
    model, example = _gpt(blocks=2), _gpt_batch(batch=6)
    try:
        if what == "batch":
            pipe = autoshard.pipeline(model, example, mesh=mesh, microbatches=3)
            pipe.step(*_gpt_batch(batch=8))
        elif what == "stages":
            autoshard.pipeline(model, example, mesh=mesh, microbatches=2, schedule="Interleaved1F1B",
                               stages_per_rank=2)
        elif what == "example":
            autoshard.pipeline(model, example, mesh=mesh, microbatches=4)
    except ShardingError as e:
        return str(e)
    return None


def test_errors_by_name(dist2):
    assert "a batch of 8 does not split into 3 equal microbatches" in dist2.run(_refused, "batch")[0]
    assert "4 stages (pp 2 x 2 a rank)" in dist2.run(_refused, "stages")[0]
    assert "has 2 blocks" in dist2.run(_refused, "stages")[0]
    assert "a batch of 6 does not split into 4 equal microbatches" in dist2.run(_refused, "example")[0]


# ----------------------------------------------------------------------------- checkpoints

def _checkpoint_moves(rank, world, path):
    """Save at pp 2 x tp 2, load at pp 1 x tp 4 and in one process: every tensor and moment bit-exact."""
    from autoshard.checkpoint import dcp_to_torch_save, get_state_dict, load, save, set_state_dict
    model, example = _hf("gpt2")
    fresh = copy.deepcopy(model)
    for p in fresh.parameters():                 # other values than the saved ones
        torch.nn.init.normal_(p, std=0.5)
    pipe = autoshard.pipeline(model, example, mesh=_mesh(world, 2, 2), microbatches=2, tracer="export")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.step(**example)
    opt.step()
    msd, osd = get_state_dict(pipe, opt)
    save({"model": msd, "optim": osd}, path)
    named = dict(pipe.named_parameters())
    saved = autoshard.collect_state_dict(pipe, pipe.state_dict())
    moments = autoshard.collect_state_dict(pipe, {n: opt.state[p]["exp_avg"] for n, p in named.items()})
    every = [None] * world
    dist.all_gather_object(every, (saved, moments))
    saved = {k: v for s, _ in every for k, v in s.items()}
    moments = {k: v for _, m in every for k, v in m.items()}
    gm = autoshard.parallelize(fresh, 4, example, tracer="export")
    opt4 = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    msd4, osd4 = get_state_dict(gm, opt4)
    load({"model": msd4, "optim": osd4}, path)
    set_state_dict(gm, opt4, model_state_dict=msd4, optim_state_dict=osd4)
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    assert set(full) == set(saved), sorted(set(full) ^ set(saved))
    for k, v in full.items():
        assert torch.equal(v, saved[k]), k
    got = autoshard.collect_state_dict(gm, {n: opt4.state[p]["exp_avg"] for n, p in gm.named_parameters()})
    for k, v in got.items():
        assert torch.equal(v, moments[k]), k
    if rank == 0:                                # one process: the checkpoint as full tensors
        dcp_to_torch_save(path, path + ".pt")
        one = torch.load(path + ".pt", weights_only=True)["model"]
        for k, v in saved.items():
            assert torch.equal(one[k], v), k
    return len(full)


def test_checkpoint_pp2_tp2_to_tp4_and_one_process(dist4, tmp_path):
    out = dist4.run(_checkpoint_moves, os.path.join(str(tmp_path), "ckpt"), timeout=500)
    assert out[0] == len(_hf("gpt2")[0].state_dict())


# ----------------------------------------------------------------------------- evaluation, dropout

def _evaluates(rank, world):
    model, example = _hf("llama")
    ref = copy.deepcopy(model).eval()
    pipe = autoshard.pipeline(model, example, mesh=_mesh(world, 2, 1), microbatches=4, tracer="export")
    pipe.eval()
    loss, outputs = pipe(**example)
    want = ref(**example)
    close_to_scale(loss, want.loss, "evaluation loss")
    assert loss.requires_grad is False
    if outputs is not None:                       # the last stage's rank: every output, microbatches joined
        close_to_scale(outputs[1], want.logits, "evaluation logits")
    again = pipe.step(**example)                  # eval mode: step is forward only
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train()
    trained = pipe.step(**example)
    close_to_scale(again, want.loss, "eval step")
    return outputs is not None, float(trained)


def test_eval_forward_only(dist2):
    out = dist2.run(_evaluates, timeout=300)
    assert [o[0] for o in out] == [False, True]
    assert out[0][1] == out[1][1]


def _dropout_runs(rank, world, seed):
    model, example = _gpt(dropout=0.2), _gpt_batch()
    autoshard.manual_seed(seed)
    pipe = autoshard.pipeline(model, example, mesh=_mesh(world, 2, 2), microbatches=4)
    losses = [float(pipe.step(*example)) for _ in range(2)]
    pipe.eval()
    off = float(pipe.step(*example))
    return losses, off


def test_dropout_on(dist4):
    """Dropout runs in every stage, from streams seeded per stage (Megatron's seed + 100 x pp rank):
    the same seed gives the same losses, another seed others, and eval mode none."""
    a = dist4.run(_dropout_runs, 5, timeout=300)
    b = dist4.run(_dropout_runs, 5, timeout=300)
    c = dist4.run(_dropout_runs, 6, timeout=300)
    assert a == b
    assert len({str(x) for x in a}) == 1                    # every rank reports the batch's loss
    assert a[0][0] != c[0][0]
    assert a[0][1] == c[0][1] and a[0][1] not in a[0][0]


# ----------------------------------------------------------------------------- a model on meta

def _meta_loads_own_stages(rank, world, path):
    """A model built on meta, filled from a checkpoint file: each rank reads and holds only its
    stages (the other stages' blocks stay on meta), and trains as one process does."""
    from hf_models import llama as build
    model, example = _hf("llama")
    ref = copy.deepcopy(model)
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    with torch.device("meta"):
        empty, _ = build(batch=8, num_hidden_layers=4)
    empty.train()
    pipe = autoshard.pipeline(empty, example, mesh=_mesh(world, 2, 1), microbatches=2, tracer="export", load=path)
    real = {n for n, p in pipe.named_parameters() if not p.is_meta}
    assert real == {n for n, _ in pipe.named_parameters()}
    loss = pipe.step(**example)
    want = _loss(ref, example)
    want.backward()
    close_to_scale(loss, want, "loss of a model built on meta")
    grads = autoshard.collect_state_dict(pipe, {n: p.grad for n, p in pipe.named_parameters()})
    rgrads = dict(ref.named_parameters())
    for n, g in grads.items():
        close_to_scale(g, rgrads[n].grad, f"grad of {n}")
    return sorted(real)


def test_model_on_meta_fills_only_its_stages(dist2, tmp_path):
    out = dist2.run(_meta_loads_own_stages, os.path.join(str(tmp_path), "llama.pt"), timeout=400)
    assert not set(out[0]) & set(out[1])                       # no rank holds another's stage
    assert set(out[0]) | set(out[1]) == {n for n, _ in _hf("llama")[0].named_parameters()}
    assert "model.layers.0.mlp.up_proj.weight" in out[0] and "lm_head.weight" in out[1]


# ----------------------------------------------------------------------------- precision

def _bf16_autocast(rank, world):
    """Planned and stepped under torch.autocast(bf16): the stages are the module's graph of that
    recipe, and the loss and gradients are the single process's under the same autocast."""
    model, example = _hf("llama")
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", torch.bfloat16):
        pipe = autoshard.pipeline(model, example, mesh=_mesh(world, 2, 1), microbatches=2, tracer="export")
        loss = pipe.step(**example)
        want = _loss(ref, example)
    want.backward()
    tol = 2e-2                                             # bf16's rounding, summed in another order
    torch.testing.assert_close(loss.float(), want.float().detach(), rtol=tol, atol=tol)
    grads = autoshard.collect_state_dict(pipe, {n: p.grad for n, p in pipe.named_parameters()})
    rgrads = dict(ref.named_parameters())
    worst = 0.0
    for n, g in grads.items():
        r = rgrads[n].grad
        assert g.dtype == r.dtype == torch.float32, n
        worst = max(worst, ((g - r).norm() / r.norm().clamp_min(1e-12)).item())
    assert worst < 5e-2, worst
    return float(loss), worst


def test_bf16_autocast(dist2):
    out = dist2.run(_bf16_autocast, timeout=300)
    assert out[0][0] == out[1][0]


def _phi3_three_layers(rank, world):
    """Phi-3 (a dropout child in each layer, fused qkv) with 3 layers on 2 stages: the middle layer
    is cut between its children that hold tensors; the dropouts run with their inputs' stage."""
    from hf_models import phi3
    model, example = phi3(batch=6, num_hidden_layers=3)
    model.train()
    ref = copy.deepcopy(model)
    pipe = autoshard.pipeline(model, example, mesh=_mesh(world, 2, 1), microbatches=3, tracer="export")
    loss = pipe.step(**example)
    want = _loss(ref, example)
    want.backward()
    close_to_scale(loss, want, "phi3 loss")
    grads = autoshard.collect_state_dict(pipe, {n: p.grad for n, p in pipe.named_parameters()})
    rgrads = dict(ref.named_parameters())
    for n, g in grads.items():
        close_to_scale(g, rgrads[n].grad, f"phi3 grad of {n}")
    return sorted(grads), pipe.plan.stages


def test_cut_inside_a_layer_with_a_dropout_child(dist2):
    out = dist2.run(_phi3_three_layers, timeout=300)
    from hf_models import phi3
    assert set(out[0][0]) | set(out[1][0]) == {n for n, _ in phi3(num_hidden_layers=3)[0].named_parameters()}
    assert any(n.startswith("model.layers.1.") for group in out[0][1] for n in group)
