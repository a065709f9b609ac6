"""Under the training loops people use (autoshard.io.training): the Hugging Face Trainer,
accelerate's own loop and Lightning train autoshard's module exactly, and mis-wirings are refused.

A tiny LLaMA (hidden 32, 2 layers, vocab 128: tests/scripts/hf_trainer.py) trained 4 steps with
clipping on (max norm 0.05: every step clips) by a plain `Trainer` with plain
`TrainingArguments` inside the gloo ranks (RANK / WORLD_SIZE set as torchrun sets them): at world
2 (tp 2, gradient accumulation 2) and world 4 (tp 2 x dp 2) the logged losses and gradient norms
equal those of the one-process Trainer with the same global batch (within 1e-4), so does
`trainer.evaluate`, `trainer.save_model` then `from_pretrained` in one process gives the trained
weights, and a fresh Trainer resumed from a step-2 checkpoint ends with the uninterrupted run's
losses and weights (a weights-only checkpoint: its step-3 loss). A
DistributedSampler over the whole world and a DDP wrap across the tensor-parallel ranks are each
refused by name on the first step. The pieces: the input check (a batch split over the world,
another data order, another shape), the gradient norm over every shard, the data-parallel average
with `no_sync`. The Trainer runs (a minute or more each on 2 loaded cores; the default suite keeps
the sampler's refusal and the resume at world 2), accelerate, Lightning and the same run under
`torchrun` as a user launches it are behind `-m slow`.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "scripts"))

import hf_trainer  # noqa: E402

STEPS, CLIP = 4, 0.05


def _trainer_env(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _train(tp, batch, accum, out, miswire="none", save=False, save_steps=0, resume=None, seed=0):
    """hf_trainer's run, in this process (a gloo rank, or the parent for tp=1); `save_steps`: a
    Trainer checkpoint every so many steps; `resume`: the checkpoint to resume from."""
    import transformers
    import autoshard
    transformers.logging.set_verbosity_error()
    model = hf_trainer.build(seed)
    data = hf_trainer.dataset()
    module = hf_trainer.parallel(model, data, tp, batch)
    trainer = hf_trainer.make_trainer(module, data, os.path.join(out, "run"), batch, accum, STEPS, CLIP, save_steps)
    hf_trainer.miswire(trainer, module, data, batch, miswire)
    result = {}
    try:
        trainer.train(resume_from_checkpoint=resume)
    except autoshard.AutoshardError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result.update(hf_trainer.logged(trainer))
    if save and "error" not in result:
        result["eval_loss"] = trainer.evaluate(data[:8])["eval_loss"]      # split by data-parallel rank
        trainer.save_model(os.path.join(out, "saved"))
        full = autoshard.collect_state_dict(module, module.state_dict()) if tp > 1 else module.state_dict()
        result["state"] = {k: v.clone() for k, v in full.items()}
    return result


def _rank_case(rank, world, tp, batch, accum, out, miswire, save):
    _trainer_env(rank, world)
    if world > tp:
        from autoshard.distributed import init_process_group
        init_process_group(tp)                    # tensor-parallel pairs, data-parallel groups across them
    try:
        return _train(tp, batch, accum, out, miswire, save)
    finally:
        _reset_accelerate()


_REFERENCE = {}


def _reference(batch, accum, tmp):
    key = (batch, accum)
    if key not in _REFERENCE:
        _REFERENCE[key] = _train(1, batch, accum, str(tmp), save=True)
        _reset_accelerate()
    return _REFERENCE[key]


def _close(a, b, tol=1e-4):
    return len(a) == len(b) == STEPS and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("world,accum", [(2, 2), (4, 1)])
def test_trainer_equals_one_process(world, accum, dist2, dist4, tmp_path):
    pool = dist2 if world == 2 else dist4
    dp = world // 2
    ref = _reference(2 * dp, accum, tmp_path / "ref")
    out = pool.run(_rank_case, 2, 2, accum, str(tmp_path), "none", True, timeout=300)
    for r in out:
        assert "error" not in r, r["error"]
        assert _close(r["losses"], ref["losses"]), (r["losses"], ref["losses"])
        assert _close(r["grad_norms"], ref["grad_norms"]), (r["grad_norms"], ref["grad_norms"])
        assert abs(r["eval_loss"] - ref["eval_loss"]) < 1e-4, (r["eval_loss"], ref["eval_loss"])
    # save_model wrote the full trained weights: one process loads them
    import transformers
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    state = loaded.state_dict()
    for k, v in out[0]["state"].items():
        assert torch.allclose(state[k], v, atol=1e-6), k
    for k, v in ref["state"].items():          # and they are one process's trained weights
        assert torch.allclose(state[k], v, atol=1e-4), k


def _resume_case(rank, world, out):
    """4 steps with a Trainer checkpoint at step 2, then a model built from another seed resumed
    from that checkpoint by a fresh Trainer: (the whole run, the resumed run)."""
    _trainer_env(rank, world)
    if world > 2:
        from autoshard.distributed import init_process_group
        init_process_group(2)
    try:
        whole = _train(2, 2, 1, out, save=True, save_steps=2)
        _reset_accelerate()
        checkpoint = os.path.join(out, "run", "checkpoint-2")
        stored = sorted(os.listdir(checkpoint))
        resumed = _train(2, 2, 1, os.path.join(out, "again"), save=True, resume=checkpoint, seed=1)
        _reset_accelerate()
        if rank == 0:                 # a checkpoint with weights only (as save_only_model writes)
            import shutil
            shutil.copytree(checkpoint, os.path.join(out, "weights"), ignore=shutil.ignore_patterns("optimizer_*"))
        torch.distributed.barrier()
        weights = _train(2, 2, 1, os.path.join(out, "third"), resume=os.path.join(out, "weights"), seed=1)
        return whole, resumed, stored, weights
    finally:
        _reset_accelerate()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_trainer_resumes_from_its_checkpoint_exactly(world, dist2, dist4, tmp_path):
    """The checkpoint holds every rank's optimizer state (AdamW's moments: without them steps 3
    and 4 differ) and the module's shards; the resumed run's losses and weights are the whole run's."""
    pool = dist2 if world == 2 else dist4
    ref = _reference(2 * (world // 2), 1, tmp_path / "ref")
    out = pool.run(_resume_case, str(tmp_path), timeout=400)
    for whole, resumed, stored, weights in out:
        assert "error" not in whole and "error" not in resumed, (whole.get("error"), resumed.get("error"))
        assert _close(whole["losses"], ref["losses"]), (whole["losses"], ref["losses"])   # and evaluate():
        assert abs(whole["eval_loss"] - ref["eval_loss"]) < 1e-4, (whole["eval_loss"], ref["eval_loss"])
        assert "optimizer_autoshard" in stored and "scheduler.pt" in stored and "optimizer.pt" not in stored, stored
        assert _close(resumed["losses"], whole["losses"], 1e-6), (resumed["losses"], whole["losses"])
        for k, v in whole["state"].items():
            assert torch.allclose(resumed["state"][k], v, atol=1e-6), k
        # weights only: step 3's loss is the saved weights' (each rank kept its shards of the full
        # tensors); the fresh optimizer's step 4 is not the whole run's
        assert abs(weights["losses"][2] - whole["losses"][2]) < 1e-6, (weights["losses"], whole["losses"])
        assert abs(weights["losses"][3] - whole["losses"][3]) > 1e-4, (weights["losses"], whole["losses"])


@pytest.mark.parametrize("miswire,named", [("sampler", "InputMismatchError"),
                                            pytest.param("ddp", "DistributedDataParallel", marks=pytest.mark.slow)])
def test_miswired_trainer_is_refused_on_the_first_step(miswire, named, dist2, tmp_path):
    out = dist2.run(_rank_case, 2, 2, 1, str(tmp_path), miswire, False, timeout=300)
    for r in out:
        assert named in r.get("error", ""), r
        assert r["losses"] == [], "refused before any step was logged"


# ----------------------------------------------------------------------------- accelerate's loop, Lightning

EXAMPLES = os.path.join(os.path.dirname(HERE), "docs", "examples")
sys.path.insert(0, EXAMPLES)


def _loop_case(rank, world, loop):
    import importlib
    _trainer_env(rank, world)
    try:
        return importlib.import_module(loop).train(tp=2, batch=2, steps=STEPS, clip=CLIP)
    finally:
        _reset_accelerate()


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["train_accelerate", "train_lightning"])
def test_accelerate_and_lightning_loops_equal_one_process(loop, dist4):
    if loop == "train_lightning":
        pytest.importorskip("lightning")
    import importlib
    ref = importlib.import_module(loop).train(tp=1, batch=4, steps=STEPS, clip=CLIP)
    _reset_accelerate()
    out = dist4.run(_loop_case, loop, timeout=400)
    if loop == "train_lightning":            # each rank: its data-parallel replica's loss; ranks 0, 2 are the replicas
        out = [[(a + b) / 2 for a, b in zip(out[0], out[2])]] * 4
    for losses in out:
        assert _close(losses, ref), (losses, ref)


# ----------------------------------------------------------------------------- the pieces

def _tiny(rank, p, **kw):
    import autoshard
    model = hf_trainer.build()
    data = hf_trainer.dataset()
    ids = torch.stack([data[0]["input_ids"], data[1]["input_ids"]])
    gm = autoshard.parallelize(model, p, {"input_ids": ids, "labels": ids}, tracer="export", **kw)
    return model, gm, ids


def _input_check_case(rank, p):
    from autoshard.errors import InputMismatchError
    _, gm, ids = _tiny(rank, p, check_inputs=2)
    out = {}
    gm(input_ids=ids, labels=ids)                               # call 0, checked: the same batch
    other = (ids + rank) % hf_trainer.VOCAB
    gm(input_ids=other, labels=other)                           # call 1: not checked (every 2nd)
    mine = ids.roll(rank, 0)                                    # call 2, checked: another order of the rows
    try:
        gm(input_ids=mine, labels=mine)
    except InputMismatchError as e:
        out["order"] = str(e)
    gm.eval()                                                   # eval: a new signature, checked at once
    try:
        with torch.no_grad():
            gm(input_ids=ids[:1 + rank])
    except InputMismatchError as e:
        out["shape"] = str(e)
    return out


def test_inputs_that_differ_between_tensor_parallel_ranks_are_named(dist2):
    for r in dist2.run(_input_check_case, timeout=240):
        assert "'input_ids'" in r["order"] and "ranks [0, 1]" in r["order"] and "data_parallel_rank" in r["order"]
        assert "int64[1, 8]" in r["shape"] and "int64[2, 8]" in r["shape"], r["shape"]


def _norm_case(rank, p):
    import autoshard
    from autoshard.distributed import init_process_group
    init_process_group(p // 2 if p == 4 else p)
    tp = p // 2 if p == 4 else p
    model, gm, ids = _tiny(rank, tp)
    ref = hf_trainer.build()
    ref(input_ids=ids, labels=ids).loss.backward()
    want = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()])
    with gm.no_sync():                                  # accumulate without the data-parallel average
        gm(input_ids=ids, labels=ids).loss.backward()
    gm(input_ids=ids, labels=ids).loss.backward()       # then average the sum
    local = torch.nn.utils.get_total_norm([q.grad for q in gm.parameters()])
    norm = gm.clip_grad_norm_(1e-3)
    after = gm.grad_norm()
    full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters()})
    return dict(want=float(want) * 2, norm=float(norm), local=float(local), after=float(after),
                same=all(torch.allclose(full[k], q.grad * 2 * 1e-3 / (float(want) * 2 + 1e-6), atol=1e-7)
                         for k, q in ref.named_parameters()))


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_grad_norm_over_every_shard_equals_one_process(world, dist2, dist4):
    pool = dist2 if world == 2 else dist4
    for r in pool.run(_norm_case, timeout=240):
        assert abs(r["norm"] - r["want"]) < 1e-4 * r["want"], r
        assert abs(r["local"] - r["want"]) > 1e-3 * r["want"], "a rank's local norm misses the other shards"
        assert abs(r["after"] - 1e-3) < 1e-6 and r["same"], r


# ----------------------------------------------------------------------------- as a user launches it

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, nproc, *args, timeout=600):
    """`python -m torch.distributed.run --nproc_per_node nproc script *args` (a free port, one
    thread per rank); a failing rank's traceback is raised."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), script, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        text = done.stderr
        start = text.find("Traceback")
        raise AssertionError(f"{' '.join(cmd)} failed:\n{text[start:start + 6000] if start >= 0 else text[-6000:]}")
    return done


@pytest.mark.slow
def test_trainer_under_torchrun_tp2_dp2(tmp_path):
    script = os.path.join(HERE, "scripts", "hf_trainer.py")
    subprocess.run([sys.executable, script, "--tp", "1", "--batch", "4", "--out", str(tmp_path / "one")],
                   check=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)), capture_output=True,
                   timeout=600)
    os.makedirs(tmp_path / "four")
    torchrun(script, 4, "--tp", "2", "--batch", "2", "--out", str(tmp_path / "four"))
    ref = json.load(open(tmp_path / "one" / "rank0.json"))
    for r in range(4):
        got = json.load(open(tmp_path / "four" / f"rank{r}.json"))
        assert _close(got["losses"], ref["losses"]) and _close(got["grad_norms"], ref["grad_norms"]), (got, ref)
