"""Fewer key/value heads than ranks (grouped and multi-query attention): K and V made whole on
every rank with a Partial gradient (`ReplicatePartialGrad`) and sliced to the heads each rank's
queries read, in the two ways the cost model chooses between: the K/V weights split and their
outputs all-gathered (gradients reduce-scattered back), or the weights replicated and their
gradients all-reduced (Megatron's replicated K/V heads).

Gloo ranks at world 2, 3 and 4 against the single-process model of tiny Hugging Face Qwen2
configurations (8 heads / 1 kv head, 6 / 2, 7 / 1): the loss and every gradient, and the bytes
counted at run time against the plan's. At a constant price of state the weights split; with memory
free and the query heads pinned split, replication is cheaper (fewer bytes than the gathers);
the test asserts the plan took each. Where no groups of ranks can hold the kv heads (2 kv heads
on 3 ranks), K and V are held by the ranks whose queries read them (`Shard(d, cover=g)`:
1, 2 and 1 heads), computed from whole weights or gathered from split ones, exact with
dropout on too.
"""
import copy
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.runtime.collectives import count_comm  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402
from autoshard.runtime.placements import REPLICATE_PG, Shard, ShardGathered  # noqa: E402
import refs  # noqa: E402
from refs import close_to_scale, grads  # noqa: E402

# tiny sizes: bytes, not the number of collectives, decide; state priced at a constant (the
# default objective's bound lets a 2-layer toy split its first layer's norms and row-split q/k/v)
LATENCY_FREE = CostModel(latency=0.0, memory_weight=1e-9)


def _ways(way, layers=2):
    """(plan options, batch) that make `way` the cheapest for K/V."""
    if way in ("column_gather_pg", "column_gather_groups", "column_gather_cover"):
        return dict(cost_model=LATENCY_FREE), 2
    pins = {}
    for i in range(layers):
        a = f"model.layers.{i}.self_attn"
        pins.update({f"{a}.q_proj": -1, f"{a}.k_proj": None, f"{a}.v_proj": None, f"{a}.o_proj": 0})
    return dict(cost_model=CostModel(latency=0.0, memory_weight=0.0), pin=pins), 4


def _model(heads, kv_heads, batch, seq):
    import hf_models
    model, kw = hf_models.qwen2(hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                intermediate_size=16 * heads, vocab_size=128, batch=batch, seq=seq)
    return model.train(), kw          # the training graph is the one planned (no dropout in these configs)


def _kv_strategies(plan) -> set:
    return {d.strategy for name, d in plan.nodes.items() if d.module and d.module.endswith(("k_proj", "v_proj"))}


def _case(rank, p, heads, kv_heads, way):
    options, batch = _ways(way)
    model, kw = _model(heads, kv_heads, batch, 16)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", **options)
    plan = gm._autoshard_plan
    assert _kv_strategies(plan) == {way}, (way, _kv_strategies(plan), plan.report())
    q = next(d for d in plan.nodes.values() if d.module and d.module.endswith("q_proj"))
    assert q.strategy == "column", q               # the query heads split, K/V sliced to them
    if way == "column_gather_groups" and heads % p:  # uneven: the query heads split pair by pair
        assert q.output.nest == p // math.gcd(kv_heads, p), q
    _step_matches(gm, ref, kw, f"{heads}/{kv_heads} heads at {p}, {way}")
    return True


def _step_matches(gm, ref, kw, what, seed=None):
    """One training step of the rank's module against the single-process model: the loss, every
    gradient, and the bytes counted at run time against the plan's, kind by kind. With `seed`,
    each draws its dropout masks under it (the module the masks one process draws: built with
    dropout_masks="single_process"). Returns the module's loss."""
    if seed is not None:
        autoshard.manual_seed(seed)
    with count_comm() as c:
        out = gm(**kw)
        out.loss.backward()
    if seed is not None:
        torch.manual_seed(seed)
    want = ref(**kw)
    want.loss.backward()
    close_to_scale(out.loss, want.loss, f"{what}: loss")
    got = autoshard.collect_state_dict(gm, grads(gm, remove_duplicate=False))
    for k, g in grads(ref, remove_duplicate=False).items():
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-5 * g.abs().max().item() + 1e-7,
                                   msg=lambda m: f"{what}: grad of {k}: {m}")
    plan = gm._autoshard_plan
    assert c.bytes == pytest.approx(plan.comm_bytes, rel=1e-9), (what, c.by_kind, plan.comm_by_kind)
    assert {k: pytest.approx(b, rel=1e-9) for k, (_, b) in plan.comm_by_kind.items()} == \
        {k: b for k, (_, b) in c.by_kind.items()}, (what, c.by_kind, plan.comm_by_kind)     # kind by kind
    return out.loss.item()


@pytest.mark.parametrize("world,heads,kv_heads,way", [
    (2, 8, 1, "column_gather_pg"), (4, 8, 1, "column_gather_pg"), (4, 8, 2, "column_gather_groups"),
    (4, 4, 2, "column_gather_groups"), (4, 6, 2, "column_gather_groups"),
    (4, 8, 1, "replicate_pg"), (3, 6, 2, "replicate_cover"), (3, 6, 2, "column_gather_cover"),
    (3, 8, 2, "column_gather_cover"),
])
def test_fewer_kv_heads_than_ranks(world, heads, kv_heads, way, request):
    assert all(request.getfixturevalue(f"dist{world}").run(_case, heads, kv_heads, way, timeout=300))


def _readers_case(rank, p, way):
    """Qwen2 (biases on q, k and v) with 6 query heads over 2 kv heads at 3 ranks, attention
    dropout on: each rank's K and V hold only the kv heads its query heads read (1, 2, 1: no
    groups of ranks exist), made either way (`_ways`); the loss and every gradient equal one
    process's under the same dropout masks (masks="single_process"), bytes as planned, and other
    masks under another seed (dropout is on)."""
    import hf_models
    options, batch = _ways(way)
    model, kw = hf_models.qwen2(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96,
                                vocab_size=128, batch=batch, seq=16, attention_dropout=0.2)
    model.train()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", dropout_masks="single_process", **options)
    plan = gm._autoshard_plan
    assert _kv_strategies(plan) == {way}, (way, plan.report())
    held = [d.output for d in plan.nodes.values() if d.module and d.module.endswith(("k_proj", "v_proj"))]
    assert held and all(pl == Shard(2, unit=8, cover=3) for pl in held), held
    loss = _step_matches(gm, ref, kw, f"6/2 heads at {p}, {way}, dropout", seed=5)
    autoshard.manual_seed(6)
    with torch.no_grad():
        assert gm(**kw).loss.item() != loss          # other masks: dropout is on
    return True


@pytest.mark.parametrize("way", ["column_gather_cover", "replicate_cover"])
def test_kv_heads_held_by_their_readers_train_exactly_with_dropout(dist3, way):
    assert all(dist3.run(_readers_case, way, timeout=300))


def test_kv_heads_held_by_their_readers_pieces_and_cuts():
    """`Shard(d, unit=u, cover=g)`: each rank holds the kv heads its share of the query heads reads
    (overlapping pieces), cut locally to its query heads only where they lie inside."""
    from autoshard.runtime.placements import cover_cut, cover_ranges, local_shape
    assert cover_ranges(2, 3, 1, 3) == ((0, 1), (0, 2), (1, 2))            # 6 query heads over 2 kv heads
    assert cover_ranges(16, 3, 8, 3) == ((0, 8), (0, 16), (8, 16))         # the same in features of 8
    assert cover_ranges(2, 3, 1, 2) == ((0, 1), (1, 2), (1, 2))            # 4 query heads (2, 1, 1): no overlap
    assert cover_ranges(2, 4, 1, 1) is None                                 # a rank would read nothing
    expanded = Shard(1, unit=3, cover=3)                                    # K expanded to the 6 query heads
    assert [local_shape((2, 6, 5, 8), expanded, 3, r)[1] for r in (0, 1, 2, None)] == [3, 6, 3, 6]
    assert cover_cut(6, expanded, Shard(1), 3) == ((0, 2), (2, 2), (1, 2))  # rank 1's heads 2-3 of its 0-5
    # 6 query heads over 3 kv heads at 4 ranks (2, 2, 1, 1): split pair by pair instead (2, 1 | 2, 1),
    # rank 2's query heads 3-4 read kv heads 1 and 2, of which it holds only 2
    assert cover_cut(6, Shard(1, unit=2, cover=2), Shard(1, nest=2), 4) is None
    assert cover_cut(6, Shard(1, unit=2, cover=2), Shard(1), 4) == ((0, 2), (0, 2), (0, 1), (1, 1))
    with pytest.raises(ValueError):
        Shard(1, 2, cover=3)                                                # one contiguous dim only


def _nest_save(rank, p, path, root):
    """Qwen2 with 6 query heads and 2 kv heads at 4 ranks: the query heads split pair by pair (2, 1
    | 2, 1: each pair's 3 read the kv head it gathers); collected and relocated, saved with DCP
    and as a Hugging Face directory; (the full state, bytes counted and planned)."""
    options, batch = _ways("column_gather_groups")
    model, kw = _model(6, 2, batch, 16)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", **options)
    layouts = gm._autoshard_layouts
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == Shard(0, size=48, unit=8, nest=2), layouts
    want = ref.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    rows = {0: (0, 16), 1: (16, 24), 2: (24, 40), 3: (40, 48)}[rank]
    assert torch.equal(gm.get_parameter("model.layers.1.self_attn.q_proj.weight").detach(), want[rows[0]:rows[1]])
    plan = gm._autoshard_plan
    with count_comm() as c:
        gm(**kw).loss.backward()
    sd = autoshard.collect_state_dict(gm, gm.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), f"collect {k}"
    back = autoshard.relocate_state_dict(gm, ref.state_dict())
    for k, v in gm.state_dict().items():
        assert torch.equal(back[k], v), f"relocate {k}"
    refs.dcp_save_model(gm, path)
    gm.save_pretrained(root)
    return sd, (c.bytes, plan.comm_bytes)


def _nest_load(rank, p, path):
    model, kw = _model(6, 2, 2, 16)
    gm = autoshard.parallelize(model, p, kw, tracer="export", cost_model=LATENCY_FREE)
    with torch.no_grad():
        for q in gm.parameters():
            q.zero_()                          # every value must come from the checkpoint
    return refs.dcp_load_model(gm, path)


def test_query_heads_split_by_kv_group_checkpoint_across_degrees(dist2, dist3, dist4, tmp_path):
    """A shard split over groups of ranks first (`Shard(d, unit=8, nest=2)`) is held, saved and
    loaded like any uneven shard: a DCP checkpoint saved at 4 loads at 2 and 3 with every tensor
    the saved model's, and the save_pretrained directory loads in one process."""
    import transformers
    path, root = str(tmp_path / "dcp"), str(tmp_path / "hf")
    results = dist4.run(_nest_save, path, root, timeout=300)
    for _, (counted, planned) in results:
        assert counted == pytest.approx(planned, rel=1e-9)
    saved = results[0][0]
    for pool in (dist2, dist3):
        for loaded in pool.run(_nest_load, path, timeout=300):
            for k, v in saved.items():
                assert torch.equal(loaded[k], v), f"{k} at {pool.world_size}"
    model = transformers.Qwen2ForCausalLM.from_pretrained(root)
    for k, v in model.state_dict().items():
        if k in saved:
            assert torch.equal(v, saved[k]), k


def test_layouts_are_stored_as_plain_shards_and_replicas():
    """The plan's S(0)g / Rp layouts (what the search chose) are held, saved and loaded as the
    Shard / Replicate they are: the module's layout table and TorchShard attributes say so."""
    model, kw = _model(8, 1, 2, 16)
    plan = autoshard.plan(model, 4, kw, tracer="export", cost_model=LATENCY_FREE)
    kv = {k: v for k, v in plan.layouts.items() if "k_proj" in k or "v_proj" in k}
    assert kv and all(type(v) is ShardGathered and v.dim == 0 for v in kv.values()), kv
    assert "column_gather_pg" in plan.report()
    gm = autoshard.parallelize(model, 4, kw, plan=plan, rank=1)
    table = {k: v for k, v in gm._autoshard_layouts.items() if k in kv}
    assert table and all(type(v) is Shard and v.dim == 0 for v in table.values()), table
    assert gm.get_parameter("model.layers.0.self_attn.k_proj.weight").shape == (2, 64)
    options, _ = _ways("replicate_pg")
    plan = autoshard.plan(model, 4, kw, tracer="export", **options)
    assert _kv_strategies(plan) == {"replicate_pg"}, plan.report()
    kv = {k: v for k, v in plan.layouts.items() if "k_proj" in k or "v_proj" in k}
    assert kv and all(v == REPLICATE_PG for v in kv.values()), kv
    gm = autoshard.parallelize(model, 4, kw, plan=plan, rank=1)
    assert not any(k in gm._autoshard_layouts for k in kv)
    assert gm.get_parameter("model.layers.0.self_attn.k_proj.weight").shape == (8, 64)
    assert str(REPLICATE_PG) == "Rp" and str(ShardGathered(0)) == "S(0)g"


def _gemma_case(rank, p):
    """Gemma, a family no other test names: one kv head of head_dim 32 beside 4 query heads, a
    vocabulary of 301, at 4 ranks (before the strided-shard fix in `transitions.redistribute` its plan
    priced an all-to-all of a rotary's strided shard that the rewrite could not run)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=301, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, use_cache=False)
    model = transformers.GemmaForCausalLM(cfg).float().train()
    ids = torch.randint(cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    kw = {"input_ids": ids, "labels": ids}
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", cost_model=LATENCY_FREE)
    plan = gm._autoshard_plan
    assert "column_gather_pg" in _kv_strategies(plan), plan.report()
    _step_matches(gm, ref, kw, f"gemma at {p}")
    ids2 = torch.randint(cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))   # another shape
    close_to_scale(gm(input_ids=ids2, labels=ids2).loss, ref(input_ids=ids2, labels=ids2).loss, "gemma 1 x 9")
    return True


def test_gemma_one_kv_head(dist4):
    assert all(dist4.run(_gemma_case, timeout=300))


def _gemma2_case(rank, p, mode):
    """Gemma-2 (eager attention with logit soft-capping, sliding-window layers, head_dim 32 beside
    a hidden size of 96) with 4 query heads and 2 kv heads at 4 ranks: each kv head gathered onto
    the 2 ranks whose query heads read it (`column_gather_groups`, groups of 2), exact in the
    loss and every gradient, in train mode with dropout on the attention and in eval mode, and
    at another input shape."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=301, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                                    attention_dropout=0.1 if mode == "train" else 0.0, use_cache=False)
    model = transformers.Gemma2ForCausalLM(cfg).float()
    model = model.train() if mode == "train" else model.eval()
    ids = torch.randint(cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    kw = {"input_ids": ids, "labels": ids}
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", cost_model=LATENCY_FREE, dropout_masks="single_process")
    plan = gm._autoshard_plan
    assert _kv_strategies(plan) == {"column_gather_groups"}, plan.report()
    kv = {k: v for k, v in plan.layouts.items() if "k_proj" in k or "v_proj" in k}
    assert kv and all(v == ShardGathered(0, within=2) for v in kv.values()), kv
    assert gm.get_parameter("model.layers.0.self_attn.k_proj.weight").shape == (16, 96)    # 64 rows / 4, stored split
    loss = _step_matches(gm, ref, kw, f"gemma2 {mode}", seed=5 if mode == "train" else None)
    if mode == "train":
        autoshard.manual_seed(6)
        with torch.no_grad():
            assert gm(**kw).loss.item() != loss          # other masks: dropout is on
    ids2 = torch.randint(cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))   # another shape
    with torch.no_grad():
        close_to_scale(gm.eval()(input_ids=ids2, labels=ids2).loss, ref.eval()(input_ids=ids2, labels=ids2).loss,
                       "gemma2 1 x 9")
    return True


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gemma2_kv_heads_gathered_in_groups(dist4, mode):
    assert all(dist4.run(_gemma2_case, mode, timeout=300))


def test_strided_and_whole_unit_shards_move_by_gather_and_cut():
    """An all-to-all moves equal contiguous blocks; a strided shard (the rotary's halves of a
    head_dim split) or a whole-unit one reaches another dim by a gather and a cut, in the cost
    model as in the rewrite (`Rewriter.forward`)."""
    from autoshard.runtime.transitions import redistribute
    both = (("all_gather",), ("all_gather",))
    assert redistribute(Shard(3, 2), Shard(1)) == both
    assert redistribute(Shard(1), Shard(3, 2)) == both
    assert redistribute(Shard(2, unit=8), Shard(1)) == both
    assert redistribute(Shard(2), Shard(1)) == (("all_to_all",), ("all_to_all",))


def test_unequal_shards_move_by_gather_and_cut():
    """Shards of unequal sizes (7 features on 4 ranks) cannot be exchanged in an all-to-all's
    equal blocks: the plan prices the gather and cut the rewrite runs; equal ones keep the
    all-to-all."""
    import torch.nn as nn
    from autoshard.capture.trace import capture
    from autoshard.planner.build import chunk_candidates, unit_candidates
    from autoshard.planner.search import Problem

    gm = capture(nn.Linear(8, 7), (torch.randn(4, 8, 8),)).gm
    prob = Problem(gm, 4, CostModel(), chunk_candidates(gm), unit_candidates(gm))
    j = next(i for i, n in enumerate(prob.nodes) if n.op == "call_function" and prob.val[i].shape == (4, 8, 7))
    assert prob.redistribution(j, Shard(2), Shard(1)) == (("all_gather",), ("all_gather",))
    assert prob.redistribution(j, Shard(1), Shard(0)) == (("all_to_all",), ("all_to_all",))


class _ReturnsKeys(torch.nn.Module):
    """Grouped attention (8 query heads, 2 kv heads of 8, repeated as Hugging Face's `repeat_kv`
    does) that also returns its repeated keys, as a cache would."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(64, 64), torch.nn.Linear(64, 16), torch.nn.Linear(64, 16)
        self.o = torch.nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 8, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 8).transpose(1, 2)[:, :, None].expand(b, 2, 4, s, 8).reshape(b, 8, s, 8)
        v = self.v(x).view(b, s, 2, 8).transpose(1, 2)[:, :, None].expand(b, 2, 4, s, 8).reshape(b, 8, s, 8)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, s, 64)), k


def test_a_group_shard_is_never_returned_as_a_dtensor():
    """With outputs="sharded", a split output is returned as the DTensor it is; a shard held by
    groups of ranks has p/m pieces, not p, so it is gathered or never made (never left as is)."""
    plan = autoshard.plan(_ReturnsKeys(), 4, (torch.randn(2, 32, 64),), outputs="sharded", cost_model=LATENCY_FREE)
    assert all(getattr(pl, "replicas", 1) == 1 for pl in plan.output_placements.values()), plan.output_placements


def _falcon_mq(device="cpu", attn="sdpa"):
    """A tiny Falcon-7B: multi-query attention whose 7 query heads and one K/V head of 16 come out
    of one fused projection, viewed as 9 heads and cut after the view (`qkv[..., :-2, :]`,
    `qkv[..., [-2], :]`, `qkv[..., [-1], :]`), linears run as `x @ W.T`, parallel attention and
    MLP, a tied vocabulary of 257 that does not divide."""
    import transformers
    cfg = transformers.FalconConfig(vocab_size=257, hidden_size=112, num_hidden_layers=2, num_attention_heads=7,
                                    multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False,
                                    alibi=False, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.FalconForCausalLM._from_config(cfg, attn_implementation=attn).float()
    return model.train()


FALCON_PINS = {f"transformer.h.{i}.self_attention.{m}": d for i in range(2)
               for m, d in (("query_key_value", -1), ("dense", 0))}


def _falcon_case(rank, p, attn):
    """The query heads split in whole heads (3, 3, 1 at 3 ranks; 2, 2, 2, 1 at 4), the
    features of K and of V (16 each) split in elements and gathered whole where they are cut out, the one
    head broadcast to this rank's query heads: the state dict collected and relocated exactly,
    the loss and every gradient exact, bytes as planned, and another input shape in eval mode."""
    model = _falcon_mq(attn=attn)
    kw = _falcon_batch()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", cost_model=LATENCY_FREE, pin=FALCON_PINS)
    plan = gm._autoshard_plan
    qkv = plan.layouts["transformer.h.0.self_attention.query_key_value.weight"]
    assert qkv == Shard(0, 3, unit=16, parts=(112, 16, 16)), plan.report()
    assert plan.layouts["transformer.h.1.self_attention.dense.weight"] == Shard(1, unit=16), plan.report()
    heads = [d for n, d in plan.nodes.items() if n.startswith(("scaled_dot_product_attention", "matmul"))
             and d.strategy in ("heads", "shard(1)")]
    assert heads, plan.report()                   # attention runs on this rank's query heads
    heads, kv = {3: ((3, 3, 1), (6, 6, 4)), 4: ((2, 2, 2, 1), (4, 4, 4, 4))}[p]   # torch.chunk's boundaries
    rows = heads[rank] * 16 + 2 * kv[rank]
    assert gm.get_parameter("transformer.h.0.self_attention.query_key_value.weight").shape == (rows, 112)
    full = autoshard.collect_state_dict(gm, gm.state_dict())      # the mixed shard, whole again
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k
    for k, v in autoshard.relocate_state_dict(gm, ref.state_dict()).items():
        assert torch.equal(v, gm.state_dict()[k]), k
    _step_matches(gm, ref, kw, f"falcon multi-query at {p} ({attn})")
    ids2 = torch.randint(257, (2, 11), generator=torch.Generator().manual_seed(2))   # another shape
    with torch.no_grad():
        close_to_scale(gm.eval()(input_ids=ids2, labels=ids2).loss, ref.eval()(input_ids=ids2, labels=ids2).loss,
                       f"falcon at {p}: 2 x 11")
    return True


@pytest.mark.parametrize("world,attn", [(4, "sdpa"), (3, "eager")])
def test_falcon_multi_query_heads_split_kv_gathered(world, attn, request):
    assert all(request.getfixturevalue(f"dist{world}").run(_falcon_case, attn, timeout=300))


def test_falcon_heads_cut_after_the_view_capture_on_meta():
    """The parts taken after the view into heads become slices of the projection's features,
    whose index constants are kept on a model built on meta (made on the CPU, not lifted without
    values): the meta model's plan is the CPU model's."""
    from autoshard.capture.trace import capture
    ids = _falcon_batch()["input_ids"]
    plans = []
    for device in ("cpu", "meta"):
        kw = {"input_ids": ids.to(device), "labels": ids.to(device)}
        gm = capture(_falcon_mq(device), kwargs=kw, tracer="export").gm
        index = [n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor
                 and len(n.meta["val"].shape) == 4 and n.meta["val"].shape[-1] == 16]
        assert not index, [n.format_node() for n in index]      # no head picked by an index remains
        plans.append(autoshard.plan(_falcon_mq(device), 4, kw, tracer="export", cost_model=LATENCY_FREE,
                                    pin=FALCON_PINS))
    assert plans[0].layouts == plans[1].layouts and plans[0].comm_bytes == plans[1].comm_bytes
    assert plans[1].layouts["transformer.h.0.self_attention.query_key_value.weight"] == \
        Shard(0, 3, unit=16, parts=(112, 16, 16))


def _falcon_save(rank, p, path):
    gm = autoshard.parallelize(_falcon_mq(), p, _falcon_batch(), tracer="export", cost_model=LATENCY_FREE,
                               pin=FALCON_PINS)
    refs.dcp_save_model(gm, path)
    return autoshard.collect_state_dict(gm, gm.state_dict())


def _falcon_load(rank, p, path):
    model = _falcon_mq()
    torch.manual_seed(7)
    for q in model.parameters():
        torch.nn.init.normal_(q)              # other values: every one must come from the checkpoint
    gm = autoshard.parallelize(model, p, _falcon_batch(), tracer="export", cost_model=LATENCY_FREE, pin=FALCON_PINS)
    assert gm._autoshard_plan.layouts["transformer.h.0.self_attention.query_key_value.weight"].parts
    return refs.dcp_load_model(gm, path)


def _falcon_batch():
    ids = torch.randint(257, (3, 24), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def test_falcon_mixed_part_shards_checkpoint_across_degrees(dist2, dist3, dist4, tmp_path):
    """The fused q/k/v held as query heads (3, 3, 1 at 3 ranks) and K / V cut in elements (6, 6, 4)
    saves with DCP at 3 ranks and loads at 2 and 4, every tensor the saved model's."""
    path = str(tmp_path / "dcp")
    saved = dist3.run(_falcon_save, path, timeout=300)[0]
    for pool in (dist2, dist4):
        for loaded in pool.run(_falcon_load, path, timeout=300):
            for k, v in saved.items():
                assert torch.equal(loaded[k], v), f"{k} at {pool.world_size}"


def _grouped_case(rank, p, kv_heads, dropout):
    """8 query heads over `kv_heads` at `p` ranks: each rank's attention reads its K/V heads
    grouped (`enable_gqa=True`, no per-query-head copies) where the heads split alike, and the
    repeat capture wrote stays where they do not; the step equals one process's (with attention
    dropout under one process's masks), bytes as planned."""
    import hf_models
    model, kw = hf_models.qwen2(hidden_size=64, num_attention_heads=8, num_key_value_heads=kv_heads,
                                intermediate_size=96, vocab_size=128, batch=2, seq=16, attention_dropout=dropout)
    model.train()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", dropout_masks="single_process")
    nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]  # blocks too
    calls = [n for n in nodes if "scaled_dot_product_attention" in str(n.target)
             or (n.op == "call_module" and "autoshard_attention" in n.target)]
    grouped = [n.kwargs.get("enable_gqa", False) for n in calls]
    expands = [n for n in nodes if n.target is torch.ops.aten.expand.default       # repeat_kv's
               and any(u in calls for v in n.users for u in v.users)]
    _step_matches(gm, ref, kw, f"8/{kv_heads} heads at {p}, dropout {dropout}", seed=3 if dropout else None)
    return len(calls), grouped, len(expands)


@pytest.mark.parametrize("world,kv_heads,dropout", [(2, 2, 0.0), (2, 4, 0.1), (4, 4, 0.0), (4, 1, 0.0)])
def test_grouped_query_attention_runs_grouped(world, kv_heads, dropout, request):
    for calls, grouped, expands in request.getfixturevalue(f"dist{world}").run(
            _grouped_case, kv_heads, dropout, timeout=300):
        assert calls == 2, calls                               # one attention a layer
        if kv_heads % world == 0:                              # K/V heads split with their queries
            assert all(grouped) and expands == 0, (grouped, expands)
        else:                         # one K/V head: repeated whole, cut to the rank's query heads
            assert not any(grouped), grouped
