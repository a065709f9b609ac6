"""Sharded checkpoints through torch.distributed.checkpoint: save at one degree, resume at another.

A GPT with tied embeddings and a fused q/k/v Linear (strided S(0)x3 shards), AdamW, 2 steps, saved
at degree 4, 2, 2 TP x 2 DP (DDP) and unsharded; resumed at 2, 4, 4 x 1 and unsharded: the resumed
third step equals 3 uninterrupted single-process steps (fp32, 1e-5 relative). PyTorch's
dcp_to_torch_save of a sharded checkpoint equals the single-process state_dict() key for key, and
PyTorch's torch_save_to_dcp output of an unsharded model resumes at degree 2; Hugging Face GPT-2's
Conv1D c_attn (q/k/v fused along dim 1) converts and loads back; SGD momentum round-trips. Bad input (another
model's checkpoint, unreadable / partial directories, a failed save) raises and changes nothing.
The ranks of a pool share one temporary directory, passed from the parent.
"""
import contextlib
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import autoshard
from autoshard import distributed as ad
from autoshard.checkpoint import CheckpointError
from models import GPT
from refs import close_to_scale as _close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, H, SEQ, LR = 512, 32, 32, 3e-3


# ----------------------------------------------------------------------------- model, data, reference

def _model(seed=0, vocab=VOCAB, blocks=1):
    torch.manual_seed(seed)
    return GPT(vocab=vocab, h=H, heads=4, blocks=blocks, seq=SEQ, tied=True, fused=True)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(VOCAB, (4, SEQ), generator=g), torch.randint(VOCAB, (4, SEQ), generator=g)


def _optimizer(params):
    # eps 1e-3, not 1e-8: the key bias of attention has an exactly zero gradient (softmax ignores a
    # constant per query), so it only sees rounding noise, which Adam at eps 1e-8 would blow up to
    # +-lr steps that differ between degrees. Real gradients here are >= 1e-3, so the moments still
    # decide every step (a resume that lost exp_avg, exp_avg_sq or step would not match).
    return torch.optim.AdamW(params, lr=LR, eps=1e-3, weight_decay=0.1)


def _steps(module, opt, steps, dp=1, dp_rank=0):
    """Training steps `steps` (an iterable of step numbers); a data-parallel replica takes its rows."""
    rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    for step in steps:
        idx, targets = _batch(step)
        opt.zero_grad()
        module(idx[rows], targets[rows]).backward()
        opt.step()


def _reference():
    """The single-process state_dict() after 2 and after 3 steps, and the model/optimizer at 2."""
    model = _model()
    opt = _optimizer(model.parameters())
    _steps(model, opt, range(2))
    at2 = {k: v.clone() for k, v in model.state_dict().items()}
    return model, opt, at2


def _check_full(full, expected, what, ordered=True):
    """Every key and value of `expected` (in its order unless ordered=False: DCP's files list keys
    in the order the ranks wrote them)."""
    keys = list if ordered else sorted
    assert keys(full) == keys(expected), f"{what}: keys {list(full)} != {list(expected)}"
    for key, value in expected.items():
        _close(full[key], value, f"{what}: {key}")
    return True


# ----------------------------------------------------------------------------- rank cases

def _parallel(tp, seed):
    """(gm, training module, optimizer, dp, dp_rank) at tensor-parallel degree tp (DDP across groups)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    ad.init_process_group(tp)
    gm = autoshard.parallelize(_model(seed), tp, _batch(0))
    dp, dp_rank = dist.get_world_size() // tp, dist.get_rank() // tp
    train = gm
    if dp > 1:
        autoshard.register_ddp_parameters_to_ignore(gm)
        train = DDP(gm, process_group=ad.get_data_parallel_group())
    return gm, train, _optimizer(train.parameters()), dp, dp_rank


def _train_and_save(rank, world, tp, path, plain):
    """2 steps at degree tp, then save (plain dcp.save, or autoshard.checkpoint.save)."""
    gm, train, opt, dp, dp_rank = _parallel(tp, seed=0)
    assert any(layout.chunks == 3 for layout in gm._autoshard_layouts.values() if layout is not None)
    _steps(train, opt, range(2), dp, dp_rank)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    if plain:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    else:
        autoshard.checkpoint.save({"model": msd, "optim": osd}, path)
    return True


def _resume(rank, world, tp, path, how):
    """A differently initialised model at degree tp, a fresh optimizer, load (`how`: plain dcp.load,
    dcp.load with autoshard's reader, or autoshard.checkpoint.load), one more step: the full state
    dict after it (to compare with 3 uninterrupted steps)."""
    gm, train, opt, dp, dp_rank = _parallel(tp, seed=1)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    sd = {"model": msd, "optim": osd}
    if how == "dcp":
        dcp.load(sd, checkpoint_id=path)
    elif how == "reader":
        dcp.load(sd, storage_reader=autoshard.checkpoint.FileSystemReader(path, block_bytes=1024))
    else:
        autoshard.checkpoint.load(sd, path)
    autoshard.checkpoint.set_state_dict(gm, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _steps(train, opt, [2], dp, dp_rank)
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    return full if rank == 0 else None


def _snapshot(gm, opt):
    out = {k: v.clone() for k, v in gm.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{id(p)}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _unchanged(before, after):
    assert before.keys() == after.keys()
    return all(torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
               for k in before)


def _bad_inputs(rank, world, good, tmp):
    """Another model's checkpoint, unreadable and partial directories, a failed save: each raises a
    CheckpointError naming what is wrong, and nothing in the model or optimizer changes."""
    import torch.distributed as dist
    gm, train, opt, _, _ = _parallel(2, seed=1)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    sd = {"model": msd, "optim": osd}
    before = _snapshot(gm, opt)

    # another model: two blocks (extra keys) / a smaller vocabulary (global shapes differ)
    other = os.path.join(tmp, "other")
    gm2 = autoshard.parallelize(_model(2, blocks=2, vocab=2 * VOCAB), 2, _batch(0))
    opt2 = _optimizer(gm2.parameters())
    m2, o2 = autoshard.checkpoint.get_state_dict(gm2, opt2)
    autoshard.checkpoint.save({"model": m2, "optim": o2}, other)
    with pytest.raises(CheckpointError) as err:
        autoshard.checkpoint.load(sd, other)
    text = str(err.value)
    assert "in the checkpoint but not in the model: ['model.blocks.1.attn.o.bias'" in text, text
    assert f"'model.wte.weight': checkpoint ({2 * VOCAB}, {H}), model ({VOCAB}, {H})" in text, text
    with pytest.raises(CheckpointException, match=r"'model.head.weight': checkpoint \(1024, 32\), model \(512, 32\)"):
        dcp.load(sd, checkpoint_id=other, planner=autoshard.checkpoint.LoadPlanner())   # DCP wraps the error
    # a checkpoint that lacks keys the model asks for (model saved without its optimizer)
    no_optim = os.path.join(tmp, "no_optim")
    autoshard.checkpoint.save({"model": m2}, no_optim)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['optim.param_groups"):
        autoshard.checkpoint.load({"model": msd, "optim": osd}, no_optim)
    # set_state_dict with another model's (full) tensors: named, and refused before any copy
    full_other = {k: torch.zeros(v.shape) for k, v in _model(3, vocab=2 * VOCAB).state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'wte.weight' has global shape \(1024, 32\), the model's is "
                                              r"\(512, 32\)"):
        autoshard.checkpoint.set_state_dict(gm, model_state_dict=full_other)
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.0.attn.qkv.weight'\]"):
        autoshard.checkpoint.set_state_dict(
            gm, model_state_dict={k: v for k, v in full_other.items() if k != "blocks.0.attn.qkv.weight"})

    # unreadable and partial directories
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        autoshard.checkpoint.load(sd, os.path.join(tmp, "nowhere"))
    empty = os.path.join(tmp, f"empty{rank}")
    os.makedirs(empty, exist_ok=True)
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint \(no .metadata file"):
        autoshard.checkpoint.load(sd, empty)
    garbage = os.path.join(tmp, f"garbage{rank}")
    os.makedirs(garbage, exist_ok=True)
    with open(os.path.join(garbage, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"garbage\d/.metadata cannot be read"):
        autoshard.checkpoint.load(sd, garbage)
    partial = os.path.join(tmp, "partial")
    if rank == 0:
        shutil.copytree(good, partial)
        victim = sorted(f for f in os.listdir(partial) if f.endswith(".distcp"))[-1]
        with open(os.path.join(partial, victim), "r+b") as f:
            f.truncate(100)
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"partial checkpoint: __\d+_0.distcp is 100 bytes, .metadata needs"):
        autoshard.checkpoint.load(sd, partial)

    # a save that fails on one rank raises on every rank and leaves the previous checkpoint whole
    target = os.path.join(tmp, "target")
    autoshard.checkpoint.save(sd, target)
    listing = sorted(os.listdir(target))
    with _fail_on(rank), pytest.raises(CheckpointError, match=r"target failed; it was left as it was. "
                                                             r"rank 1: OSError: disk full"):
        autoshard.checkpoint.save(sd, target)
    dist.barrier()
    assert sorted(os.listdir(target)) == listing
    assert not any(n.startswith(".target") for n in os.listdir(tmp)), os.listdir(tmp)
    # plain dcp.save fails the same way into a fresh directory, and writes no .metadata
    fresh = os.path.join(tmp, "fresh")
    with _fail_on(rank), pytest.raises(CheckpointException, match="disk full"):
        dcp.save(sd, checkpoint_id=fresh)
    dist.barrier()
    assert not os.path.exists(os.path.join(fresh, ".metadata"))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        autoshard.checkpoint.load(sd, fresh)

    return _unchanged(before, _snapshot(gm, opt))


def _fail_on(rank):
    """Rank 1's storage writer fails (a full disk); the others write normally."""
    from torch.distributed.checkpoint import FileSystemWriter
    if rank != 1:
        return contextlib.nullcontext()
    return mock.patch.object(FileSystemWriter, "write_data", side_effect=OSError("disk full"))


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def run(tmp_path_factory, dist2, dist4):
    """Save at 2 (plain dcp), 4, 2 TP x 2 DP, and unsharded (this process, and through torch.save +
    PyTorch's torch_save_to_dcp); the reference after 2 and 3 steps; the shared directory."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    paths = {k: os.path.join(tmp, k) for k in ("p2", "p4", "p2x2", "p1", "p1_torch")}
    assert all(dist2.run(_train_and_save, 2, paths["p2"], True, timeout=120))
    assert all(dist4.run(_train_and_save, 4, paths["p4"], False, timeout=120))
    assert all(dist4.run(_train_and_save, 2, paths["p2x2"], True, timeout=120))
    model, opt, at2 = _reference()
    msd, osd = autoshard.checkpoint.get_state_dict(model, opt)           # no process group: degree 1
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=paths["p1"])
    torch.save({"model": model.state_dict(), "optim": osd}, os.path.join(tmp, "p1.pt"))
    torch_save_to_dcp(os.path.join(tmp, "p1.pt"), paths["p1_torch"])
    _steps(model, opt, [2])
    return {"tmp": tmp, "paths": paths, "at2": at2, "at3": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("saved,world,tp,how", [("p4", 2, 2, "dcp"), ("p2", 4, 4, "autoshard"),
                                                 ("p2x2", 4, 4, "dcp"), ("p1", 2, 2, "autoshard"),
                                                 ("p1_torch", 2, 2, "reader")])
def test_resume_at_another_degree_equals_uninterrupted_training(run, saved, world, tp, how, request):
    pool = request.getfixturevalue(f"dist{world}")
    full = pool.run(_resume, tp, run["paths"][saved], how, timeout=120)[0]
    assert _check_full(full, run["at3"], f"saved at {saved}, resumed at {tp}x{world // tp}")


def test_sharded_checkpoint_into_the_unsharded_model(run):
    model = _model(seed=1)
    opt = _optimizer(model.parameters())
    msd, osd = autoshard.checkpoint.get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    autoshard.checkpoint.load(sd, run["paths"]["p2"])
    autoshard.checkpoint.set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert model.head.weight is model.wte.weight
    _steps(model, opt, [2])
    _check_full(model.state_dict(), run["at3"], "saved at 2, resumed unsharded")


@pytest.mark.parametrize("saved", ["p2", "p4", "p2x2"])
def test_dcp_to_torch_save_gives_the_global_state_dict(run, saved):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(run["tmp"], f"{saved}.pt")
    dcp_to_torch_save(run["paths"][saved], out)
    full = torch.load(out, weights_only=False)
    _check_full(full["model"], run["at2"], f"dcp_to_torch_save of the checkpoint saved at {saved}", ordered=False)
    model = _model(seed=1)
    model.load_state_dict(full["model"])                       # the unsharded model accepts it
    assert set(full["optim"]["state"]) == {n for n, _ in model.named_parameters()}
    assert full["optim"]["state"]["blocks.0.attn.qkv.weight"]["exp_avg"].shape == (3 * H, H)


def test_convert_cli_both_ways(run):
    out, back = os.path.join(run["tmp"], "cli.pt"), os.path.join(run["tmp"], "cli_dcp")
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "autoshard", "convert"]
    r = subprocess.run(cmd + [run["paths"]["p4"], out], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + [out, back], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    model = _model(seed=1)
    msd, _ = autoshard.checkpoint.get_state_dict(model)
    autoshard.checkpoint.load({"model": msd}, back)
    _check_full(model.state_dict(), run["at2"], "convert to torch.save and back")
    r = subprocess.run(cmd + [os.path.join(run["tmp"], "nowhere"), out], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "nowhere: no such" in r.stderr, r.stderr


def test_bad_checkpoints_are_refused_and_change_nothing(run, dist2):
    bad = os.path.join(run["tmp"], "bad")
    os.makedirs(bad)
    assert all(dist2.run(_bad_inputs, run["paths"]["p2"], bad, timeout=180))


def test_sgd_momentum_and_partly_initialised_state_round_trip(tmp_path):
    """SGD's momentum buffers are saved and loaded by parameter name; initialising a fresh
    optimizer's state moves no parameter and leaves state that already exists alone."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _steps(model, opt, range(2))
    msd, osd = autoshard.checkpoint.get_state_dict(model, opt)
    autoshard.checkpoint.save({"model": msd, "optim": osd}, tmp_path / "sgd")
    resumed = _model(seed=1)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in resumed.state_dict().items()}
    msd2, osd2 = autoshard.checkpoint.get_state_dict(resumed, opt2)
    _check_full(resumed.state_dict(), before, "after initialising the optimizer state")
    assert set(osd2["state"]["wte.weight"]) == {"momentum_buffer"}
    sd = {"model": msd2, "optim": osd2}
    autoshard.checkpoint.load(sd, tmp_path / "sgd")
    autoshard.checkpoint.set_state_dict(resumed, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for step_model, step_opt in ((model, opt), (resumed, opt2)):
        _steps(step_model, step_opt, [2])
    _check_full(resumed.state_dict(), model.state_dict(), "SGD with momentum resumed")
    # one parameter without state: only it is initialised, the others' buffers stay as they are
    p = opt2.param_groups[0]["params"][1]
    kept = {id(q): st["momentum_buffer"].clone() for q, st in opt2.state.items() if q is not p}
    del opt2.state[p]
    autoshard.checkpoint.get_state_dict(resumed, opt2)
    assert torch.equal(opt2.state[p]["momentum_buffer"], torch.zeros_like(p))
    assert all(torch.equal(opt2.state[q]["momentum_buffer"], kept[id(q)]) for q in opt2.state if q is not p)


def _gpt2_save(rank, world, path):
    """Hugging Face GPT-2 (Conv1D c_attn: q/k/v fused along dim 1 of an [in, out] weight; lm_head
    tied to wte) captured with torch.export, parallelized at 2, saved, zeroed and loaded back."""
    from hf_models import gpt2
    model, kwargs = gpt2(n_layer=1)
    gm = autoshard.parallelize(model, world, kwargs, tracer="export")
    layout = autoshard.layouts(gm)["transformer.h.0.attn.c_attn.weight"]
    assert layout == autoshard.Shard(1, 3), layout
    msd, _ = autoshard.checkpoint.get_state_dict(gm)
    autoshard.checkpoint.save({"model": msd}, path)
    # and back: the c_attn boxes are cut along dim 1, so DCP fills copies that set_state_dict copies in
    before = autoshard.collect_state_dict(gm, gm.state_dict())
    with torch.no_grad():
        for p in gm.parameters():
            p.zero_()
    msd, _ = autoshard.checkpoint.get_state_dict(gm)
    sd = {"model": msd}
    dcp.load(sd, checkpoint_id=path)
    autoshard.checkpoint.set_state_dict(gm, model_state_dict=sd["model"])
    return _check_full(autoshard.collect_state_dict(gm, gm.state_dict()), before, "GPT-2 saved and loaded at 2")


def test_gpt2_fused_conv1d_checkpoint_converts_to_the_unsharded_state_dict(run, dist2):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from hf_models import gpt2
    path, out = os.path.join(run["tmp"], "gpt2"), os.path.join(run["tmp"], "gpt2.pt")
    assert all(dist2.run(_gpt2_save, path, timeout=180))
    dcp_to_torch_save(path, out)
    model, _ = gpt2(n_layer=1)
    expected = model.state_dict()
    full = torch.load(out, weights_only=False)["model"]
    _check_full(full, expected, "GPT-2 saved at 2, converted", ordered=False)
    fresh, _ = gpt2(n_layer=1, seed=1)
    fresh.load_state_dict(full)
    _check_full(fresh.state_dict(), expected, "GPT-2 checkpoint loaded into the unsharded model")


# ----------------------------------------------------------------------------- reading only a rank's box

@pytest.mark.parametrize("seed", range(4))
def test_reader_copies_exactly_the_requested_box_a_block_at_a_time(tmp_path, seed):
    """Random shapes, dtypes, saved views and boxes, into destinations of another dtype and
    non-contiguous ones: the reader's box equals narrowing the saved tensor (nothing around it is
    written), no block exceeds block_bytes or the box (or one element), and a box of whole rows
    reads its own bytes and nothing else."""
    from autoshard.io.checkpoint.reader import FileSystemReader as Reader, _locate
    g = torch.Generator().manual_seed(seed)
    import torch.utils.serialization as serialization
    # float8 and uint16 are pickled by _rebuild_tensor_v3 (an untyped storage, the dtype an argument)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.float8_e4m3fn,
              torch.uint16]
    tensors = {}
    for i in range(14):
        shape = tuple(int(n) for n in torch.randint(1, 9, (int(torch.randint(0, 4, (1,), generator=g)),),
                                                     generator=g))
        dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=g))]
        base = (torch.randn((3,) + shape, generator=g) * 10)
        base = (base.abs().to(torch.int32) if dtype == torch.uint16 else base).to(dtype)
        view = base[1]                                  # a view into a larger storage
        tensors[f"t{i}"] = view.transpose(0, -1) if i % 3 == 2 and view.dim() > 1 else view   # saved transposed
    tensors["transposed"] = torch.randn(5, 7, generator=g).t()
    tensors["channels_last"] = torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)
    path = str(tmp_path / "ckpt")
    crc = serialization.config.save.compute_crc32
    serialization.config.save.compute_crc32 = seed % 2 == 0      # archives without CRCs read in place too
    try:
        with pytest.warns(UserWarning):
            dcp.save(tensors, checkpoint_id=path, no_dist=True)
    finally:
        serialization.config.save.compute_crc32 = crc

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    checked, orders = 0, []
    for index, info in storage.items():
        saved = tensors[index.fqn]
        with open(os.path.join(path, info.relative_path), "rb", buffering=0) as f:
            place = _locate(Reader(path).item(f, info))
            orders.append(place.order if place is not None else ())
            assert place is not None and place.dtype == saved.dtype, index.fqn
            assert place.size == tuple(saved.shape[d] for d in place.order)
            for _ in range(5):
                offsets = [int(torch.randint(n, (1,), generator=g)) for n in saved.shape]
                lengths = [int(torch.randint(1, n - o + 1, (1,), generator=g)) for n, o in zip(saved.shape, offsets)]
                whole_rows = saved.dim() > 0 and torch.rand(1, generator=g).item() < 0.5
                if whole_rows:
                    offsets[1:], lengths[1:] = [0] * (saved.dim() - 1), list(saved.shape[1:])
                block = int(torch.randint(1, 64, (1,), generator=g))
                reader = Reader(path, block_bytes=block)
                item = reader.item(f, info)                    # no .checksums: read as it is
                # the destination may have another dtype (a model in float64) and, as DCP's
                # narrowed destinations do, may be a non-contiguous view of a larger tensor
                dtype = torch.float64 if saved.is_floating_point() and seed % 2 else saved.dtype
                outer = torch.full(lengths[:-1] + [lengths[-1] + 3] if lengths else [], 7, dtype=dtype)
                target = outer.narrow(-1, 1, lengths[-1]) if lengths else outer
                before = outer.clone()
                reader._copy(item, place, tuple(offsets), target)
                expected = saved
                for d, (o, n) in enumerate(zip(offsets, lengths)):
                    expected = expected.narrow(d, o, n)
                assert torch.equal(bits(target), bits(expected.to(dtype))), (index.fqn, offsets, lengths, block)
                if lengths:
                    around = [(0, 1), (lengths[-1] + 1, 2)]
                    assert all(torch.equal(bits(outer.narrow(-1, o, n)), bits(before.narrow(-1, o, n)))
                               for o, n in around)
                box = target.numel() * saved.element_size()
                assert item.largest <= min(block, box) or item.largest == saved.element_size()
                if whole_rows and place.order == tuple(range(saved.dim())):
                    assert item.bytes_read == target.numel() * saved.element_size()
                checked += 1
    assert checked == 5 * len(tensors)
    assert any(p != tuple(sorted(p)) for p in orders), "no transposed save was read in place"


def _load_unsharded_a_block_at_a_time(rank, world, path):
    """Load the unsharded checkpoint at degree `world` through dcp.load with a 512-byte block:
    (the full model state, the largest block and the bytes this rank read)."""
    gm, train, opt, dp, dp_rank = _parallel(world, seed=1)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    sd = {"model": msd, "optim": osd}
    reader = autoshard.checkpoint.FileSystemReader(path, block_bytes=512)
    dcp.load(sd, storage_reader=reader)
    autoshard.checkpoint.set_state_dict(gm, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    return (full if rank == 0 else None), reader.largest_block, reader.bytes_read, reader.fallbacks


def test_unsharded_checkpoint_loads_at_4_without_a_full_tensor(run, dist4):
    """Every rank of degree 4 reads the unsharded checkpoint in blocks of at most 512 bytes (the
    largest saved tensor is the 64 KiB embedding) and less than half the checkpoint (0.28 of it:
    replicated tensors whole, row shards their rows, column shards whole rows a block at a time)."""
    path = run["paths"]["p1"]
    results = dist4.run(_load_unsharded_a_block_at_a_time, path, timeout=120)
    _check_full(results[0][0], run["at2"], "unsharded checkpoint loaded at 4")
    saved = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    for rank, (_, largest, read, fallbacks) in enumerate(results):
        assert fallbacks == 0, (rank, fallbacks)
        assert 0 < largest <= 512, (rank, largest)
        assert read < saved / 2, (rank, read, saved)


def test_reader_leaves_what_it_cannot_read_to_pytorch_and_says_so(tmp_path):
    tensors = {"a": torch.randn(6, 4), "b": torch.arange(5), "obj": {"lr": 0.1}}
    path = str(tmp_path / "ckpt")
    with pytest.warns(UserWarning):
        dcp.save(tensors, checkpoint_id=path, no_dist=True)
    into = {"a": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.long), "obj": {"lr": 0.0}}
    reader = autoshard.checkpoint.FileSystemReader(path)
    with mock.patch("autoshard.io.checkpoint.reader._locate", return_value=None), \
            pytest.warns(UserWarning, match=r"2 saved tensor\(s\) read whole by PyTorch's reader.*a, b"):
        dcp.load(into, storage_reader=reader, no_dist=True)
    assert torch.equal(into["a"], tensors["a"]) and torch.equal(into["b"], tensors["b"]) and into["obj"] == {"lr": 0.1}
    assert reader.fallbacks == 2 and reader.bytes_read == 0
    with pytest.raises(ValueError, match="block_bytes must be at least 1"):
        autoshard.checkpoint.FileSystemReader(path, block_bytes=0)
