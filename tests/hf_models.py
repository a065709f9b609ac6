"""Small, deterministic Hugging Face models for tests.

Every builder returns ``(model, example_kwargs)``:

* ``model`` is built from a config with random weights (no downloads), fp32, in
  eval mode, with every dropout probability set to 0.
* ``example_kwargs`` is ``dict(input_ids=LongTensor[batch, seq], labels=...)``,
  so ``model(**example_kwargs).loss`` is a scalar.

All widths (hidden, intermediate, vocab, heads) divide by 4 so the models can be
sharded over a world of size 1, 2 or 4.  The LLaMA and Qwen2 defaults use
grouped-query attention (4 query heads, 2 key/value heads), which divides by 2
but not by 4; ``world_size=4`` on those builders gives 8 query / 4 key/value
heads (head_dim 8), still grouped, whose key/value heads shard four ways.
Explicit ``num_attention_heads`` / ``num_key_value_heads`` override both.

Any builder keyword that is not a named parameter goes to the config and wins
over the defaults here, so ``llama(num_hidden_layers=4)`` and
``gpt2(resid_pdrop=0.1)`` work.  ``attn_implementation`` defaults to
``"sdpa"``; both ``"sdpa"`` and ``"eager"`` export with ``torch.export``.

Usage::

    from hf_models import gpt2
    model, kwargs = gpt2()
    ep = torch.export.export(model, (), kwargs, strict=False)
"""

from __future__ import annotations

import torch

__all__ = ["gpt2", "llama", "bert", "qwen2", "mistral", "phi3", "BUILDERS", "example_kwargs", "build_model"]


def example_kwargs(vocab_size, batch=2, seq=16, seed=0, ignore_index=False):
    """``dict(input_ids, labels)`` drawn from a seeded generator.

    With ``ignore_index`` (masked LM) about three quarters of the labels are -100.
    """
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=g, dtype=torch.long)
    labels = input_ids.clone()
    if ignore_index:
        keep = torch.rand(batch, seq, generator=g) < 0.25
        keep[:, 0] = True  # at least one real target per row
        labels = torch.where(keep, labels, torch.full_like(labels, -100))
    return dict(input_ids=input_ids, labels=labels)


def build_model(config_cls, model_cls, config_kwargs, seed=0, attn_implementation="sdpa"):
    """A model of ``model_cls`` from ``config_cls(**config_kwargs)``: seeded random weights, fp32,
    eval mode, every parameter trainable. ``attn_implementation=None`` keeps the model's default."""
    cfg = config_cls(**config_kwargs)
    torch.manual_seed(seed)
    extra = {} if attn_implementation is None else dict(attn_implementation=attn_implementation)
    model = model_cls._from_config(cfg, **extra).to(torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _build(config_cls, model_cls, defaults, overrides, batch, seq, seed, attn_implementation,
           ignore_index=False):
    """``(model, example_kwargs)``: the config from ``defaults`` updated by the caller's
    ``overrides``, seeded random weights, fp32, eval mode, every parameter trainable."""
    model = build_model(config_cls, model_cls, {**defaults, **overrides}, seed, attn_implementation)
    return model, example_kwargs(model.config.vocab_size, batch, seq, seed, ignore_index)


def _gqa_heads(num_attention_heads, num_key_value_heads, world_size):
    """(heads, kv heads): 4 and 2 by default; 8 and 4 when ``world_size=4``.

    The world-size-4 variant keeps grouped-query attention (2 query heads per
    key/value head) while letting the key/value heads shard four ways.
    """
    if num_key_value_heads is None:
        num_key_value_heads = 4 if world_size == 4 else 2
    if num_attention_heads is None:
        num_attention_heads = 8 if num_key_value_heads > 2 else 4
    return num_attention_heads, num_key_value_heads


def gpt2(
    n_embd=64,
    n_head=4,
    n_layer=2,
    vocab_size=256,
    n_positions=64,
    batch=2,
    seq=16,
    seed=0,
    attn_implementation="sdpa",
    **config_overrides,
):
    """GPT2LMHeadModel; ``lm_head.weight`` is tied to ``transformer.wte.weight``.

    GPT-2 uses ``Conv1D`` (weight stored [in, out]) which exports as ``aten.addmm``.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    defaults = dict(
        n_embd=n_embd,
        n_head=n_head,
        n_layer=n_layer,
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_inner=4 * n_embd,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        tie_word_embeddings=True,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        use_cache=False,
    )
    return _build(GPT2Config, GPT2LMHeadModel, defaults, config_overrides, batch, seq, seed, attn_implementation)


def bert(
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=64,
    batch=2,
    seq=16,
    seed=0,
    attn_implementation="sdpa",
    **config_overrides,
):
    """BertForMaskedLM; labels are -100 except at about a quarter of positions.

    The decoder weight ``cls.predictions.decoder.weight`` is tied to the word
    embeddings (BERT's default ``tie_word_embeddings=True``).
    """
    from transformers import BertConfig, BertForMaskedLM

    defaults = dict(
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        use_cache=False,
    )
    return _build(BertConfig, BertForMaskedLM, defaults, config_overrides, batch, seq, seed, attn_implementation,
                  ignore_index=True)


def _gqa_lm(config_name, model_name, extra, hidden_size=64, intermediate_size=128, num_attention_heads=None,
            num_key_value_heads=None, num_hidden_layers=2, vocab_size=256, max_position_embeddings=64,
            batch=2, seq=16, seed=0, world_size=None, attn_implementation="sdpa", **config_overrides):
    """A grouped-query-attention causal LM of `transformers` (4 heads / 2 kv heads, untied head);
    ``world_size=4`` gives 8 heads / 4 kv heads (head_dim 8) so the kv heads shard four ways;
    explicit head counts override this."""
    import transformers

    heads, kv_heads = _gqa_heads(num_attention_heads, num_key_value_heads, world_size)
    defaults = dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        **extra,
    )
    return _build(getattr(transformers, config_name), getattr(transformers, model_name), defaults, config_overrides,
                  batch, seq, seed, attn_implementation)


def llama(**kwargs):
    """LlamaForCausalLM: GQA, SwiGLU, RoPE, untied ``lm_head``."""
    return _gqa_lm("LlamaConfig", "LlamaForCausalLM", {}, **kwargs)


def qwen2(**kwargs):
    """Qwen2ForCausalLM: like LLaMA but q/k/v projections carry a bias."""
    return _gqa_lm("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}, **kwargs)


def qwen3(**kwargs):
    """Qwen3ForCausalLM: like LLaMA with an RMSNorm of each query and key head (`q_norm`, `k_norm`)
    before RoPE, and head_dim set on its own (16 by default)."""
    kwargs.setdefault("head_dim", 16)
    return _gqa_lm("Qwen3Config", "Qwen3ForCausalLM", {}, **kwargs)


def mistral(**kwargs):
    """MistralForCausalLM (GQA, no q/k/v bias, no sliding window)."""
    return _gqa_lm("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, **kwargs)


def phi3(**kwargs):
    """Phi3ForCausalLM: one fused ``qkv_proj`` sliced into q, k and v, one fused ``gate_up_proj``
    chunked into gate and up (4 heads and 4 kv heads by default: equal parts)."""
    kwargs.setdefault("num_attention_heads", 4)
    kwargs.setdefault("num_key_value_heads", 4)
    return _gqa_lm("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
                   **kwargs)


BUILDERS = {"gpt2": gpt2, "llama": llama, "bert": bert, "qwen2": qwen2, "mistral": mistral, "phi3": phi3}


# mixtures of experts: family -> (config, model, the config's names for experts / top-k / expert FFN size, extra)
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
                dict(sliding_window=None, router_jitter_noise=0.0)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
                  dict(shared_expert_intermediate_size=64, decoder_sparse_step=1, use_sliding_window=False,
                       norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
                  dict(head_dim=16, decoder_sparse_step=1, use_sliding_window=False, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
                    dict(n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=32,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True)),
}


def moe(family, num_experts=8, top_k=2, expert_size=48, batch=2, seq=16, seed=0, **overrides):
    """A tiny mixture-of-experts causal LM of `family` (MOE): `num_experts` experts of FFN size
    `expert_size`, `top_k` of them per token, 4 heads / 2 kv heads, hidden 64, 2 layers."""
    config, model, (n_experts, k, size), extra = MOE[family]
    kw = {n_experts: num_experts, k: top_k, **extra, **overrides}
    if size == "intermediate_size":
        return _gqa_lm(config, model, kw, intermediate_size=expert_size, batch=batch, seq=seq, seed=seed)
    return _gqa_lm(config, model, {size: expert_size, **kw}, batch=batch, seq=seq, seed=seed)
