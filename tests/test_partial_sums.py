"""A Partial summand plus a whole tensor stays Partial (`rules.pointwise`, strategy
"partial_plus"): each rank adds its 1/p share of the whole operand, so the ranks' summands add it
once. BERT and RoBERTa sum a vocabulary-split word embedding (Partial), replicated token-type
embeddings and position embeddings: with the position table split by rows (a masked lookup,
Partial as well), the three need one all-reduce, as in Megatron, instead of one all-reduce for
the words and an all-gather for the positions.

Gloo ranks against the single-process model: tiny Hugging Face RoBERTa (vocabulary 257, 40
positions: uneven at 3) and BERT masked LMs, and a plain module whose whole operand comes first
in a subtraction (`bias - x`). Each checks the loss, the logits and every gradient, the bytes
counted against the plan's, the strategy taken and that the embeddings move nothing but that
one all-reduce; the Hugging Face ones also in eval mode at another shape. A tiny BLOOM whose
residual stream is held split between layers reduce-scatters each row layer's output to the split
residual instead of gathering the residual to add it while Partial (`State.reduce_early`).
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
from autoshard.runtime.collectives import count_comm  # noqa: E402
from refs import close_to_scale, grads_match, hf_step_matches  # noqa: E402


def _masked_lm(kind):
    import transformers
    from hf_models import build_model, example_kwargs
    extra = dict(type_vocab_size=1, pad_token_id=1) if kind == "roberta" else {}
    cfg = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)
    config, model = {"roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM),
                     "bert": (transformers.BertConfig, transformers.BertForMaskedLM)}[kind]
    kw = example_kwargs(257, batch=2, seq=24)
    kw["labels"] = torch.where(kw["input_ids"] % 3 == 0, kw["input_ids"], -100)
    return build_model(config, model, cfg).train(), kw


def _embedding_comm(plan, prefix):
    """(forward, backward) collectives of the tensors the embeddings' module makes."""
    mods = {n: d.module for n, d in plan.nodes.items()}
    return [(r.forward, r.backward) for r in plan.redistributions
            if (r.forward or r.backward) and mods.get(r.node, "").startswith(prefix)]


def _hf_case(rank, p, kind):
    model, kw = _masked_lm(kind)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    plan = gm._autoshard_plan
    emb = f"{kind}.embeddings"
    counted = hf_step_matches(gm, ref, kw, f"{kind} at {p}")
    # eval mode at another shape (dropout layers off in both)
    gm.eval(), ref.eval()
    ids = torch.randint(257, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        close_to_scale(gm(input_ids=ids).logits, ref(input_ids=ids).logits, f"{kind} at {p}, eval 3 x 11")
    sums = [d.strategy for d in plan.nodes.values() if d.module == emb and d.op in ("add.Tensor", "add_.Tensor")]
    # (RoBERTa's position ids are integer sums of their own, replicated)
    dims = {k.rsplit(".", 1)[-1]: v for k, v in plan.dims.items() if k.startswith(emb)}
    return dims, sums, _embedding_comm(plan, emb), (counted, plan.comm_bytes)


@pytest.mark.parametrize("kind,world", [("roberta", 3), ("bert", 4)])
def test_embedding_sum_reduced_once(kind, world, request):
    for dims, sums, comm, (counted, planned) in request.getfixturevalue(f"dist{world}").run(
            _hf_case, kind, timeout=300):
        assert counted == pytest.approx(planned, rel=1e-9)
        assert dims == {"word_embeddings": 0, "position_embeddings": 0, "token_type_embeddings": None}, dims
        assert sums[-2:] == ["partial_plus", "partial"], sums      # (words + types) + positions
        # forward: the one all-reduce of the sum (backward: the all-reduce of the first layer's input
        # gradient, Megatron's as well)
        assert [f for f, _ in comm if f] == [("all_reduce",)], comm
        assert not any("all_gather" in b for _, b in comm), comm


class _Subtracted(nn.Module):
    """A whole operand first in a subtraction: `positions - (bias - words)`, both tables pinned
    split by rows, so that one all-reduce after both sums is the cheapest plan."""

    def __init__(self, vocab=257, positions=40, hidden=48):
        super().__init__()
        self.words = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.bias = nn.Parameter(torch.randn(hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.positions(pos) - (self.bias - self.words(ids))
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())


def _subtracted_case(rank, p):
    torch.manual_seed(0)
    model = _Subtracted()
    ids = torch.randint(257, (4, 40), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, (ids, ids), pin={"words": 0, "positions": 0})   # (at these sizes a
    # split by features, the other cheap plan, would win)
    plan = gm._autoshard_plan
    with count_comm() as c:
        loss = gm(ids, ids)
        loss.backward()
    want = ref(ids, ids)
    want.backward()
    close_to_scale(loss, want, f"subtracted at {p}: loss")
    grads_match(gm, ref, f"subtracted at {p}")
    subs = {n: d.strategy for n, d in plan.nodes.items() if d.op.startswith("sub")}
    reduces = [r.node for r in plan.redistributions if "all_reduce" in r.forward]
    return dict(plan.dims), subs, reduces, (c.bytes, plan.comm_bytes)


def test_whole_operand_first_in_a_subtraction(dist3):
    for dims, subs, reduces, (counted, planned) in dist3.run(_subtracted_case, timeout=120):
        assert counted == pytest.approx(planned, rel=1e-9)
        assert dims["words"] == 0 and dims["positions"] == 0, dims
        assert sorted(subs.values()) == ["partial", "partial_plus"], subs
        assert len(reduces) == 1, reduces


def test_in_place_sum_never_shares_its_own_input():
    """`x.add_(partial)` would leave x's storage holding x / p: the rule offers the share only of
    the operand that is not written."""
    from autoshard.planner.rules.registry import NodeInfo, lookup

    class M(nn.Module):
        def forward(self, x, y):
            return x.add_(y)

    gm = torch.fx.symbolic_trace(M())
    for n in gm.graph.nodes:
        n.meta["val"] = torch.zeros(4, 8)
    node = next(n for n in gm.graph.nodes if n.op == "call_method")
    info = NodeInfo(node, 2)
    plus = [s for s in lookup(node, {})(info) if s.name == "partial_plus"]
    x, y = info.inputs
    assert [(str(s.inputs[0]), str(s.inputs[1])) for s in plus] == [("P", "R")], plus


def _bloom_stream_case(rank, p):
    """A tiny BLOOM whose plan holds the residual stream split on hidden between the layer norms
    (split norms, reduce-scatter and all-gather: Megatron's sequence parallelism on features) at a
    price of state of 1e-9 s a byte, in train mode with residual dropout on and single-process masks."""
    import transformers
    from hf_models import build_model, example_kwargs
    cfg = dict(vocab_size=256, hidden_size=512, n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.0)
    model = build_model(transformers.BloomConfig, transformers.BloomForCausalLM, cfg, attn_implementation="eager")
    model.train()
    ref = copy.deepcopy(model)
    kw = example_kwargs(256, batch=2, seq=128)
    # (a price of state: without one the norms stay whole, the stream with them)
    gm = autoshard.parallelize(model, p, kw, tracer="export", dropout_masks="single_process", memory_weight=1e-9)
    torch.manual_seed(11)
    want = ref(**kw)
    autoshard.manual_seed(11)
    with count_comm() as c:
        res = gm(**kw)
        res.loss.backward()
    want.loss.backward()
    close_to_scale(res.loss, want.loss, f"bloom at {p}: loss")
    close_to_scale(res.logits, want.logits, f"bloom at {p}: logits")
    grads_match(gm, ref, f"bloom at {p}")
    plan = gm._autoshard_plan
    residual = {d.module: d.strategy for d in plan.nodes.values()
                if d.op == "add.Tensor" and d.module.endswith(".mlp")}
    gathered_to_sum = [r.node for r in plan.redistributions if "all_gather" in r.forward
                       and any(plan.nodes[u].strategy == "partial_plus" for u in r.consumers if u in plan.nodes)]
    norms = {k: v for k, v in plan.layouts.items() if "layernorm" in k and k.endswith("weight")}
    return residual, gathered_to_sum, norms, (c.bytes, plan.comm_bytes)


def test_row_output_reduced_to_a_split_residual(dist2):
    """BLOOM's MLP adds its residual, held split, to the row layer's Partial output. The per-node
    choice gathered the residual whole to add it while Partial, then reduce-scattered the sum
    for the next norm; `State.reduce_early` reduce-scatters the row layer's output instead and
    adds the split residual to it: one all-gather a layer less, exact with dropout on."""
    for residual, gathered, norms, (counted, planned) in dist2.run(_bloom_stream_case, timeout=300):
        assert counted == pytest.approx(planned, rel=1e-9)
        assert any(str(v).startswith("S") for v in norms.values()), norms     # the stream is split
        assert len(residual) == 2 and set(residual.values()) == {"shard(2)"}, residual
        assert gathered == [], gathered
