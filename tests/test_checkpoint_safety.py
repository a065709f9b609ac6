"""A checkpoint from elsewhere never runs code: `.metadata` and pickled items are read through allowlists.

A small GPT and its AdamW state are saved with `autoshard.checkpoint.save`; copies of it are
altered as an attacker would: (a) `.metadata` replaced by a pickle whose load calls a function
(`pathlib.Path.touch`, or `io.open`) that creates a marker file, bare or hidden inside a real
Metadata; (b) the pickled item `optim.param_groups.0.lr` replaced by a `torch.save` archive whose
load creates the marker, `.metadata` pointing at it (offset and length), `.checksums` removed (as
a plain DCP checkpoint has none). `autoshard.checkpoint.load` at 1 process and at 2 ranks, DCP's
own `dcp.load` through autoshard's reader or with autoshard's LoadPlanner, `verify` (the function
and `python -m autoshard verify`), and both converters refuse each with the file, key and class
named, and the marker never appears; with `trust_checkpoint=True` the altered item's payload
does run (the payloads are real). A checkpoint of plain `dcp.save` with optimizer state and
extras of plain types still loads exactly; an extra of a class of this module is refused by name
unless trusted (or allowed with `torch.serialization.add_safe_globals`); `verify` also checks
that each item is what `.metadata` says.
"""
import io
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

import autoshard
import autoshard.checkpoint as ckpt
from autoshard.checkpoint import CheckpointError
from autoshard.io.checkpoint.safe import METADATA_GLOBALS, read_metadata_file
from models import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR_KEY = "optim.param_groups.0.lr"


# ----------------------------------------------------------------------------- payloads and a class of our own

class Touch:
    """Unpickled, creates the file `path` (what `os.system(...)` would be in an attack)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


class Opens:
    """Unpickled, creates the file `path` through builtins.open."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class Custom:
    """A user's own extra: harmless, but not a class torch's weights-only unpickler knows."""

    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return isinstance(other, Custom) and other.n == self.n


# ----------------------------------------------------------------------------- checkpoints

def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(vocab=128, h=32, heads=4, blocks=1, seq=16, tied=True, fused=True)


def _trained():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()
    opt.step()
    return model, opt


def _fresh_state(extra=None):
    model = _model(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = ckpt.get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    if extra is not None:
        sd["extra"] = extra
    return sd


def _metadata(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)                           # the test's own files: trusted


def _write_metadata(path, md):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _replace_item(src, dst, fqn, obj):
    """A copy of checkpoint `src` whose item `fqn` is the torch.save archive of `obj`, appended to
    its file, `.metadata` pointing at it, `.checksums` removed."""
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, ".checksums"))
    md = _metadata(dst)
    (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == fqn]
    buf = io.BytesIO()
    torch.save(obj, buf)
    file = os.path.join(dst, info.relative_path)
    offset = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buf.getvalue()))
    _write_metadata(dst, md)
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("safety")
    model, opt = _trained()
    msd, osd = ckpt.get_state_dict(model, opt)
    good = str(tmp / "good")
    ckpt.save({"model": msd, "optim": osd}, good)
    out = {"tmp": tmp, "good": good, "model": {k: v.clone() for k, v in model.state_dict().items()}}

    bare = str(tmp / "meta_bare")                     # (a) .metadata: a bare payload
    shutil.copytree(good, bare)
    _write_metadata(bare, Touch(tmp / "MARKER_meta_bare"))
    hidden = str(tmp / "meta_hidden")                 # (a') a real Metadata carrying a payload
    shutil.copytree(good, hidden)
    md = _metadata(hidden)
    md.storage_meta.modules = ["x", Opens(tmp / "MARKER_meta_hidden")]
    _write_metadata(hidden, md)
    _replace_item(good, str(tmp / "item"), LR_KEY, Touch(tmp / "MARKER_item"))    # (b) a pickled item
    out["cases"] = {"meta_bare": (bare, "pathlib.Path.touch", tmp / "MARKER_meta_bare"),
                    "meta_hidden": (hidden, f"{open.__module__}.open", tmp / "MARKER_meta_hidden"),
                    "item": (str(tmp / "item"), "builtins.getattr, pathlib.Path", tmp / "MARKER_item")}
    return out


def _markers(ckpts):
    return sorted(p.name for p in ckpts["tmp"].iterdir() if p.name.startswith("MARKER"))


def _expect(case, text, path, cls):
    """The error names the file, the class and (for an item) the key."""
    if case == "item":
        assert f"{path}/__0_0.distcp: '{LR_KEY}': the pickled item needs {cls}" in text, text
    else:
        assert f"{path}/.metadata cannot be read: it asks to build {cls}" in text, text
    assert "trust_checkpoint=True" in text, text


CASES = ["meta_bare", "meta_hidden", "item"]


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("case", CASES)
def test_an_altered_checkpoint_is_refused_by_name_and_its_payload_never_runs(ckpts, case):
    path, cls, marker = ckpts["cases"][case]
    sd = _fresh_state()
    lr_before = sd["optim"]["param_groups"][0]["lr"]
    with pytest.raises(CheckpointError) as err:
        ckpt.load(sd, path)
    _expect(case, str(err.value), path, cls)
    assert sd["optim"]["param_groups"][0]["lr"] == lr_before
    # DCP's own load through autoshard's reader (PyTorch's planner), and autoshard's planner with
    # PyTorch's reader (for the item: the metadata reader there is PyTorch's, unsafe by design)
    with pytest.raises(BaseException, match=cls.replace(".", r"\.")):
        dcp.load(_fresh_state(), storage_reader=ckpt.FileSystemReader(path), no_dist=True)
    if case == "item":
        with pytest.raises(BaseException, match=rf"'{LR_KEY}': the pickled item needs builtins\.getattr, pathlib\.Path"):
            dcp.load(_fresh_state(), checkpoint_id=path, planner=ckpt.LoadPlanner(), no_dist=True)
    # verify reports it as a problem, naming the class
    report = ckpt.verify(path)
    assert not report.ok and any(cls in p for p in report.problems), str(report)
    # converting it refuses, and writes nothing
    out = str(ckpts["tmp"] / f"{case}.pt")
    with pytest.raises(CheckpointError, match=cls.replace(".", r"\.")):
        ckpt.dcp_to_torch_save(path, out)
    assert not os.path.exists(out)
    assert not marker.exists() and _markers(ckpts) == []


def test_verify_and_convert_from_the_command_line_refuse_without_running_anything(ckpts):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for case in CASES:
        path, cls, marker = ckpts["cases"][case]
        r = subprocess.run([sys.executable, "-m", "autoshard", "verify", path], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "problem: " in r.stdout and cls in r.stdout, r.stdout + r.stderr
        assert "1 problem(s)" in r.stdout, r.stdout
        out = str(ckpts["tmp"] / f"cli_{case}.pt")
        r = subprocess.run([sys.executable, "-m", "autoshard", "convert", path, out], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and cls in r.stderr and not os.path.exists(out), r.stdout + r.stderr
        assert not marker.exists()
    assert _markers(ckpts) == []


def test_the_payloads_are_real_trust_checkpoint_runs_them(ckpts, tmp_path):
    """trust_checkpoint=True reads as PyTorch does: the altered item's payload runs (in a copy
    with its own marker), and a bare payload in `.metadata` runs too, then is no Metadata."""
    marker = tmp_path / "MARKER_trusted"
    path = _replace_item(ckpts["good"], str(tmp_path / "item"), LR_KEY, Touch(marker))
    sd = _fresh_state()
    ckpt.load(sd, path, trust_checkpoint=True)
    assert marker.exists()
    assert sd["optim"]["param_groups"][0]["lr"] is None         # Path.touch returns None
    meta = tmp_path / "MARKER_trusted_meta"
    bare = str(tmp_path / "bare")
    shutil.copytree(ckpts["good"], bare)
    _write_metadata(bare, Touch(meta))
    with pytest.raises(CheckpointError, match="not DCP's Metadata"):
        ckpt.load(_fresh_state(), bare, trust_checkpoint=True)
    assert meta.exists()


def test_the_good_checkpoint_loads_verifies_and_converts(ckpts, tmp_path):
    sd = _fresh_state()
    ckpt.load(sd, ckpts["good"])
    assert all(torch.equal(sd["model"][k], v) for k, v in ckpts["model"].items())
    assert sd["optim"]["param_groups"][0]["lr"] == 1e-2
    report = ckpt.verify(ckpts["good"])
    assert report.ok and not report.notes, str(report)
    out = str(tmp_path / "full.pt")
    ckpt.dcp_to_torch_save(ckpts["good"], out)
    full = torch.load(out, weights_only=True)
    assert all(torch.equal(full["model"][k], v) for k, v in ckpts["model"].items())
    assert full["optim"]["param_groups"][0]["lr"] == 1e-2
    back = str(tmp_path / "back")
    ckpt.torch_save_to_dcp(out, back)
    sd = _fresh_state()
    ckpt.load(sd, back)
    assert all(torch.equal(sd["model"][k], v) for k, v in ckpts["model"].items())


def test_torch_save_to_dcp_refuses_a_pickled_payload(tmp_path):
    marker = tmp_path / "MARKER_torch_save"
    src = str(tmp_path / "evil.pt")
    torch.save({"model": {"w": torch.ones(2)}, "x": Touch(marker)}, src)
    with pytest.raises(CheckpointError, match=r"evil.pt: the torch.save file needs builtins\.getattr, pathlib\.Path"):
        ckpt.torch_save_to_dcp(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") and not marker.exists()
    r = subprocess.run([sys.executable, "-m", "autoshard", "convert", src, str(tmp_path / "out")],
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "builtins.getattr, pathlib.Path" in r.stderr and not marker.exists(), r.stderr


# ----------------------------------------------------------------------------- plain DCP, extras, classes of one's own

EXTRAS = {"step": 7, "loss": 2.5, "name": "run-1", "seen": [1, 2, 3], "flags": (True, False, None),
          "cfg": {"a": 1, "b": [0.5, "x"], "c": {"d": "e"}}, "t": torch.arange(4.0), "ts": [torch.ones(2), 3]}


def test_a_plain_dcp_checkpoint_with_optimizer_state_and_plain_extras_loads(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    path = str(tmp_path / "plain")
    dcp.save({"model": msd, "optim": osd, "extra": EXTRAS}, checkpoint_id=path, no_dist=True)
    fresh = _model(seed=1)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    fopt.step()
    fmsd, fosd = get_state_dict(fresh, fopt)
    extra = {"step": 0, "loss": 0.0, "name": "", "seen": [], "flags": (), "cfg": {"a": 0, "b": [], "c": {"d": ""}},
             "t": torch.zeros(4), "ts": [torch.zeros(2), 0]}
    sd = {"model": fmsd, "optim": fosd, "extra": extra}
    with pytest.warns(UserWarning, match="no .checksums"):
        ckpt.load(sd, path)
    assert all(torch.equal(sd["model"][k], v) for k, v in msd.items())
    for name, state in osd["state"].items():
        assert all(torch.equal(sd["optim"]["state"][name][k], v) for k, v in state.items()), name
    assert sd["optim"]["param_groups"] == osd["param_groups"]
    got = sd["extra"]
    assert torch.equal(got.pop("t"), EXTRAS["t"])
    ts = got.pop("ts")
    assert torch.equal(ts[0], torch.ones(2)) and ts[1] == 3
    assert got == {k: v for k, v in EXTRAS.items() if k not in ("t", "ts")}
    assert ckpt.verify(path).ok


def test_an_extra_of_ones_own_class_is_refused_by_name_unless_trusted(tmp_path):
    model, opt = _trained()
    msd, osd = ckpt.get_state_dict(model, opt)
    path = str(tmp_path / "custom")
    ckpt.save({"model": msd, "optim": osd, "extra": {"mine": Custom(3), "step": 4}}, path)
    sd = _fresh_state({"mine": None, "step": 0})
    with pytest.raises(CheckpointError, match=r"'extra.mine': the pickled item needs "
                                              rf"{Custom.__module__}\.Custom, which autoshard does not unpickle"):
        ckpt.load(sd, path)
    report = ckpt.verify(path)
    assert not report.ok and f"{Custom.__module__}.Custom" in report.problems[0], str(report)
    ckpt.load(sd, path, trust_checkpoint=True)
    assert sd["extra"] == {"mine": Custom(3), "step": 4}
    report = ckpt.verify(path, trust_checkpoint=True)
    assert report.ok and any(f"{Custom.__module__}.Custom (not unpickled; trusted)" in n for n in report.notes)
    out = str(tmp_path / "custom.pt")
    ckpt.dcp_to_torch_save(path, out, trust_checkpoint=True)
    assert torch.load(out, weights_only=False)["extra"]["mine"] == Custom(3)
    sd = _fresh_state({"mine": None, "step": 0})                # torch's own allowlist is honoured
    with torch.serialization.safe_globals([Custom]):
        ckpt.load(sd, path)
    assert sd["extra"]["mine"] == Custom(3)


# ----------------------------------------------------------------------------- verify: items are what .metadata says

def test_verify_checks_each_item_is_what_metadata_says(ckpts, tmp_path):
    good = ckpts["good"]
    md = _metadata(good)
    (w_index, w_info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == "model.wte.weight"]
    (b_index, b_info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == "model.ln_f.bias"]
    swapped = str(tmp_path / "swapped")                   # a tensor item pointing at another tensor's bytes
    shutil.copytree(good, swapped)
    os.remove(os.path.join(swapped, ".checksums"))
    md.storage_data[w_index] = b_info
    _write_metadata(swapped, md)
    report = ckpt.verify(swapped)
    assert any("'model.wte.weight'" in p and "holds a torch.float32 tensor of size (32,), .metadata says "
               "torch.float32 of size (128, 32)" in p for p in report.problems), str(report)
    as_bytes = _replace_item(good, str(tmp_path / "as_bytes"), "model.ln_f.bias", 0.5)    # a tensor item, pickled
    report = ckpt.verify(as_bytes)
    assert any("'model.ln_f.bias'" in p and "holds a float, .metadata says a tensor" in p
               for p in report.problems), str(report)


def test_the_metadata_allowlist_reads_every_checkpoint_here_and_nothing_else(ckpts, tmp_path):
    assert isinstance(read_metadata_file(os.path.join(ckpts["good"], ".metadata")),
                      dcp.metadata.Metadata)
    assert all(m.startswith(("torch", "pathlib", "collections", "builtins", "_codecs")) for m, _ in METADATA_GLOBALS)
    for name in ("Path.touch", "Path"):
        assert ("pathlib", name) not in METADATA_GLOBALS
    evil = tmp_path / ".metadata"
    evil.write_bytes(pickle.dumps(Touch(tmp_path / "MARKER")))
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read: it asks to build pathlib\.Path\.touch"):
        read_metadata_file(str(evil))
    assert not (tmp_path / "MARKER").exists()


# ----------------------------------------------------------------------------- two ranks

def _load_at_2(rank, world, path, marker):
    sd = _fresh_state()
    try:
        ckpt.load(sd, path)
        err = None
    except CheckpointError as e:
        err = str(e)
    return err, os.path.exists(marker)


def _save_and_load_sharded(rank, world, path):
    """Degree 2 (DTensor and ShardedTensor shards) saved and loaded back through the allowlist."""
    from autoshard import distributed as ad
    ad.init_process_group(world)
    model = _model()
    idx = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    gm = autoshard.parallelize(model, world, (idx, idx))
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    gm(idx, idx).backward()
    opt.step()
    msd, osd = ckpt.get_state_dict(gm, opt)
    ckpt.save({"model": msd, "optim": osd, "extra": {"step": 3}}, path)
    gm2 = autoshard.parallelize(_model(seed=1), world, (idx, idx))
    opt2 = torch.optim.AdamW(gm2.parameters(), lr=0.5)
    m2, o2 = ckpt.get_state_dict(gm2, opt2)
    sd = {"model": m2, "optim": o2, "extra": {"step": 0}}
    ckpt.load(sd, path)
    ckpt.set_state_dict(gm2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    same = all(torch.equal(a, b) for a, b in zip(gm.state_dict().values(), gm2.state_dict().values()))
    return same and sd["extra"]["step"] == 3 and opt2.param_groups[0]["lr"] == 1e-2


def test_at_two_ranks_every_rank_refuses_and_nothing_runs(ckpts, dist2):
    for case in CASES:
        path, cls, marker = ckpts["cases"][case]
        results = dist2.run(_load_at_2, path, str(marker), timeout=120)
        for rank, (err, ran) in enumerate(results):
            assert err is not None and not ran, (case, rank, err)
            _expect(case, err, path, cls)
    assert _markers(ckpts) == []
    sharded = str(ckpts["tmp"] / "sharded")
    assert all(dist2.run(_save_and_load_sharded, sharded, timeout=180))
    md = read_metadata_file(os.path.join(sharded, ".metadata"))
    assert any(len(m.chunks) > 1 for m in md.state_dict_metadata.values() if hasattr(m, "chunks"))
    assert ckpt.verify(sharded).ok


# ----------------------------------------------------------------------------- Hugging Face directories

def test_a_hugging_face_config_naming_its_own_code_is_refused_without_running_it(tmp_path):
    pytest.importorskip("transformers")
    from autoshard.errors import LoadError
    from autoshard.io.loading import meta_model
    marker = tmp_path / "MARKER_remote_code"
    (tmp_path / "config.json").write_text('{"model_type": "evilmodel", "auto_map": {"AutoConfig": '
                                          '"evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}')
    (tmp_path / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    with pytest.raises(LoadError, match=r"config.json names code of its own \(auto_map\), which autoshard does "
                                        r"not run"):
        meta_model(str(tmp_path))
    with pytest.raises(LoadError, match="names code of its own"):
        autoshard.from_pretrained(str(tmp_path), 1)
    assert not marker.exists()
