"""Capture's normal forms (autoshard.normalize): graphs rewritten, equal in value, into forms the
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
    from autoshard.capture import capture
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
