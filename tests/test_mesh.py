"""Tensor parallel inside a 2-D DeviceMesh: `parallelize(..., group=mesh["tp"])`, autoshard's own
groups as a mesh (`autoshard.distributed.device_mesh()`), FSDP2 over mesh["dp"] trains exactly
as one process does; a mesh of the wrong size or shape, and fully_shard before parallelize, are
named errors."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autoshard
from autoshard.errors import ProcessGroupError, ShardingError
from models import GPT
from refs import close_to_scale


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


def _two_d_case(rank, world, via):
    if via == "autoshard":
        autoshard.distributed.init_process_group(2)
        mesh = autoshard.distributed.device_mesh()
        tp_ranks = dist.get_process_group_ranks(autoshard.distributed.get_group())
        assert dist.get_process_group_ranks(mesh["tp"].get_group()) == tp_ranks == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert dist.get_process_group_ranks(mesh["dp"].get_group()) == [rank % 2, rank % 2 + 2]
        assert autoshard.distributed.device_mesh() is mesh
        group = None                           # parallelize on the current tensor-parallel group
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        group = mesh["tp"]
    torch.manual_seed(0)
    model = GPT(vocab=128, h=64, heads=4, blocks=2, seq=16, tied=False)
    ref = copy.deepcopy(model)
    batches = _data(3)
    gm = autoshard.parallelize(model, 2, (batches[0][:2], batches[0][:2]), group=group)
    fully_shard(gm, mesh=mesh["dp"])
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    for step, idx in enumerate(batches):
        mine = idx[2 * dp:2 * dp + 2]          # this data-parallel replica's half of the batch
        loss = gm(mine, mine)
        loss.backward()
        want = ref(idx, idx)
        want.backward()
        both = loss.detach().clone()
        dist.all_reduce(both, group=mesh["dp"].get_group())
        close_to_scale(both / 2, want, f"step {step} loss")
        full = _full(gm, lambda t: t.grad)     # FSDP2 averaged them over the replicas
        for name, t in ref.named_parameters():  # after a step, Adam's noise on ~0 gradients (k's bias)
            scale = t.grad.abs().max().item()   # moves the parameters apart by ~1e-7: 1e-4 of the scale
            torch.testing.assert_close(full[name], t.grad, rtol=1e-5, atol=(1e-5 if step == 0 else 1e-4) * scale + 1e-8,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
        opt.step(), opt.zero_grad()
        ref_opt.step(), ref_opt.zero_grad()
    full = _full(gm, lambda t: t)
    for name, t in ref.named_parameters():   # Adam moves an element by ~lr (1e-2) whatever its gradient's
        torch.testing.assert_close(full[name], t.detach(), atol=1e-3, rtol=0,   # size, so rounding noise in
                                   msg=lambda m: f"{name}: {m}")               # a ~0 gradient moves it too
    return True


@pytest.mark.parametrize("via", ["init_device_mesh", "autoshard"])
def test_tensor_parallel_by_fsdp2_trains_exactly(dist4, via):
    assert all(dist4.run(_two_d_case, via, timeout=180))


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
