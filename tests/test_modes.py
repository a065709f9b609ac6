"""The parallel module behaves like its model in train and eval modes, and its dropout draws from
autoshard's streams: replicated activations one mask on every rank, sharded ones a mask per rank,
or, with dropout_masks="single_process", the mask one process draws under the same seed."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.nn.dropout import ParallelAttention, ParallelDropout
from hf_models import gpt2
from models import GPT
from refs import close_to_scale, grads


class DropMLP(nn.Module):
    """Dropout on a replicated input, on the column-split hidden (sharded), and after the
    row-parallel output; functional dropout on the hidden too; a batch norm on the input."""

    def __init__(self, h=32, p=0.2, bn=True):
        super().__init__()
        self.bn = nn.BatchNorm1d(h) if bn else nn.Identity()
        self.fc1, self.fc2, self.head = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Linear(h, 8)
        self.drop_in, self.drop_hidden, self.drop_out = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)
        self.p = p

    def forward(self, x, y):
        x = self.drop_in(self.bn(x))
        hid = self.drop_hidden(F.gelu(self.fc1(x)))
        hid = F.dropout(hid, self.p, self.training)
        x = x + self.drop_out(self.fc2(hid))
        return F.cross_entropy(self.head(x), y)


def _mlp_inputs(seed=0, n=16, h=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g), torch.randint(0, 8, (n,), generator=g)


def _eval_equals_and_train_is_random(gm, ref, call):
    """Eval: loss and every gradient equal the model's eval; train: two calls differ."""
    gm.eval(), ref.eval()
    loss, want = call(gm), call(ref)
    close_to_scale(loss, want, "eval loss")
    loss.backward(), want.backward()
    full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters() if v.grad is not None})
    for name, g in grads(ref).items():
        close_to_scale(full[name], g, f"eval grad {name}")
    gm.zero_grad(), ref.zero_grad()
    gm.train()
    with torch.no_grad():
        a, b = call(gm), call(gm)
    return (a - b).abs().item()


def _modes_case(rank, p, train_at_capture):
    out = {}
    model, kw = gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model.train(train_at_capture)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    assert gm.training == train_at_capture
    kinds = {type(m) for m in gm.modules()}
    assert ParallelDropout in kinds and ParallelAttention in kinds, kinds
    out["gpt2"] = _eval_equals_and_train_is_random(gm, ref, lambda m: m(**kw).loss)
    for tracer in ("symbolic_trace", "export"):
        torch.manual_seed(1)
        model = DropMLP().train(train_at_capture)
        ref = copy.deepcopy(model)
        x, y = _mlp_inputs()
        gm = autoshard.parallelize(model, p, (x, y), tracer=tracer)
        out[tracer] = _eval_equals_and_train_is_random(gm, ref, lambda m: m(x, y))
        ref.train()                        # running statistics follow the module's mode as the model's do
        with torch.no_grad():
            for name, buf in ref.named_buffers():      # from the same statistics (the train calls above moved gm's)
                buf.copy_(dict(gm.named_buffers())[name])
            gm(x, y), ref(x, y)
        bn = dict(gm.named_buffers())
        for name, b in ref.named_buffers():
            assert torch.allclose(bn[name].float(), b.float(), atol=1e-6), (tracer, name)
    return out


@pytest.mark.parametrize("train_at_capture", [True, False], ids=["captured_in_train", "captured_in_eval"])
def test_train_and_eval_follow_the_module_mode(dist2, train_at_capture):
    for r in dist2.run(_modes_case, train_at_capture):
        assert all(diff > 0 for diff in r.values()), r


def _seeds_case(rank, p, masks):
    torch.manual_seed(0)                  # the same model on every rank
    model = GPT(vocab=128, h=64, heads=4, blocks=2, seq=16, dropout=0.1)
    mlp = DropMLP(h=64, bn=False)
    torch.manual_seed(1000 + rank)        # then per-rank global generators, as data shuffling does
    g = torch.Generator().manual_seed(5)  # the same data on every rank
    idx = torch.randint(0, 128, (4, 16), generator=g)
    gm = autoshard.parallelize(model.train(), p, (idx, idx), dropout_masks=masks)
    gm2 = autoshard.parallelize(mlp.train(), p, (torch.randn(8, 64, generator=g), torch.randint(0, 8, (8,), generator=g)),
                                dropout_masks=masks)
    opt = torch.optim.AdamW(list(gm.parameters()) + list(gm2.parameters()), lr=1e-2)
    for step in range(3):
        idx = torch.randint(0, 128, (4, 16), generator=g)
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 8, (8,), generator=g)
        torch.rand(7)                     # the user draws from the global generator as they like
        (gm(idx, idx) + gm2(x, y)).backward()
        opt.step(), opt.zero_grad()
    differ = []
    for module in (gm, gm2):
        layouts = autoshard.layouts(module)
        for name, t in module.state_dict().items():
            if name in layouts:
                continue
            every = [torch.empty_like(t) for _ in range(p)]
            dist.all_gather(every, t.contiguous())
            if not all(torch.equal(every[0], e) for e in every[1:]):
                differ.append(name)
    # the sharded hidden's masks: independent per rank, or slices of one mask
    drop = next(m for m in gm2.modules() if isinstance(m, ParallelDropout) and m.shard is not None)
    mask = drop(torch.ones(8, 256 // p)) > 0
    every = [torch.empty_like(mask) for _ in range(p)]
    dist.all_gather(every, mask)
    return differ, [torch.equal(every[0], e) for e in every[1:]]


def test_replicated_parameters_stay_identical_with_per_rank_seeds(dist2):
    for differ, same_masks in dist2.run(_seeds_case, "independent"):
        assert differ == [], f"replicated tensors that differ across ranks: {differ}"
        assert not any(same_masks), "the shards of a sharded activation drew the same mask"


def _single_process_case(rank, p, tracer):
    torch.manual_seed(3)
    model = DropMLP(bn=False).train()
    ref = copy.deepcopy(model)
    x, y = _mlp_inputs(1)
    gm = autoshard.parallelize(model, p, (x, y), tracer=tracer, dropout_masks="single_process")
    assert any(isinstance(m, ParallelDropout) and m.shard is not None for m in gm.modules()), \
        "no dropout on a sharded activation: the case would not test the slices"
    torch.manual_seed(11)
    want = ref(x, y)
    autoshard.manual_seed(11)
    loss = gm(x, y)
    close_to_scale(loss, want, "loss")
    loss.backward(), want.backward()
    full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters()})
    for name, g in grads(ref).items():
        close_to_scale(full[name], g, f"grad {name}")
    return loss.item()


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_single_process_masks_equal_the_model_under_the_same_seed(dist2, tracer):
    losses = dist2.run(_single_process_case, tracer)
    assert losses[0] == losses[1]


def test_single_process_masks_at_four(dist4):
    dist4.run(_single_process_case, "export")


def _single_process_attention_case(rank, p):
    """GPT-2 with dropout in the embeddings, the residuals and inside attention (split by heads):
    with single_process masks, the loss and every gradient equal the model's under one seed."""
    model, kw = gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model.train()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", dropout_masks="single_process")
    assert any(isinstance(m, ParallelAttention) and m.shard is not None for m in gm.modules()), \
        "attention is not split by heads: the case would not test the sliced attention mask"
    torch.manual_seed(11)
    want = ref(**kw).loss
    autoshard.manual_seed(11)
    loss = gm(**kw).loss
    close_to_scale(loss, want, "loss")
    loss.backward(), want.backward()
    full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters()})
    for name, g in grads(ref).items():
        close_to_scale(full[name], g, f"grad {name}")
    autoshard.manual_seed(12)
    with torch.no_grad():
        assert gm(**kw).loss.item() != loss.item()          # another seed, other masks: dropout is on
    return loss.item()


@pytest.mark.parametrize("world", [2, 4])
def test_single_process_masks_inside_attention(request, world):
    losses = request.getfixturevalue(f"dist{world}").run(_single_process_attention_case)
    assert len(set(losses)) == 1


def _seed_mismatch_case(rank, p):
    autoshard.manual_seed(rank)
    with pytest.raises(autoshard.ProcessGroupError, match=r"different seeds .*\[0, 1\]"):
        autoshard.parallelize(DropMLP(), p, _mlp_inputs())
    return True


def test_different_manual_seeds_are_refused(dist2):
    assert all(dist2.run(_seed_mismatch_case))


def test_bad_dropout_masks_option():
    with pytest.raises(ValueError, match="dropout_masks must be one of"):
        autoshard.parallelize(DropMLP(), 1, _mlp_inputs(), dropout_masks="same")
