"""`gm.generate`: Hugging Face's GenerationMixin over the parallel module, the key/value cache
split by heads (autoshard.io.generate).

Gloo ranks at world 2 and 3 against the single-process model's own `generate`: greedy tokens
equal for LLaMA (grouped K/V heads; also fewer K/V heads than ranks), GPT-2 (fused c_attn),
Qwen2 and GPT-NeoX (parallel attention and MLP), one prompt and a left-padded batch with its
attention mask; sampling (temperature, top-k, top-p) the same on every rank whatever each rank's
torch seed, and equal to one process under autoshard.manual_seed(s) / torch.manual_seed(s); beam
search equal, with return_dict_in_generate's scores. Every case asserts the cache each rank
holds: its own K/V heads only (the heads its queries read; K/V heads replicated where there are
fewer than ranks), and the bytes counted in a decode step against its plan's prediction and,
where the module's layouts are Megatron's, against Megatron's inference bytes.
cache_implementation="static": tokens and scores equal one process's static generate, eager and
with the decode step compiled (`compile=True`: one dynamo graph for every token, no graph
break); each rank's static buffers hold its K/V heads at HF's max_cache_len; what the static
path does not serve is a ShardingError.
LLaMA and GPT-2 greedy at world 2, one world-3 case, one world-4 case (2 K/V heads held by groups
of 2 ranks) and generate with use_cache=False (Phi-3) run by default; the rest with -m slow.
"""
import copy

import pytest
import torch

import hf_models

pytest.importorskip("transformers")


def _neox(**kw):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
               max_position_embeddings=64, use_parallel_residual=True, rotary_pct=0.5, attention_dropout=0.0,
               hidden_dropout=0.0, use_cache=False, **kw)
    model = hf_models.build_model(GPTNeoXConfig, GPTNeoXForCausalLM, cfg)
    return model, hf_models.example_kwargs(256)


def _nemotron(**kw):
    from transformers import NemotronConfig, NemotronForCausalLM
    cfg = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=2, max_position_embeddings=64, use_cache=False, **kw)
    return hf_models.build_model(NemotronConfig, NemotronForCausalLM, cfg), hf_models.example_kwargs(256)


def _falcon(**kw):
    """Falcon's new decoder architecture: one fused query_key_value in groups (each K/V head's query
    heads, then its K and V), parallel attention and MLP; its cache holds K and V expanded to the
    query heads."""
    from transformers import FalconConfig, FalconForCausalLM
    cfg = dict(vocab_size=256, hidden_size=96, num_attention_heads=6, num_kv_heads=2, new_decoder_architecture=True,
               num_hidden_layers=2, max_position_embeddings=128, parallel_attn=True, bias=False)
    cfg.update(kw)
    return hf_models.build_model(FalconConfig, FalconForCausalLM, cfg), hf_models.example_kwargs(256, seq=64)


def _arch(config: str, model: str, **extra):
    """A decoder of `transformers` by class names, 6 query / 2 K/V heads of 16 features, 2 layers."""
    import transformers
    cfg = dict(vocab_size=256, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=192,
               num_hidden_layers=2, max_position_embeddings=128, pad_token_id=0, **extra)
    return (hf_models.build_model(getattr(transformers, config), getattr(transformers, model), cfg),
            hf_models.example_kwargs(256, seq=64))


MODELS = {
    "llama": lambda: hf_models.llama(),
    "llama_mqa": lambda: hf_models.llama(num_attention_heads=4, num_key_value_heads=1),
    "gpt2": lambda: hf_models.gpt2(),
    "qwen2": lambda: hf_models.qwen2(),
    "neox": _neox,
    "phi3": lambda: hf_models.phi3(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=192,
                                   seq=64, max_position_embeddings=128),      # fused qkv_proj and gate_up_proj
    "nemotron": _nemotron,
    "falcon": _falcon,
    "falcon8_2": lambda: _falcon(hidden_size=128, num_attention_heads=8),      # 2 K/V groups on 4 ranks
    # at 3 ranks (examples of 64 tokens, where splitting attention by heads pays): 7 heads that
    # do not divide (3, 2, 2 a rank), and 6 query heads over 2 K/V heads (fewer K/V heads than ranks)
    "llama7": lambda: hf_models.llama(hidden_size=56, num_attention_heads=7, num_key_value_heads=7,
                                      intermediate_size=112, seq=64, max_position_embeddings=128),
    "qwen2_6_2": lambda: hf_models.qwen2(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                         intermediate_size=96, seq=64, max_position_embeddings=128),
    "llama6_2": lambda: hf_models.llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                        intermediate_size=96, seq=64, max_position_embeddings=128),
    # Qwen3's per-head RMSNorm of the keys between k_proj and the cache
    "qwen3_6_2": lambda: hf_models.qwen3(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                         intermediate_size=192, seq=40, max_position_embeddings=128),
    # architectures no other test names: attention and MLP in parallel from one norm, interleaved
    # rotary, a LayerNorm of each q and k head (Cohere); q, k and v clamped in place (OLMo's clip_qkv);
    # partial interleaved rotary (GLM); a LayerNorm per head split from q and k and cat (StableLM)
    "cohere": lambda: _arch("CohereConfig", "CohereForCausalLM", use_qk_norm=True),
    "olmo_clip": lambda: _arch("OlmoConfig", "OlmoForCausalLM", clip_qkv=8.0),
    "glm": lambda: _arch("GlmConfig", "GlmForCausalLM", head_dim=16),
    "stablelm": lambda: _arch("StableLmConfig", "StableLmForCausalLM", qk_layernorm=True),
    # sliding-window layers (a window of 4 tokens) and a RMSNorm of each q and k head
    "gemma3": lambda: _arch("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=4),
    # at 4 ranks: 2 K/V heads held by groups of 2 ranks (`Shard(d, replicas=2)`)
    "llama8_2": lambda: hf_models.llama(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                        intermediate_size=256, seq=64, max_position_embeddings=128),
}


def _prompts(kw, batch):
    """One prompt (1, 6), or a left-padded batch of 3 prompts of lengths 6, 4, 2 with its mask."""
    ids = kw["input_ids"]
    if batch == 1:
        return {"input_ids": ids[:1, :6]}
    lengths = (6, 4, 2)
    pad = 0
    out = torch.full((3, 6), pad, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, 6 - n:] = ids[i % ids.size(0), :n]
        mask[i, 6 - n:] = 1
    return {"input_ids": out, "attention_mask": mask}


def _cache_of(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _kv_heads(model) -> int:
    cfg = model.config
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _query_kv_heads(gm, model, rank, p) -> int:
    """The K/V heads rank `rank`'s query heads read (from its share of the first layer's query
    projection, whole heads in rank order)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = _kv_heads(model)
    plan = gm._autoshard_plan
    q = next((n for n in plan.layouts if n.endswith(("q_proj.weight", "query_key_value.weight", "c_attn.weight"))),
             None)
    from autoshard.runtime.placements import Shard, local_shape
    if q is None:      # q in a fused projection of unequal parts (Phi-3's qkv_proj): heads cut as torch.chunk does
        mine = [len(c) for c in torch.arange(heads).chunk(p)]
    else:
        pl = plan.layouts[q]
        if not isinstance(pl, Shard):
            return kv
        shape = plan.graph_module.get_parameter(q).shape
        chunks = 3 if q.endswith(("query_key_value.weight", "c_attn.weight")) else 1   # fused q, k, v rows
        head_dim = cfg.hidden_size // heads
        mine = [local_shape(shape, pl, p, r)[pl.dim] // chunks // head_dim for r in range(p)]
    start = sum(mine[:rank])
    group = heads // kv
    return len({h // group for h in range(start, start + mine[rank])})


def _generate_case(rank, p, name, batch, options, plan_options=None):
    import autoshard
    from autoshard.runtime.collectives import count_comm
    model, kw = MODELS[name]()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export", **(plan_options or {}))
    gm.eval()
    prompts = _prompts(kw, batch)
    options = dict(options, max_new_tokens=6, use_cache=True, return_dict_in_generate=True, output_scores=True,
                   pad_token_id=0)
    sampled = options.get("do_sample", False)
    if sampled:
        torch.manual_seed(1000 + 17 * rank)           # each rank's own torch seed differs
        autoshard.manual_seed(5)
    out = gm.generate(**prompts, **options)
    if sampled:
        torch.manual_seed(5)
    want = ref.generate(**prompts, **options)
    cache = _cache_of(out)
    heads = [int(layer.keys.shape[1]) for layer in cache.layers]
    full = [int(layer.keys.shape[1]) for layer in _cache_of(want).layers]
    assert full == [_kv_heads(ref)] * len(full), full
    expected = _query_kv_heads(gm, ref, rank, p)
    assert heads == [expected] * len(heads), (name, rank, heads, expected, full)
    if p > 1 and _kv_heads(ref) >= p:
        assert expected < _kv_heads(ref)
    # one more decode step, its bytes counted against its plan
    sig = gm._autoshard_signatures
    adapter = gm.__dict__["_autoshard_generator"]
    key = next(k for k in sig.served if len(k) == 4 and k[3] == "generate.step"
               and any(n == "keys" and v != ("tuple", ()) for n, v in k[1]))
    plan = sig.plans[key]
    rows = int(cache.layers[0].keys.shape[0])          # batch x beams: beam search keeps one row a beam
    nxt = out.sequences[:, -1:].repeat_interleave(rows // out.sequences.size(0), dim=0)
    with count_comm() as c:
        adapter(input_ids=nxt, use_cache=True, **{adapter._cache_name: cache})
    return (out.sequences.tolist(), want.sequences.tolist(),
            [s.tolist() for s in out.scores][:2], [s.tolist() for s in want.scores][:2],
            heads, c.bytes, _forward_bytes(plan), dict(c.by_kind), [(r.node, r.forward, r.nbytes) for r in plan.redistributions if r.forward],
            _megatron_bytes(gm, ref, plan, rows),
            sorted({d.strategy for d in plan.nodes.values() if d.module and d.module.endswith(("k_proj", "v_proj"))}))


def _megatron_bytes(gm, model, plan, rows):
    """Megatron's inference bytes of a decode step (2 all-reduces of rows x hidden a layer, 1 a
    layer where attention and MLP run in parallel, one for the vocabulary-parallel embedding,
    the all-gather of rows x vocabulary logits, the vocabulary padded to the largest rank's share
    as the gather moves it; fp32), where the module's layouts are Megatron's: every norm's
    weights replicated, heads that divide over the ranks (7 heads over 3 ranks count 16 bytes
    more, not analysed), and no K/V gathered inside a projection's strategy (as many K/V heads as
    ranks or more, or fewer computed where they are read from whole weights); else None."""
    from autoshard.runtime.counters import ring_bytes
    from autoshard.runtime.placements import Replicate
    layouts = gm._autoshard_plan.layouts
    norms = [k for k in layouts if "norm" in k or ".ln_" in k]
    cfg, p = model.config, plan.world_size
    if cfg.num_attention_heads % p or not norms or not all(isinstance(layouts[k], Replicate) for k in norms) \
            or any(d.comm for d in plan.nodes.values()):
        return None
    per_layer = 1 if getattr(cfg, "use_parallel_residual", False) else 2
    layers = cfg.num_hidden_layers
    vocab = -(-cfg.vocab_size // p) * p          # gathered padded to the largest share (256 at 3 ranks: 86 each)
    return float((per_layer * layers + 1) * ring_bytes("all_reduce", rows * cfg.hidden_size * 4, p)
                 + ring_bytes("all_gather", rows * vocab * 4, p))


def _forward_bytes(plan) -> float:
    """The ring bytes a rank sends in the plan's forward collectives (a decode step runs no
    backward): its redistributions' forward ones, and the all-gathers inside the nodes' own
    strategies (K/V heads gathered onto groups of ranks where there are fewer K/V heads than
    ranks; a strategy's reduce-scatter is that all-gather's backward)."""
    from autoshard.runtime.counters import ring_bytes, split_kind
    p = plan.world_size
    moved = sum(ring_bytes(k, r.nbytes, p) for r in plan.redistributions for k in r.forward)
    inside = sum(ring_bytes(k, nb, p) for d in plan.nodes.values() for k, nb in d.comm
                 if split_kind(k)[0] == "all_gather")
    return float(moved + inside)


def _check(results, name):
    first = results[0]
    for r in results:
        assert r[0] == first[0], f"{name}: ranks generated different tokens"
        assert r[0] == r[1], f"{name}: {r[0]} != one process's {r[1]}"
        for got, want in zip(r[2], r[3]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
        assert r[5] == pytest.approx(r[6], rel=1e-9), (name, r[7], r[6], r[8])
        if r[9] is not None:   # Megatron's or fewer (an embedding split on hidden gathers half an all-reduce's bytes)
            assert r[5] <= r[9], (name, "decode bytes against Megatron's", r[5], r[9], r[7])


GREEDY = dict(do_sample=False)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_world2(name, dist2):
    _check(dist2.run(_generate_case, name, 1, GREEDY, timeout=600), name)


def test_greedy_world3_padded(dist3):
    _check(dist3.run(_generate_case, "llama7", 3, GREEDY, timeout=600), "llama at 3")


@pytest.mark.slow
@pytest.mark.parametrize("name,batch", [("llama", 3), ("gpt2", 3), ("llama_mqa", 1), ("llama_mqa", 3),
                                        ("qwen2", 3), ("neox", 1), ("neox", 3)])
def test_greedy_more_world2(name, batch, dist2):
    _check(dist2.run(_generate_case, name, batch, GREEDY, timeout=600), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama6_2", "gpt2", "qwen2_6_2", "neox"])
def test_greedy_world3(name, dist3):
    _check(dist3.run(_generate_case, name, 1, GREEDY, timeout=600), name)


def test_greedy_world4_kv_heads_held_by_groups(dist4):
    """2 K/V heads on 4 ranks: each pair of ranks holds the K/V head its queries read, in the
    prefill's cache and in every decode step, which reads the cache as the prefill returned it
    (it failed in the shape check before: the decode step could not take a cache held by groups)."""
    results = dist4.run(_generate_case, "llama8_2", 3, GREEDY, timeout=600)
    _check(results, "llama 8/2 heads at 4")
    assert [r[4] for r in results] == [[1, 1]] * 4, [r[4] for r in results]


def test_greedy_world3_fused_qkv(dist3):
    """Phi-3's fused qkv_proj with 2 K/V heads on 3 ranks (6 query heads), a left-padded batch: the
    default plan trains the fused weight split in elements, so a generation step gathers the new
    tokens' q, k and v; each rank still computes attention for its query heads only and caches
    only the K/V heads they read (1, 2, 1), cut from the gathered projection (a step without
    backward may cut a whole K or V to its readers' heads). Every rank cached both heads before.
    Bytes counted = predicted; not Megatron's (that gather, beside the all-reduces)."""
    results = dist3.run(_generate_case, "phi3", 3, GREEDY, timeout=600)
    _check([r[:9] + (None,) + r[10:] for r in results], "phi3 6/2 heads at 3")
    assert [r[4] for r in results] == [[1, 1], [2, 2], [1, 1]], [r[4] for r in results]


def test_greedy_world3_per_head_key_norm(dist3):
    """Qwen3 (an RMSNorm of each key head before the cache), 6 query / 2 K/V heads at 3 ranks: the
    generation step cuts the whole K to the heads each rank's queries read before the norm, whose
    statistics then stay per rank's heads (the norm's rule kept only plain shards, so the plan had
    them whole while each rank held its heads: the first step failed the shape check). At this
    size the training plan gathers q, k and v for attention (a norm weight's gradient all-reduce
    costs more than the gathers), so the step's bytes are its plan's, not Megatron's."""
    results = dist3.run(_generate_case, "qwen3_6_2", 1, GREEDY, timeout=600)
    _check([r[:9] + (None,) + r[10:] for r in results], "qwen3 6/2 heads at 3")
    assert [r[4] for r in results] == [[1, 1], [2, 2], [1, 1]], [r[4] for r in results]


def _expanded_cache_case(rank, p, name, static=True):
    """(tokens equal one process's, K and V heads a rank caches, one process's), dynamic and (with
    `static`) static cache, for a model whose cache holds K/V expanded to the query heads."""
    import autoshard
    model, kw = MODELS[name]()
    ref = copy.deepcopy(model).eval()
    gm = autoshard.parallelize(model, p, kw, tracer="export").eval()
    out = []
    for extra in ({}, {"cache_implementation": "static"})[:2 if static else 1]:
        options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=True, return_dict_in_generate=True,
                       **extra)
        got, want = gm.generate(**_prompts(kw, 1), **options), ref.generate(**_prompts(kw, 1), **options)
        layer, whole = _cache_of(got).layers[0], _cache_of(want).layers[0]
        out.append((got.sequences.tolist() == want.sequences.tolist(), int(layer.keys.shape[1]),
                    int(layer.values.shape[1]), int(whole.keys.shape[1])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,heads", [("cohere", [2, 2, 2]), ("olmo_clip", [1, 2, 1]), ("glm", [1, 2, 1]),
                                        ("stablelm", [2, 2, 2]), ("gemma3", [1, 2, 1])])
def test_unnamed_architectures_world3(name, heads, dist3):
    """Decoders no other test is written for, at 3 ranks, dynamic and static cache (Gemma 3's
    sliding-window layers: dynamic only, the static one is refused by name): the tokens of one
    process. Before: OLMo's in-place clamp had no rule (the first step failed its shape check);
    Cohere's, GLM's, StableLM's and Gemma 3's generation steps cut K by heads where a later op (a
    stack, a cat, the sliding window's concatenation to an empty tensor) could not read the piece
    (a ShardingError at the first call), and Cohere's plan took minutes (its five projections
    reading one norm enumerated together). Cohere and StableLM still cache both K/V heads on every
    rank (the step is searched again without the cut)."""
    static = name != "gemma3"
    results = dist3.run(_expanded_cache_case, name, static, timeout=900)
    for rank in results:
        assert all(r[0] for r in rank), (name, rank)
    assert [[r[1] for r in rank] for rank in results] == [[h] * (1 + static) for h in heads], results


def test_expanded_cache_world3(dist3):
    """Falcon (new decoder architecture, 6 query / 2 K/V heads) at 3 ranks: its cache holds K and V
    expanded to the 6 query heads; each rank keeps its own query heads' 2 (the pieces held by the
    ranks that read them are cut to the even share inside them as the step returns them), where
    ranks held 3, 6 and 3 before (the middle rank the whole cache)."""
    for rank in dist3.run(_expanded_cache_case, "falcon", timeout=600):
        assert rank == [(True, 2, 2, 6)] * 2, rank


@pytest.mark.parametrize("world,name,heads", [(2, "falcon", 3), pytest.param(4, "falcon8_2", 2, marks=pytest.mark.slow)])
def test_cache_split_where_attention_trains_whole(world, name, heads, request):
    """Falcon whose training plan splits the fused query_key_value in rows that do not follow its
    K/V groups (hidden 96 at 2 ranks; 2 groups on 4 ranks), so K and V come out of it whole on
    every rank: a generation step cuts them by heads before the cache is written
    (`planner.inference`), and each rank caches 1/p of the expanded heads, where every rank
    cached all of them before (tokens exact either way), dynamic and static cache."""
    pool = request.getfixturevalue(f"dist{world}")
    for rank in pool.run(_expanded_cache_case, name, timeout=600):
        assert rank == [(True, heads, heads, heads * world)] * 2, rank


def _replicated_kv(layers=2):
    """Plan options pinning Megatron's layouts with its replicated K/V heads: every K/V
    projection's weights whole, the norms' weights whole, the embedding split by vocabulary;
    bytes priced without latency (at these tiny sizes the default's 1 us a ring step would rather
    gather the queries and run attention whole)."""
    from autoshard.planner.cost import CostModel
    pins = {f"model.layers.{i}.{m}": None for i in range(layers)
            for m in ("self_attn.k_proj", "self_attn.v_proj", "input_layernorm", "post_attention_layernorm")}
    return {"pin": {**pins, "model.norm": None, "model.embed_tokens": 0}, "cost_model": CostModel(latency=0.0)}


@pytest.mark.slow
def test_greedy_world3_kv_heads_computed_where_read(dist3):
    """2 K/V heads on 3 ranks with the K/V weights whole: each rank computes and caches only the
    K/V heads its queries read (1, 2, 1 heads), its projection reading those rows of the weights
    ("replicate_cover"), so a decode step moves no K/V: bytes counted = predicted = Megatron's
    (2 all-reduces a layer, the embedding's, the logits' gather)."""
    results = dist3.run(_generate_case, "llama6_2", 1, GREEDY, _replicated_kv(), timeout=600)
    _check(results, "llama 6/2 heads at 3, K/V weights whole")
    assert [r[4] for r in results] == [[1, 1], [2, 2], [1, 1]], [r[4] for r in results]
    assert all(r[10] == ["replicate_cover"] for r in results), [r[10] for r in results]
    assert all(r[9] is not None and r[5] == r[9] for r in results), [(r[5], r[9], r[7]) for r in results]


@pytest.mark.slow
def test_greedy_nemotron(dist2):
    """Nemotron (LayerNorm1P, partial rotary, squared-ReLU MLP): tokens and scores equal one
    process's, bytes counted = predicted. Its decode step is not Megatron's: it moves 2176 bytes
    against Megatron's 1792 at 2 ranks (4 all-gathers of activations beside the all-reduces; not
    analysed), so that comparison is left out here."""
    results = dist2.run(_generate_case, "nemotron", 1, GREEDY, timeout=600)
    _check([r[:9] + (None,) + r[10:] for r in results], "nemotron")


def _no_cache_case(rank, p, name):
    """generate with the model's config at use_cache=False (a training config: HF then passes the
    whole sequence every step and keeps no cache) and with use_cache=True: tokens and scores as
    one process's either way (the step read the sequence again on top of its cache before)."""
    import autoshard
    model, kw = MODELS[name]()
    assert model.config.use_cache is False
    ref = copy.deepcopy(model).eval()
    gm = autoshard.parallelize(model, p, kw, tracer="export").eval()
    ids = kw["input_ids"][:1, :6]
    out = []
    for use_cache in (None, True):
        options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                       output_scores=True, **({} if use_cache is None else {"use_cache": use_cache}))
        got, want = gm.generate(input_ids=ids, **options), ref.generate(input_ids=ids, **options)
        out.append((got.sequences.tolist() == want.sequences.tolist(),
                    max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores)), _cache_of(got) is None))
    return out


@pytest.mark.parametrize("name", ["phi3"])
def test_generate_without_cache(name, dist2):
    for (same, diff, no_cache), (same_c, diff_c, _) in dist2.run(_no_cache_case, name, timeout=600):
        assert same and diff < 1e-4 and no_cache, (same, diff, no_cache)
        assert same_c and diff_c < 1e-4, (same_c, diff_c)


def _eos_case(rank, p, name):
    """Greedy generation that stops on `eos_token_id`: the token one process's model writes third
    in the first row of a left-padded batch is made the end-of-sequence token; that row is then
    padded with pad_token_id after it while the others go on, and a prompt alone stops there."""
    import autoshard
    model, kw = MODELS[name]()
    ref = copy.deepcopy(model).eval()
    gm = autoshard.parallelize(model, p, kw, tracer="export").eval()
    prompts = _prompts(kw, 3)
    options = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    free = ref.generate(**prompts, **options)
    eos = int(free[0, prompts["input_ids"].size(1) + 2])
    out = []
    for batch in (prompts, {"input_ids": prompts["input_ids"][:1]}):
        got, want = gm.generate(**batch, **options, eos_token_id=eos), ref.generate(**batch, **options, eos_token_id=eos)
        out.append((got.tolist(), want.tolist()))
    return eos, free.tolist(), out


def test_stops_on_eos(dist2):
    for eos, free, ((got, want), (got1, want1)) in dist2.run(_eos_case, "llama", timeout=600):
        assert got == want and got1 == want1, (got, want, got1, want1)
        start, new = 6, 8
        first = got[0].index(eos, start)                 # row 0 ends at its first eos (its third new token at latest)
        assert first <= start + 2 and got[0][first + 1:] == [0] * (len(got[0]) - first - 1), (eos, got[0])
        assert len(got1[0]) < start + new and got1[0][-1] == eos, (eos, got1)        # a prompt alone stops there
        assert len(free[0]) == start + new, free                                     # (without eos it would not)


@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(2, "llama"), (3, "llama6_2")])
def test_sampling_agrees(world, name, request):
    """At 3 ranks a LLaMA whose attention the plan splits by heads (6 query heads over 2 K/V
    heads, examples of 64 tokens): each rank's cache holds the K/V heads its queries read."""
    options = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9)
    pool = request.getfixturevalue(f"dist{world}")
    _check(pool.run(_generate_case, name, 3, options, timeout=600), "sampling")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_beam_search(name, dist2):
    _check(dist2.run(_generate_case, name, 1, dict(do_sample=False, num_beams=3), timeout=600), "beam")


def _from_pretrained_case(rank, p, path):
    import autoshard
    from transformers import AutoModelForCausalLM
    gm = autoshard.from_pretrained(path, p)          # config -> meta model -> this rank's slices
    gm.eval()
    assert not any(t.is_meta for t in gm.parameters())
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    out = gm.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    want = AutoModelForCausalLM.from_pretrained(path).eval().generate(ids, max_new_tokens=6, do_sample=False,
                                                                      use_cache=True, pad_token_id=0)
    return out.tolist(), want.tolist()


@pytest.mark.slow
def test_from_pretrained_generates(dist2, tmp_path):
    model, _ = hf_models.llama()
    model.save_pretrained(tmp_path)
    for got, want in dist2.run(_from_pretrained_case, str(tmp_path), timeout=600):
        assert got == want


def _static_case(rank, p, name, batch, compile_config, errors=False, beams=1):
    """Greedy generation with cache_implementation="static" against one process's, eager and
    then with the decode step compiled (`compile_config`: HF CompileConfig options); the static
    cache each rank holds (its K/V heads, HF's max_cache_len), the compiled decode's graphs and
    graph breaks, and the last decode step run again eagerly, its bytes against its plan's
    (`errors`: then what the static path refuses, `_unsupported`; `beams`: beam search)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, StaticCache

    import autoshard
    from autoshard.runtime.collectives import count_comm
    model, kw = MODELS[name]()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export")
    gm.eval()
    prompts = _prompts(kw, batch)
    options = dict(max_new_tokens=6, use_cache=True, return_dict_in_generate=True, output_scores=True, pad_token_id=0,
                   do_sample=False, cache_implementation="static", num_beams=beams)
    want = ref.generate(**prompts, **options)
    out = gm.generate(**prompts, **options)
    served = gm._autoshard_signatures.served
    static_key = next(k for k in served if len(k) == 4 and k[3] == "generate.static")
    assert not served[static_key].compiled, "compiled without compile=True on the CPU (HF compiles on accelerators)"
    dynamo.reset()
    counters.clear()
    compiled = gm.generate(**prompts, **options, compile=True, compile_config=CompileConfig(**compile_config))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    # HF compiles the decode steps of greedy search and sampling (`_sample`); its beam search
    # calls the model uncompiled, and so does the parallel module's
    assert bool(served[static_key].compiled) == (beams == 1), (beams, "compiled" if served[static_key].compiled else "")
    expected_graphs = 1 if beams == 1 else 0
    cache, full = _cache_of(out), _cache_of(want)
    assert isinstance(cache, StaticCache) and isinstance(full, StaticCache)
    heads = [tuple(layer.keys.shape) for layer in cache.layers]
    expected = _query_kv_heads(gm, ref, rank, p)
    for mine, whole in zip(heads, [tuple(layer.keys.shape) for layer in full.layers]):
        assert mine == (whole[0], expected, whole[2], whole[3]), (name, rank, mine, whole, expected)
    if _kv_heads(ref) >= p:
        assert expected * p == _kv_heads(ref), (expected, _kv_heads(ref))
    # the last decode step again, eager (HF's crop: the cache's length one less), its bytes counted
    adapter = gm.__dict__["_autoshard_generator"]
    rows = int(cache.layers[0].keys.shape[0])
    mask = torch.ones(rows, out.sequences.size(1) - 1, dtype=torch.long)
    if "attention_mask" in prompts:
        mask[:, :prompts["attention_mask"].size(1)] = prompts["attention_mask"].repeat_interleave(beams, dim=0)
    last = out.sequences[:, -2:-1].repeat_interleave(rows // out.sequences.size(0), dim=0)
    for layer in cache.layers:
        layer.crop(-1)
    with count_comm() as c:
        adapter(input_ids=last, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                use_cache=True, **{adapter._cache_name: cache})
    plan = gm._autoshard_signatures.plans[static_key]
    return (out.sequences.tolist(), compiled.sequences.tolist(), want.sequences.tolist(),
            [s.tolist() for s in out.scores], [s.tolist() for s in compiled.scores],
            [s.tolist() for s in want.scores], (graphs, expected_graphs), breaks, c.bytes, _forward_bytes(plan),
            _megatron_bytes(gm, ref, plan, rows), _unsupported(gm, kw) if errors else None)


def _check_static(results, name):
    for r in results:
        assert r[0] == r[2] and r[1] == r[2], f"{name}: eager {r[0]}, compiled {r[1]}, one process {r[2]}"
        for mine in (r[3], r[4]):
            for got, want in zip(mine, r[5]):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
        assert r[6][0] == r[6][1] and r[7] == 0, f"{name}: {r[6][0]} compiled graphs ({r[6][1]} expected), {r[7]} graph breaks"
        assert r[8] == pytest.approx(r[9], rel=1e-9), (name, r[8], r[9])
        if r[10] is not None:    # Megatron's or fewer (an embedding split on features: half an all-reduce)
            assert r[8] <= r[10], (name, "decode bytes against Megatron's", r[8], r[10])


DYNAMO = dict(backend="eager", fullgraph=True)      # dynamo's graph capture only: seconds, not minutes


def test_static_cache(dist2):
    """cache_implementation="static" at 2 ranks, LLaMA, a left-padded batch: eager and with the
    decode step compiled (dynamo, fullgraph, one graph for every token); what is not supported
    is a ShardingError saying so."""
    results = dist2.run(_static_case, "llama", 3, DYNAMO, True, timeout=600)
    _check_static(results, "llama static")
    for *_, errors in results:
        assert errors[0] is not None and "compile=True" in errors[0] and "static" in errors[0], errors[0]
        assert errors[1] is not None and "offloading" in errors[1], errors[1]
        assert errors[2] is not None and "one token a step" in errors[2], errors[2]
        assert errors[3] is not None and "StaticSlidingWindowLayer" in errors[3], errors[3]


@pytest.mark.slow
@pytest.mark.parametrize("name,batch,compile_config", [("gpt2", 1, DYNAMO), ("llama_mqa", 3, DYNAMO),
                                                       ("llama", 1, dict(fullgraph=True)),
                                                       ("gpt2", 3, dict(fullgraph=True))])
def test_static_cache_more(name, batch, compile_config, dist2):
    """More models, and inductor (HF's CompileConfig defaults, fullgraph)."""
    _check_static(dist2.run(_static_case, name, batch, compile_config, timeout=900), f"{name} static")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama6_2", "phi3"])
def test_static_cache_world3_kv_heads_held_by_readers(name, dist3):
    """The static cache at 3 ranks with 2 K/V heads (6 query heads): each rank's buffers hold the
    K/V heads its queries read (1, 2, 1) at HF's max_cache_len, eager and compiled; also with
    Phi-3's fused qkv_proj (its decode bytes not Megatron's: see test_greedy_world3_fused_qkv)."""
    results = dist3.run(_static_case, name, 3, DYNAMO, timeout=900)
    _check_static([r if name != "phi3" else r[:10] + (None,) + r[11:] for r in results], f"{name} at 3 static")


@pytest.mark.slow
def test_static_cache_beam_search(dist2):
    """Beam search (3 beams, a left-padded batch) over the static cache; with compile=True its
    decode steps stay eager, as HF's beam search does."""
    _check_static(dist2.run(_static_case, "llama", 3, DYNAMO, False, 3, timeout=900), "llama static beams")


def _unsupported(gm, kw):
    """The messages of what the parallel module's generate refuses (None where nothing raised):
    compile=True without a static cache, an offloaded static cache, two tokens in a static
    decode step, a sliding-window static cache (this changes gm's config: call it last)."""
    from autoshard.errors import ShardingError
    ids = kw["input_ids"][:1, :6]
    options = dict(max_new_tokens=2, use_cache=True, pad_token_id=0, do_sample=False)
    errors = []

    def error(fn):
        try:
            fn()
        except ShardingError as e:
            return str(e)
        return None
    errors.append(error(lambda: gm.generate(ids, **options, compile=True)))
    errors.append(error(lambda: gm.generate(ids, **options, cache_implementation="offloaded_static")))
    out = gm.generate(ids, **options, cache_implementation="static", return_dict_in_generate=True)
    adapter, cache = gm.__dict__["_autoshard_generator"], _cache_of(out)
    for layer in cache.layers:
        layer.crop(-2)
    errors.append(error(lambda: adapter(input_ids=out.sequences[:, -3:-1], use_cache=True,
                                        **{adapter._cache_name: cache})))   # two tokens a step
    gm.config.sliding_window = 4                        # a sliding-window static cache: HF makes sliding layers
    errors.append(error(lambda: gm.generate(ids, **options, cache_implementation="static")))
    return errors


def _default_static_case(rank, p):
    """The 6 / 2-head LLaMA at 3 ranks under the default objective, which trains K whole (dK
    all-reduced) and V gathered from split weights: the generation steps still compute, cache and
    read only each rank's K/V heads (`rules.linear.cover_heads`, inference); tokens as one
    process's static generate."""
    import autoshard
    model, kw = MODELS["llama6_2"]()
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, p, kw, tracer="export").eval()
    prompts = _prompts(kw, 1)
    options = dict(max_new_tokens=5, use_cache=True, pad_token_id=0, do_sample=False, cache_implementation="static",
                   return_dict_in_generate=True)
    out = gm.generate(**prompts, **options)
    want = ref.generate(**prompts, **options)
    layer = out.past_key_values.layers[0]
    return out.sequences.tolist() == want.sequences.tolist(), int(layer.keys.shape[1]), int(layer.values.shape[1])


@pytest.mark.slow
def test_static_cache_world3_default_objective(dist3):
    results = dist3.run(_default_static_case, timeout=900)
    assert all(same for same, _, _ in results), results
    assert [(k, v) for _, k, v in results] == [(1, 1), (2, 2), (1, 1)], results     # held by their readers
