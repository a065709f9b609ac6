"""Models built on meta, filled with only this rank's shards (autoshard.io.loading).

At world sizes 2 and 4 (gloo, CPU): a meta-built GPT (fused q/k/v, tied embeddings) loaded with
load= from a torch.save file, a safetensors file and a sharded Hugging Face-style directory
gives the full model's loss and every gradient; seeded initialisation without load= equals the
CPU-built model tensor for tensor; autoshard.from_pretrained of tiny LLaMA (fp32) and GPT-2
(saved in bf16, loaded as fp32) directories written by save_pretrained in many shards equals
AutoModelForCausalLM.from_pretrained of the same directory in loss, logits and gradients.
Then, in one process: every bad input gives a LoadError naming it before anything is
allocated, device=, and the CLI's --from-pretrained on a directory that holds no weights.
"""
import contextlib
import io
import json
import os

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.errors import LoadError
from models import GPT
from refs import close

SEQ = 16


def _gpt(device=None, seed=0):
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return GPT(vocab=256, seq=SEQ, fused=True, tied=True)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(256, (2, SEQ), generator=g), torch.randint(256, (2, SEQ), generator=g)


def _write_gpt_checkpoints(d):
    """The CPU GPT as a torch.save file, a safetensors file and a sharded directory (index +
    shards, the tied alias head.weight left out as save_pretrained does)."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file
    sd = _gpt().state_dict()
    torch.save(sd, os.path.join(d, "gpt.pt"))
    untied = {k: v.contiguous() for k, v in sd.items() if k != "head.weight"}
    save_file(untied, os.path.join(d, "gpt.safetensors"))
    os.makedirs(os.path.join(d, "gpt_dir"))
    save_torch_state_dict(untied, os.path.join(d, "gpt_dir"), max_shard_size="40KB")
    assert len([f for f in os.listdir(os.path.join(d, "gpt_dir")) if f.endswith(".safetensors")]) > 3


def _grads(gm):
    return autoshard.collect_state_dict(
        gm, {k: v.grad for k, v in gm.named_parameters(remove_duplicate=False) if v.grad is not None})


def _gpt_case(rank, p, d):
    idx, tgt = _batch()
    ref = _gpt()
    want = ref(idx, tgt)
    want.backward()
    ref_grads = {k: v.grad for k, v in ref.named_parameters(remove_duplicate=False)}
    meta = _gpt("meta")
    plan = autoshard.plan(meta, p, (idx, tgt))                # on meta: planned once, used for every load
    out = {}
    for name in ("gpt.pt", "gpt.safetensors", "gpt_dir"):
        gm = autoshard.parallelize(meta, p, plan=plan, load=os.path.join(d, name))
        assert gm.head.weight is gm.wte.weight                     # still tied
        assert any(isinstance(l, autoshard.Shard) and l.chunks == 3 for l in gm._autoshard_layouts.values())
        loss = gm(idx, tgt)
        loss.backward()
        close(loss, want)
        grads = _grads(gm)
        assert set(grads) == set(ref_grads)
        for k, g in grads.items():
            close(g, ref_grads[k])
        out[name] = sum(t.numel() for t in gm.parameters())
    # seeded initialisation, no load=: the collected tensors are the CPU-built model's
    torch.manual_seed(0)
    gm = autoshard.parallelize(meta, p, plan=plan)
    full = autoshard.collect_state_dict(gm, gm.state_dict())
    ref_sd = ref.state_dict()
    assert set(full) == set(ref_sd)
    assert all(torch.equal(full[k], ref_sd[k]) for k in ref_sd), [k for k in ref_sd if not torch.equal(full[k], ref_sd[k])]
    assert all(t.is_meta for t in meta.parameters())                        # the user's model stays on meta
    return out


def _hf_case(rank, p, dirs):
    import transformers
    import hf_models
    out = {}
    for name, d in dirs.items():
        kwargs = hf_models.example_kwargs(256, seq=SEQ)
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        ref.config.use_cache = False
        gm = autoshard.from_pretrained(d, p, kwargs, dtype=torch.float32)
        assert all(t.dtype == torch.float32 for t in gm.parameters())
        got, want = gm(**kwargs), ref(**kwargs)
        close(got.loss, want.loss)
        close(got.logits, want.logits)
        got.loss.backward()
        want.loss.backward()
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        grads = _grads(gm)
        assert set(grads) == set(ref_params)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_params[k].grad, atol=1e-5, rtol=1e-4)
        ref_buffers = dict(ref.named_buffers())
        for k, b in gm.named_buffers():                          # rotary inv_freq: initialised, not read
            assert torch.equal(b, ref_buffers[k]), k
        out[name] = (got.loss.item(), sum(t.numel() for t in gm.parameters()))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Files every rank reads: made once in the parent, passed by path."""
    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    import hf_models
    d = str(tmp_path_factory.mktemp("ckpt"))
    _write_gpt_checkpoints(d)
    dirs = {}
    for name, dtype in (("llama", torch.float32), ("gpt2", torch.bfloat16)):
        kw = dict(vocab_size=256, world_size=4, num_hidden_layers=1) if name == "llama" else dict(vocab_size=256, n_layer=1)
        model, _ = hf_models.BUILDERS[name](**kw)
        dirs[name] = os.path.join(d, name)
        model.to(dtype).save_pretrained(dirs[name], max_shard_size="40KB")
        assert os.path.isfile(os.path.join(dirs[name], "model.safetensors.index.json"))
    return d, dirs


@pytest.mark.parametrize("world", [2, 4])
def test_meta_gpt_load_and_init(world, dist2, dist4, checkpoints):
    pool = dist2 if world == 2 else dist4
    d, _ = checkpoints
    sizes = pool.run(_gpt_case, d, timeout=240)
    full = sum(t.numel() for t in _gpt().parameters())
    for r in sizes:                                     # each rank holds a fraction of the model
        assert all(n < full for n in r.values())


@pytest.mark.parametrize("world", [2, 4])
def test_from_pretrained_equals_hf(world, dist2, dist4, checkpoints):
    pool = dist2 if world == 2 else dist4
    _, dirs = checkpoints
    results = pool.run(_hf_case, dirs, timeout=300)
    assert all(r.keys() == dirs.keys() for r in results)


# ----------------------------------------------------------------------------- one process

@pytest.fixture
def no_rewrite(monkeypatch):
    """Fails the test if parallelize gets as far as building (allocating) this rank's module."""
    import autoshard.rewrite.rewriter

    def boom(*a, **k):
        raise AssertionError("rewrite (shard allocation) reached despite a bad input")
    monkeypatch.setattr(autoshard.rewrite.rewriter, "rewrite", boom)


def _bad(load, match, model=None):
    with pytest.raises(LoadError, match=match):
        autoshard.parallelize(model or _gpt("meta"), 2, _batch(), rank=0, load=load)


def test_bad_sources_name_the_keys(no_rewrite, tmp_path):
    sd = dict(_gpt().state_dict())
    del sd["head.weight"]
    missing = dict(sd)
    del missing["blocks.1.mlp.fc2.weight"]
    _bad(missing, r"missing keys \(1\): blocks\.1\.mlp\.fc2\.weight \[64, 256\]")
    _bad(dict(sd, **{"extra.weight": torch.zeros(3)}), r"unexpected keys \(1\): extra\.weight")
    _bad(dict(sd, **{"wpe.weight": torch.zeros(8, 64)}), r"wpe\.weight: \[8, 64\] in the checkpoint, \[16, 64\]")
    _bad(dict(sd, **{"head.weight": torch.zeros(256, 32)}), r"head\.weight: \[256, 32\]")   # a tied alias, checked too
    _bad(dict(sd, **{"wpe.weight": "x"}), r"wpe\.weight.*not tensors")
    _bad(str(tmp_path / "nowhere"), "no such file")
    _bad(str(tmp_path), "not a Hugging Face checkpoint directory")
    torch.save([1, 2], tmp_path / "list.pt")
    _bad(str(tmp_path / "list.pt"), "holds a list")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    _bad(str(tmp_path), "do not exist")
    with pytest.raises(LoadError, match="not a checkpoint directory"):
        autoshard.from_pretrained(str(tmp_path / "nowhere"), 2, rank=0)


class Odd(nn.Module):
    """A parameter made in __init__ with no reset_parameters: cannot be initialised on meta."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x) * self.scale


def test_uninitialisable_module_is_named(no_rewrite):
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(64, 64), Odd())
    with pytest.raises(LoadError, match=r"module 1 \(Odd\) has tensors on meta \(scale\)"):
        autoshard.parallelize(m, 2, (torch.randn(2, 64),), rank=0)


def test_device_and_real_model(tmp_path):
    """device= places the filled shards; a model built on CPU can be loaded into as well; the
    safetensors reads are of this rank's boxes only (a fused q/k/v shard: three blocks)."""
    from safetensors.torch import save_file
    from autoshard.io import loading
    sd = {k: v for k, v in _gpt(seed=3).state_dict().items() if k != "head.weight"}
    path = str(tmp_path / "w.safetensors")
    save_file(sd, path)
    reads = []
    src = loading.open_source(path)
    read = src.read
    src.read = lambda key, index: reads.append((key, index)) or read(key, index)
    gm = autoshard.parallelize(_gpt("meta"), 2, _batch(), rank=1, load=src, device="cpu")
    assert all(t.device.type == "cpu" for t in gm.parameters())
    qkv = [i for k, i in reads if k == "blocks.0.attn.qkv.weight"]
    assert [s[0] for s in qkv] == [slice(32, 64), slice(96, 128), slice(160, 192)]
    assert len([k for k, _ in reads if k == "wte.weight"]) == 1                 # tied: read once
    gm2 = autoshard.parallelize(_gpt(seed=0), 2, _batch(), rank=1, load=path)   # CPU model, overwritten
    for (k, a), b in zip(gm.state_dict().items(), gm2.state_dict().values()):
        assert torch.equal(a, b), k


def test_cli_from_pretrained_reads_no_weights(tmp_path, capsys):
    """A directory with config.json only: the plan and the per-rank memory need no weights."""
    pytest.importorskip("transformers")
    import transformers
    from autoshard.cli import main
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=256).save_pretrained(tmp_path)
    assert main(["plan", "--from-pretrained", str(tmp_path), "-n", "2", "--tokens", "16"]) == 0
    text = capsys.readouterr().out
    assert "lm_head" in text and "memory per rank of a training step at world size 2" in text
    model = autoshard.io.loading.meta_model(str(tmp_path))
    plan = autoshard.plan(model, 2, {"input_ids": torch.zeros(1, 16, dtype=torch.long)}, tracer="export")
    mem = plan.memory
    assert f"{mem['peak']:,d}" in text and f"{mem['activations']:,d}" in text
    assert mem["parameters"] == 4 * plan.params_per_rank and mem["optimizer"] == 2 * mem["gradients"]
    with pytest.raises(SystemExit):
        main(["plan", "-n", "2"])                                              # neither target nor DIR


def test_shapes_stand_for_example_token_ids():
    """A meta model planned from shapes alone (torch.Size: int64 token ids of that shape)."""
    with torch.device("meta"):
        model = GPT(vocab=512, h=64, heads=4, blocks=2)
    plan = autoshard.plan(model, 2, (torch.Size([2, 32]), torch.Size([2, 32])))
    assert plan.dims["head"] == -1 and plan.params_per_rank * 2 < plan.params_total * 1.01
    assert all(p.is_meta for p in model.parameters())
