"""Tensor parallel inside a 2-D DeviceMesh: a mesh of the wrong size or shape, and fully_shard
before parallelize, are named errors; checkpoints of a 2-D run reshard to other layouts. (Training
exactly over `parallelize(..., group=mesh["tp"])` and autoshard's own mesh: tests/test_blocks.py.)"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autoshard
from autoshard.errors import ProcessGroupError, ShardingError
from models import GPT


def _data(steps, batch=4, seq=16, vocab=128):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def _full(gm, of) -> dict:
    """{name: full tensor} of `of(parameter)` (the parameter, its gradient) for a module whose
    parameters FSDP2 made DTensors over the data-parallel mesh (each a part of this rank's
    tensor-parallel shard)."""
    local = {}
    for name, t in gm.named_parameters(remove_duplicate=False):
        v = of(t)
        local[name] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return autoshard.collect_state_dict(gm, local)


def _mesh_errors_case(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    idx = torch.randint(0, 128, (2, 16))
    with pytest.raises(ProcessGroupError, match=r"2-D DeviceMesh \('dp', 'tp'\).*mesh\['tp'\]"):
        autoshard.parallelize(GPT(vocab=128, h=64, seq=16), 2, (idx, idx), group=mesh)
    with pytest.raises(ProcessGroupError, match=r"world_size=4\) but the tensor-parallel group has 2 ranks"):
        autoshard.parallelize(GPT(vocab=128, h=64, seq=16), 4, (idx, idx), group=mesh["tp"])
    model = GPT(vocab=128, h=64, seq=16)
    fully_shard(model, mesh=mesh["dp"])
    with pytest.raises(ShardingError, match=r"parameter wte.weight is already a DTensor.*parallelize the plain model"):
        autoshard.parallelize(model, 2, (idx, idx), group=mesh["tp"])
    return True


def test_wrong_meshes_are_named(dist4):
    assert all(dist4.run(_mesh_errors_case))


def _device_mesh_case(rank, world):
    with pytest.raises(ProcessGroupError, match=r"device_mesh\(\) needs the groups"):
        autoshard.distributed.device_mesh()
    return True


def test_device_mesh_needs_autoshards_groups(dist2):
    assert all(dist2.run(_device_mesh_case))


# ----------------------------------------------------------------------------- 2-D checkpoints

LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1), "1x4": (1, 4)}      # tensor-parallel x data-parallel degree


def _build(layout, seed):
    """(module, optimizer) in `layout`: autoshard at the tensor-parallel degree (over mesh["tp"],
    or the whole world), FSDP2 over the data-parallel mesh (1x4: plain FSDP2, no autoshard)."""
    tp, dp = LAYOUTS[layout]
    torch.manual_seed(seed)
    model = GPT(vocab=128, h=64, heads=4, blocks=2, seq=16, tied=False)
    idx = _data(1)[0][:2]
    if layout == "4x1":
        module = autoshard.parallelize(model, 4, (idx, idx))
    elif layout == "2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        module = autoshard.parallelize(model, 2, (idx, idx), group=mesh["tp"])
        for block in autoshard.blocks_of(module).values():      # the recipe: block by block, then the root
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    else:
        module = model
        fully_shard(module, mesh=init_device_mesh("cpu", (4,)))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(idx, idx).backward()
    opt.step(), opt.zero_grad()
    return module, opt


def _full_state(module, opt) -> dict:
    """Every parameter and optimizer moment as a full tensor, by name."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = {f"param {n}": v for n, v in _full(module, lambda t: t).items() if n in names.values()}
    for key in ("exp_avg", "exp_avg_sq"):
        moments = {names[id(p)]: st[key] for p, st in opt.state.items()}
        local = {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in moments.items()}
        out.update({f"{key} {n}": v for n, v in autoshard.collect_state_dict(module, local).items()})
    return out


def _checkpoint_case(rank, world, src, dst, path):
    module, opt = _build(src, seed=0)
    saved = _full_state(module, opt)
    msd, osd = autoshard.checkpoint.get_state_dict(module, opt)
    autoshard.checkpoint.save({"model": msd, "optim": osd}, path)
    module2, opt2 = _build(dst, seed=1)                 # other values until loaded
    assert not all(torch.equal(saved[k], v) for k, v in _full_state(module2, opt2).items())
    msd2, osd2 = autoshard.checkpoint.get_state_dict(module2, opt2)
    autoshard.checkpoint.load({"model": msd2, "optim": osd2}, path)
    autoshard.checkpoint.set_state_dict(module2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    loaded = _full_state(module2, opt2)
    assert sorted(loaded) == sorted(saved)
    differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert not differ, f"{src} -> {dst}: not bit for bit: {differ[:5]}"
    if rank == 0 and src == "2x2":                      # and to the unsharded model, in one file
        out = f"{path}.pt"
        autoshard.checkpoint.dcp_to_torch_save(path, out)
        full = torch.load(out, weights_only=False)
        for k, v in saved.items():
            kind, name = k.split(" ")
            got = full["model"][name] if kind == "param" else full["optim"]["state"][name][kind]
            assert torch.equal(got, v), k
    return True


@pytest.mark.parametrize("src, dst", [("2x2", "4x1"), ("4x1", "2x2"), ("2x2", "1x4")])
def test_two_d_checkpoints_reshard(dist4, tmp_path, src, dst):
    assert all(dist4.run(_checkpoint_case, src, dst, str(tmp_path / "ckpt"), timeout=180))


def _other_model_case(rank, world, path):
    module, opt = _build("2x2", seed=0)
    msd, osd = autoshard.checkpoint.get_state_dict(module, opt)
    autoshard.checkpoint.save({"model": msd, "optim": osd}, path)
    torch.manual_seed(0)
    other = GPT(vocab=128, h=32, heads=4, blocks=3, seq=16, tied=False)      # narrower, one block more
    idx = _data(1)[0][:2]
    gm = autoshard.parallelize(other, 4, (idx, idx))
    msd2, _ = autoshard.checkpoint.get_state_dict(gm)
    with pytest.raises(autoshard.checkpoint.CheckpointError, match=r"blocks\.2\..*|global shape"):
        autoshard.checkpoint.load({"model": msd2}, path)
    return True


def test_a_checkpoint_of_another_model_is_named(dist4, tmp_path):
    assert all(dist4.run(_other_model_case, str(tmp_path / "ckpt"), timeout=180))
