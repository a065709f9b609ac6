"""Dims that do not divide by the degree: a vocabulary of 257 (and 50257) split at torch.chunk's
boundaries, as DTensor splits (257 on 3 ranks: 86, 86, 85).

Gloo ranks at world 2, 3 and 4 against the single-process model: the loss and every gradient
(tied and untied heads, the GPT of tests/models.py and tiny Hugging Face GPT-2 and BERT through
torch.export), the logits returned whole or as a DTensor whose `full_tensor()` is the model's; the
layouts hold the global size; state dicts collect and relocate; a checkpoint saved at 3 ranks
loads at 2 and 4; `parallelize(load=)` reads each rank's uneven rows from a file.
"""
import copy
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.runtime.collectives import count_comm  # noqa: E402
from autoshard.runtime.placements import chunk_sizes  # noqa: E402
from models import GPT  # noqa: E402
from refs import close_to_scale, dcp_load_model, dcp_save_model, grads_match  # noqa: E402


def _gpt(vocab, h=32, tied=True, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return GPT(vocab=vocab, h=h, heads=4, blocks=1, seq=32, tied=tied, dropout=dropout)


def _ids(vocab, seed=0, batch=2, seq=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g)



def _uneven_rows(gm, key, vocab, rank, p):
    layout = gm._autoshard_layouts[key]
    assert layout == autoshard.Shard(0, 1, vocab), layout
    assert gm.get_parameter(key).shape[0] == chunk_sizes(vocab, p)[rank]


# ----------------------------------------------------------------------------- ranks

def _gpt_case(rank, p, vocab, h, tied):
    """outputs='sharded' keeps the vocabulary split (head and loss vocabulary-parallel): the loss
    with targets, the logits as a DTensor without; outputs='full' returns the logits whole."""
    model = _gpt(vocab, h, tied)
    ref = copy.deepcopy(model)
    idx, tgt = _ids(vocab)
    out = {}
    # the vocabulary split pinned: at this toy size (h = 32) a hidden-split embedding costs about as
    # much, and the search may take it; the case is the vocabulary's uneven rows
    vocab_split = {"wte": 0} if tied else {"head": -1}
    gm = autoshard.parallelize(copy.deepcopy(model), p, (idx, tgt), outputs="sharded", pin=vocab_split)
    _uneven_rows(gm, "head.weight", vocab, rank, p)
    with count_comm() as c:
        loss = gm(idx, tgt)
        loss.backward()
    out["measured"], out["plan"] = c.bytes, gm._autoshard_plan.comm_bytes
    want = ref(idx, tgt)
    want.backward()
    close_to_scale(loss, want, "loss")
    grads_match(gm, ref, f"vocab {vocab} at {p}")

    logits = gm(idx)                                   # another signature: the logits, still split
    from torch.distributed.tensor import DTensor
    assert isinstance(logits, DTensor) and logits.to_local().shape[-1] == chunk_sizes(vocab, p)[rank]
    close_to_scale(logits.full_tensor(), ref(idx), "logits.full_tensor()")

    full = autoshard.parallelize(copy.deepcopy(model), p, (idx,))          # logits whole, gathered padded
    close_to_scale(full(idx), ref(idx), "logits (outputs='full')")
    ref.zero_grad(set_to_none=True)
    full(idx).square().mean().backward()
    ref(idx).square().mean().backward()
    grads_match(full, ref, f"vocab {vocab} at {p}, logits gathered")

    # state dicts: collect gives the model's, relocate gives this rank's shards back
    sd = autoshard.collect_state_dict(gm, gm.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, msg=lambda m: f"collect {k}: {m}")
    back = autoshard.relocate_state_dict(gm, ref.state_dict())
    for k, v in gm.state_dict().items():
        assert torch.equal(back[k], v), k
    sd0 = autoshard.collect_state_dict(gm, gm.state_dict(), dst=0)
    assert (len(sd0) > 0) == (rank == 0)
    return out


@pytest.mark.parametrize("world,vocab,h,tied", [(2, 257, 32, True), (3, 257, 32, True), (4, 257, 32, True),
                                                (3, 257, 32, False), (4, 50257, 16, True)],
                         ids=["2-v257-tied", "3-v257-tied", "4-v257-tied", "3-v257-untied", "4-v50257-tied"])
def test_odd_vocabulary_is_split_exactly(world, vocab, h, tied, request):
    pool = request.getfixturevalue(f"dist{world}")
    for r in pool.run(_gpt_case, vocab, h, tied, timeout=240):
        assert r["measured"] == pytest.approx(r["plan"], rel=1e-9), r


def _hf_case(rank, p, arch, vocab):
    import hf_models
    model, kw = getattr(hf_models, arch)(vocab_size=vocab, seed=0)
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(copy.deepcopy(model), p, kw, tracer="export", outputs="sharded")
    key = "transformer.wte.weight" if arch == "gpt2" else "bert.embeddings.word_embeddings.weight"
    _uneven_rows(gm, key, vocab, rank, p)
    res = gm(**kw)
    res.loss.backward()
    want = ref(**kw)
    want.loss.backward()
    close_to_scale(res.loss, want.loss, f"{arch}: loss")
    close_to_scale(res.logits.full_tensor(), want.logits, f"{arch}: logits")
    grads_match(gm, ref, f"{arch} vocab {vocab} at {p}")
    return True


@pytest.mark.parametrize("world,arch", [(3, "gpt2"), (4, "bert")])
def test_hugging_face_odd_vocabulary(world, arch, request):
    assert all(request.getfixturevalue(f"dist{world}").run(_hf_case, arch, 1001, timeout=300))


# ----------------------------------------------------------------------------- checkpoints and load=

VOCAB = 257


def _trained(p):
    """The GPT at degree p after one AdamW step (so the optimizer holds uneven moments too)."""
    gm = autoshard.parallelize(_gpt(VOCAB, seed=0), p, _ids(VOCAB))
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    gm(*_ids(VOCAB)).backward()
    opt.step()
    return gm, opt


def _save3(rank, p, path):
    gm, opt = _trained(p)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    moments = {name: autoshard.collect_state_dict(gm, {name: opt.state[t]["exp_avg"]})[name]
               for name, t in gm.named_parameters()}
    torch.save(full, path + ".full.pt")
    return full, moments


def _load(rank, p, path):
    gm = autoshard.parallelize(_gpt(VOCAB, seed=1), p, _ids(VOCAB))
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    autoshard.checkpoint.set_state_dict(gm, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    moments = {name: autoshard.collect_state_dict(gm, {name: opt.state[t]["exp_avg"]})[name]
               for name, t in gm.named_parameters()}
    # parallelize(load=) from the full state saved by torch.save: this rank's rows only
    with torch.device("meta"):
        meta = GPT(vocab=VOCAB, h=32, heads=4, blocks=1, seq=32, tied=True)
    loaded = autoshard.parallelize(meta, p, _ids(VOCAB), load=path + ".full.pt")
    return full, moments, autoshard.collect_state_dict(loaded, loaded.state_dict())


def test_checkpoint_saved_at_3_loads_at_2_and_4(dist2, dist3, dist4, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = dist3.run(_save3, path, timeout=240)[0]
    for pool in (dist2, dist4):
        for full, moments, loaded in pool.run(_load, path, timeout=240):
            for k, v in saved[0].items():
                torch.testing.assert_close(full[k], v, msg=lambda m: f"{k} at {pool.world_size}: {m}")
                torch.testing.assert_close(loaded[k], v, msg=lambda m: f"load= {k}: {m}")
            for k, v in saved[1].items():
                torch.testing.assert_close(moments[k], v, msg=lambda m: f"exp_avg of {k}: {m}")


# ----------------------------------------------------------------------------- one process

def test_layout_reports_local_sizes_per_rank():
    plan = autoshard.plan(_gpt(VOCAB), 3, _ids(VOCAB), outputs="sharded", pin={"wte": 0})
    assert plan.layouts["head.weight"] == autoshard.Shard(0)
    text = plan.report()
    assert "86/86/85" in text, text


# ----------------------------------------------------------------------------- heads that do not divide

def _heads_case(rank, p, arch, heads, kv_heads, hidden):
    """Attention whose heads do not divide by the degree: q / k / v split in whole heads
    (`Shard(0, unit=head_dim)`, torch.chunk's boundaries over the heads: 7 heads on 4 ranks hold
    2, 2, 2, 1) where they can be, and every case exact against one process."""
    import hf_models
    if arch == "gpt":
        torch.manual_seed(0)
        model = GPT(vocab=512, h=hidden, heads=heads, blocks=1, seq=64, tied=False)
        idx, tgt = _ids(512, seq=64)
        args, kw = (idx, tgt), {}
    else:
        model, kw = hf_models.qwen2(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    intermediate_size=2 * hidden, vocab_size=512, seq=64)
        args = ()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw or args, tracer="export" if arch != "gpt" else "auto")
    out = gm(*args, **kw)
    loss = out if arch == "gpt" else out.loss
    loss.backward()
    want = ref(*args, **kw)
    want = want if arch == "gpt" else want.loss
    want.backward()
    close_to_scale(loss, want, f"{arch} {heads}/{kv_heads} heads at {p}: loss")
    grads_match(gm, ref, f"{arch} {heads}/{kv_heads} heads at {p}")
    return {k: v for k, v in gm._autoshard_plan.layouts.items() if "q" in k.rsplit(".", 2)[-2] and k.endswith("weight")}


@pytest.mark.parametrize("world,arch,heads,kv_heads,hidden", [(4, "gpt", 7, 7, 56), (3, "qwen2", 7, 7, 56),
                                                              (4, "gpt", 6, 6, 48), (4, "qwen2", 7, 1, 56),
                                                              (4, "qwen2", 6, 2, 48)])
def test_heads_that_do_not_divide(world, arch, heads, kv_heads, hidden, request):
    layouts = request.getfixturevalue(f"dist{world}").run(_heads_case, arch, heads, kv_heads, hidden, timeout=300)[0]
    if world == 4 and heads == kv_heads:     # 7 heads of 8 on 4 ranks: 2, 2, 2, 1 heads each; 6: 2, 2, 1, 1
        assert autoshard.Shard(0, unit=8) in layouts.values(), layouts


# ----------------------------------------------------------------------------- balanced splits

class Narrow(torch.nn.Module):
    """A 6-feature middle layer at 4 ranks: torch.chunk's boundaries (2, 2, 2, 0) would leave a
    rank empty, so the split is balanced (2, 2, 1, 1)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 6), torch.nn.Linear(6, 16)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h), h


def _balanced_case(rank, p, path):
    torch.manual_seed(0)
    model = Narrow()
    ref = copy.deepcopy(model)
    x = torch.randn(512, 16)
    # pinned: at these sizes the search might replicate the 6 features instead
    gm = autoshard.parallelize(model, p, (x,), pin={"fc1": -1, "fc2": 0}, outputs="sharded")
    assert gm._autoshard_layouts["fc1.weight"] == autoshard.Shard(0, 1, 6), gm._autoshard_layouts
    assert gm.get_parameter("fc1.weight").shape[0] == [2, 2, 1, 1][rank]
    y, h = gm(x)
    y_ref, h_ref = ref(x)
    close_to_scale(y, y_ref, "output")
    assert not hasattr(h, "full_tensor"), "a balanced split is no DTensor: returned whole"
    close_to_scale(h, h_ref, "split output, gathered")
    (y.square().mean() + h.sum()).backward()
    (y_ref.square().mean() + h_ref.sum()).backward()
    grads_match(gm, ref, f"6 features at {p}")
    sd = autoshard.collect_state_dict(gm, gm.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, msg=lambda m: f"collect {k}: {m}")
    back = autoshard.relocate_state_dict(gm, ref.state_dict())
    assert all(torch.equal(back[k], v) for k, v in gm.state_dict().items())
    dcp_save_model(gm, path)
    return sd


def _balanced_load(rank, p, path):
    torch.manual_seed(1)
    model = Narrow()
    gm = autoshard.parallelize(model, p, (torch.randn(512, 16),), pin={"fc1": -1, "fc2": 0})
    return dcp_load_model(gm, path)


def test_balanced_split_is_exact_and_checkpoints_across_degrees(dist2, dist3, dist4, tmp_path):
    path = str(tmp_path / "balanced")
    saved = dist4.run(_balanced_case, path, timeout=240)[0]
    for pool in (dist2, dist3):
        for loaded in pool.run(_balanced_load, path, timeout=240):
            for k, v in saved.items():
                torch.testing.assert_close(loaded[k], v, msg=lambda m: f"{k} at {pool.world_size}: {m}")


def test_balanced_boundaries():
    from autoshard.runtime.placements import Shard, dtensor_boundaries, splits
    from autoshard.runtime.pieces import boxes
    assert chunk_sizes(257, 3) == [86, 86, 85]                   # torch.chunk's, where no rank is empty
    assert chunk_sizes(12, 8) == [2, 2, 2, 2, 1, 1, 1, 1]        # balanced where it would leave one empty
    assert chunk_sizes(768, 8, 64) == [128] * 4 + [64] * 4       # the features of 12 heads of 64
    assert chunk_sizes(14, 8) == [2] * 6 + [1] * 2 and chunk_sizes(9, 4) == [3, 2, 2, 2]
    assert not splits((3, 5), Shard(0), 4) and splits((4, 5), Shard(0), 4)
    assert [b.offsets[0] for r in range(4) for b in boxes((6, 4), Shard(0), r, 4)] == [0, 2, 4, 5]
    assert dtensor_boundaries((257,), Shard(0), 3) and not dtensor_boundaries((6,), Shard(0), 4)
    assert not dtensor_boundaries((64,), Shard(0, unit=8), 3) and not dtensor_boundaries((64,), Shard(0, 2), 2)


# ----------------------------------------------------------------------------- save_pretrained

def _save_pretrained_case(rank, p, root):
    import hf_models
    model, kw = hf_models.qwen2(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                intermediate_size=6, vocab_size=257, seq=32)
    mlp = "model.layers.0.mlp."                       # 6 features at 4 ranks: a balanced 2, 2, 1, 1
    gm = autoshard.parallelize(model, p, kw, tracer="export", outputs="sharded",    # (the vocabulary split: 257 rows)
                               pin={mlp + "gate_proj": -1, mlp + "up_proj": -1, mlp + "down_proj": 0,
                                    "model.embed_tokens": 0, "lm_head": -1})
    gm(**kw).loss.backward()
    gm.save_pretrained(root)
    layouts = {k: v for k, v in gm._autoshard_layouts.items() if isinstance(v, autoshard.Shard)}
    return autoshard.collect_state_dict(gm, gm.state_dict()), layouts


def test_save_pretrained_writes_uneven_shards_whole(dist4, tmp_path):
    """A vocabulary of 257 (65, 65, 65, 62 rows) and an MLP of 6 features (2, 2, 1, 1) at 4 ranks:
    the directory save_pretrained writes loads in one process with every tensor the module's
    (the pieces of unequal sizes used to be written padded: a 260-row embedding)."""
    import transformers
    full, layouts = dist4.run(_save_pretrained_case, str(tmp_path), timeout=300)[0]
    assert any(v.size == 257 for v in layouts.values()), layouts                   # the odd vocabulary
    assert any(v.size == 6 for v in layouts.values()), layouts                     # the balanced split
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    for k, v in full.items():
        assert torch.equal(loaded[k], v), k


class _FewClasses(torch.nn.Module):
    """A classifier whose head has fewer outputs than there are ranks (3 classes), in a graph that
    cuts features into units of 3 (a softmax over groups of 3, as attention's heads cut them)."""

    def __init__(self, classes=3):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(48, classes)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.fc1(x))
        h = h.view(h.shape[0], 16, 3).softmax(-1).reshape(h.shape[0], 48)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits, y), logits


def _few_classes_case(rank, p):
    torch.manual_seed(0)
    model = _FewClasses()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    gm = autoshard.parallelize(copy.deepcopy(model), p, (x, y))
    loss, logits = gm(x, y)
    loss.backward()
    want, want_logits = ref(x, y)
    want.backward()
    close_to_scale(loss, want, "loss")
    close_to_scale(logits, want_logits, "logits")
    grads_match(gm, ref, f"3 classes at {p}")
    return gm._autoshard_plan.layouts["head.weight"]


def test_a_head_with_fewer_outputs_than_ranks_plans_and_trains_exactly(dist4):
    """3 classes on 4 ranks in a graph with units of 3: the head's output holds fewer units than
    ranks, and cut in elements one rank would hold none, so its rule offers no such split. Planning
    raised a bare ValueError from the shard sizes before (the zoo's ViT, DeiT, LLaMA classifier and
    Mixtral at 8 ranks)."""
    dist4.run(_few_classes_case, timeout=240)
