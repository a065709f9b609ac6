"""Capture's normal forms (autoshard.capture.normalize): graphs rewritten, equal in value, into forms the
rules can split. BLOOM merges batch and heads for its `baddbmm` / `bmm` (`[b * H, s, d]`, its
ALiBi bias `[H, 1, s]` repeated b times): captured, the scores are a 4-d `matmul` of the unmerged
tensors with the bias broadcast, so the heads split over the ranks. One process: the captured
graph has no `bmm` left and computes the model's loss at the example's shape and another; gloo
ranks at 3 (4 heads: 2, 1, 1) and 4: the loss, the logits and every gradient equal the
single-process model's, the bytes counted the plan's, and every score product runs on this
rank's heads.
"""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from refs import close_to_scale, hf_step_matches  # noqa: E402


def _bloom():
    import transformers
    from hf_models import build_model, example_kwargs
    cfg = dict(vocab_size=256, hidden_size=128, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_model(transformers.BloomConfig, transformers.BloomForCausalLM, cfg, attn_implementation="eager")
    return model.train(), example_kwargs(256, batch=2, seq=24)


def test_bloom_scores_captured_as_4d_matmul():
    from autoshard.capture.trace import capture
    model, kw = _bloom()
    gm = capture(model, kwargs=kw, tracer="export").gm
    targets = {n.target for n in gm.graph.nodes}
    assert not targets & {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}, targets
    close_to_scale(gm(**kw).loss, model(**kw).loss, "bloom 2 x 24")
    ids = torch.randint(256, (3, 7), generator=torch.Generator().manual_seed(3))
    close_to_scale(gm(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss, "bloom 3 x 7")


def _bloom_case(rank, p):
    model, kw = _bloom()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    plan = gm._autoshard_plan
    counted = hf_step_matches(gm, ref, kw, f"bloom at {p}")
    scores = {n: d.strategy for n, d in plan.nodes.items() if d.op == "matmul.default" and "self_attention" in d.module
              and not d.module.endswith(("query_key_value", "dense"))}
    return scores, (counted, plan.comm_bytes)


@pytest.mark.parametrize("world", [3, 4])
def test_bloom_heads_split_through_batched_scores(world, request):
    for scores, (counted, planned) in request.getfixturevalue(f"dist{world}").run(_bloom_case, timeout=300):
        assert counted == pytest.approx(planned, rel=1e-9)
        assert len(scores) == 4 and all(s == "shard(1)" for s in scores.values()), scores   # 2 a layer


# ----------------------------------------------------------------------------- parts of groups (CodeGen)

class _GroupedQKV(torch.nn.Module):
    """CodeGen's attention in miniature: a fused projection laid out in `groups` model-parallel
    groups, each its heads' q, v and k, viewed as `[b, s, groups, 3 * c]` and split into q, v, k,
    each merged into heads; then attention, an output projection and an MLP."""

    def __init__(self, hidden=32, heads=8, groups=2):
        super().__init__()
        self.heads, self.groups = heads, groups
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden)
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        fused = self.qkv(x).reshape(b, s, self.groups, -1)
        q, v, k = torch.split(fused, h // self.groups, dim=-1)
        q, v, k = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, v, k))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _grouped_x(seed, batch=2, seq=6):
    return torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(seed))


def test_groups_captured_as_regroup():
    from autoshard.capture.trace import capture
    from autoshard.nn.functional import regroup
    torch.manual_seed(0)
    model = _GroupedQKV()
    gm = capture(model, (_grouped_x(0),), tracer="export").gm
    grouped = [n for n in gm.graph.nodes if n.target is regroup]
    assert [n.args[1:] for n in grouped] == [(2, 3)], gm.graph
    close_to_scale(gm(_grouped_x(1, 3, 5)), model(_grouped_x(1, 3, 5)), "grouped 3 x 5")


def _grouped_case(rank, p, path):
    """At 4 ranks each group of q / v / k on 2 ranks, half of each of its parts a rank (2 heads):
    the weight's rows cut so, loss and gradients exact, bytes counted equal to the plan's, the state
    dict collected and relocated exactly, and a DCP checkpoint saved."""
    from refs import block_steps_match, dcp_save_model
    torch.manual_seed(0)
    model = _GroupedQKV()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, (_grouped_x(0),), tracer="export")
    plan = gm._autoshard_plan
    layout = plan.layouts["qkv.weight"]
    w = ref.qkv.weight.detach().view(2, 3, 16, 32)                 # [group, part, features, in]
    g, half = divmod(rank, 2)
    mine = w[g, :, 8 * half:8 * half + 8].reshape(24, 32)           # its group's half of q, v and k
    rows_ok = torch.equal(gm.get_parameter("qkv.weight").detach(), mine)
    counted = block_steps_match(gm, ref, _grouped_x, f"grouped at {p}")
    sd = autoshard.collect_state_dict(gm, gm.state_dict())
    collected = all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    back = autoshard.relocate_state_dict(gm, ref.state_dict())
    relocated = all(torch.equal(back[k], v) for k, v in gm.state_dict().items())
    dcp_save_model(gm, path)
    strategies = {d.strategy for d in plan.nodes.values() if d.op == "regroup"}
    return layout, rows_ok, (counted, plan.comm_bytes), collected, relocated, strategies


def _grouped_load(rank, p, path):
    from refs import dcp_load_model
    torch.manual_seed(1)                                           # other weights, then the checkpoint
    gm = autoshard.parallelize(_GroupedQKV(), p, (_grouped_x(0),), tracer="export")
    return dcp_load_model(gm, path)


def test_groups_split_within_groups_of_ranks(dist4, dist2, dist3, tmp_path):
    path = str(tmp_path / "grouped")
    for layout, rows_ok, (counted, planned), collected, relocated, strategies in dist4.run(
            _grouped_case, path, timeout=300):
        assert layout == autoshard.Shard(0, 6, groups=2), layout
        assert strategies == {"regroup"}, strategies
        assert rows_ok and collected and relocated
        assert counted == pytest.approx(planned, rel=1e-9)
    torch.manual_seed(0)
    want = _GroupedQKV().state_dict()
    for pool in (dist2, dist3):                                    # one group a rank; no grouped shard at 3
        for sd in pool.run(_grouped_load, path, timeout=300):
            assert all(torch.equal(sd[k], v) for k, v in want.items())


def _codegen_case(rank, p, root):
    """A tiny Hugging Face CodeGen (its 4 groups: two a rank at 2) exact against one process;
    save_pretrained writes `root`."""
    import transformers
    from hf_models import build_model, example_kwargs
    cfg = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64, n_ctx=64,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    model = build_model(transformers.CodeGenConfig, transformers.CodeGenForCausalLM, cfg, attn_implementation="eager")
    kw = example_kwargs(256, batch=2, seq=16)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model.train(), p, kw, tracer="export")
    plan = gm._autoshard_plan
    counted = hf_step_matches(gm, ref, kw, f"codegen at {p}")
    layouts = {plan.layouts[f"transformer.h.{i}.attn.qkv_proj.weight"] for i in range(2)}
    gm.save_pretrained(root)
    return layouts, (counted, plan.comm_bytes), ref.state_dict() if rank == 0 else None


def test_codegen_groups_at_2(dist2, tmp_path):
    import transformers
    root = str(tmp_path / "codegen")
    results = dist2.run(_codegen_case, root, timeout=300)
    for layouts, (counted, planned), _ in results:
        assert layouts == {autoshard.Shard(0, 12, groups=4)}, layouts
        assert counted == pytest.approx(planned, rel=1e-9)
    model, info = transformers.CodeGenForCausalLM.from_pretrained(root, output_loading_info=True)
    assert not any(info.values()), info
    got, want = model.state_dict(), results[0][2]
    assert all(torch.equal(got[k], v) for k, v in want.items() if k in got) and set(want) <= set(got)


class _Twice(torch.nn.Module):
    """Pure computations written twice: one copy of `x * 2` written into in place (`add_`), of
    `x * 4` fed to a ReLU module that may be in place; `x * 3` and `x - 1` read only."""

    def __init__(self):
        super().__init__()
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        a, b = x * 2, x * 2
        b.add_(1)
        c, d = x * 3, x * 3
        d += 1
        e, f = x - 1, x - 1
        g, h = x * 4, x * 4
        return a + b + c + d + e * f + g + self.relu(h)


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_duplicates_merged_unless_written_into(tracer):
    """`merge_duplicates` makes one node of a pure computation written twice (Cohere's LayerNorm
    computes `x - mean` twice), but never one that an op may write into: merged, `b.add_(1)`
    would change `a` too (symbolic_trace keeps the in-place ops; export's graph has none, and
    keeps the values)."""
    from autoshard.capture.trace import capture
    model, x = _Twice(), torch.randn(4, 8)
    gm = capture(model, (x,), tracer=tracer).gm
    torch.testing.assert_close(gm(x.clone()), model(x.clone()))
    if tracer == "symbolic_trace":
        names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
        # x - 1 once, x * 3 once (fx traces `d += 1` as a new `d + 1`); x * 2 and x * 4 twice each
        assert names.count("sub") == 1 and names.count("mul") == 6, names
