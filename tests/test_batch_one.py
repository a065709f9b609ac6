"""An example of batch 1 (or sequence length 1), the example users reach for first, does not fix
that dim: capture runs at size 2 where the example has size 1 (torch.export specialises sizes 0
and 1), so a module planned from (1, 16) takes (3, 16), (2, 1) and (1, 9) as the model does. A
model that really needs a size-1 dim is still planned for size 1 there, with a note."""
import copy

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.capture.trace import capture
from autoshard.capture.dynamic import dynamic_dims
from hf_models import llama
from models import GPT
from refs import close_to_scale, grads

SHAPES = [(1, 16), (3, 16), (2, 1), (1, 9)]          # the example's first, then the others


def _ids(shape, vocab, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _compare_grads(gm, ref, what):
    """Every gradient equals the model's to 1e-5 of its largest entry, plus 1e-7 of the model's
    largest gradient entry: a gradient that is zero in exact arithmetic (a key bias's; the query's
    and key's at one position) is roundoff of the gradients around it."""
    full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters() if v.grad is not None})
    want = grads(ref)
    assert want and set(want) <= set(full), (what, sorted(set(want) - set(full)))
    top = max(g.abs().max().item() for g in want.values())
    for name, g in want.items():
        torch.testing.assert_close(full[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item() + 1e-7 * top,
                                   msg=lambda m: f"{what}: grad {name}: {m}")
    gm.zero_grad(), ref.zero_grad()


def _llama_case(rank, p):
    model, kw = llama(world_size=p, batch=1, seq=16)
    ref = copy.deepcopy(model)
    vocab = model.config.vocab_size
    assert tuple(kw["input_ids"].shape) == (1, 16)
    gm = autoshard.parallelize(model, p, {"input_ids": kw["input_ids"], "labels": kw["labels"]}, tracer="export")
    served = len(gm._autoshard_signatures.served)
    for i, shape in enumerate(SHAPES):
        ids = _ids(shape, vocab, i)
        out, want = gm(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
        close_to_scale(out.logits, want.logits, f"{shape}: logits")
        if shape[1] == 1:                # nothing to predict after one token: the model's loss is nan
            assert out.loss.isnan() and want.loss.isnan(), (out.loss, want.loss)
            out.logits.pow(2).mean().backward(), want.logits.pow(2).mean().backward()
        else:
            close_to_scale(out.loss, want.loss, f"{shape}: loss")
            out.loss.backward(), want.loss.backward()
        _compare_grads(gm, ref, str(shape))
    assert len(gm._autoshard_signatures.served) == served       # every shape ran the planned graph
    return [n.meta.get("autoshard_dynamic") for n in gm._autoshard_plan.graph_module.graph.nodes
            if n.op == "placeholder"]


def test_llama_planned_at_batch_one(dist2):
    """A Hugging Face LLaMA (torch.export) parallelized from input_ids of (1, 16) with labels."""
    assert dist2.run(_llama_case, timeout=300) == [[frozenset({0, 1})] * 2] * 2


def _gpt_case(rank, p, example, tracer):
    torch.manual_seed(0)
    model = GPT(vocab=128, h=64, heads=4, blocks=2, seq=32)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, example, tracer=tracer)
    served = len(gm._autoshard_signatures.served)
    with_targets = len(example) == 2
    for i, shape in enumerate(SHAPES):
        idx, targets = _ids(shape, 128, 2 * i), _ids(shape, 128, 2 * i + 1)
        call = (idx, targets) if with_targets else (idx,)
        out, want = gm(*call), ref(*call)
        close_to_scale(out, want, str(shape))
        if not with_targets:
            out, want = out.pow(2).mean(), want.pow(2).mean()
        out.backward(), want.backward()
        _compare_grads(gm, ref, str(shape))
    assert len(gm._autoshard_signatures.served) == served
    return gm._autoshard_plan.tracer


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_gpt_planned_at_batch_one(dist2, tracer):
    """The plain GPT from (idx, targets) of (1, 16), with either tracer."""
    example = (_ids((1, 16), 128, 100), _ids((1, 16), 128, 101))
    assert dist2.run(_gpt_case, example, tracer) == [tracer] * 2


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_shapes_only_batch_one(dist2, tracer):
    """A shapes-only example, torch.Size([1, 16]) (token ids of that shape), gives logits."""
    assert dist2.run(_gpt_case, (torch.Size([1, 16]),), tracer) == [tracer] * 2


class OneSequence(nn.Module):
    """Reads one sequence: its batch dim must be 1 (it is viewed away)."""

    def __init__(self, vocab=64, h=32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, h), nn.Linear(h, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x.view(x.size(1), x.size(2)))


class MaskedMixer(nn.Module):
    """Attention with an additive float mask of (1, 1, T, T): its dim 1 broadcasts over 4 heads."""

    def __init__(self, vocab=64, h=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb, self.qkv, self.o = nn.Embedding(vocab, h), nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, ids, mask):
        B, T = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2) + mask).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, -1))


def _free(plan):
    return {n.target: dynamic_dims(n) for n in plan.graph_module.graph.nodes if n.op == "placeholder"}


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_a_dim_the_model_needs_at_one_stays_one(tracer):
    """The model fails at batch 2: planned for batch 1 (as before), with a note naming the dim."""
    ids = torch.zeros(1, 16, dtype=torch.long)
    plan = autoshard.plan(OneSequence(), 2, (ids,), tracer=tracer)
    assert plan.tracer == tracer
    assert _free(plan) == {"ids": frozenset({1})}
    assert any("ids dim 0" in note and "only size 1" in note for note in plan.notes), plan.notes
    assert plan.dims


def test_a_broadcast_dim_stays_one():
    """torch.export fails with the mask's head dim at 2 (4 heads): that dim alone stays 1, the
    batch dims of ids and mask and the sequence dims are free."""
    ids, mask = torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 1, 8, 8)
    cap = capture(MaskedMixer(), (ids, mask), tracer="export")
    free = {n.target: dynamic_dims(n) for n in cap.gm.graph.nodes if n.op == "placeholder"}
    assert free == {"ids": frozenset({0, 1}), "mask": frozenset({0, 2, 3})}, free
    assert [note for note in cap.notes if "mask dim 1" in note and "only size 1" in note], cap.notes
    assert not any("ids dim" in note for note in cap.notes), cap.notes
    assert cap.args[0] is ids and cap.args[1] is mask          # the plan keeps the user's example


def test_meta_model_planned_from_shapes_at_batch_one():
    """autoshard.from_pretrained's default example: a meta model and input_ids of (1, tokens)."""
    model, _ = llama()
    with torch.device("meta"):
        meta = type(model)(model.config)
    plan = autoshard.plan(meta, 2, {"input_ids": torch.Size([1, 16])}, tracer="export")
    assert _free(plan) == {"input_ids": frozenset({0, 1})}
    assert tuple(plan.example[1]["input_ids"].shape) == (1, 16)
    assert all(p.is_meta for p in meta.parameters())
