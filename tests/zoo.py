"""The model zoo: tiny Hugging Face architectures (random weights from configs, no downloads)
that autoshard must parallelize exactly.

``ZOO`` maps a name to an ``Arch``; ``arch.build()`` returns ``(model, kwargs)`` where ``model``
is built by ``hf_models.build_model`` (seeded weights, fp32, eval mode, every parameter
trainable) and ``kwargs`` are example inputs with labels, so ``arch.loss(model(**kwargs))`` is
a scalar (the model's own ``.loss``).  Sizes: hidden 64, 2 layers, 4 heads (2 key/value heads
for grouped-query attention), vocab 256, batch 2 x 16 tokens; images 32x32 in 8x8 patches.
Every width divides by 2.

``FAST`` is the diverse subset CI runs; the rest runs under ``pytest -m zoo``.

Usage::

    from zoo import ZOO
    model, kwargs = ZOO["bloom"].build()
    loss = ZOO["bloom"].loss(model(**kwargs))
"""
from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass, field

import torch

import hf_models
from autoshard.errors import first_line
from refs import grads

__all__ = ["Arch", "ZOO", "FAST", "build", "zoo_case", "run_zoo", "compiled_case"]

VOCAB, BATCH, SEQ, HIDDEN, FFN, HEADS, LAYERS, POS = 256, 2, 16, 64, 128, 4, 2, 64
IMAGE, PATCH, LABELS = 32, 8, 4


@dataclass(frozen=True)
class Arch:
    """One zoo entry: a `transformers` model class, its tiny config and the inputs it takes."""

    name: str
    family: str
    task: str                       # causal-lm, masked-lm, seq-cls, seq2seq, image-cls, speech-seq2seq
    config: str                     # transformers config class name
    model: str                      # transformers model class name
    kwargs: dict = field(default_factory=dict)
    inputs: str = "causal"          # causal, masked, cls, seq2seq, image, speech
    attn: str | None = "sdpa"       # attn_implementation (None: the model's default)
    note: str = ""                  # what this entry exercises

    def build(self, seed: int = 0):
        return build(self, seed)

    @staticmethod
    def loss(out) -> torch.Tensor:
        return out.loss


def _zero_dropout(kw: dict, cfg_cls) -> dict:
    """Every dropout-like float of the config's defaults set to 0 (eval mode skips dropout anyway,
    but a traced graph must not depend on it)."""
    out = dict(kw)
    for k, v in cfg_cls().to_dict().items():
        if k in out or isinstance(v, bool) or not isinstance(v, float):
            continue
        if any(w in k for w in ("dropout", "pdrop", "drop_path", "drop_rate")):
            out[k] = 0.0
    return out


def _inputs(arch: Arch, model, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    cfg = model.config
    if arch.inputs in ("causal", "masked"):
        return hf_models.example_kwargs(cfg.vocab_size, BATCH, SEQ, seed, ignore_index=arch.inputs == "masked")
    if arch.inputs == "cls":         # ids avoid the pad token: a decoder classifier pools the last non-pad one
        ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
        return dict(input_ids=ids, labels=torch.randint(0, cfg.num_labels, (BATCH,), generator=g))
    if arch.inputs == "seq2seq":
        ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
        labels = torch.randint(3, cfg.vocab_size, (BATCH, SEQ // 2), generator=g)
        return dict(input_ids=ids, labels=labels)
    if arch.inputs == "image":
        return dict(pixel_values=torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
                    labels=torch.randint(0, cfg.num_labels, (BATCH,), generator=g))
    if arch.inputs == "speech":
        feats = torch.randn(BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        labels = torch.randint(3, cfg.vocab_size, (BATCH, SEQ // 2), generator=g)
        return dict(input_features=feats, labels=labels)
    raise ValueError(f"unknown inputs kind {arch.inputs!r} of {arch.name}")


def build(arch: Arch, seed: int = 0):
    """``(model, kwargs)`` of ``arch``: the same model and inputs on every call with the same seed."""
    import transformers
    cfg_cls, model_cls = getattr(transformers, arch.config), getattr(transformers, arch.model)
    kw = _zero_dropout(arch.kwargs, cfg_cls)
    model = hf_models.build_model(cfg_cls, model_cls, kw, seed, arch.attn)
    return model, _inputs(arch, model, seed)


# ---- config templates -------------------------------------------------------------------------
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)     # use_cache: the config default (on)
_GQA = dict(_COMMON, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=2,
            num_hidden_layers=LAYERS, max_position_embeddings=POS, tie_word_embeddings=False)
_BERT = dict(_COMMON, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
             num_hidden_layers=LAYERS, max_position_embeddings=POS)
_BART = dict(_COMMON, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
             decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=POS,
             pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
_CLS = dict(num_labels=LABELS, pad_token_id=0)
_VIT = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
            image_size=IMAGE, patch_size=PATCH, num_labels=LABELS)


def _a(name, family, task, config, model, kwargs, inputs="causal", attn="sdpa", note=""):
    return Arch(name, family, task, config, model, kwargs, inputs, attn, note)


_ARCHS = [
    # ---- causal LMs
    _a("gpt2", "GPT-2", "causal-lm", "GPT2Config", "GPT2LMHeadModel",
       dict(_COMMON, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=POS, n_inner=FFN),
       note="Conv1D (addmm), tied head"),
    _a("gpt_neo", "GPT-Neo", "causal-lm", "GPTNeoConfig", "GPTNeoForCausalLM",
       dict(_COMMON, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, intermediate_size=FFN,
            max_position_embeddings=POS, attention_types=[[["global", "local"], 1]], window_size=8),
       attn=None, note="local attention window"),
    _a("gptj", "GPT-J", "causal-lm", "GPTJConfig", "GPTJForCausalLM",
       dict(_COMMON, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POS, rotary_dim=8, n_inner=FFN),
       attn=None, note="parallel attention+MLP, partial interleaved RoPE"),
    _a("gpt_neox", "GPT-NeoX", "causal-lm", "GPTNeoXConfig", "GPTNeoXForCausalLM",
       dict(_COMMON, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
            max_position_embeddings=POS, rotary_pct=0.25),
       note="fused qkv per head, partial RoPE"),
    _a("opt", "OPT", "causal-lm", "OPTConfig", "OPTForCausalLM",
       dict(_COMMON, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=FFN,
            word_embed_proj_dim=HIDDEN, max_position_embeddings=POS),
       note="learned positions with offset"),
    _a("bloom", "Bloom", "causal-lm", "BloomConfig", "BloomForCausalLM",
       dict(_COMMON, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS), attn=None, note="ALiBi, fused qkv"),
    _a("falcon", "Falcon", "causal-lm", "FalconConfig", "FalconForCausalLM",
       dict(_COMMON, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            max_position_embeddings=POS), note="multi-query attention, parallel block"),
    _a("falcon_alibi", "Falcon", "causal-lm", "FalconConfig", "FalconForCausalLM",
       dict(_COMMON, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            max_position_embeddings=POS, alibi=True, multi_query=False), attn=None, note="ALiBi"),
    _a("mpt", "MPT", "causal-lm", "MptConfig", "MptForCausalLM",
       dict(_COMMON, d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, expansion_ratio=2, max_seq_len=POS),
       attn=None, note="ALiBi"),
    _a("llama", "LLaMA", "causal-lm", "LlamaConfig", "LlamaForCausalLM", dict(_GQA), note="GQA, SwiGLU, RoPE"),
    _a("mistral", "Mistral", "causal-lm", "MistralConfig", "MistralForCausalLM", dict(_GQA, sliding_window=None)),
    _a("mixtral", "Mixtral", "causal-lm", "MixtralConfig", "MixtralForCausalLM",
       dict(_GQA, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), note="MoE top-2 of 4"),
    _a("qwen2", "Qwen2", "causal-lm", "Qwen2Config", "Qwen2ForCausalLM", dict(_GQA, use_sliding_window=False),
       note="q/k/v bias"),
    _a("qwen2_moe", "Qwen2-MoE", "causal-lm", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
       dict(_GQA, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, use_sliding_window=False), note="MoE + shared expert"),
    _a("qwen3", "Qwen3", "causal-lm", "Qwen3Config", "Qwen3ForCausalLM",
       dict(_GQA, head_dim=16, use_sliding_window=False), note="q/k RMSNorm per head"),
    _a("qwen3_moe", "Qwen3-MoE", "causal-lm", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
       dict(_GQA, head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, use_sliding_window=False), note="MoE"),
    _a("gemma", "Gemma", "causal-lm", "GemmaConfig", "GemmaForCausalLM", dict(_GQA, head_dim=16),
       note="scaled embedding, GeGLU, tied head"),
    _a("gemma2", "Gemma2", "causal-lm", "Gemma2Config", "Gemma2ForCausalLM",
       dict(_GQA, head_dim=16, query_pre_attn_scalar=16, sliding_window=8), attn="eager",
       note="logit soft-capping, sliding window"),
    _a("phi", "Phi", "causal-lm", "PhiConfig", "PhiForCausalLM",
       dict(_GQA, num_key_value_heads=HEADS, partial_rotary_factor=0.5), note="parallel block, partial RoPE"),
    _a("phi3", "Phi3", "causal-lm", "Phi3Config", "Phi3ForCausalLM", dict(_GQA, pad_token_id=0),
       note="fused qkv and gate_up"),
    _a("stablelm", "StableLM", "causal-lm", "StableLmConfig", "StableLmForCausalLM", dict(_GQA),
       note="LayerNorm, partial RoPE"),
    _a("starcoder2", "Starcoder2", "causal-lm", "Starcoder2Config", "Starcoder2ForCausalLM",
       dict(_GQA, sliding_window=None), note="GELU MLP with bias"),
    _a("olmo", "OLMo", "causal-lm", "OlmoConfig", "OlmoForCausalLM", dict(_GQA, pad_token_id=0),
       note="non-parametric LayerNorm"),
    _a("olmo2", "OLMo2", "causal-lm", "Olmo2Config", "Olmo2ForCausalLM", dict(_GQA, pad_token_id=0),
       note="q/k RMSNorm over all heads"),
    _a("codegen", "CodeGen", "causal-lm", "CodeGenConfig", "CodeGenForCausalLM",
       dict(_COMMON, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POS, n_ctx=POS, rotary_dim=8,
            n_inner=FFN), attn=None, note="fused qkv in model-parallel blocks"),
    _a("granite", "Granite", "causal-lm", "GraniteConfig", "GraniteForCausalLM", dict(_GQA),
       note="scaled residuals and logits"),
    _a("cohere", "Cohere", "causal-lm", "CohereConfig", "CohereForCausalLM", dict(_GQA, pad_token_id=0),
       note="parallel block, interleaved RoPE, logit scale"),
    _a("persimmon", "Persimmon", "causal-lm", "PersimmonConfig", "PersimmonForCausalLM",
       dict(_BERT, tie_word_embeddings=False), note="fused qkv, q/k LayerNorm, squared ReLU"),
    _a("biogpt", "BioGPT", "causal-lm", "BioGptConfig", "BioGptForCausalLM", dict(_BERT), note="scaled embedding"),
    # ---- sequence classifiers
    _a("gpt2_cls", "GPT-2", "seq-cls", "GPT2Config", "GPT2ForSequenceClassification",
       dict(_COMMON, **_CLS, n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=POS, n_inner=FFN),
       inputs="cls", note="last non-pad token pooling"),
    _a("llama_cls", "LLaMA", "seq-cls", "LlamaConfig", "LlamaForSequenceClassification", dict(_GQA, **_CLS),
       inputs="cls"),
    _a("bert_cls", "BERT", "seq-cls", "BertConfig", "BertForSequenceClassification", dict(_BERT, num_labels=LABELS),
       inputs="cls", note="pooler + classifier"),
    _a("deberta_v2_cls", "DeBERTa-v2", "seq-cls", "DebertaV2Config", "DebertaV2ForSequenceClassification",
       dict(_BERT, num_labels=LABELS, relative_attention=True, pos_att_type=["c2p", "p2c"], position_buckets=8,
            max_relative_positions=POS), inputs="cls", attn=None),
    # ---- masked LMs
    _a("bert", "BERT", "masked-lm", "BertConfig", "BertForMaskedLM", dict(_BERT), inputs="masked"),
    _a("roberta", "RoBERTa", "masked-lm", "RobertaConfig", "RobertaForMaskedLM",
       dict(_BERT, max_position_embeddings=POS + 2), inputs="masked", note="positions from the pad mask"),
    _a("xlm_roberta", "XLM-RoBERTa", "masked-lm", "XLMRobertaConfig", "XLMRobertaForMaskedLM",
       dict(_BERT, max_position_embeddings=POS + 2), inputs="masked"),
    _a("distilbert", "DistilBERT", "masked-lm", "DistilBertConfig", "DistilBertForMaskedLM",
       dict(_COMMON, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN, max_position_embeddings=POS),
       inputs="masked"),
    _a("albert", "ALBERT", "masked-lm", "AlbertConfig", "AlbertForMaskedLM",
       dict(_BERT, embedding_size=32), inputs="masked", note="factorised embedding, shared layers"),
    _a("electra", "ELECTRA", "masked-lm", "ElectraConfig", "ElectraForMaskedLM",
       dict(_BERT, embedding_size=32), inputs="masked", note="embedding projection"),
    _a("deberta", "DeBERTa", "masked-lm", "DebertaConfig", "DebertaForMaskedLM",
       dict(_BERT, relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=POS),
       inputs="masked", attn=None, note="disentangled relative-position attention"),
    _a("deberta_v2", "DeBERTa-v2", "masked-lm", "DebertaV2Config", "DebertaV2ForMaskedLM",
       dict(_BERT, relative_attention=True, pos_att_type=["c2p", "p2c"], position_buckets=8,
            max_relative_positions=POS), inputs="masked", attn=None, note="log-bucket relative positions"),
    _a("mpnet", "MPNet", "masked-lm", "MPNetConfig", "MPNetForMaskedLM",
       dict(_BERT, max_position_embeddings=POS + 2), inputs="masked", attn=None, note="relative position bias"),
    _a("ernie", "ERNIE", "masked-lm", "ErnieConfig", "ErnieForMaskedLM", dict(_BERT), inputs="masked"),
    _a("esm", "ESM", "masked-lm", "EsmConfig", "EsmForMaskedLM",
       dict(_BERT, vocab_size=64, pad_token_id=1, mask_token_id=2, position_embedding_type="rotary"),
       inputs="masked", note="rotary encoder, token dropout scaling"),
    # ---- encoder-decoders
    _a("t5", "T5", "seq2seq", "T5Config", "T5ForConditionalGeneration",
       dict(_COMMON, d_model=HIDDEN, d_kv=16, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
            decoder_start_token_id=0, pad_token_id=0), inputs="seq2seq", attn=None,
       note="relative position bias, tied head rescale"),
    _a("bart", "BART", "seq2seq", "BartConfig", "BartForConditionalGeneration", dict(_BART), inputs="seq2seq"),
    _a("mbart", "mBART", "seq2seq", "MBartConfig", "MBartForConditionalGeneration", dict(_BART), inputs="seq2seq",
       note="pre-LN"),
    _a("pegasus", "Pegasus", "seq2seq", "PegasusConfig", "PegasusForConditionalGeneration",
       dict(_BART, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0), inputs="seq2seq",
       note="sinusoidal positions"),
    _a("marian", "Marian", "seq2seq", "MarianConfig", "MarianMTModel",
       dict(_BART, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0), inputs="seq2seq"),
    _a("whisper", "Whisper", "speech-seq2seq", "WhisperConfig", "WhisperForConditionalGeneration",
       dict(_COMMON, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, num_mel_bins=16,
            max_source_positions=16, max_target_positions=POS, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None),
       inputs="speech", note="conv front end"),
    # ---- vision
    _a("vit", "ViT", "image-cls", "ViTConfig", "ViTForImageClassification", dict(_VIT), inputs="image"),
    _a("deit", "DeiT", "image-cls", "DeiTConfig", "DeiTForImageClassification", dict(_VIT), inputs="image"),
    _a("beit", "BEiT", "image-cls", "BeitConfig", "BeitForImageClassification",
       dict(_VIT, use_relative_position_bias=True), inputs="image", attn=None, note="relative position bias"),
    _a("swin", "Swin", "image-cls", "SwinConfig", "SwinForImageClassification",
       dict(image_size=IMAGE, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4,
            num_labels=LABELS), inputs="image", attn=None, note="shifted windows"),
    _a("convnext", "ConvNeXt", "image-cls", "ConvNextConfig", "ConvNextForImageClassification",
       dict(image_size=IMAGE, patch_size=4, num_stages=2, hidden_sizes=[32, 64], depths=[1, 1], num_labels=LABELS),
       inputs="image", attn=None, note="convolutions, pointwise Linear"),
]

ZOO: dict[str, Arch] = {a.name: a for a in _ARCHS}
assert len(ZOO) == len(_ARCHS), "duplicate zoo names"

# CI's fast subset: an ALiBi causal LM, a multi-query LM whose linears are `x @ W.T` (Falcon), an
# MoE with grouped-query attention, a relative-position masked LM, an encoder-decoder with a
# relative position bias, a vision transformer.
FAST = ("bloom", "falcon", "mixtral", "deberta", "t5", "vit")


# ---- the runner (tests/test_zoo.py and benchmarks/model_zoo.py) -------------------------------
LOSS_TOL = 1e-5     # relative
GRAD_TOL = 1e-4     # relative to each gradient's largest entry (floor 1e-2: exact-zero gradients)

def _stage(exc: BaseException) -> str:
    """Which autoshard stage raised: the package (capture/, rewrite/) of the innermost autoshard
    module in the traceback chain; the entry points are no stage; everything else is the plan."""
    stages = {"capture": "capture", "rewrite": "rewrite", "api.py": None}
    found = None
    e = exc
    while e is not None and found is None:
        for fr in reversed(traceback.extract_tb(e.__traceback__)):
            path = fr.filename.replace(os.sep, "/")
            if "/autoshard/" not in path:
                continue
            first = path.rsplit("/autoshard/", 1)[-1].split("/")[0]
            found = stages.get(first, "plan")
            if found is not None:
                break
        e = e.__cause__
    return found or "plan"


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"[:400]


def _grads(model) -> dict:
    return grads(model, remove_duplicate=False)      # tied aliases too: collect_state_dict sees every name


def zoo_case(rank, p, name, seed=0):
    """One architecture on this rank: single-process reference, parallelize, one step, compare.

    Returns a picklable record (see the module docstring) with the plan's numbers when it planned.
    """
    import time
    import warnings

    import autoshard
    from autoshard.errors import AutoshardError

    warnings.filterwarnings("ignore")
    arch = ZOO[name]
    model, kwargs = arch.build(seed)
    ref = copy.deepcopy(model)
    want = arch.loss(ref(**kwargs))
    want.backward()
    ref_grads = _grads(ref)
    rec = dict(name=name, family=arch.family, task=arch.task, model=arch.model, status="ok", stage=None, error=None,
               params_total=sum(t.numel() for t in model.parameters()))
    stage = "capture"
    try:
        t0 = time.perf_counter()
        plan = autoshard.plan(model, p, kwargs, tracer="export")
        rec.update(plan_seconds=time.perf_counter() - t0, search_seconds=plan.search_seconds,
                   ratio=plan.params_per_rank / plan.params_total, comm_bytes=plan.comm_bytes,
                   comm_by_kind={k: tuple(v) for k, v in plan.comm_by_kind.items()},
                   sharded=sorted(k for k, v in plan.dims.items() if v is not None),
                   unsupported=[str(u) for u in plan.unsupported][:20], notes=list(plan.notes)[:10])
        stage = "rewrite"
        gm = autoshard.parallelize(model, p, plan=plan)
    except Exception as e:  # noqa: BLE001 - classified below
        stage = _stage(e) if stage == "capture" else stage
        rec.update(status="unsupported" if isinstance(e, AutoshardError) else "crash", stage=stage,
                   error=_first_line(e), trace=traceback.format_exc()[-3000:])
        return rec
    try:
        out = arch.loss(gm(**kwargs))
        out.backward()
        grads = autoshard.collect_state_dict(gm, _grads(gm))
    except Exception as e:  # noqa: BLE001
        rec.update(status="crash", stage="run", error=_first_line(e), trace=traceback.format_exc()[-3000:])
        return rec
    loss_err = abs(out.item() - want.item()) / max(abs(want.item()), 1e-6)
    missing = sorted(set(ref_grads) - set(grads))
    extra = sorted(set(grads) - set(ref_grads))
    errs = {k: ((g - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp_min(1e-2)).item()
            for k, g in grads.items() if k in ref_grads and g.shape == ref_grads[k].shape}
    shape_bad = sorted(k for k, g in grads.items() if k in ref_grads and g.shape != ref_grads[k].shape)
    worst = max(errs, key=errs.get) if errs else None
    rec.update(loss=out.item(), ref_loss=want.item(), loss_err=loss_err,
               grad_err=errs.get(worst, 0.0), worst_grad=worst, missing_grads=missing[:8], extra_grads=extra[:8],
               grad_shape_bad=shape_bad[:8])
    bad = []
    rec["signature"] = _without_labels(gm, ref, kwargs, bad)
    if loss_err > LOSS_TOL:
        bad.append(f"loss {out.item():.6g} vs {want.item():.6g}")
    if missing or extra or shape_bad:
        bad.append(f"gradient keys: missing {missing[:4]} extra {extra[:4]} wrong shape {shape_bad[:4]}")
    if errs and errs[worst] > GRAD_TOL:
        bad.append(f"gradient {worst} off by {errs[worst]:.3g} (relative)")
    if bad:
        rec.update(status="crash" if rec["signature"] == "crash" else "wrong",
                   stage="signature" if rec["signature"] in ("crash", "wrong") else "run", error="; ".join(bad))
    return rec


def _without_labels(gm, ref, kwargs, bad) -> str:
    """The module called without labels (another call signature, captured on first use): its
    logits against the model's; "n/a" where the model itself needs them (a seq2seq model with no
    decoder inputs)."""
    if "labels" not in kwargs:
        return "n/a"
    rest = {k: v for k, v in kwargs.items() if k != "labels"}
    try:
        with torch.no_grad():
            want = ref(**rest).logits
    except Exception:  # noqa: BLE001 - the model cannot run so either
        return "n/a"
    try:
        with torch.no_grad():
            got = gm(**rest).logits
    except Exception as e:  # noqa: BLE001
        bad.append(f"without labels: {_first_line(e)}")
        return "crash"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-2)).item()
    if err > GRAD_TOL:
        bad.append(f"logits without labels off by {err:.3g} (relative)")
        return "wrong"
    return "ok"


def run_zoo(pool, names, timeout=300.0):
    """Records of `names` run one after the other in `pool` (a RankPool); a rank failure or a
    timeout outside zoo_case's own handling becomes a crash record."""
    out = []
    for name in names:
        try:
            recs = pool.run(zoo_case, name, timeout=timeout)
            rec = recs[0]
            if any(r["status"] != rec["status"] for r in recs):
                rec = dict(rec, status="crash", error=f"ranks disagree: {[r['status'] for r in recs]}")
        except Exception as e:  # noqa: BLE001 - a hang or a dead rank
            rec = dict(name=name, family=ZOO[name].family, task=ZOO[name].task, model=ZOO[name].model,
                       status="crash", stage="pool", error=_first_line(e), trace=str(e)[-3000:])
        out.append(rec)
    return out


def compiled_case(rank, p, name):
    """Every block of `name`'s parallel module `.compile(fullgraph=True)` (inductor, fp32): loss and
    every gradient equal the eager parallel module's, no graph break; "no blocks" where it has none."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    import autoshard
    import refs
    arch = ZOO[name]
    model, kw = arch.build(0)
    model.train()
    eager = autoshard.parallelize(copy.deepcopy(model), p, kw, tracer="export")
    compiled = autoshard.parallelize(model, p, kw, tracer="export")
    blocks = autoshard.blocks_of(compiled)
    if not blocks:
        return "no blocks"
    dynamo.reset()
    counters.clear()
    for block in blocks.values():
        block.compile(fullgraph=True)
    got, want = arch.loss(compiled(**kw)), arch.loss(eager(**kw))
    got.backward(), want.backward()
    refs.close_to_scale(got, want, f"{name} loss")
    refs.close_grads(refs.grads(compiled), refs.grads(eager), f"{name}, blocks compiled")
    assert not sum(counters["graph_break"].values()), dict(counters["graph_break"])
    return None
