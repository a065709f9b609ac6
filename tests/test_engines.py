"""Plans exported to other engines (autoshard/views/engines.py): PyTorch's `parallelize_module`
and transformers' `tp_plan`, run on gloo ranks against the single-process model.

For tiny LLaMA, Qwen2 (biased q/k/v), Mistral, GPT-2 (fused Conv1D q/k/v: nothing an engine can
split, each module listed with its reason) and a plain MLP with a vocabulary head and its loss,
at world 2 and 4: the DTensor export applied with PyTorch's own `parallelize_module` and the
transformers export loaded with `from_pretrained` (both the whole model's keys through
`DistributedConfig(tp_plan=...)` and the base model's through `config.base_model_tp_plan` with
`tp_plan="auto"`) give the model's loss and every gradient. Bytes are counted on the functional
collectives the engines dispatch: the DTensor export of a LLaMA-family plan that the engine can
run whole moves exactly autoshard's predicted bytes; a LLaMA whose 2 K/V heads are held by pairs
of 4 ranks is exported with its attention replicated, still exact.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_models  # noqa: E402
import refs  # noqa: E402


class MLP(nn.Module):
    """Embedding -> Linear -> GELU -> Linear -> vocabulary head -> cross entropy."""

    def __init__(self, vocab=96, h=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _build(name, p):
    if name == "mlp":
        torch.manual_seed(0)
        idx = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
        return MLP(), {"idx": idx, "targets": idx.roll(1, 1)}
    if name == "llama_kv2":                   # 2 K/V heads on 4 ranks: held by pairs (not expressible)
        return hf_models.llama(num_hidden_layers=2)
    if name == "neox_uneven":                 # 6 heads and a vocabulary of 301 on 4 ranks
        import transformers
        torch.manual_seed(0)
        cfg = transformers.GPTNeoXConfig(vocab_size=301, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                                         intermediate_size=200, use_cache=False, hidden_dropout=0.0,
                                         attention_dropout=0.0)
        ids = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(1))
        return transformers.GPTNeoXForCausalLM(cfg), {"input_ids": ids, "labels": ids}
    return hf_models.BUILDERS[name](num_hidden_layers=2, world_size=p) if name != "gpt2" else hf_models.gpt2()


def _loss(model, kw):
    out = model(**kw)
    return out if isinstance(out, torch.Tensor) else out.loss


def _full_grads(model):
    from torch.distributed.tensor import DTensor
    return {n: (q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad)
            for n, q in model.named_parameters() if q.grad is not None}


def _steps_match(ref, par, kw, what):
    """One forward and backward of the model and of the engine's module on the same inputs: the
    loss and every gradient equal; returns the engine's collectives counted (count_functional)."""
    from autoshard.runtime.counters import count_functional
    want = _loss(ref, kw)
    want.backward()
    with count_functional() as counted:
        got = _loss(par, kw)
        got.backward()
    refs.close_to_scale(got, want, f"{what}: loss")
    refs.close_grads(_full_grads(par), refs.grads(ref), what)
    return counted


def _dtensor_case(rank, p, name):
    import autoshard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    model, kw = _build(name, p)
    plan = autoshard.plan(model, p, kw)
    exported = plan.export("dtensor", model=model)
    ref, par = copy.deepcopy(model), parallelize_module(copy.deepcopy(model), init_device_mesh("cpu", (p,)),
                                                        exported.plan)
    counted = _steps_match(ref, par, kw, f"{name} at {p}")
    return dict(styles=dict(exported.styles), dropped=dict(exported.dropped), counted=counted.bytes,
                predicted=exported.comm_bytes, autoshard=plan.comm_bytes, notes=exported.notes)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "mlp"])
def test_dtensor_export_at_2(dist2, name):
    _check_dtensor(dist2.run(_dtensor_case, name, timeout=300), name, 2)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "mlp", "llama_kv2", "neox_uneven"])
def test_dtensor_export_at_4(dist4, name):
    _check_dtensor(dist4.run(_dtensor_case, name, timeout=300), name, 4)


def _check_dtensor(results, name, p):
    r = results[0]
    assert all(x["counted"] == r["counted"] for x in results)
    if name == "gpt2":            # Conv1D layers, a strided fused q/k/v and a tied head: all left replicated
        assert not r["styles"] and r["counted"] == r["predicted"] == 0
        assert "strided" in r["dropped"]["transformer.h.0.attn.c_attn"]
        assert "Linear and Embedding" in r["dropped"]["transformer.h.0.mlp.c_fc"]
        assert "tied" in r["dropped"]["lm_head"]
        return
    if name == "llama_kv2":       # K/V heads held by pairs of ranks: the attention runs replicated
        assert "groups of ranks" in r["dropped"]["model.layers.0.self_attn.k_proj"]
        assert "model.layers.0.self_attn.q_proj" in r["dropped"] and "model.layers.0.mlp.up_proj" in r["styles"]
        assert r["counted"] == r["predicted"] < r["autoshard"]
        return
    if name == "neox_uneven":     # heads split 2, 2, 1, 1: not the engine's even split; the padded head gather
        assert "whole heads" in r["dropped"]["gpt_neox.layers.0.attention.query_key_value"]
        assert r["counted"] == r["predicted"], r
        return
    assert not r["dropped"], r["dropped"]
    assert r["counted"] == r["predicted"], r          # the engine sends what the export predicts
    if name == "mlp":             # autoshard splits the residual stream; the engine holds it whole
        assert r["styles"] == {"emb": "embedding_colwise", "fc1": "colwise_gather_output",
                               "fc2": "rowwise_rep", "head": "rowwise_rep"}, r["styles"]
        return
    # the engine runs autoshard's whole plan: the same bytes, counted on the engine's own collectives
    assert r["counted"] == r["predicted"] == r["autoshard"], r
    assert r["styles"]["lm_head"] == "colwise_gather_output"
    assert r["styles"]["model.layers.1.self_attn.o_proj"] == "rowwise"


def _hf_case(rank, p, name, path, base):
    import autoshard
    import torch.distributed as dist
    import transformers
    from torch.distributed.tensor import DTensor
    model, kw = _build(name, p)
    plan = autoshard.plan(model, p, kw)
    if rank == 0:
        model.save_pretrained(path)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if base:          # the base model's keys, as a config carries them, and the class's own head plan
            tp_plan = plan.to_hf_tp_plan(base_model_prefix=model.base_model_prefix)
            config = transformers.AutoConfig.from_pretrained(path)
            config.base_model_tp_plan = tp_plan
            par = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, tp_plan="auto", tp_size=p,
                                                                    attn_implementation="sdpa")
        else:
            from transformers.distributed import DistributedConfig
            tp_plan = plan.to_hf_tp_plan()
            par = transformers.AutoModelForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(tp_plan=tp_plan, tp_size=p), attn_implementation="sdpa")
    ref = copy.deepcopy(model)
    counted = _steps_match(ref, par, kw, f"{name} at {p} (hf, base={base})")
    return dict(tp_plan=tp_plan, sharded=sum(isinstance(q, DTensor) for q in par.parameters()),
                counted=counted.bytes, autoshard=plan.comm_bytes, predicted=plan.export("hf").comm_bytes)


@pytest.mark.parametrize("name, base", [("llama", False), ("llama", True), ("qwen2", False), ("mistral", True)])
def test_hf_export_at_2(dist2, tmp_path, name, base):
    r = dist2.run(_hf_case, name, str(tmp_path / "ckpt"), base, timeout=300)[0]
    assert r["tp_plan"]["model.layers.*.self_attn.q_proj" if not base else "layers.*.self_attn.q_proj"] == "colwise"
    assert r["sharded"] >= 14                   # every projection of both layers (+ embedding, head)
    # transformers' styles all-reduce each column layer's input gradient on its own: more bytes
    assert r["counted"] == r["predicted"] > r["autoshard"], r


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_hf_export_at_4(dist4, tmp_path, name):
    r = dist4.run(_hf_case, name, str(tmp_path / "ckpt"), False, timeout=300)[0]
    assert r["tp_plan"]["model.layers.*.mlp.down_proj"] == "rowwise" and r["sharded"] >= 14


def test_gpt2_hf_export_says_what_it_leaves():
    """GPT-2 (no tp_plan in transformers): what the export can and cannot express, in one process."""
    import autoshard
    model, kw = hf_models.gpt2()
    exported = autoshard.plan(model, 2, kw).export("hf")
    assert exported.styles == {} and set(exported.plan.values()) == {"replicate"}
    assert "strided" in exported.dropped["transformer.h.1.attn.c_attn"]
    assert exported.comm_bytes == 0 and exported.autoshard_bytes > 0
    with pytest.warns(UserWarning, match="leaves 11 modules replicated"):
        autoshard.plan(model, 2, kw).to_hf_tp_plan()
    assert "c_attn" in str(exported)


def _loss_parallel_case(rank, p):
    import autoshard
    from autoshard.runtime.counters import count_functional
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    model, kw = _build("llama", p)
    exported = autoshard.plan(model, p, kw, outputs="sharded").export("dtensor", model=model, loss_parallel=True)
    ref, par = copy.deepcopy(model), parallelize_module(copy.deepcopy(model), init_device_mesh("cpu", (p,)),
                                                        exported.plan)
    want = _loss(ref, kw)
    want.backward()
    with count_functional() as counted, loss_parallel():
        out = par(**kw)
        out.loss.backward()
    refs.close_to_scale(out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss, want, "loss_parallel")
    refs.close_grads(_full_grads(par), refs.grads(ref), "loss_parallel")
    tokens, hidden = kw["input_ids"].numel(), model.config.hidden_size
    return dict(styles=dict(exported.styles), kinds=counted.by_kind, logits=type(out.logits).__name__,
                notes=exported.notes, embedding_gather=tokens * hidden * 4 * (p - 1) / p)


def test_dtensor_export_with_loss_parallel(dist2):
    """A plan that leaves the logits split (outputs="sharded") exports its head with a sharded
    DTensor output; the model's own loss under loss_parallel() equals the single-process loss,
    and no rank gathers the logits (the one all-gather is a feature-split embedding's output)."""
    r = dist2.run(_loss_parallel_case, timeout=300)[0]
    assert r["styles"]["lm_head"] == "colwise_loss_parallel" and r["logits"] == "DTensor"
    gathers = {} if r["styles"]["model.embed_tokens"] == "embedding_rowwise" else \
        {"all_gather": (1, r["embedding_gather"])}
    assert {k: v for k, v in r["kinds"].items() if k == "all_gather"} == gathers, (r["styles"], r["kinds"])
    assert "loss_parallel()" in r["notes"][0]


def test_cli_keeps_what_libraries_print_off_an_exported_plan(capsys):
    """`--export` and `--json` write only the plan to standard output: what is printed while the model
    is built and planned (DeepSpeed's accelerator line, when transformers imports it) goes to standard
    error, so that `autoshard plan ... --export hf > tp_plan.json` holds JSON."""
    import json

    from autoshard import cli
    assert cli.main(["plan", "tests.factories:chatty_mlp", "-n", "2", "--input-shape", "2,64,128", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["world_size"] == 2 and "a library's line" in out.err


def test_cli_prints_the_exported_plans(tmp_path, capsys):
    """`python -m autoshard plan ... --export dtensor` prints Python that builds the styles it
    lists; `--export hf` prints a transformers tp_plan as JSON (here of a checkpoint directory)."""
    import json

    from autoshard import cli
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    assert cli.main(["plan", "tests.factories:mlp", "-n", "2", "--input-shape", "2,64,128", "--export", "dtensor"]) == 0
    out = capsys.readouterr()
    scope = {}
    exec(out.out, scope)                              # what a user pastes into a training script
    assert isinstance(scope["plan"]["fc1"], ColwiseParallel) and isinstance(scope["plan"]["fc2"], RowwiseParallel)
    assert "2 sharded modules" in out.err
    model, _ = hf_models.llama(num_hidden_layers=2)
    model.save_pretrained(tmp_path / "llama")
    assert cli.main(["plan", "--from-pretrained", str(tmp_path / "llama"), "-n", "2", "--tokens", "16",
                     "--export", "hf", "--base-model-prefix", "model"]) == 0
    tp_plan = json.loads(capsys.readouterr().out)
    # (the embedding split on features, its output gathered: half the vocabulary split's all-reduce)
    assert tp_plan["layers.*.self_attn.o_proj"] == "rowwise" and tp_plan["embed_tokens"] == "embedding_colwise"
