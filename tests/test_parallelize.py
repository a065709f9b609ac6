"""parallelize(): each rank's GraphModule computes what the single-process model computes.

At world sizes 2 and 4 (gloo, CPU), for an MLP returning logits, a GPT with its loss inside, a
fused q/k/v GPT, a tied-embedding GPT returning logits and a LayerNorm/residual/dropout/SwiGLU mix:
forward output, loss and every collected gradient equal the model's (fp32, 1e-5 relative), five
optimizer steps stay equal, state dicts round-trip through relocate/collect, and the bytes the
collectives moved (count_comm) equal the plan's prediction while torch's CommDebugMode counts the
same collectives. Then: tensor-parallel subgroups (group=), 2 TP x 2 DP with DDP, rank= without a
process group, clear errors for bad input, and the demo / torchrun example as users run them.
"""
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import distributed as ad
from autoshard.runtime.collectives import count_comm
from autoshard.runtime.pieces import cat_along
from autoshard.rewrite.local_ops import FRESH_OUTPUT_OPS
from autoshard.errors import CaptureError, ProcessGroupError, ShardingError
from autoshard.nn import functional as PF
from launcher import _free_port
from models import GPT, MLPStack
from refs import close_to_scale as _close, grads as _grads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "train_gpt.py")
VOCAB = 2048          # large enough (x 128 tokens) that the vocabulary-parallel loss beats gathering logits


# ----------------------------------------------------------------------------- models and checks

class Classifier(nn.Module):
    """Residual MLP blocks and a linear head returning logits (the loss is computed outside)."""

    def __init__(self, classes=32):
        super().__init__()
        self.body = MLPStack(blocks=2, h=64)
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        return self.head(self.body(x))


def _tokens(seed, batch=4, seq=32, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g)


def _features(seed):
    return (torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(seed)),)


def _ids(seed):
    return _tokens(seed)[:1]


def _class_loss(logits, args):                     # a label per position, a function of the input
    return F.cross_entropy(logits.reshape(-1, 32), args[0].argmax(-1).reshape(-1) % 32)


def _next_id_loss(logits, args):
    return F.cross_entropy(logits.reshape(-1, VOCAB), ((args[0] + 1) % VOCAB).reshape(-1))


def _own_loss(loss, args):                         # the model computes its loss itself
    return loss


def _build(name, seed=0):
    """(model, example args, batch(seed) -> args, loss(output, args) -> scalar)."""
    torch.manual_seed(seed)
    if name == "mlp_logits":
        model, batch, loss = Classifier(), _features, _class_loss
    elif name == "tied_logits":
        model, batch, loss = GPT(vocab=VOCAB, blocks=1, tied=True), _ids, _next_id_loss
    else:
        kw = {"gpt_loss": dict(blocks=2, tied=False), "fused_qkv": dict(blocks=1, fused=True, tied=False),
              "mix": dict(blocks=2, tied=True, swiglu=True, dropout=0.1)}[name]
        model, batch, loss = GPT(vocab=VOCAB, **kw), _tokens, _own_loss
    if name == "mix":
        model.eval()                  # dropout off for the comparisons (checked separately below)
    return model, batch(seed), batch, loss


def _check_grads(gm, ref, what):
    collected = autoshard.collect_state_dict(gm, _grads(gm))
    expected = _grads(ref)
    assert set(collected) == set(expected), (sorted(collected), sorted(expected))
    for key, g in expected.items():
        _close(collected[key], g, f"{what}: grad of {key}")


def _check_full(full, ref, what):
    expected = ref.state_dict()
    assert list(full) == list(expected), f"{what}: keys {list(full)} != {list(expected)}"
    for key, value in expected.items():
        _close(full[key], value, f"{what}: {key}")


# ----------------------------------------------------------------------------- the equivalence case

def _equivalence(rank, p, name):
    """Everything one model must satisfy at degree p; returns numbers for the test to compare."""
    from torch.distributed.tensor.debug import CommDebugMode

    model, args, batch, loss_fn = _build(name)
    ref = copy.deepcopy(model)                      # parallelize shares replicated tensors with `model`
    gm = autoshard.parallelize(model, p, args, check_inputs=None)     # the plan's collectives alone are counted
    plan = gm._autoshard_plan

    # names, sharing and shard storage
    assert list(gm.state_dict()) == list(ref.state_dict())
    layouts = autoshard.layouts(gm)
    assert layouts, f"{name}: nothing was sharded"
    for key, full in ref.named_parameters(remove_duplicate=False):
        local = gm.get_parameter(key)
        if key in layouts:
            shape = list(full.shape)
            shape[layouts[key].dim] //= p
            assert list(local.shape) == shape, (key, local.shape, shape)
            assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), key   # shard only
        else:
            assert local is model.get_parameter(key), f"{key}: a replicated parameter must be shared, not copied"

    # one forward + backward, counted by autoshard and by torch
    with CommDebugMode() as torch_counts, count_comm() as ours:
        out = gm(*args)
        loss = loss_fn(out, args)
        loss.backward()
    ref_out = ref(*args)
    ref_loss = loss_fn(ref_out, args)
    ref_loss.backward()
    _close(out, ref_out, f"{name}: output")
    _close(loss, ref_loss, f"{name}: loss")
    _check_grads(gm, ref, name)
    vocab_parallel = any(n.target is PF.vocab_parallel_cross_entropy for n in gm.graph.nodes)

    # a batch of another size runs through the same module: fx graphs read sizes with size()
    # (torch.export graphs are specialised to the example's shapes and guard against others)
    if plan.tracer == "symbolic_trace":
        other = tuple(a[:2] for a in batch(11))
        _close(loss_fn(gm(*other), other), loss_fn(ref(*other), other), f"{name}: loss on another batch size")

    # five optimizer steps stay equal (SGD with momentum: Adam would amplify fp32 rounding of
    # gradients that are zero in exact arithmetic, like a key bias under softmax)
    opt = torch.optim.SGD(gm.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
        args_s, losses = batch(100 + step), []
        for module, optim in ((gm, opt), (ref, ref_opt)):
            optim.zero_grad()
            losses.append(loss_fn(module(*args_s), args_s))
            losses[-1].backward()
            optim.step()
        _close(*losses, f"{name}: loss at step {step + 1}")
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    _check_full(full, ref, f"{name} after 5 steps")

    # state dict round trip: relocate(collect(local)) is local; a module built from another
    # instance with the same plan and loaded with relocate(reference) computes like the reference
    local = autoshard.relocate_state_dict(gm, full)
    assert list(local) == list(gm.state_dict())
    for key, value in gm.state_dict().items():
        assert torch.equal(local[key], value), key
    fresh_model, _, _, _ = _build(name, seed=123)
    fresh = autoshard.parallelize(fresh_model, p, plan=plan)
    fresh.load_state_dict(autoshard.relocate_state_dict(fresh, ref.state_dict()))
    _close(loss_fn(fresh(*args), args), loss_fn(ref(*args), args), f"{name}: loss after relocate + load")

    result = dict(measured=ours.bytes, predicted=plan.comm_bytes, calls=ours.calls,
                  planned_calls=sum(c for c, _ in plan.comm_by_kind.values()),
                  torch_calls=torch_counts.get_total_counts(), vocab_parallel=vocab_parallel,
                  loss=float(loss))
    if name == "mix":
        result.update(_dropout_honoured(gm, ref, args, p))
    return result


def _dropout_honoured(gm, ref, args, p):
    """Dropout modules follow train()/eval(); with the same seed everywhere (torch's for the
    reference, autoshard's streams for the module), train-mode outputs are the same on every rank
    and equal the reference's where every dropout runs on a whole tensor."""
    def run(module, train):
        module.train(train)
        torch.manual_seed(5)
        autoshard.manual_seed(5)
        with torch.no_grad():
            return module(*args)
    train, evaluated = run(gm, True), run(gm, False)
    assert not torch.allclose(train, evaluated), "dropout is not applied in train mode"
    _close(evaluated, run(ref, False), "eval-mode loss")
    every = [torch.zeros_like(train) for _ in range(p)]
    dist.all_gather(every, train.contiguous())
    assert all(torch.equal(e, every[0]) for e in every), "train-mode outputs differ between ranks"
    drops = [d for d in gm._autoshard_plan.nodes.values() if d.op == "Dropout"]
    # a Partial input (a row layer's summands) draws the whole tensor's mask, as a replicated one does
    whole = bool(drops) and all(isinstance(d.output, (autoshard.Replicate, autoshard.Partial)) for d in drops)
    if whole:
        _close(train, run(ref, True), "train-mode loss (same dropout masks)")
    return dict(dropout_whole=whole)


MODELS = ["mlp_logits", "gpt_loss", "fused_qkv", "tied_logits", "mix"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("world", ["dist2", "dist4"])
def test_equals_single_process(world, name, request):
    results = request.getfixturevalue(world).run(_equivalence, name, timeout=120)
    for r in results:
        assert r["measured"] == pytest.approx(r["predicted"], rel=0.01), r
        assert r["calls"] == r["planned_calls"] == r["torch_calls"], r
        assert r["measured"] > 0, r
        assert r["loss"] == results[0]["loss"]                       # every rank returns the full loss
    if name in ("gpt_loss", "fused_qkv", "mix"):
        assert results[0]["vocab_parallel"], f"{name}: the loss is not computed vocabulary-parallel"
    if name == "mix":
        assert results[0]["dropout_whole"]


# ----------------------------------------------------------------------------- groups

def _subgroups(rank, p):
    """World 4 as two independent tensor-parallel pairs passed with group=."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    model, args, _, loss_fn = _build("fused_qkv", seed=rank // 2)     # each pair its own model
    ref = copy.deepcopy(model)
    with pytest.raises(ProcessGroupError, match=r"world_size=4\) but the tensor-parallel group has 2 ranks"):
        autoshard.parallelize(model, 4, args, group=mine)
    with pytest.raises(ProcessGroupError, match="tensor-parallel group has 4 ranks"):
        autoshard.parallelize(model, 2, args)                        # the default group is the world
    gm = autoshard.parallelize(model, 2, args, group=mine)
    with count_comm() as c:
        loss = loss_fn(gm(*args), args)
        loss.backward()
    ref_loss = loss_fn(ref(*args), args)
    ref_loss.backward()
    _close(loss, ref_loss, "loss in a subgroup")
    _check_grads(gm, ref, "subgroup")
    assert c.bytes == pytest.approx(gm._autoshard_plan.comm_bytes, rel=0.01)
    return float(loss)


def test_tensor_parallel_subgroups(dist4):
    losses = dist4.run(_subgroups)
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]


def _ddp_2x2(rank, p):
    """World 4 as TP groups {0,1}, {2,3} and DP groups {0,2}, {1,3}: DDP over the DP group with the
    sharded parameters ignored trains like one process on the whole batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ad.init_process_group(2)
    model, args, _, loss_fn = _build("gpt_loss")
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, 2, args)
    ignored = autoshard.register_ddp_parameters_to_ignore(gm)
    assert ignored and set(ignored) == set(autoshard.layouts(gm))
    ddp = DDP(gm, process_group=ad.get_data_parallel_group())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    half = slice(2 * (rank // 2), 2 * (rank // 2) + 2)               # this replica's half of the batch
    for step in range(3):
        idx, targets = _tokens(200 + step)
        opt.zero_grad()
        ddp(idx[half], targets[half]).backward()
        opt.step()
        ref_opt.zero_grad()
        ref(idx, targets).backward()
        ref_opt.step()
    _check_full(autoshard.collect_state_dict(gm, gm.state_dict()), ref, "2 TP x 2 DP after 3 steps")
    return True


def test_ddp_across_tensor_parallel_groups(dist4):
    assert all(dist4.run(_ddp_2x2, timeout=120))


def _bad_groups(rank, p):
    model, args, _, _ = _build("gpt_loss")
    with pytest.raises(ProcessGroupError, match=r"world_size=4\) but the tensor-parallel group has 2 ranks"):
        autoshard.parallelize(model, 4, args)
    with pytest.raises(ProcessGroupError, match=f"rank={1 - rank} but this process is rank {rank}"):
        autoshard.parallelize(model, 2, args, rank=1 - rank)
    with pytest.raises(ProcessGroupError, match="group size 3 must be >= 1 and divide the world size 2"):
        ad.init_process_group(3)
    return True


def test_world_size_that_does_not_match_the_group(dist2):
    assert all(dist2.run(_bad_groups))


def _different_plans(rank, p):
    model, args, _, _ = _build("gpt_loss")
    pin = {"head": None} if rank == 0 else {}       # rank 0 keeps the head whole, rank 1 splits it
    with pytest.raises(ProcessGroupError, match="planned differently"):
        autoshard.parallelize(model, p, args, pin=pin)
    return True


def test_ranks_that_plan_differently_get_an_error_not_a_hang(dist2):
    assert all(dist2.run(_different_plans))


# ----------------------------------------------------------------------------- one process

def test_rank_without_process_group_builds_that_ranks_module():
    assert not dist.is_initialized()
    model, args, _, _ = _build("fused_qkv")
    plan = autoshard.plan(model, 2, args, memory_weight=1e-9)   # (the fixed price: q/k/v in three parts)
    shards = [autoshard.parallelize(model, 2, plan=plan, rank=r) for r in range(2)]
    layouts = autoshard.layouts(shards[0])
    assert "blocks.0.attn.qkv.weight" in layouts and layouts["blocks.0.attn.qkv.weight"].chunks == 3
    for key, full in model.state_dict(keep_vars=True).items():
        pieces = [gm.state_dict()[key] for gm in shards]
        if key in layouts:                                          # the ranks' shards make the tensor
            assert torch.equal(cat_along(pieces, layouts[key].dim, layouts[key].chunks), full.detach()), key
        else:                                                       # replicated: the model's own tensor
            assert all(piece.data_ptr() == full.data_ptr() for piece in pieces), key
    assert "autoshard_runtime_collectives" in shards[0].code                # collectives are named graph nodes
    gpt, ids = _build("gpt_loss")[:2]
    reduces = [n for gm in (shards[0], autoshard.parallelize(gpt, 2, ids, rank=0)) for n in gm.graph.nodes
               if n.target is autoshard.runtime.collectives.reduce_from and n.args[0].target in FRESH_OUTPUT_OPS]
    assert reduces and all(n.kwargs.get("inplace") for n in reduces)    # row matmul / lookup outputs: no copy
    with pytest.raises(ProcessGroupError, match="needs a process group"):
        shards[0](*args)                                            # running it needs the group
    with pytest.raises(ProcessGroupError, match=r"needs an initialised process group .* or rank="):
        autoshard.parallelize(model, 2, args)
    with pytest.raises(ShardingError, match="rank 2 is outside 0..1"):
        autoshard.parallelize(model, 2, plan=plan, rank=2)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:                                             # Python control flow on a value
            return self.fc(x)
        return -self.fc(x)


def test_bad_input_errors():
    x = torch.randn(2, 8)
    with pytest.raises(CaptureError) as e:
        autoshard.parallelize(DataDependent(), 2, (x,), rank=0)
    text = str(e.value)
    assert "could not capture DataDependent" in text
    assert re.search(r"symbolic_trace failed: \w+", text) and re.search(r"export failed: \w+", text), text
    assert "try:" in text
    model, args, _, _ = _build("gpt_loss")
    plan = autoshard.plan(model, 2, args)
    other = GPT(vocab=VOCAB, blocks=1, tied=False)
    with pytest.raises(ShardingError, match="the plan was made for another model: GPT lacks parameters"):
        autoshard.parallelize(other, 2, plan=plan, rank=0)
    with pytest.raises(ShardingError, match="made for another model"):
        autoshard.parallelize(Classifier(), 2, plan=plan, rank=0)
    with pytest.raises(ShardingError, match="the plan was made for world_size 2, not 4"):
        autoshard.parallelize(model, 4, plan=plan, rank=0)
    with pytest.raises(ShardingError, match="world_size must be >= 1, got 0"):
        autoshard.parallelize(model, 0, args, rank=0)
    with pytest.raises(TypeError, match="given together with plan="):
        autoshard.parallelize(model, 2, plan=plan, rank=0, search="exact")


# ----------------------------------------------------------------------------- as users run it

def _env(**extra):
    path = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.update({k: str(v) for k, v in extra.items()})
    return env


SMALL = ["--vocab", "512", "--hidden", "32", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "4", "--quiet"]


def test_demo_losses_agree(capfd):
    from autoshard import demo
    assert demo.main(["--steps", "3"]) == 0
    out = capfd.readouterr().out
    assert "autoshard plan" in out and "OK: the tensor-parallel model trains like the single-process one" in out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert all(abs(float(a) - float(b)) <= 1e-4 for _, a, b, _ in rows)
    ratios = re.findall(r"^\s+[01]\s+\d+\s+.*\s([\d.]+)$", out, re.M)
    assert len(ratios) == 2 and all(abs(float(r) - 1) <= 0.01 for r in ratios), out


def _train_then_destroy(rank, port):
    """A fresh rank: train a parallelized MLP one step, tear down, check nothing keeps the group."""
    import gc
    import weakref
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    world = weakref.ref(dist.group.WORLD)
    gm = autoshard.parallelize(MLPStack(blocks=1, h=32), 2, (torch.randn(4, 32),))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))      # one batch on both ranks
    gm(x).sum().backward()
    del gm
    ad.destroy_process_group()
    gc.collect()
    if world() is not None:
        raise AssertionError(f"the default process group outlives destroy_process_group: "
                             f"{sys.getrefcount(world()) - 1} references left")


def test_destroy_frees_the_process_group():
    """A group still referenced when the interpreter exits can abort the process at exit (gloo
    threads), which fails a finished run; planning must not pin it (torch.distributed.nn)."""
    import torch.multiprocessing as mp
    mp.spawn(_train_then_destroy, args=(_free_port(),), nprocs=2, join=True)


def test_torchrun_example_two_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           EXAMPLE, "--tp", "2", "--steps", "2", *SMALL]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world 2 = 2 tensor-parallel x 1 data-parallel (gloo)" in done.stdout
    sent = re.findall(r"bytes sent ([\d.]+) MB \(plan ([\d.]+) MB\)", done.stdout)
    assert len(sent) == 2 and all(a == b for a, b in sent), done.stdout


def _launch(rank, world, port, *args):
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=world, RANK=rank, LOCAL_RANK=rank,
               LOCAL_WORLD_SIZE=world)
    return subprocess.Popen([sys.executable, EXAMPLE, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_tensor_parallel_degree_that_does_not_divide_the_world():
    done = subprocess.run([sys.executable, EXAMPLE, "--tp", "2", *SMALL], capture_output=True, text=True,
                          env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(), WORLD_SIZE=1, RANK=0),
                          timeout=60)
    assert done.returncode != 0
    assert "ProcessGroupError: tensor-parallel group size 2 must be >= 1 and divide the world size 1" in done.stderr


def test_missing_rank_ends_with_an_error_within_the_timeout():
    """WORLD_SIZE=2 but only rank 0 comes: the rendezvous gives up after --timeout seconds."""
    t0 = time.monotonic()
    proc = _launch(0, 2, _free_port(), "--tp", "2", "--timeout", "3", *SMALL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert re.search(r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined", out), out[-2000:]
    assert time.monotonic() - t0 < 45


def test_a_rank_that_dies_ends_the_others_with_an_error():
    port = _free_port()
    procs = [_launch(r, 2, port, "--tp", "2", "--steps", "100000", "--timeout", "10", *SMALL) for r in range(2)]
    watchdog = threading.Timer(120, lambda: [proc.kill() for proc in procs])
    watchdog.start()
    try:
        lines = []
        for line in procs[0].stdout:                              # wait until training runs
            lines.append(line)
            if line.startswith("step   2"):
                break
        assert any(line.startswith("step   2") for line in lines), "".join(lines)[-2000:]
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rest, _ = procs[0].communicate(timeout=40)
        assert procs[0].returncode not in (0, None)
        assert time.monotonic() - t0 < 30
        assert re.search(r"Connection (reset|closed) by peer|Broken pipe|Timed out|timed out|"
                         r"rank\(s\) \[1\] \(pid \[\d+\]\) exited before", rest), rest[-2000:]   # gloo's, or shm's
    finally:
        watchdog.cancel()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_the_module_keeps_no_full_weights_alive():
    """Once the model is dropped, its full tensors are freed: the module holds its shards and the
    replicated tensors, the plan only shapes (issue: a rank kept a full copy beside its shards)."""
    import gc
    import weakref

    from models import GPT
    torch.manual_seed(0)
    model = GPT(vocab=128, h=64, heads=4, blocks=3, seq=16, tied=False)
    idx = torch.randint(0, 128, (2, 16))
    gm = autoshard.parallelize(model, 2, (idx, idx), rank=0)
    sharded = [n for n, pl in autoshard.layouts(gm).items() if not isinstance(pl, autoshard.Replicate)]
    assert "head.weight" in sharded and len(sharded) > 10
    refs = {n: weakref.ref(model.get_parameter(n)) for n in sharded}
    plan = gm._autoshard_plan
    assert all(t.is_meta for n, t in plan.graph_module.named_parameters() if n in sharded)
    del model
    gc.collect()
    alive = [n for n, r in refs.items() if r() is not None]
    assert not alive, f"full tensors kept alive: {alive[:5]}"
