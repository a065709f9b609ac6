"""Published model configurations by name: each typed in from its checkpoint's config.json (or the paper
that trained it), for planning on meta without a download (`autoshard advise --config NAME`, the
benchmarks of docs/benchmarks.md).

`config_of(name)` is the transformers config at the published depth; `Spec` says how it is built.
Korthikanti et al. 2022's GPT models (gpt-22b .. gpt-1t: "Reducing Activation Recomputation in Large
Transformer Models", Table 3: learned positions, vocabulary 51200, sequence 2048, MLP 4h, tied
embedding and head) run eager attention, as Megatron-LM did then (no flash attention), in fp16.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..errors import LoadError

@dataclass
class Spec:
    """One published configuration: `config` (a transformers config class name) with `kwargs` from
    the checkpoint's config.json, built by `auto` (a transformers Auto* class) with `LAYERS` layers."""

    hf_id: str
    config: str
    kwargs: dict
    auto: str = "AutoModelForCausalLM"
    parallel: bool = False      # attention and MLP in parallel: 1 + `norms` all-reduces a layer, not 4
    norms: int = 1              # parallel layers: norms feeding the two branches (backward all-reduces)
    attn: str = "sdpa"
    layers_key: str = "num_hidden_layers"
    remark: str = ""
    extra: dict = field(default_factory=dict)
    per_layer: dict = field(default_factory=dict)   # kwargs listing a value per layer: {key: (value, layers per entry)}
    moe: bool = False           # a mixture of experts: experts' strategies, expert weights moved, memory recorded
    bar: bool = True            # False: Megatron's dense formula is not this configuration's bar (no `ratio`)
    dtype: str = ""             # the dtype it trains in, where the config names none


# Hyperparameters as published in each checkpoint's config.json (the depth is replaced by 2 layers).
CONFIGS: dict[str, Spec] = {
    "gpt2": Spec("openai-community/gpt2", "GPT2Config", dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=50256, eos_token_id=50256), layers_key="n_layer", remark="GPT-2 124M; Conv1D layers"),
    "bert-base": Spec("google-bert/bert-base-uncased", "BertConfig", dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0,
        tie_word_embeddings=True), auto="AutoModelForMaskedLM", remark="BertForMaskedLM"),
    "roberta-base": Spec("FacebookAI/roberta-base", "RobertaConfig", dict(
        vocab_size=50265, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        hidden_act="gelu", max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, tie_word_embeddings=True), auto="AutoModelForMaskedLM",
        remark="RobertaForMaskedLM"),
    "llama3-8b": Spec("meta-llama/Meta-Llama-3-8B", "LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001)),
    "llama2-7b": Spec("meta-llama/Llama-2-7b-hf", "LlamaConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "mistral-7b": Spec("mistralai/Mistral-7B-v0.1", "MistralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "qwen2.5-0.5b": Spec("Qwen/Qwen2.5-0.5B", "Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643), remark="q/k/v biases"),
    "qwen3-0.6b": Spec("Qwen/Qwen3-0.6B", "Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000, attention_bias=False, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645), remark="an RMSNorm of each query and key head; head_dim 128 apart from the width"),
    "qwen3-8b": Spec("Qwen/Qwen3-8B", "Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000, attention_bias=False, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645), remark="per-head q/k RMSNorm"),
    "qwen2-7b": Spec("Qwen/Qwen2-7B", "Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643)),
    "qwen2.5-7b": Spec("Qwen/Qwen2.5-7B", "Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643)),
    "gemma-2b": Spec("google/gemma-2b", "GemmaConfig", dict(
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=2, eos_token_id=1), remark="multi-query (1 kv head), head_dim 256"),
    "gemma2-2b": Spec("google/gemma-2-2b", "Gemma2Config", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attention_bias=False,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1), attn="eager",
        remark="logit soft-capping; sandwich norms"),
    "falcon-7b": Spec("tiiuae/falcon-7b", "FalconConfig", dict(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False, layer_norm_epsilon=1e-5,
        tie_word_embeddings=True, bos_token_id=11, eos_token_id=11), parallel=True,
        remark="71 heads, multi-query, fused query_key_value"),
    "falcon-40b": Spec("tiiuae/falcon-40b", "FalconConfig", dict(
        vocab_size=65024, hidden_size=8192, num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
        new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False, layer_norm_epsilon=1e-5,
        tie_word_embeddings=True, bos_token_id=11, eos_token_id=11), parallel=True, norms=2,
        remark="128 heads in 8 groups, q/k/v fused per group"),
    "phi3-mini": Spec("microsoft/Phi-3-mini-4k-instruct", "Phi3Config", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="silu", max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=2047,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
        remark="fused qkv_proj and gate_up_proj"),
    "phi3-medium": Spec("microsoft/Phi-3-medium-4k-instruct", "Phi3Config", dict(
        vocab_size=32064, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=10, hidden_act="silu", max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=2047,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
        remark="grouped q/k/v fused in qkv_proj (40 / 10 heads)"),
    "starcoderbase-1b": Spec("bigcode/starcoderbase-1b", "GPTBigCodeConfig", dict(
        vocab_size=49152, n_positions=8192, n_embd=2048, n_layer=24, n_head=16, n_inner=8192, multi_query=True,
        activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-5, scale_attn_weights=True,
        bos_token_id=0, eos_token_id=0), layers_key="n_layer",
        remark="multi-query: q and one kv head fused in c_attn (2048, 128, 128)"),
    "phi-2": Spec("microsoft/phi-2", "PhiConfig", dict(
        vocab_size=51200, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="gelu_new", max_position_embeddings=2048, layer_norm_eps=1e-5,
        partial_rotary_factor=0.4, rope_theta=10000.0, qk_layernorm=False, resid_pdrop=0.1, embd_pdrop=0.0,
        attention_dropout=0.0, tie_word_embeddings=False,
        bos_token_id=50256, eos_token_id=50256), parallel=True, remark="lm_head with bias"),
    "command-r-plus": Spec("CohereForAI/c4ai-command-r-plus", "CohereConfig", dict(
        vocab_size=256000, hidden_size=12288, intermediate_size=33792, num_hidden_layers=64, num_attention_heads=96,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=8192, layer_norm_eps=1e-5,
        logit_scale=0.8333333333333334, rope_theta=75000000.0, use_qk_norm=True, attention_bias=False,
        tie_word_embeddings=True, bos_token_id=5, eos_token_id=255001, pad_token_id=0), parallel=True,
        remark="attention and MLP read one norm; a LayerNorm of each q and k head"),
    "pythia-1b": Spec("EleutherAI/pythia-1b", "GPTNeoXConfig", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
        hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5, rotary_pct=0.25,
        rotary_emb_base=10000, use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0), parallel=True, norms=2, remark="GPT-NeoX, fused query_key_value"),
    "gpt-neox-20b": Spec("EleutherAI/gpt-neox-20b", "GPTNeoXConfig", dict(
        vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44, num_attention_heads=64,
        hidden_act="gelu_fast", max_position_embeddings=2048, layer_norm_eps=1e-5, rotary_pct=0.25,
        rotary_emb_base=10000, use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=2), parallel=True, norms=2, remark="parallel residual, a norm per branch (issue 40)"),
    "falcon-11b": Spec("tiiuae/falcon-11B", "FalconConfig", dict(
        vocab_size=65024, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_kv_heads=8,
        new_decoder_architecture=True, num_ln_in_parallel_attn=1, parallel_attn=True, bias=False, alibi=False,
        layer_norm_epsilon=1e-5, max_position_embeddings=8192, rope_theta=500042.0, bos_token_id=11,
        eos_token_id=11), parallel=True, remark="32 heads in 8 groups, q/k/v fused per group, one norm"),
    "opt-1.3b": Spec("facebook/opt-1.3b", "OPTConfig", dict(
        vocab_size=50272, hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
        max_position_embeddings=2048, word_embed_proj_dim=2048, do_layer_norm_before=True,
        activation_function="relu", enable_bias=True, tie_word_embeddings=True, pad_token_id=1, bos_token_id=2,
        eos_token_id=2), remark="learned positions (offset 2)"),
    "bloom-560m": Spec("bigscience/bloom-560m", "BloomConfig", dict(
        vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16, layer_norm_epsilon=1e-5,
        apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=3), attn="eager",
        layers_key="n_layer", remark="ALiBi; batch x heads merged for baddbmm; fused q/k/v per head"),
    "gpt-j-6b": Spec("EleutherAI/gpt-j-6b", "GPTJConfig", dict(
        vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_positions=2048,
        activation_function="gelu_new", tie_word_embeddings=False, bos_token_id=50256, eos_token_id=50256),
        parallel=True, attn="eager", layers_key="n_layer", remark="rotary on 64 of 256 features, rotate_every_two"),
    "codegen-350m": Spec("Salesforce/codegen-350M-mono", "CodeGenConfig", dict(
        vocab_size=51200, n_embd=1024, n_layer=20, n_head=16, rotary_dim=32, n_ctx=2048, n_positions=2048,
        activation_function="gelu_new", tie_word_embeddings=False, bos_token_id=1, eos_token_id=50256),
        parallel=True, attn="eager", layers_key="n_layer", remark="fused qkv_proj in 4 model-parallel blocks"),
    "gpt-neo-1.3b": Spec("EleutherAI/gpt-neo-1.3B", "GPTNeoConfig", dict(
        vocab_size=50257, hidden_size=2048, num_layers=24, num_heads=16, intermediate_size=None, window_size=256,
        max_position_embeddings=2048, activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256),
        attn="eager", layers_key="num_layers", per_layer={"attention_types": (["global", "local"], 2)},
        remark="global and local (window 256) attention alternate; tied embeddings"),
    # Mixtures of experts (the module docstring: Megatron's formula applies unchanged).
    "mixtral-8x7b": Spec("mistralai/Mixtral-8x7B-v0.1", "MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        attention_dropout=0.0, output_router_logits=False, router_aux_loss_coef=0.02, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2), moe=True, remark="8 experts top-2"),
    "qwen3-30b-a3b": Spec("Qwen/Qwen3-30B-A3B", "Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
        max_position_embeddings=40960, max_window_layers=48, rms_norm_eps=1e-6, rope_theta=1000000.0,
        attention_bias=False, use_sliding_window=False, sliding_window=None, attention_dropout=0.0,
        output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645), moe=True, remark="128 experts top-8; per-head q/k RMSNorm"),
    "qwen1.5-moe-a2.7b": Spec("Qwen/Qwen1.5-MoE-A2.7B", "Qwen2MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, hidden_act="silu",
        max_position_embeddings=8192, max_window_layers=21, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=32768, attention_dropout=0.0, output_router_logits=False,
        router_aux_loss_coef=0.001, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
        moe=True, remark="60 experts top-4 + a sigmoid-gated shared expert"),
    "qwen2-57b-a14b": Spec("Qwen/Qwen2-57B-A14B", "Qwen2MoeConfig", dict(
        vocab_size=151936, hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1, hidden_act="silu",
        max_position_embeddings=131072, max_window_layers=28, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=131072, attention_dropout=0.0, output_router_logits=False,
        router_aux_loss_coef=0.001, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
        moe=True, remark="64 experts top-8 + a sigmoid-gated shared expert"),
    "olmoe-1b-7b": Spec("allenai/OLMoE-1B-7B-0924", "OlmoeConfig", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, clip_qkv=None,
        attention_dropout=0.0, output_router_logits=False, router_aux_loss_coef=0.01, tie_word_embeddings=False,
        pad_token_id=1, bos_token_id=None, eos_token_id=50279), moe=True,
        remark="64 experts top-8; RMSNorm of q and of k over all heads"),
    "deepseek-v2-lite": Spec("deepseek-ai/DeepSeek-V2-Lite", "DeepseekV2Config", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, n_group=1,
        topk_group=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax",
        aux_loss_alpha=0.001, seq_aux=True, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                        "mscale": 0.707, "mscale_all_dim": 0.707,
                                        "original_max_position_embeddings": 4096},
        attention_bias=False, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001),
        moe=True, bar=False,
        remark="multi-head latent attention (not the dense formula's); 64 routed experts top-6 + 2 shared; "
               "layer 0 dense"),
}

# Large models of published training runs (docs/benchmarks.md section 16), by name beside CONFIGS.
LARGE: dict[str, Spec] = {
    # Korthikanti et al. 2022, Table 3 (no checkpoint: GPT2Config builds them; eager attention, fp16)
    "gpt-22b": Spec("", "GPT2Config", dict(vocab_size=51200, n_positions=2048, n_embd=6144, n_layer=48, n_head=64,
                                           activation_function="gelu", tie_word_embeddings=True),
                    layers_key="n_layer", attn="eager", dtype="float16", remark="Korthikanti et al. 2022"),
    "gpt-175b": Spec("", "GPT2Config", dict(vocab_size=51200, n_positions=2048, n_embd=12288, n_layer=96, n_head=96,
                                            activation_function="gelu", tie_word_embeddings=True),
                     layers_key="n_layer", attn="eager", dtype="float16", remark="Korthikanti et al. 2022; GPT-3"),
    "gpt-530b": Spec("", "GPT2Config", dict(vocab_size=51200, n_positions=2048, n_embd=20480, n_layer=105,
                                            n_head=128, activation_function="gelu", tie_word_embeddings=True),
                     layers_key="n_layer", attn="eager", dtype="float16", remark="Korthikanti et al. 2022; MT-NLG"),
    "gpt-1t": Spec("", "GPT2Config", dict(vocab_size=51200, n_positions=2048, n_embd=25600, n_layer=128, n_head=160,
                                          activation_function="gelu", tie_word_embeddings=True),
                   layers_key="n_layer", attn="eager", dtype="float16", remark="Korthikanti et al. 2022"),
    "llama3-70b": Spec("meta-llama/Meta-Llama-3-70B", "LlamaConfig", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001), dtype="bfloat16"),
    "llama2-13b": Spec("meta-llama/Llama-2-13b-hf", "LlamaConfig", dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=40, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), dtype="bfloat16"),
    "llama2-70b": Spec("meta-llama/Llama-2-70b-hf", "LlamaConfig", dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), dtype="bfloat16"),
    "llama3-405b": Spec("meta-llama/Llama-3.1-405B", "LlamaConfig", dict(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001), dtype="bfloat16"),
}


def config_of(name_or_path, layers: int | None = None):
    """The transformers config of a built-in name (CONFIGS) or of a config.json file / directory, at
    the published depth or `layers`, with its attention implementation set (`Spec.attn`)."""
    import transformers
    key = str(name_or_path)
    if key in CONFIGS or key in LARGE:
        spec = {**CONFIGS, **LARGE}[key]
        scaled = {k: [[v, (layers or spec.kwargs[spec.layers_key]) // n]] for k, (v, n) in spec.per_layer.items()}
        cfg = getattr(transformers, spec.config)(**{**spec.kwargs, **scaled, "use_cache": False,
                                                   **({spec.layers_key: layers} if layers else {})})
        cfg._attn_implementation = spec.attn
        if spec.dtype:
            cfg.dtype = spec.dtype
        return cfg
    path = os.path.join(key, "config.json") if os.path.isdir(key) else key
    if not os.path.isfile(path):
        raise LoadError(f"{key!r} is neither a built-in configuration ({', '.join(sorted({**CONFIGS, **LARGE}))}) nor a "
                        "config.json file or directory")
    with open(path) as f:
        data = json.load(f)
    if "model_type" not in data:
        raise LoadError(f"{path} has no model_type: not a transformers config.json")
    cfg = transformers.AutoConfig.for_model(**data)
    if layers:
        cfg.num_hidden_layers = layers
    return cfg
