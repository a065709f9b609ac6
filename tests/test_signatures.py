"""The parallel module takes every call its model's forward takes: with and without labels,
positionally and by keyword, with an attention_mask; each new signature is captured, planned on
the parameters' existing layouts and rewritten on its first use (autoshard.rewrite.signatures)."""
import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.errors import ShardingError
from autoshard.runtime.placements import Shard
from hf_models import llama
from refs import close_to_scale, grads


class Tagger(nn.Module):
    """Logits without labels, the loss with them; an optional mask scales the embeddings; a batch
    norm (a leaf module of symbolic_trace, holding running statistics) that every call shares."""

    def __init__(self, vocab=64, h=32):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(vocab, h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.norm, self.head = nn.BatchNorm1d(h), nn.Linear(h, vocab)

    def forward(self, ids, labels=None, mask=None):
        x = self.emb(ids)
        x = self.norm(x.flatten(0, -2)).view_as(x)
        if mask is not None:
            x = x * mask[..., None]
        x = x + self.fc2(F.gelu(self.fc1(x)))
        logits = self.head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _compare_grads(gm, ref, what):
    full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters() if v.grad is not None})
    want = grads(ref)
    assert set(want) <= set(full), (what, sorted(set(want) - set(full)))
    for name, g in want.items():
        close_to_scale(full[name], g, f"{what}: grad {name}")
    gm.zero_grad(), ref.zero_grad()


def _plain_case(rank, p, tracer):
    torch.manual_seed(0)
    model = Tagger()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    mask = torch.rand(2, 8, generator=g)
    gm = autoshard.parallelize(model, p, (ids, labels), tracer=tracer)
    keys, layouts = list(gm.state_dict()), dict(autoshard.layouts(gm))
    calls = {
        "positional (the example's)": ((ids, labels), {}),
        "by keyword": ((), dict(ids=ids, labels=labels)),
        "with a mask": ((ids, labels), dict(mask=mask)),
        "labels=None": ((ids,), dict(labels=None)),
        "no labels": ((ids,), {}),
        "no labels, a mask by keyword": ((), dict(ids=ids, mask=mask)),
    }
    for what, (args, kwargs) in calls.items():
        out, want = gm(*args, **kwargs), ref(*args, **kwargs)
        close_to_scale(out, want, what)
        (out.float().pow(2).mean() if out.dim() else out).backward()
        (want.float().pow(2).mean() if want.dim() else want).backward()
        _compare_grads(gm, ref, what)
    sigs = gm._autoshard_signatures
    assert len(sigs.served) == 4, list(sigs.served)          # (ids, labels), +mask, (ids), (ids, mask)
    assert sigs.plans[next(iter(sigs.served))] is None        # the module's own graph serves the example
    assert list(gm.state_dict()) == keys and dict(autoshard.layouts(gm)) == layouts
    for plan in sigs.plans.values():
        if plan is not None:
            assert {k: v for k, v in plan.layouts.items() if isinstance(v, Shard)} == layouts
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        gm(ids, colour=1)
    close_to_scale(gm(ids[0]), ref(ids[0]), "one sequence, no batch dim")     # a new signature too
    for name, b in ref.named_buffers():          # every call updated the one set of running statistics
        close_to_scale(dict(gm.named_buffers())[name], b, f"buffer {name}")
    gm.eval(), ref.eval()
    close_to_scale(gm(ids, mask=mask), ref(ids, mask=mask), "eval, running statistics")   # the eval graph
    return len(sigs.served)


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_plain_module_every_signature(dist2, tracer):
    assert dist2.run(_plain_case, tracer) == [6, 6]       # 5 training graphs and 1 evaluation graph


def _llama_case(rank, p):
    model, kw = llama(world_size=p)
    ref = copy.deepcopy(model)
    in_eval = not model.training                   # parallelize then builds the example's eval graph too
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    sigs = gm._autoshard_signatures
    assert (False, sigs.first.key, sigs.recipe) in sigs.served or not in_eval
    del model                                      # new signatures are then captured on the meta copy
    gc.collect()
    ids, labels = kw["input_ids"], kw["labels"]
    mask = torch.ones_like(ids)
    mask[0, :5] = 0                                # left padding on the first row
    gm.train(), ref.train()

    def loss_step(what, call):
        out, want = call(gm), call(ref)
        close_to_scale(out.loss, want.loss, what)
        out.loss.backward(), want.loss.backward()
        _compare_grads(gm, ref, what)

    def logits_step(what, call):
        out, want = call(gm), call(ref)
        assert out.loss is None and want.loss is None
        close_to_scale(out.logits, want.logits, what)
        out.logits.pow(2).mean().backward(), want.logits.pow(2).mean().backward()
        _compare_grads(gm, ref, what)

    loss_step("labels by keyword", lambda m: m(input_ids=ids, labels=labels))
    logits_step("input_ids by keyword", lambda m: m(input_ids=ids))
    logits_step("input_ids by position", lambda m: m(ids))
    logits_step("an attention_mask", lambda m: m(ids, attention_mask=mask))
    loss_step("labels and an attention_mask", lambda m: m(ids, attention_mask=mask, labels=labels))
    loss_step("labels by position", lambda m: m(ids, mask, labels=labels))
    gm.eval(), ref.eval()                          # eval mode runs the evaluation graph
    with torch.no_grad():
        close_to_scale(gm(ids).logits, ref(ids).logits, "eval, input_ids only")
    return len(gm._autoshard_signatures.served) - in_eval


@pytest.mark.parametrize("world", [2, 4])
def test_llama_with_and_without_labels(request, world):
    assert request.getfixturevalue(f"dist{world}").run(_llama_case, timeout=300) == [5] * world   # (ids, labels), (ids), (ids, mask), (ids, mask, labels), eval (ids)


def _dropped_on_one_rank_case(rank, p):
    model, kw = llama(world_size=p)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    if rank == 1:                                  # one rank's collector frees the model, the other's not yet
        del model
        gc.collect()
    ids = kw["input_ids"]
    with torch.no_grad():
        close_to_scale(gm(input_ids=ids).logits, ref(input_ids=ids).logits, "no labels, the model on one rank only")
    return True


def test_a_model_dropped_on_one_rank_only(dist2):
    """Every rank captures a new call on the same source (the model only where every rank has it),
    so the ranks plan the same graph (before, the ranks' plan digests differed)."""
    assert all(dist2.run(_dropped_on_one_rank_case, timeout=300))


def test_one_process_signature_error_names_the_call():
    """A signature the module cannot be copied for says which call and why."""
    torch.manual_seed(0)
    model = Tagger()
    ids = torch.randint(0, 64, (2, 8))
    gm = autoshard.parallelize(model, 1, (ids,))
    gm._autoshard_signatures.copy_error = "TypeError: cannot pickle 'lock'"
    with pytest.raises(ShardingError, match=r"\(ids=int64\[2, 8\], labels=int64\[2, 8\]\).*cannot pickle"):
        gm(ids, ids)
    close_to_scale(gm(ids), model(ids), "the example's signature still runs")


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_capture_leaves_the_models_buffers_alone(tracer):
    """Shape propagation on fake tensors runs one-element ops for real: planning (and capturing a
    new signature) must not count a batch norm's num_batches_tracked up on the model."""
    torch.manual_seed(0)
    model = Tagger().train()
    ids = torch.randint(0, 64, (2, 8))
    before = {k: v.clone() for k, v in model.named_buffers()}
    gm = autoshard.parallelize(model, 1, (ids, ids), tracer=tracer)
    with torch.no_grad():
        gm(ids, mask=torch.ones(2, 8))             # a new signature: captured, then run once
    after = dict(model.named_buffers())
    assert after["norm.num_batches_tracked"].item() == 1
    assert not torch.equal(after["norm.running_mean"], before["norm.running_mean"])   # the one real call


class Branchy(nn.Module):
    """`if self.training:` branches beyond dropout and batch norm, which a tracer bakes in."""

    def __init__(self, h=32):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Linear(h, 8)

    def forward(self, x, y=None):
        hid = F.gelu(self.fc1(x))
        if self.training:
            hid = hid + 0.5 * hid.tanh()            # e.g. a router's jitter, a training-only term
        x = x + self.fc2(hid)
        logits = self.head(x * 2.0 if not self.training else x)
        return logits if y is None else F.cross_entropy(logits, y)


def _branch_case(rank, p, tracer, train_at_capture):
    torch.manual_seed(0)
    model = Branchy().train(train_at_capture)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    gm = autoshard.parallelize(model, p, (x, y), tracer=tracer)
    for mode in (True, False, True):
        gm.train(mode), ref.train(mode)
        loss, want = gm(x, y), ref(x, y)
        close_to_scale(loss, want, f"loss, training={mode}")
        loss.backward(), want.backward()
        _compare_grads(gm, ref, f"training={mode}")
        close_to_scale(gm(x), ref(x), f"logits, training={mode}")
    return sorted(k[0] for k in gm._autoshard_signatures.served)


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
@pytest.mark.parametrize("train_at_capture", [True, False], ids=["captured_in_train", "captured_in_eval"])
def test_training_branches_follow_the_mode(dist2, tracer, train_at_capture):
    assert dist2.run(_branch_case, tracer, train_at_capture) == [[False, False, True, True]] * 2
