"""Fused projections whose heads do not divide by the degree: GPT-2's `c_attn` (a Conv1D of
[h, 3h] whose output `.split(h, dim=2)` cuts into q, k and v) with 6 heads of 8 at 4 ranks, 4
heads at 3, 12 heads at 8. The fused weight is held as a strided shard in whole heads,
`Shard(dim, 3, unit=head_dim)`: each of the three blocks is cut by `chunk_sizes(block, p, unit)`
(6 heads at 4 ranks: 2, 2, 1, 1 heads of q, of k and of v; 4 at 3: 2, 1, 1), the layout table
records it with its global size (`Shard(1, 3, 144, 8)` for c_attn.weight [48, 144] at 4), and
the parts go on to the attention split, never gathered. Before, such a projection fell back to
an even split of its output that had to be all-gathered before the split.

Plans in one process (GPT-2 at 3, 4 and 8; the plain-module FusedBlock of test_fused.py with 6
heads at 4, both tracers); gloo ranks at world 3 and 4 against the single-process model (loss,
every gradient, each rank's piece cut from the model's weight by hand, bytes counted equal to
the plan's, logits returned whole and as a DTensor); state dicts collect and relocate; a DCP
checkpoint saved at 4 loads at 2 and 3; save_pretrained at 4 writes a directory that
`transformers.GPT2LMHeadModel.from_pretrained` loads tensor for tensor. Every case asserts the
layout is the strided one in whole heads, so a planner that falls back to gathering fails them.
"""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.runtime.placements import chunk_sizes  # noqa: E402
from refs import block_steps_match, dcp_load_model, dcp_save_model, gathers_near, hf_step_matches  # noqa: E402
from test_fused import FusedBlock, _x  # noqa: E402

HEAD = 8          # head_dim of every model here
VOCAB = 256


def _gpt2(h, heads, seed=0):
    """Tiny HF GPT-2 (2 layers, every dropout 0) in train mode, and its input_ids / labels."""
    import hf_models
    model, kw = hf_models.gpt2(n_embd=h, n_head=heads, vocab_size=VOCAB, seq=16, seed=seed)
    return model.train(), kw


def _c_attn(plan):
    """The fused projections' module names of a GPT-2's plan (one a layer)."""
    found = sorted(n for n in plan.dims if n.endswith("attn.c_attn"))
    assert len(found) == 2, sorted(plan.dims)
    return found


# ----------------------------------------------------------------------------- what whole heads look like

def _strided(layout, dim, size, sized):
    """Whether `layout` is the strided shard in whole heads: three blocks (q, k, v) each cut in heads
    of HEAD features; a layout table (`sized`) records the global size, a plan may leave it out.
    Fields compared one by one, so that no Shard is built here."""
    return (isinstance(layout, autoshard.Shard) and layout.dim == dim and layout.chunks == 3
            and layout.unit == HEAD and (layout.size == size if sized else layout.size in (None, size)))



def _check_whole_heads(plan, modules, dim, h, layouts=None):
    """Every fused projection of `modules` planned column-wise, its weight and bias a strided shard in
    whole heads (in `plan.layouts`, and with the global size in a module's layout table `layouts`),
    none of its parts gathered, and every attention run on a shard of the heads."""
    size = 3 * h
    for m in modules:
        assert plan.dims[m] == -1, (m, plan.dims)
        for key, d in ((f"{m}.weight", dim), (f"{m}.bias", 0)):
            assert _strided(plan.layouts[key], d, size, sized=False), (key, plan.layouts[key])
            if layouts is not None:
                assert _strided(layouts[key], d, size, sized=True), (key, layouts[key])
        gathered = gathers_near(plan, m)
        assert not gathered, (m, gathered, plan.report())
    attention = {n: d.output for n, d in plan.nodes.items() if "scaled_dot_product_attention" in d.op}
    assert attention and all(isinstance(o, autoshard.Shard) for o in attention.values()), attention


def _local_columns(h, p):
    """Each rank's columns of the fused projection: its whole heads of q, of k and of v."""
    return [3 * s for s in chunk_sizes(h, p, HEAD)]


def _piece(full, dim, h, rank, p):
    """Rank `rank`'s piece of a fused [.., 3h, ..] tensor, cut by hand: its heads of each block."""
    sizes = chunk_sizes(h, p, HEAD)
    start = sum(sizes[:rank])
    return torch.cat([full.narrow(dim, b * h + start, sizes[rank]) for b in range(3)], dim=dim)


# ----------------------------------------------------------------------------- one process

def test_chunk_sizes_of_the_cases():
    """The whole-head splits the cases below rely on (and the one they avoid)."""
    assert chunk_sizes(48, 4, HEAD) == [16, 16, 8, 8]                    # 6 heads at 4: 2, 2, 1, 1
    assert chunk_sizes(32, 3, HEAD) == [16, 8, 8]                        # 4 heads at 3: 2, 1, 1
    assert chunk_sizes(96, 8, HEAD) == [16] * 4 + [8] * 4                # 12 heads at 8
    assert 0 in chunk_sizes(48, 8, HEAD)                                 # 6 heads at 8: two ranks empty


@pytest.mark.parametrize("h,heads,p", [(48, 6, 4), (32, 4, 3), (96, 12, 8)], ids=["6-heads-at-4", "4-heads-at-3",
                                                                                  "12-heads-at-8"])
def test_gpt2_c_attn_is_split_in_whole_heads(h, heads, p):
    model, kw = _gpt2(h, heads)
    plan = autoshard.plan(model, p, kw, tracer="export")
    _check_whole_heads(plan, _c_attn(plan), 1, h)                       # Conv1D: weight [h, 3h], columns


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_fused_block_with_six_heads_at_4_is_split_in_whole_heads(tracer):
    plan = autoshard.plan(FusedBlock(h=48, heads=6), 4, (_x(),), tracer=tracer)
    _check_whole_heads(plan, ["qkv"], 0, 48)                            # nn.Linear: weight [3h, h], rows
    assert plan.layouts["gate_up.weight"] == autoshard.Shard(0, 2)      # the MLP's halves unchanged


# ----------------------------------------------------------------------------- ranks: exactness


def _gpt2_case(rank, p, h, heads, outputs):
    """GPT-2 in train mode at degree p: the strided layout and each rank's columns (cut by hand from
    the model's weight), the loss and every gradient as one process computes them, the bytes counted
    equal to the plan's; with outputs='sharded' the logits come back a DTensor of the model's."""
    model, kw = _gpt2(h, heads)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", outputs=outputs)
    plan = gm._autoshard_plan
    modules = _c_attn(plan)
    _check_whole_heads(plan, modules, 1, h, gm._autoshard_layouts)
    want_sd = ref.state_dict()
    for m in modules:
        w, b = gm.get_parameter(f"{m}.weight"), gm.get_parameter(f"{m}.bias")
        assert tuple(w.shape) == (h, _local_columns(h, p)[rank]) and b.shape[0] == w.shape[1], (m, w.shape, b.shape)
        assert torch.equal(w.detach(), _piece(want_sd[f"{m}.weight"], 1, h, rank, p)), f"{m}.weight on rank {rank}"
        assert torch.equal(b.detach(), _piece(want_sd[f"{m}.bias"], 0, h, rank, p)), f"{m}.bias on rank {rank}"
    measured = hf_step_matches(gm, ref, kw, f"gpt2 {heads} heads of {HEAD} at {p} ({outputs})",
                               sharded_logits=outputs == "sharded")
    return dict(measured=measured, plan=plan.comm_bytes)


@pytest.mark.parametrize("world,h,heads,outputs", [(4, 48, 6, "full"), (3, 32, 4, "sharded")],
                         ids=["6-heads-at-4-full", "4-heads-at-3-sharded"])
def test_gpt2_with_heads_that_do_not_divide_is_exact(world, h, heads, outputs, request):
    pool = request.getfixturevalue(f"dist{world}")
    for r in pool.run(_gpt2_case, h, heads, outputs, timeout=300):
        assert r["measured"] == pytest.approx(r["plan"], rel=1e-9), r


def _block_case(rank, p):
    """FusedBlock(h=48, heads=6) at p: q/k/v rows in whole heads, loss and gradients exact on two
    batches (the example's and another), bytes counted equal to the plan's."""
    torch.manual_seed(0)
    model = FusedBlock(h=48, heads=6)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, (_x(),), tracer="symbolic_trace")
    plan = gm._autoshard_plan
    _check_whole_heads(plan, ["qkv"], 0, 48, gm._autoshard_layouts)
    w = gm.get_parameter("qkv.weight")
    assert tuple(w.shape) == (_local_columns(48, p)[rank], 48), w.shape
    assert torch.equal(w.detach(), _piece(ref.qkv.weight.detach(), 0, 48, rank, p))
    measured = block_steps_match(gm, ref, _x, f"FusedBlock 6 heads at {p}")
    return dict(measured=measured, plan=plan.comm_bytes)


def test_fused_block_with_six_heads_at_4_is_exact(dist4):
    for r in dist4.run(_block_case, timeout=300):
        assert r["measured"] == pytest.approx(r["plan"], rel=1e-9), r


# ----------------------------------------------------------------------------- state dicts and checkpoints

def _save4(rank, p, path, root):
    """GPT-2 with 6 heads at 4: collect gives the model's state dict, relocate gives this rank's
    pieces back, a DCP checkpoint is saved to `path` and save_pretrained writes `root`."""
    model, kw = _gpt2(48, 6)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    _check_whole_heads(gm._autoshard_plan, _c_attn(gm._autoshard_plan), 1, 48, gm._autoshard_layouts)
    sd = autoshard.collect_state_dict(gm, gm.state_dict())
    want = ref.state_dict()
    assert set(want) <= set(sd), sorted(set(want) - set(sd))
    for k, v in want.items():
        assert torch.equal(sd[k], v), f"collect {k}"
    back = autoshard.relocate_state_dict(gm, want)
    for k, v in gm.state_dict().items():
        assert torch.equal(back[k], v), f"relocate {k}"
    dcp_save_model(gm, path)
    gm.save_pretrained(root)
    return sd


def _load(rank, p, path):
    """GPT-2 with 6 heads at p from other weights, then the checkpoint saved at 4 loaded into it."""
    model, kw = _gpt2(48, 6, seed=1)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    plan = gm._autoshard_plan
    for m in _c_attn(plan):                                  # 6 heads divide by 2 and 3: the even strided shard
        assert plan.layouts[f"{m}.weight"] == autoshard.Shard(1, 3), plan.layouts[f"{m}.weight"]
    return dcp_load_model(gm, path)


def test_state_dicts_and_checkpoints_of_whole_heads(dist2, dist3, dist4, tmp_path):
    """Saved at 4 ranks (2, 2, 1, 1 heads of q, k and v): a DCP checkpoint loads at 2 and 3 with
    every tensor the saved model's; the save_pretrained directory loads in one process with no
    missing, unexpected or mismatched key and every tensor equal."""
    import transformers
    path, root = str(tmp_path / "dcp"), str(tmp_path / "hf")
    saved = dist4.run(_save4, path, root, timeout=300)[0]
    for pool in (dist2, dist3):
        for loaded in pool.run(_load, path, timeout=300):
            for k, v in saved.items():
                assert torch.equal(loaded[k], v), f"{k} at {pool.world_size}"
    model, info = transformers.GPT2LMHeadModel.from_pretrained(root, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
