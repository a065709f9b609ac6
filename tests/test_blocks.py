"""Blocks stay modules: the parallel module is a skeleton calling one GraphModule per block, so
FSDP2 (`fully_shard` per block), activation checkpointing and `torch.compile` apply per block,
and 2-D runs (tensor parallel x FSDP2) train exactly as one process does."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import autoshard
from autoshard.errors import ShardingError
from hf_models import llama
from models import GPT, MLPStack
from refs import close_to_scale


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=128, h=64, heads=4, blocks=3, seq=16, tied=False)


def _ids(seed, batch=4, seq=16, vocab=128):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- one process

def test_blocks_are_graph_modules_with_the_models_names():
    model = _gpt()
    idx = _ids(0)[:2]
    gm = autoshard.parallelize(model, 2, (idx, idx), rank=0)
    blocks = autoshard.blocks_of(gm)
    assert list(blocks) == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(isinstance(b, fx.GraphModule) and type(b).__name__ == "Block" for b in blocks.values())
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    code = gm.code
    assert all(f'getattr(self.blocks, "{i}")(' in code for i in range(3))          # the skeleton calls them
    assert "blocks_0_attn_q_weight" not in code                                       # their ops are inside
    assert any(c in blocks["blocks.0"].code for c in ("reduce_from", "all_gather", "reduce_scatter"))   # and so
    # are their collectives (an all-reduce, or at these sizes a reduce-scatter and an all-gather)
    flat = autoshard.parallelize(_gpt(), 2, (idx, idx), rank=0, blocks=None)
    assert autoshard.blocks_of(flat) == {} and "blocks_0_attn_q_weight" in flat.code
    one = autoshard.parallelize(_gpt(), 2, (idx, idx), rank=0, blocks=["blocks.1"])
    assert list(autoshard.blocks_of(one)) == ["blocks.1"]
    head = autoshard.parallelize(_gpt(), 2, (idx, idx), rank=0, blocks=["head", "wte"])      # untied: both
    assert list(autoshard.blocks_of(head)) == ["head", "wte"]
    torch.manual_seed(0)
    tied = GPT(vocab=128, h=64, heads=4, blocks=2, seq=16, tied=True)
    with pytest.warns(UserWarning, match=r"block wte: its tensor wte.weight is also read outside it \(tied\)"):
        kept = autoshard.parallelize(tied, 2, (idx, idx), rank=0, blocks=["wte", "blocks.0"])
    assert list(autoshard.blocks_of(kept)) == ["blocks.0"]


def test_blocks_found_and_named():
    from autoshard.rewrite.blocks import find_blocks
    model, _ = llama(num_hidden_layers=3)
    assert find_blocks(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert find_blocks(MLPStack(blocks=2)) == ["blocks.0", "blocks.1"]
    idx = _ids(0)[:2]
    with pytest.raises(ShardingError, match=r"GPT has no submodule 'layers\.0'"):
        autoshard.parallelize(_gpt(), 2, (idx, idx), rank=0, blocks=["layers.0"])


def test_one_block_module_equals_flat_single_process():
    """At degree 1 the skeleton and its blocks compute what the flat graph does (dropout off)."""
    model = _gpt()
    ref = copy.deepcopy(model)
    idx = _ids(1)
    gm = autoshard.parallelize(model, 1, (idx, idx))
    loss = gm(idx, idx)
    want = ref(idx, idx)
    loss.backward(), want.backward()
    close_to_scale(loss, want, "loss")
    for (n, a), (_, b) in zip(gm.named_parameters(), ref.named_parameters()):
        close_to_scale(a.grad, b.grad, n)


# ----------------------------------------------------------------------------- 2-D training

def _llama():
    model, _ = llama(num_hidden_layers=2, world_size=2)
    return model


def _full(module, of) -> dict:
    """{name: full tensor} of `of(parameter)`; FSDP2's DTensors gathered, autoshard's shards
    collected; activation-checkpoint wrappers' prefix dropped from the names."""
    local = {}
    for name, t in module.named_parameters():
        v = of(t)
        local[name.replace("._checkpoint_wrapped_module", "")] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return autoshard.collect_state_dict(module, local)


def _mesh(rank, tp, dp, via):
    """(2-D ("dp", "tp") mesh, the group to parallelize on), built by torch or from autoshard's groups."""
    if via == "init_device_mesh":
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return mesh, mesh["tp"]
    autoshard.distributed.init_process_group(tp)
    mesh = autoshard.distributed.device_mesh()
    first = rank // tp * tp
    assert dist.get_process_group_ranks(mesh["tp"].get_group()) == list(range(first, first + tp)) == \
        dist.get_process_group_ranks(autoshard.distributed.get_group())
    assert dist.get_process_group_ranks(mesh["dp"].get_group()) == list(range(rank % tp, dp * tp, tp))
    assert autoshard.distributed.device_mesh() is mesh
    return mesh, None                          # parallelize on the current tensor-parallel group


def _per_block_case(rank, world, kind, layout, wrap, via):
    tp, dp = layout
    mesh, group = _mesh(rank, tp, dp, via)
    model = (_gpt() if kind == "gpt" else _llama()).train()       # trained in train mode, evaluated below
    ref = copy.deepcopy(model)
    batches = [_ids(s, vocab=128 if kind == "gpt" else model.config.vocab_size) for s in range(3)]
    per = 4 // dp
    call = (lambda m, x: m(x, x)) if kind == "gpt" else (lambda m, x: m(input_ids=x, labels=x).loss)
    example = (batches[0][:per],) * 2 if kind == "gpt" else {"input_ids": batches[0][:per], "labels": batches[0][:per]}
    gm = autoshard.parallelize(model, tp, example, group=group,
                               tracer="symbolic_trace" if kind == "gpt" else "export")
    blocks = autoshard.blocks_of(gm)
    assert len(blocks) >= 2
    for name, block in blocks.items() if wrap != "root" else ():
        if wrap == "checkpointed":
            parent, _, last = name.rpartition(".")
            gm.get_submodule(parent)._modules[last] = block = checkpoint_wrapper(block)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(gm, mesh=mesh["dp"])           # root only: the whole tensor-parallel shard gathered at once
    assert all(isinstance(gm.get_submodule(n), FSDPModule) == (wrap != "root") for n in blocks)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    d = mesh["dp"].get_local_rank()
    for step, idx in enumerate(batches):
        mine = idx[per * d:per * (d + 1)]
        loss = call(gm, mine)
        loss.backward()
        want = call(ref, idx)
        want.backward()
        both = loss.detach().clone()
        dist.all_reduce(both, group=mesh["dp"].get_group())
        close_to_scale(both / dp, want, f"step {step} loss")
        full = _full(gm, lambda t: t.grad)
        for name, t in ref.named_parameters():
            scale = t.grad.abs().max().item()
            torch.testing.assert_close(full[name], t.grad, rtol=1e-5, atol=(1e-5 if step == 0 else 1e-3) * scale + 1e-8,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
        opt.step(), opt.zero_grad()
        ref_opt.step(), ref_opt.zero_grad()
    full = _full(gm, lambda t: t)
    for name, t in ref.named_parameters():
        torch.testing.assert_close(full[name], t.detach(), atol=1e-3, rtol=0, msg=lambda m: f"{name}: {m}")
    gm.eval(), ref.eval()                   # the evaluation graph: its blocks run through the same modules
    with torch.no_grad():
        loss, want = call(gm, batches[0][per * d:per * (d + 1)]), call(ref, batches[0][per * d:per * (d + 1)])
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
    return True


@pytest.mark.parametrize("kind, layout, wrap, via", [
    ("gpt", (2, 2), "blocks", "init_device_mesh"), ("gpt", (2, 2), "checkpointed", "autoshard"),
    ("gpt", (2, 2), "root", "autoshard"), ("gpt", (4, 1), "blocks", "init_device_mesh"),
    ("llama", (2, 2), "checkpointed", "init_device_mesh")])
def test_fsdp2_trains_exactly(dist4, kind, layout, wrap, via):
    """Tensor parallel x FSDP2 (per block, per block with activation checkpointing, root only;
    the mesh from torch or from autoshard's groups) equals one process over 3 AdamW steps."""
    assert all(dist4.run(_per_block_case, kind, layout, wrap, via, timeout=300))


def _compile_case(rank, world):
    model = _gpt()
    ref = copy.deepcopy(model)
    idx = _ids(2)
    gm = autoshard.parallelize(model, 2, (idx, idx))
    eager = autoshard.parallelize(ref, 2, (idx, idx))
    gm.blocks._modules["1"] = torch.compile(gm.get_submodule("blocks.1"), backend="aot_eager")
    for x in (idx, _ids(3, batch=3, seq=12)):               # another shape: the block takes it too
        loss, want = gm(x, x), eager(x, x)
        loss.backward(), want.backward()
        close_to_scale(loss, want, "loss")
        mine = dict(eager.named_parameters())
        for n, p in gm.named_parameters():
            n = n.replace("._orig_mod", "")
            close_to_scale(p.grad, mine[n].grad, n)
        gm.zero_grad(), eager.zero_grad()
    return True


def test_compiled_block_equals_eager(dist2):
    assert all(dist2.run(_compile_case, timeout=300))


def _alike_layers_case(rank, p, name):
    """The parallel module of a Hugging Face model with 3 alike layers: one block class for all of
    them (one compile), the plan's layer 0 reading the stream as every later layer does, and the
    step still the model's (dropout modules the rewriter adds are named within their block)."""
    import hf_models
    from refs import hf_step_matches
    model, kw = {"llama": lambda: hf_models.llama(num_hidden_layers=3),
                 "gpt2": lambda: hf_models.gpt2(n_layer=3)}[name]()
    gm = autoshard.parallelize(copy.deepcopy(model), p, kw, tracer="export")
    blocks = autoshard.blocks_of(gm)
    assert len(blocks) == 3 and len({type(b) for b in blocks.values()}) == 1, \
        {n: type(b).__name__ for n, b in blocks.items()}
    hf_step_matches(gm, model, kw, name)
    return True


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_alike_layers_share_one_block_class(dist2, name):
    assert all(dist2.run(_alike_layers_case, name, timeout=180))
