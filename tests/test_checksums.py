"""Checkpoints that notice corruption: `.checksums` written by autoshard.checkpoint.save, checked
on every read by autoshard.checkpoint.load / FileSystemReader and by `python -m autoshard verify`.

A GPT with AdamW state is saved at degree 2 with 2 KiB blocks (so that the 34 KB archive of
half an embedding-sized moment has a last partial block holding tensor bytes). One byte is
flipped, in a copy each, at a place found from `.metadata` and the archive's own zip headers
(not with the reader's code): inside a weight, an Adam moment, a tensor archive's `data.pkl`, a
pickled optimizer setting, and the last partial block. Loading each at degree 2 and at degree 4 raises CheckpointError naming
the file, the key and a byte range holding the flipped byte; the ranks that report it are those
whose reads cover that block; and every tensor of every rank holds, after the failed load,
either what it held before or the checkpoint's true value: no wrong value is loaded. The good
checkpoint loads bit-exactly at 2 and at 4 (saved again and compared key for key), plain DCP
reads it, and a plain `dcp.save` checkpoint loads with a one-line note.
"""
import io
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autoshard
from autoshard import distributed as ad
from autoshard.checkpoint import CheckpointError
from autoshard.io.checkpoint.checksums import CheckedItem, ItemSums, item_sums
from autoshard.cli import main as cli_main
from models import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, H, SEQ = 512, 32, 32
BLOCK = 2048                    # the checkpoint's checksum block (4 MiB by default)
SENTINEL = -7.25


# ----------------------------------------------------------------------------- model and rank cases

def _parallel(world, seed):
    ad.init_process_group(world)
    torch.manual_seed(seed)
    model = GPT(vocab=VOCAB, h=H, heads=4, blocks=1, seq=SEQ, tied=True, fused=True)
    g = torch.Generator().manual_seed(7)
    idx, targets = torch.randint(VOCAB, (4, SEQ), generator=g), torch.randint(VOCAB, (4, SEQ), generator=g)
    gm = autoshard.parallelize(model, world, (idx, targets))
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    return gm, opt, (idx, targets)


def _state(gm, opt):
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    return {"model": msd, "optim": osd}


def _local(gm, opt) -> dict:
    """Every tensor this rank holds (parameters, optimizer state), by name: what a load fills."""
    out = {f"model.{k}": v for k, v in gm.state_dict().items()}
    names = {p: n for n, p in gm.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"optim.{names[p]}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _save(rank, world, path):
    gm, opt, (idx, targets) = _parallel(world, seed=0)
    gm(idx, targets).backward()
    opt.step()
    autoshard.checkpoint.save(_state(gm, opt), path, checksum_block_bytes=BLOCK)
    return {k: str(v) for k, v in autoshard.layouts(gm).items()}


def _load_corrupted(rank, world, good, resave, cases):
    """Load the good checkpoint (and save it again into `resave`), then each corrupted copy into
    a state filled with SENTINEL: {case: (error text or None, names of tensors holding a value
    that is neither SENTINEL nor the true one)}, and the layouts."""
    gm, opt, _ = _parallel(world, seed=1)
    sd = _state(gm, opt)
    autoshard.checkpoint.load(sd, good)
    autoshard.checkpoint.set_state_dict(gm, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    autoshard.checkpoint.save(_state(gm, opt), resave)
    right = {k: v.clone() for k, v in _local(gm, opt).items()}
    out = {}
    for name, path in cases:
        with torch.no_grad():
            for v in _local(gm, opt).values():
                v.fill_(SENTINEL)
        try:
            autoshard.checkpoint.load(_state(gm, opt), path)
            err = None
        except CheckpointError as e:
            err = str(e)
        wrong = [k for k, v in _local(gm, opt).items() if not ((v == SENTINEL) | (v == right[k])).all()]
        out[name] = (err, wrong)
    return out, {k: str(v) for k, v in autoshard.layouts(gm).items()}


# ----------------------------------------------------------------------------- finding bytes to flip

def _item(path, fqn, offset=None):
    md = dcp.FileSystemReader(path).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            return info
    raise KeyError(fqn)


def _members(path, info) -> dict:
    """{member name: (first byte in the .distcp file, size)} of the torch.save archive `info`,
    from its zip headers."""
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    out = {}
    for m in zipfile.ZipFile(io.BytesIO(raw)).infolist():
        name_len, extra_len = struct.unpack("<HH", raw[m.header_offset + 26:m.header_offset + 30])
        out[m.filename.split("/", 1)[1]] = (info.offset + m.header_offset + 30 + name_len + extra_len, m.file_size)
    return out


def _float_at(path, info, pos) -> float:
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(pos)
        return struct.unpack("<f", f.read(4))[0]


def _flipped(good, where, name, pos):
    """A copy of the checkpoint `good` with bit 6 of byte `pos` of file `name` flipped."""
    shutil.rmtree(where, ignore_errors=True)
    shutil.copytree(good, where)
    with open(os.path.join(where, name), "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x40]))
    return where


# ----------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def saved(tmp_path_factory, dist2):
    tmp = str(tmp_path_factory.mktemp("crc"))
    good = os.path.join(tmp, "good")
    layouts = dist2.run(_save, good, timeout=180)[0]
    assert [layouts[k] for k in ("wte.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight")] == \
        ["S(0)", "S(0)", "S(1)"], layouts
    return tmp, good


def _cases(tmp, good, full):
    """{case: (path, file name, flipped byte, key text)}: the flips, each checked to be where it
    is meant to be. (Not in wte.weight: head.weight is tied to it and loaded after it, so a wrong
    value there would be overwritten and a test could not see it.)"""
    fc1 = _item(good, "model.blocks.0.mlp.fc1.weight", (64, 0))      # rows 64..127, written by rank 1
    data, nbytes = _members(good, fc1)["data/0"]
    assert nbytes == 64 * H * 4
    weight = data + (16 * H + 5) * 4 + 3                              # row 80, column 5: its high byte
    assert _float_at(good, fc1, weight - 3) == full["model"]["blocks.0.mlp.fc1.weight"][80, 5].item()
    assert BLOCK <= weight - fc1.offset < fc1.length - BLOCK         # inside a block, not the first or last 2 KiB
    pkl, pkl_len = _members(good, fc1)["data.pkl"]
    moment = _item(good, "optim.state.blocks.0.mlp.fc2.weight.exp_avg", (0, 0))    # columns 0..63, rank 0
    mdata, mbytes = _members(good, moment)["data/0"]
    assert mbytes == H * 64 * 4
    in_moment = mdata + (16 * 64 + 10) * 4 + 3                        # row 16, column 10
    assert _float_at(good, moment, in_moment - 3) == \
        full["optim"]["state"]["blocks.0.mlp.fc2.weight"]["exp_avg"][16, 10].item()
    assert BLOCK <= in_moment - moment.offset < moment.length - BLOCK
    sq = _item(good, "optim.state.wte.weight.exp_avg_sq", (256, 0))  # rows 256..511, rank 1
    sdata, sbytes = _members(good, sq)["data/0"]
    last = sdata + sbytes - 1                                         # row 511, column 31: its high byte
    tail = sq.length % BLOCK
    assert tail and last - sq.offset >= sq.length - tail, "the last data byte is not in the last partial block"
    lr = _item(good, "optim.param_groups.0.lr")
    flips = {"weight": (fc1, weight, "'model.blocks.0.mlp.fc1.weight' (saved chunk at (64, 0))"),
             "pickle header": (fc1, pkl + pkl_len // 2, "'model.blocks.0.mlp.fc1.weight' (saved chunk at (64, 0))"),
             "adam moment": (moment, in_moment, "'optim.state.blocks.0.mlp.fc2.weight.exp_avg'"),
             "last partial block": (sq, last, "'optim.state.wte.weight.exp_avg_sq' (saved chunk at (256, 0))"),
             "pickled setting": (lr, lr.offset + lr.length // 2, "'optim.param_groups.0.lr'")}
    return {case: (_flipped(good, os.path.join(tmp, case.replace(" ", "_")), info.relative_path, pos),
                   info.relative_path, pos, key)
            for case, (info, pos, key) in flips.items()}


# The ranks whose reads cover the flipped byte's block. fc1 and wte are S(0): at 4, rank 2 holds
# rows 64..95 of fc1 (rows 256..383 of wte) and rank 3 rows 96..127 (384..511), halves of the
# chunks rank 1 saved; fc2 is S(1): at 4, ranks 0 and 1 read whole rows of the chunk rank 0 saved;
# every rank reads the optimizer's settings. Every rank reading an archive reads its first and
# last 2 KiB (zip headers, data.pkl, zip directory), which hold the first and last rows.
NOTICE = {2: {"weight": {1}, "adam moment": {0}, "pickle header": {1}, "pickled setting": {0, 1},
              "last partial block": {1}},
          4: {"weight": {2}, "adam moment": {0, 1}, "pickle header": {2, 3}, "pickled setting": {0, 1, 2, 3},
              "last partial block": {2, 3}}}


def test_a_flipped_byte_is_a_named_error_on_the_ranks_that_read_it_and_no_wrong_value_loads(saved, dist2, dist4):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    tmp, good = saved
    dcp_to_torch_save(good, os.path.join(tmp, "good.pt"))             # PyTorch's converter reads it unchanged
    full = torch.load(os.path.join(tmp, "good.pt"), weights_only=False)
    cases = _cases(tmp, good, full)
    for world, pool in ((2, dist2), (4, dist4)):
        resave = os.path.join(tmp, f"resaved{world}")
        results = pool.run(_load_corrupted, good, resave, [(c, p) for c, (p, _, _, _) in cases.items()], timeout=240)
        layouts = results[0][1]
        assert [layouts[k] for k in ("wte.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight")] == \
            ["S(0)", "S(0)", "S(1)"], layouts
        for case, (path, name, pos, key) in cases.items():
            wrong = {rank: out[case][1] for rank, (out, _) in enumerate(results) if out[case][1]}
            assert not wrong, f"degree {world}, {case}: wrong values loaded (rank: tensors) {wrong}"
            for rank, (out, _) in enumerate(results):
                err = out[case][0]
                assert err is not None, f"degree {world}, {case}: rank {rank} loaded without an error"
                noticed = {int(r) for r in re.findall(r"rank (\d+): CheckpointError", err)}
                assert noticed == NOTICE[world][case], (world, case, err)
                for line in re.findall(r"rank \d+: CheckpointError: [^;]*", err):
                    assert f"{path}/{name}: {key}: bytes [" in line, (world, case, line)
                    start, end = map(int, re.search(r"bytes \[(\d+), (\d+)\)", line).groups())
                    assert start <= pos < end and end - start <= BLOCK, (world, case, pos, line)
                    assert "do not match their checksum" in line
        # the good checkpoint, loaded at this degree and saved again, is the same bit for bit
        dcp_to_torch_save(resave, os.path.join(tmp, f"resaved{world}.pt"))
        again = torch.load(os.path.join(tmp, f"resaved{world}.pt"), weights_only=False)
        assert sorted(again["model"]) == sorted(full["model"])
        assert all(torch.equal(again["model"][k], v) for k, v in full["model"].items())
        for p, st in full["optim"]["state"].items():
            assert all(torch.equal(again["optim"]["state"][p][k], v) for k, v in st.items()), p
        assert again["optim"]["param_groups"] == full["optim"]["param_groups"]


def test_checked_reads_return_the_exact_bytes_and_refuse_every_block_a_flipped_byte_is_in(tmp_path):
    """Random items, block sizes and reads: a read returns the file's bytes, having read whole
    blocks (or the whole first / last E bytes where it lies inside them and the item has more
    than one block); with one byte flipped,
    exactly the reads whose blocks hold it raise, naming the block's byte range."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        length = int(torch.randint(1, 3000, (1,), generator=g))
        block = int(torch.randint(1, 700, (1,), generator=g))
        edge = min(int(torch.randint(1, 300, (1,), generator=g)), block)
        offset = int(torch.randint(0, 50, (1,), generator=g))
        raw = bytes(torch.randint(0, 256, (offset + length + 10,), dtype=torch.uint8, generator=g).tolist())
        path = tmp_path / f"f{trial}"
        path.write_bytes(raw)
        with open(path, "rb", buffering=0) as f:
            sums = item_sums(f, offset, length, block, edge)
        assert len(sums.blocks) == -(-length // block)
        flip = offset + int(torch.randint(0, length, (1,), generator=g))
        bad = bytearray(raw)
        bad[flip] ^= 1
        (tmp_path / f"b{trial}").write_bytes(bytes(bad))
        e = min(edge, length)
        for _ in range(30):
            a = int(torch.randint(0, length, (1,), generator=g))
            n = int(torch.randint(0, length - a + 1, (1,), generator=g))
            with open(path, "rb", buffering=0) as f:
                item = CheckedItem(f, "f", "'k'", offset, length, sums, block, edge)
                assert bytes(item.read(offset + a, n)) == raw[offset + a:offset + a + n]
            if n == 0:
                continue
            at = flip - offset
            if len(sums.blocks) == 1:
                covers = bad_range = (0, length)
            elif a + n <= e:
                covers = bad_range = (0, e)
            elif a >= length - e:
                covers = bad_range = (length - e, length)
            else:
                covers = (a // block * block, min(length, ((a + n - 1) // block + 1) * block))
                bad_range = (at // block * block, min(length, (at // block + 1) * block))
            assert item.bytes_read == covers[1] - covers[0]
            with open(tmp_path / f"b{trial}", "rb", buffering=0) as f:
                item = CheckedItem(f, "b", "'k'", offset, length, sums, block, edge)
                if covers[0] <= at < covers[1]:
                    with pytest.raises(CheckpointError, match=rf"b: 'k': bytes \[{offset + bad_range[0]}, "
                                                              rf"{offset + bad_range[1]}\)"):
                        item.read(offset + a, n)
                else:
                    assert bytes(item.read(offset + a, n)) == raw[offset + a:offset + a + n]
    with pytest.raises(CheckpointError, match="records 5 bytes for this item, .metadata 6"):
        CheckedItem(None, "f", "'k'", 0, 6, ItemSums(5, 0, 0, (0,)), 8, 8)


@pytest.mark.parametrize("seed", range(2))
def test_checked_box_reads_copy_exactly_the_box_through_small_blocks(tmp_path, seed):
    """Random saved tensors (dtypes, transposed views), checksum blocks of 1..300 bytes and reader
    blocks of 1..200: every random box read through the checks equals narrowing the tensor."""
    from autoshard.io.checkpoint.reader import _locate
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(8):
        shape = tuple(int(n) for n in torch.randint(1, 12, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                     generator=g))
        t = torch.randn(shape, generator=g).to([torch.float32, torch.bfloat16, torch.float64][i % 3])
        tensors[f"t{i}"] = t.transpose(0, -1) if i % 4 == 3 else t
    path = str(tmp_path / "ckpt")
    autoshard.checkpoint.save(tensors, path, checksum_block_bytes=int(torch.randint(1, 300, (1,), generator=g)))
    reader = autoshard.checkpoint.FileSystemReader(path, block_bytes=int(torch.randint(1, 200, (1,), generator=g)))
    reader.set_up_storage_reader(reader.read_metadata(), False)
    for index, info in reader.storage_data.items():
        saved = tensors[index.fqn]
        with open(os.path.join(path, info.relative_path), "rb", buffering=0) as f:
            for _ in range(6):
                item = reader.item(f, info)
                place = _locate(item)
                offsets = [int(torch.randint(n, (1,), generator=g)) for n in saved.shape]
                lengths = [int(torch.randint(1, n - o + 1, (1,), generator=g)) for n, o in zip(saved.shape, offsets)]
                target = torch.zeros(lengths, dtype=saved.dtype)
                reader._copy(item, place, tuple(offsets), target)
                expected = saved
                for d, (o, n) in enumerate(zip(offsets, lengths)):
                    expected = expected.narrow(d, o, n)
                assert torch.equal(target, expected), (index.fqn, offsets, lengths)
                assert item.blocks_checked > 0


def _tensors():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 7, generator=g), "ids": torch.arange(1000), "t": torch.randn(5, 6, generator=g).t(),
            "cfg": {"lr": 0.5}}


def _zeros():
    return {"w": torch.zeros(300, 7), "ids": torch.zeros(1000, dtype=torch.long), "t": torch.zeros(6, 5),
            "cfg": {"lr": 0.0}}


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("w", "ids", "t")) and a["cfg"] == b["cfg"]


def test_plain_dcp_checkpoint_loads_with_a_note_and_plain_dcp_reads_a_checked_one(tmp_path):
    plain, checked = str(tmp_path / "plain"), str(tmp_path / "checked")
    dcp.save(_tensors(), checkpoint_id=plain, no_dist=True)
    into = _zeros()
    with pytest.warns(UserWarning, match=r"plain has no .checksums \(written by plain dcp.save or an older "
                                         r"autoshard\): it loads without checking its bytes") as record:
        autoshard.checkpoint.load(into, plain)
    assert _equal(into, _tensors())
    notes = [w for w in record if "no .checksums" in str(w.message)]
    assert len(notes) == 1 and "\n" not in str(notes[0].message)

    autoshard.checkpoint.save(_tensors(), checked, checksum_block_bytes=512)
    assert sorted(os.listdir(checked)) == [".checksums", ".metadata", "__0_0.distcp"]
    into = _zeros()
    dcp.load(into, checkpoint_id=checked, no_dist=True)                   # PyTorch's reader, unchanged
    assert _equal(into, _tensors())
    reader = autoshard.checkpoint.FileSystemReader(checked, block_bytes=64)
    into = _zeros()
    dcp.load(into, storage_reader=reader, no_dist=True)
    assert _equal(into, _tensors()) and reader.fallbacks == 0 and reader.blocks_checked > 0
    assert reader.checksums.block_bytes == 512


def test_what_the_reader_leaves_to_pytorch_is_checked_too(tmp_path):
    path = str(tmp_path / "ckpt")
    autoshard.checkpoint.save(_tensors(), path, checksum_block_bytes=256)
    info = _item(path, "w")
    data, _ = _members(path, info)["data/0"]
    _flipped(path, str(tmp_path / "bad"), info.relative_path, data + 40 * 7 * 4)
    into = _zeros()
    with mock.patch("autoshard.io.checkpoint.reader._locate", return_value=None), \
            pytest.warns(UserWarning, match="read whole by PyTorch's reader"), \
            pytest.raises(CheckpointError, match=r"bad/__0_0.distcp: 'w': bytes \[\d+, \d+\) .* do not match"):
        autoshard.checkpoint.load(into, str(tmp_path / "bad"))
    assert torch.equal(into["w"], torch.zeros(300, 7))


def test_verify_names_every_problem_and_convert_refuses_a_damaged_checkpoint(saved, tmp_path, capsys):
    tmp, good = saved
    assert cli_main(["verify", good]) == 0
    out = capsys.readouterr().out
    assert re.search(r"good: OK \(2 file\(s\), \d+ item\(s\), \d+ checksum\(s\) compared", out), out

    wte = _item(good, "model.wte.weight", (256, 0))
    data, _ = _members(good, wte)["data/0"]
    bad = _flipped(good, str(tmp_path / "bad"), wte.relative_path, data + 1000)
    with open(os.path.join(bad, "__0_0.distcp"), "r+b") as f:                 # and one in the other file
        f.seek(5000)
        byte = f.read(1)[0]
        f.seek(5000)
        f.write(bytes([byte ^ 1]))
    assert cli_main(["verify", bad]) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 2, out
    assert any(f"bad/{wte.relative_path}: 'model.wte.weight' (saved chunk at (256, 0)): bytes [" in p for p in problems)
    assert any("bad/__0_0.distcp: " in p for p in problems) and "2 problem(s)" in out
    with pytest.raises(CheckpointError, match="is damaged, not converted"):
        autoshard.checkpoint.dcp_to_torch_save(bad, str(tmp_path / "bad.pt"))

    broken = str(tmp_path / "broken")                # a truncated file, a missing one, checksums of another
    shutil.copytree(good, broken)
    with open(os.path.join(broken, "__1_0.distcp"), "r+b") as f:
        f.truncate(20000)
    os.remove(os.path.join(broken, "__0_0.distcp"))
    assert cli_main(["verify", broken]) == 1
    out = capsys.readouterr().out
    assert "__0_0.distcp: missing; .metadata names" in out
    assert re.search(r"__1_0.distcp: '[^']+'.*: bytes \[\d+, \d+\) lie past the end of the file \(20000 bytes\)", out)

    unchecked = str(tmp_path / "unchecked")          # no .checksums: a note, and torch.save's own CRCs
    shutil.copytree(good, unchecked)
    os.remove(os.path.join(unchecked, ".checksums"))
    assert cli_main(["verify", unchecked]) == 0
    assert "note: no .checksums" in capsys.readouterr().out
    _flipped(unchecked, str(tmp_path / "unchecked_bad"), wte.relative_path, data + 1000)
    assert cli_main(["verify", str(tmp_path / "unchecked_bad")]) == 1
    assert "the torch.save archive is damaged: BadZipFile: Bad CRC-32" in capsys.readouterr().out

    with open(os.path.join(unchecked, ".checksums"), "w") as f:
        f.write("{not json")
    r = subprocess.run([sys.executable, "-m", "autoshard", "verify", unchecked], env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unchecked/.checksums cannot be read: JSONDecodeError" in r.stdout, r.stdout + r.stderr
