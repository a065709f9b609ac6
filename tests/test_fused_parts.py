"""Fused projections cut into parts of unequal sizes: grouped-query attention's q / k / v in one
weight (HF Phi-3's `qkv_proj` of heads*head_dim + 2*kv_heads*head_dim outputs, sliced
`qkv[..., :q]`, `qkv[..., q:q+kv]`, `qkv[..., q+kv:]`). The fused weight is held as a strided
shard whose blocks have the sizes of the parts, `Shard(dim, 3, parts=(q, kv, kv))`: each block is
split over the ranks, so every rank holds matching heads of q, of k and of v (4 heads / 2 kv heads
of 16 at 2 ranks: rows [2 q heads | 1 k head | 1 v head] of rank r) and nothing is gathered
between the projection and the attention. The layout table records it with its global size
(`Shard(0, 3, 128, 1, (64, 32, 32))`). It is chosen only where every part splits into whole heads
that match the grouping; elsewhere (fewer kv heads than ranks, a grouping that does not line up)
the planner falls back to a plain split whose output is gathered, and the results stay exact.

Plans in one process (the plain-module GroupedBlock with both tracers; Phi-3 4/2 heads at 2, 8/4
at 4, 6/3 at 3, and the fallback 4/2 at 4); gloo ranks at world 2, 3 and 4 against the
single-process model (loss, logits whole or as a DTensor, every gradient, each rank's qkv rows
cut from the model's weight by hand, bytes counted equal to the plan's); state dicts collect and
relocate at 4; a DCP checkpoint saved at 4 loads at 2 (the parts layout again) and at 3 (whatever
the planner picks); save_pretrained at 4 writes a directory that
`transformers.Phi3ForCausalLM.from_pretrained` loads tensor for tensor. Every case that expects
the parts layout asserts it, so a planner that falls back to gathering fails it. A multi-query
GPT-BigCode (one kv head fused after the query heads) at world 2 and 4: the one-head parts are
gathered where the split cuts them out, the query heads stay split.
"""
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.runtime.placements import REPLICATE_PG, chunk_sizes  # noqa: E402
from refs import block_steps_match, dcp_load_model, dcp_save_model, gathers_near, hf_step_matches  # noqa: E402

VOCAB = 256


class GroupedBlock(nn.Module):
    """FusedBlock of test_fused.py with grouped-query attention: one fused q/k/v projection of
    h + 2 * kv_heads * head_dim outputs sliced by `x.shape` arithmetic, k and v repeated to the
    query heads as HF's `repeat_kv` does (expand, then reshape), and a fused gate/up projection."""

    def __init__(self, h=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv, self.o = nn.Linear(h, h + 2 * kv_heads * (h // heads)), nn.Linear(h, h)
        self.gate_up, self.down = nn.Linear(h, 4 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        d = C // self.heads
        kv = self.kv_heads * d
        qkv = self.qkv(x)
        q, k, v = qkv[..., :C], qkv[..., C:C + kv], qkv[..., C + kv:]
        q = q.view(B, T, self.heads, d).transpose(1, 2)
        k, v = (t.view(B, T, self.kv_heads, d).transpose(1, 2) for t in (k, v))
        n = self.heads // self.kv_heads
        k, v = (t[:, :, None].expand(B, self.kv_heads, n, T, d).reshape(B, self.heads, T, d) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(y)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(up * F.silu(gate))


def _x(seed=0, h=64):
    return torch.randn(2, 16, h, generator=torch.Generator().manual_seed(seed))


def _phi3(heads, kv_heads, h, seed=0):
    """Tiny HF Phi-3 (2 layers, every dropout 0) in train mode, and its input_ids / labels."""
    import hf_models
    model, kw = hf_models.phi3(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=h,
                               intermediate_size=2 * h, vocab_size=VOCAB, bos_token_id=1,
                               eos_token_id=VOCAB - 1, seed=seed)
    return model.train(), kw


def _qkv_proj(plan):
    """The fused projections' module names of a Phi-3's plan (one a layer)."""
    found = sorted(n for n in plan.dims if n.endswith("self_attn.qkv_proj"))
    assert len(found) == 2, sorted(plan.dims)
    return found


# ----------------------------------------------------------------------------- what the parts layout looks like

def _parts(heads, kv_heads, h):
    """The q, k and v features of a fused grouped projection."""
    return (h, kv_heads * (h // heads), kv_heads * (h // heads))



def _is_parts(layout, parts, sized):
    """Whether `layout` is the strided shard of rows in blocks of the sizes `parts`; a layout table
    (`sized`) records the global size, a plan may leave it out. Fields compared one by one, so that
    no Shard is built here."""
    size = sum(parts)
    return (isinstance(layout, autoshard.Shard) and layout.dim == 0 and layout.chunks == 3
            and layout.parts is not None and tuple(layout.parts) == parts
            and (layout.size == size if sized else layout.size in (None, size)))


def _check_parts(plan, modules, parts, layouts=None, bias=False):
    """Every fused projection of `modules` planned column-wise, its weight (and bias) held in blocks
    of `parts` (in `plan.layouts`, and with the global size in a layout table `layouts`), none of its
    parts gathered, and every attention run on a shard of the heads."""
    for m in modules:
        assert plan.dims[m] == -1, (m, plan.dims)
        for key in [f"{m}.weight"] + ([f"{m}.bias"] if bias else []):
            assert _is_parts(plan.layouts[key], parts, sized=False), (key, plan.layouts[key])
            if layouts is not None:
                assert _is_parts(layouts[key], parts, sized=True), (key, layouts[key])
        gathered = gathers_near(plan, m)
        assert not gathered, (m, gathered, plan.report())
    attention = {n: d.output for n, d in plan.nodes.items() if "scaled_dot_product_attention" in d.op}
    assert attention and all(isinstance(o, autoshard.Shard) for o in attention.values()), attention


def _piece(full, parts, rank, p):
    """Rank `rank`'s rows of a fused [q + kv + kv, ...] tensor, cut by hand: its heads of q, then
    of k, then of v."""
    out, start = [], 0
    for block in parts:
        sizes = chunk_sizes(block, p)
        out.append(full.narrow(0, start + sum(sizes[:rank]), sizes[rank]))
        start += block
    return torch.cat(out, 0)


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_grouped_block_at_2_keeps_the_parts_split(tracer):
    plan = autoshard.plan(GroupedBlock(), 2, (_x(),), tracer=tracer)
    _check_parts(plan, ["qkv"], (64, 32, 32), bias=True)               # nn.Linear: weight [q+2kv, h], rows
    assert plan.layouts["gate_up.weight"] == autoshard.Shard(0, 2)      # the MLP's equal halves unchanged


@pytest.mark.parametrize("heads,kv_heads,h,p", [(4, 2, 64, 2), (8, 4, 64, 4), (6, 3, 48, 3)],
                         ids=["4-2-at-2", "8-4-at-4", "6-3-at-3"])
def test_phi3_grouped_qkv_is_held_in_parts(heads, kv_heads, h, p):
    model, kw = _phi3(heads, kv_heads, h)
    plan = autoshard.plan(model, p, kw, tracer="export")
    _check_parts(plan, _qkv_proj(plan), _parts(heads, kv_heads, h))


def test_phi3_with_fewer_kv_heads_than_ranks_falls_back():
    """4 heads / 2 kv heads at 4 ranks: the kv parts do not split into whole heads, so K and V are
    gathered near the fused projection, whether its weight is a plain split or parts cut in
    elements (8 of each kv part's 32 features a rank: `_kv_gathered`). This also shows
    `gathers_near` sees such a gather in Phi-3's graph, so the cases above that find none mean it."""
    model, kw = _phi3(4, 2, 64)
    plan = autoshard.plan(model, 4, kw, tracer="export")
    for m in _qkv_proj(plan):
        _kv_gathered(plan, m, plan.layouts[f"{m}.weight"])


def _kv_gathered(plan, m, layout):
    """K and V of the fused projection `m` are gathered near it (a redistribution, or the K/V
    slices' own gathers within groups of ranks, `blocks(m)`); its weight a plain split or the parts
    (64, 32, 32) evenly in elements."""
    assert layout in (autoshard.Shard(0), autoshard.Shard(0, 3, parts=(64, 32, 32))), (m, layout)
    layer = m.rsplit(".", 2)[0]
    by_slices = [n for n, d in plan.nodes.items() if d.strategy.startswith("blocks(")
                 and any(k.startswith("all_gather") for k, _ in d.comm) and d.module.startswith(layer + ".")]
    assert gathers_near(plan, m) or len(by_slices) == 2, (m, by_slices, plan.report())


# ----------------------------------------------------------------------------- ranks: exactness


def _phi3_step(rank, p, heads, kv_heads, h, outputs, expect_parts):
    """Phi-3 in train mode at degree p: the parts layout and each rank's qkv rows (cut by hand from
    the model's weight) where expected, the loss, the logits (whole or a DTensor) and every gradient
    as one process computes them; (the module, the single-process model, the bytes counted and the
    plan's)."""
    model, kw = _phi3(heads, kv_heads, h)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", outputs=outputs)
    plan = gm._autoshard_plan
    modules = _qkv_proj(plan)
    parts = _parts(heads, kv_heads, h)
    if expect_parts:
        _check_parts(plan, modules, parts, gm._autoshard_layouts)
        want_sd = ref.state_dict()
        for m in modules:
            w = gm.get_parameter(f"{m}.weight")
            assert tuple(w.shape) == (sum(parts) // p, h), (m, w.shape)
            assert torch.equal(w.detach(), _piece(want_sd[f"{m}.weight"], parts, rank, p)), f"{m}.weight on {rank}"
    else:
        for m in modules:
            _kv_gathered(plan, m, plan.layouts[f"{m}.weight"])
    measured = hf_step_matches(gm, ref, kw, f"phi3 {heads}/{kv_heads} heads at {p} ({outputs})",
                               sharded_logits=outputs == "sharded")
    return gm, ref, dict(measured=measured, plan=plan.comm_bytes)


def _phi3_case(rank, p, heads, kv_heads, h, outputs, expect_parts):
    return _phi3_step(rank, p, heads, kv_heads, h, outputs, expect_parts)[2]


@pytest.mark.parametrize("world,heads,kv_heads,h,outputs,expect_parts",
                         [(2, 4, 2, 64, "full", True), (3, 6, 3, 48, "full", True),
                          (4, 4, 2, 64, "full", False)],
                         ids=["4-2-at-2", "6-3-at-3", "4-2-at-4-fallback"])
def test_phi3_grouped_qkv_is_exact(world, heads, kv_heads, h, outputs, expect_parts, request):
    pool = request.getfixturevalue(f"dist{world}")
    for r in pool.run(_phi3_case, heads, kv_heads, h, outputs, expect_parts, timeout=300):
        assert r["measured"] == pytest.approx(r["plan"], rel=1e-9), r


def _block_case(rank, p):
    """GroupedBlock(64, 4 heads, 2 kv heads) at p under symbolic_trace: the parts layout, q/k/v rows
    and bias cut by hand, loss and gradients exact on two batches, bytes counted equal to the plan's."""
    torch.manual_seed(0)
    model = GroupedBlock()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, (_x(),), tracer="symbolic_trace")
    plan = gm._autoshard_plan
    parts = (64, 32, 32)
    _check_parts(plan, ["qkv"], parts, gm._autoshard_layouts, bias=True)
    w, b = gm.get_parameter("qkv.weight"), gm.get_parameter("qkv.bias")
    assert tuple(w.shape) == (128 // p, 64) and tuple(b.shape) == (128 // p,), (w.shape, b.shape)
    assert torch.equal(w.detach(), _piece(ref.qkv.weight.detach(), parts, rank, p))
    assert torch.equal(b.detach(), _piece(ref.qkv.bias.detach(), parts, rank, p))
    measured = block_steps_match(gm, ref, _x, f"GroupedBlock at {p}")
    return dict(measured=measured, plan=plan.comm_bytes)


def test_grouped_block_at_2_is_exact(dist2):
    for r in dist2.run(_block_case, timeout=300):
        assert r["measured"] == pytest.approx(r["plan"], rel=1e-9), r


# ----------------------------------------------------------------------------- state dicts and checkpoints

def _save4(rank, p, path, root):
    """Phi-3 with 8 heads / 4 kv heads at 4 (2 q and 1 kv head a rank), the logits returned as a
    DTensor: exact as `_phi3_step` checks it; then collect gives the model's state dict, relocate
    gives this rank's pieces back, a DCP checkpoint is saved to `path` and save_pretrained writes
    `root`. Returns (the collected state dict, the bytes counted and the plan's)."""
    gm, ref, comm = _phi3_step(rank, p, 8, 4, 64, "sharded", True)
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
    return sd, comm


def _load(rank, p, path):
    """Phi-3 with 8 heads / 4 kv heads at p from other weights, then the checkpoint saved at 4
    loaded into it; at 2 the parts layout again (4 q heads, 2 kv heads a rank)."""
    model, kw = _phi3(8, 4, 64, seed=1)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    if p == 2:
        _check_parts(gm._autoshard_plan, _qkv_proj(gm._autoshard_plan), (64, 32, 32), gm._autoshard_layouts)
    return dcp_load_model(gm, path)


def test_phi3_8_4_at_4_is_exact_and_checkpoints_across_degrees(dist2, dist3, dist4, tmp_path):
    """8 heads / 4 kv heads at 4 ranks (parts (64, 32, 32)), logits a DTensor: exact, bytes counted
    equal to the plan's; a DCP checkpoint loads at 2 and 3 with every tensor the saved model's; the
    save_pretrained directory loads in one process with no missing, unexpected or mismatched key
    and every tensor equal."""
    import transformers
    path, root = str(tmp_path / "dcp"), str(tmp_path / "hf")
    results = dist4.run(_save4, path, root, timeout=300)
    for _, comm in results:
        assert comm["measured"] == pytest.approx(comm["plan"], rel=1e-9), comm
    saved = results[0][0]
    for pool in (dist2, dist3):
        for loaded in pool.run(_load, path, timeout=300):
            for k, v in saved.items():
                assert torch.equal(loaded[k], v), f"{k} at {pool.world_size}"
    model, info = transformers.Phi3ForCausalLM.from_pretrained(root, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k


# ----------------------------------------------------------------------------- a part of fewer heads than ranks

def _bigcode_case(rank, p):
    """A tiny multi-query GPT-BigCode (StarCoder's layout: `c_attn(x).split((h, hd, hd))`, one kv
    head): q split in whole heads, the one-head k and v parts all-gathered where the split cuts them
    out (their gradients reduce-scattered back) and read by every rank's query heads; loss and every
    gradient as one process, bytes counted (the split's own gathers included) equal to the plan's.
    Latency priced at 0 so that bytes decide at these small sizes, as they do at real ones."""
    import transformers
    from hf_models import build_model, example_kwargs
    cfg = dict(vocab_size=256, n_positions=64, n_embd=256, n_layer=2, n_head=4, n_inner=512, multi_query=True,
               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = build_model(transformers.GPTBigCodeConfig, transformers.GPTBigCodeForCausalLM, cfg)
    ref = copy.deepcopy(model)
    kw = example_kwargs(256, batch=2, seq=64)
    gm = autoshard.parallelize(model, p, kw, tracer="export", latency=0.0)
    plan = gm._autoshard_plan
    counted = hf_step_matches(gm, ref, kw, f"bigcode at {p}")
    splits = [d.output for d in plan.nodes.values() if d.op == "split_with_sizes.default"]
    layouts = [v for k, v in gm._autoshard_layouts.items() if k.endswith("c_attn.weight")]
    return splits, layouts, (counted, plan.comm_bytes)


@pytest.mark.parametrize("world", [2, 4])
def test_multi_query_kv_part_is_gathered_where_it_is_cut(world, request):
    for splits, layouts, (counted, planned) in request.getfixturevalue(f"dist{world}").run(_bigcode_case, timeout=300):
        assert counted == pytest.approx(planned, rel=1e-9)
        assert len(layouts) == 2 and all(v.parts == (256, 64, 64) for v in layouts), layouts
        assert len(splits) == 2 and all(s == (autoshard.Shard(3), REPLICATE_PG, REPLICATE_PG) for s in splits), splits


def _phi3_kv_case(rank, p, kv_heads):
    """Phi-3 with 20 query heads of 8 and `kv_heads` kv heads at 4 ranks, where the kv heads do
    not split over 4 (Phi-3-medium's 10 kv heads at 4 and 8): k and v are gathered where they
    are cut out of the fused output while the query heads stay split (5 a rank), over all ranks
    (5 kv heads: 1.25 a rank, no smaller group holds whole heads) or within the pairs of ranks
    whose 10 query heads read 5 of them (10 kv heads: `Shard(2, replicas=2)`, T x 40 features each
    way within a pair, not T x 80 over all four); loss, logits and every gradient as one
    process, bytes equal to the plan's."""
    import hf_models
    model, kw = hf_models.phi3(vocab_size=256, seq=32, num_attention_heads=20, num_key_value_heads=kv_heads,
                               hidden_size=160, intermediate_size=320, bos_token_id=1, eos_token_id=255)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", latency=0.0)
    plan = gm._autoshard_plan
    counted = hf_step_matches(gm, ref, kw, f"phi3 20/{kv_heads} at {p}")
    cuts = sorted(str(d.output) for d in plan.nodes.values() if d.strategy.startswith("blocks("))
    layouts = [v.parts for k, v in gm._autoshard_layouts.items() if k.endswith("qkv_proj.weight")]
    kinds = sorted(k for k in plan.comm_by_kind if "@" in k)
    return cuts, layouts, kinds, (counted, plan.comm_bytes)


@pytest.mark.parametrize("kv_heads,kv_cut,kinds", [(5, "Rp", []), (10, "S(2)r2", ["all_gather@2", "reduce_scatter@2"])],
                         ids=["5-kv-gathered-whole", "10-kv-gathered-in-pairs"])
def test_kv_heads_that_do_not_split_are_gathered_where_cut(dist4, kv_heads, kv_cut, kinds):
    for cuts, layouts, got_kinds, (counted, planned) in dist4.run(_phi3_kv_case, kv_heads, timeout=300):
        assert counted == pytest.approx(planned, rel=1e-9)
        assert layouts == [(160, 8 * kv_heads, 8 * kv_heads)] * 2, layouts
        assert cuts == sorted([kv_cut] * 4 + ["S(2)"] * 2), cuts        # k and v gathered, q split, in both layers
        assert got_kinds == kinds, got_kinds