"""The memory model of a training step (`plan.memory`, autoshard.planner.memory) against PyTorch.

What autograd saves is checked against a real forward under `saved_tensors_hooks` (one process);
the predicted peak per rank against MemTracker's over one AdamW / SGD step of the parallel module
on gloo ranks (GPT, Hugging Face LLaMA and BERT, world 2): within 10%. Dtypes count (bf16 halves
the activations), and so does the optimizer.
"""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.planner.memory import optimizer_states, parse_bytes  # noqa: E402
from autoshard.views.report import fmt_bytes  # noqa: E402
from models import GPT  # noqa: E402

TOLERANCE = 0.10


def _gpt(seq=128, dropout=0.0):
    torch.manual_seed(0)
    model = GPT(vocab=256, h=64, heads=4, blocks=2, seq=seq, dropout=dropout)
    idx = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx.roll(1, 1))


def _saved_bytes(model, args):
    """Bytes of the distinct storages autograd saves in a real forward, parameters and inputs left out."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *args]}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in held:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*args)
    return sum(seen.values()), loss


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_tensors_are_what_autograd_saves(dropout):
    model, args = _gpt(dropout=dropout)
    model.train()
    plan = autoshard.plan(model, 1, args)
    saved, _ = _saved_bytes(model, args)
    assert plan.memory.exact
    assert abs(plan.memory.activations - saved) <= 0.01 * saved, (plan.memory.activations, saved)


def test_dtypes_and_optimizers_count():
    model, args = _gpt()
    fp32 = autoshard.plan(model, 2, args).memory
    bf16 = autoshard.plan(copy.deepcopy(model).to(torch.bfloat16), 2, args).memory
    assert bf16.parameters * 2 == fp32.parameters
    assert abs(bf16.activations * 2 - fp32.activations) <= 0.02 * fp32.activations
    sgd = autoshard.plan(model, 2, args, optimizer="sgd").memory
    assert fp32.optimizer == 2 * fp32.gradients and sgd.optimizer == 0 and sgd.peak < fp32.peak
    assert dict(fp32).keys() == {"parameters", "gradients", "optimizer", "activations", "peak"}
    assert fp32.peak <= sum(fp32[k] for k in ("parameters", "gradients", "optimizer", "activations")) * 1.5
    assert f"peak {fmt_bytes(fp32.peak)}" in str(autoshard.plan(model, 2, args))


def test_sizes_and_optimizer_names():
    assert parse_bytes("30GB") == 30e9 and parse_bytes("1.5 GiB") == 1.5 * 2 ** 30 and parse_bytes(7) == 7.0
    assert optimizer_states("AdamW") == 2 and optimizer_states(torch.optim.SGD) == 0 and optimizer_states(3) == 3
    with pytest.raises(ValueError, match="30 parsecs"):
        parse_bytes("30 parsecs")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        autoshard.plan(_gpt()[0], 2, _gpt()[1], optimizer="lion")


def _build(name, seq):
    if name == "gpt":
        model, args = _gpt(seq)
        return model, args, lambda m: m(*args)
    import hf_models
    # "llama+attention_dropout": attention's dropout on (autoshard's attention draws the masks: the
    # probabilities and dropout masks it saves, [1, H, T, T], are split on heads)
    family, _, dropout = name.partition("+")
    model, kw = getattr(hf_models, family)(batch=1 if dropout else 2, seq=seq, max_position_embeddings=seq,
                                           **({dropout: 0.1} if dropout else {}))
    return model, kw, lambda m: m(**kw).loss


def _measure(rank, p, name, seq, optimizer, outputs="full", autocast=False, sequence_parallel=False):
    import refs
    model, example, loss_of = _build(name, seq)
    recipe = lambda: torch.autocast("cpu", torch.bfloat16, enabled=autocast)     # noqa: E731
    with recipe():                       # planned under the recipe it runs: the plan's graph is captured so
        plan = autoshard.plan(model, p, example, optimizer=optimizer, outputs=outputs,
                              sequence_parallel=sequence_parallel)
    gm = autoshard.parallelize(model, p, example, plan=plan)
    gm.train()
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(gm.parameters(), lr=1e-3)

    def step_loss(m):
        with recipe():
            return loss_of(m)
    peak, _ = refs.measured_step_peak(gm, step_loss, opt)
    return plan.memory.peak, peak, plan.memory.activations


@pytest.mark.parametrize("name,seq,optimizer,outputs", [
    ("gpt", 256, "adamw", "full"), ("llama", 128, "adamw", "full"), ("llama+attention_dropout", 256, "adamw", "full"),
    ("bert", 128, "adamw", "full"), ("gpt", 256, "sgd", "full"),
    # the logits returned split on the vocabulary: their gradient (the loss's only) is split too
    # (predicted at 1.08x measured when it was counted whole: held to 5% here)
    ("llama", 512, "adamw", "sharded")])
def test_predicted_peak_is_measured_peak(dist2, name, seq, optimizer, outputs):
    single = autoshard.plan(_build(name, seq)[0], 1, _build(name, seq)[1]).memory
    tolerance = TOLERANCE if outputs == "full" else TOLERANCE / 2
    for predicted, measured, activations in dist2.run(_measure, name, seq, optimizer, outputs, timeout=240):
        assert abs(predicted - measured) <= tolerance * measured, (name, predicted, measured)
        assert activations < single.activations


@pytest.mark.parametrize("name,sequence_parallel", [("gpt", False), ("llama", False), ("llama", True)])
def test_predicted_peak_under_bf16_autocast(dist2, name, sequence_parallel):
    """Under torch.autocast(bf16) (fp32 weights): each linear saves a bf16 copy of its input, held
    as the linear reads it (whole on every rank for a column layer), and torch's cross entropy runs
    in float32, so its backward makes float32 gradients of bf16 logits. GPT (symbolic_trace: the
    loss one call) and LLaMA (export: the upcast a node of its own, the bf16 logits returned
    beside the loss, which takes no gradient through them): predicted within 2% of measured
    (GPT's was 0.82 of it before these were counted). With sequence parallelism the column layers
    save this rank's tokens in their own dtype, not autocast's whole bf16 copy (1.12 before): 3%."""
    tolerance = 0.03 if sequence_parallel else 0.02
    for predicted, measured, _ in dist2.run(_measure, name, 256, "adamw", "full", True, sequence_parallel,
                                            timeout=240):
        assert abs(predicted - measured) <= tolerance * measured, (name, predicted, measured)


def test_grouped_attention_counted_as_the_ranks_run_it(dist3):
    """Qwen3 (6 query / 2 K/V heads) at 3 ranks keeps attention whole, so its ranks call sdpa
    grouped (`rewrite.grouped`) though 2 K/V heads do not split over 3; the memory model reads
    that from the plan and counts K and V once, not their copies per query head: predicted
    within 2% of measured (1.038 when an even split of the heads decided it)."""
    from autoshard.rewrite.rewriter import rewrite
    model, example, _ = _build("qwen3", 128)
    plan = autoshard.plan(model, 3, example)
    local = rewrite(plan, 0)
    calls = [n for m in local.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
             if "scaled_dot_product_attention" in str(n.target)]
    assert calls and all(n.kwargs.get("enable_gqa") for n in calls), [n.format_node() for n in calls]
    for predicted, measured, _ in dist3.run(_measure, "qwen3", 128, "adamw", timeout=240):
        assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_captured_step_holds_what_the_models_step_holds(name):
    """Called without attention_mask, a transformers model on sdpa builds no T x T mask (is_causal,
    or no mask); the captured graph does the same (autoshard.capture.masks), where tracing used to
    materialise the mask and every layer's sdpa to save a float copy of it (1.3x the model's peak
    at 512 tokens, 2.3x at 2048). A call with attention_mask keeps its mask (it depends on the data)."""
    import refs
    model, kw, loss_of = _build(name, 512)
    captured = autoshard.plan(model, 1, kw).graph_module
    sdpa = [n for n in captured.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa and all(len(n.args) < 4 or n.args[3] is None for n in sdpa), [n.args[3:] for n in sdpa]
    gm = autoshard.parallelize(model, 1, kw)
    gm.train()
    model.train()
    mine, own = (refs.measured_step_peak(m, loss_of, steps=1)[0] for m in (gm, model))
    assert mine <= 1.1 * own, (name, mine, own)
    masked = {**kw, "attention_mask": torch.ones_like(kw["input_ids"])}
    sdpa = [n for n in autoshard.plan(model, 1, masked).graph_module.graph.nodes
            if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa and all(isinstance(n.args[3], torch.fx.Node) for n in sdpa)


# ----------------------------------------------------------------------------- memory budgets

def _budget_case(rank, p, fraction):
    import refs
    from refs import close_to_scale, grads
    model, args = _gpt(dropout=0.1)
    model.train()
    ref = copy.deepcopy(model)
    base = autoshard.plan(model, p, args)
    budget = fraction * base.memory.peak
    plan = autoshard.plan(model, p, args, memory_budget=budget)
    assert plan.memory.peak <= budget and plan.checkpointed, (plan.memory.peak, budget, plan.checkpointed)
    assert f"recomputed in backward: {', '.join(plan.checkpointed)}" in str(plan)
    gm = autoshard.parallelize(model, p, args, plan=plan, dropout_masks="single_process")
    gm.train()
    out = {}
    for seed in (11, 12):                # two steps: the streams move on between them as without recomputation
        torch.manual_seed(seed)
        want = ref(*args)
        autoshard.manual_seed(seed)
        loss = gm(*args)
        close_to_scale(loss, want, "loss")
        loss.backward(), want.backward()
        full = autoshard.collect_state_dict(gm, {k: v.grad for k, v in gm.named_parameters()})
        for name, g in grads(ref).items():
            close_to_scale(full[name], g, f"grad {name} (seed {seed})")
        gm.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    measured, _ = refs.measured_step_peak(gm, lambda m: m(*args))
    out["fits"] = measured <= budget
    out["ratio"] = plan.memory.peak / measured
    return out


def test_a_budget_of_seven_tenths_fits_and_equals_the_model(dist2):
    for r in dist2.run(_budget_case, 0.7, timeout=240):
        assert r["fits"] and abs(r["ratio"] - 1) <= TOLERANCE, r


def test_budgets_pick_the_fastest_plan_that_fits():
    model, args = _gpt()
    whole = autoshard.plan(model, 2, args, pin={n: None for n, m in model.named_modules()
                                                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))})
    roomy = autoshard.plan(model, 2, args, memory_budget=1.01 * whole.memory.peak)
    assert roomy.memory.peak <= 1.01 * whole.memory.peak and not roomy.checkpointed
    assert roomy.step_time <= whole.step_time * 1.0001
    split = autoshard.plan(model, 2, args)
    tight = autoshard.plan(model, 2, args, memory_budget=f"{(split.memory.peak + 1) / 1e6}MB")
    assert tight.memory.peak <= split.memory.peak + 1 and not tight.checkpointed
    with pytest.raises(autoshard.MemoryBudgetError, match=r"smallest peak reachable is .* with every block "
                                                          r"recomputed.*largest there: "):
        autoshard.plan(model, 2, args, memory_budget="100kB")


def test_a_budget_room_for_a_tied_embedding_and_head_whole_is_used_where_faster():
    """BERT's tied word embedding and masked-LM decoder kept whole (fewer bytes, more state: DeepSpeed
    AutoTP's layout): with that plan's peak as the budget the plan found fits and is at least as
    fast. None of the prices the budget search tries finds such a plan (they move whole kinds of
    layers at once; before: 1.17x its step time, 1.49x its bytes); flipping one family of groups at
    a time within the budget does."""
    pytest.importorskip("transformers")
    import zoo
    model, kw = zoo.build(zoo.ZOO["bert"])
    whole = autoshard.plan(model, 2, kw, pin={"bert.embeddings.word_embeddings": None, "cls.predictions.decoder": None})
    plan = autoshard.plan(model, 2, kw, memory_budget=whole.memory.peak)
    assert plan.memory.peak <= whole.memory.peak and not plan.checkpointed
    assert plan.step_time <= whole.step_time * 1.0001, (plan.step_time, whole.step_time)


def test_a_budget_at_a_layout_with_the_layers_linears_alone_split_finds_it():
    """ConvNeXt in DeepSpeed AutoTP's layout (every convolution and the classifier whole, the blocks'
    linears left to the search): at that plan's peak the budget search finds a plan as fast. It took
    1.11x that step (61,440 bytes against 53,248): its family flips ran 3 rounds where 4 were needed,
    and were compared without the reductions settled, as the plan runs (`State.reduce_early`)."""
    pytest.importorskip("transformers")
    import zoo
    model, kw = zoo.build(zoo.ZOO["convnext"])
    pins = {n: None for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d) or n == "classifier"}
    layout = autoshard.plan(model, 2, kw, pin=pins)
    plan = autoshard.plan(model, 2, kw, memory_budget=layout.memory.peak)
    assert plan.memory.peak <= layout.memory.peak and not plan.checkpointed
    assert plan.step_time <= layout.step_time * 1.0001, (plan.step_time, layout.step_time)


def test_cli_sequence_parallel_flag(capsys):
    """`autoshard plan --sequence-parallel on|off` reaches the planner: on splits ops on tokens and
    lowers the predicted activations, off splits none; the JSON summary says how many."""
    import json
    from autoshard import cli
    out = {}
    for flag in ("on", "off"):
        assert cli.main(["plan", "tests.factories:gpt", "-n", "2", "--input-shape", "2,64", "--dtype", "int64",
                         "--sequence-parallel", flag, "--json"]) == 0
        out[flag] = json.loads(capsys.readouterr().out)
    assert out["on"]["sequence_parallel"] > 0 and out["off"]["sequence_parallel"] == 0
    assert out["on"]["memory"]["activations"] < out["off"]["memory"]["activations"]


def test_memory_of_a_model_on_meta():
    """A model built on meta (what `--from-pretrained` plans) gets the memory its saved tensors
    give, as a copy with fake tensors does, not the upper bound (capture makes the graph's own
    tensors on CPU; the fake run must too)."""
    import transformers
    from autoshard.capture.trace import recipe_copy
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long)
    on_meta = autoshard.plan(model, 2, {"input_ids": ids.to("meta"), "labels": ids.to("meta")}).memory
    fake = autoshard.plan(recipe_copy(model, {}, fake=True), 2, {"input_ids": ids, "labels": ids}).memory
    assert on_meta.exact and fake.exact
    assert on_meta.activations == fake.activations        # (the optimizer step's transient follows the device)


def _canonical(sv):
    """A Saved with its storages named by the node that makes them (and their order there)."""
    made, own = {}, {}
    for s, i in sv.producer.items():
        made.setdefault(i, []).append(s)

    def name(s, i):
        p = sv.producer.get(s)
        return ("own", i, own.setdefault((i, s), len(own))) if p is None else (p, made[p].index(s))
    return ([None if s is None else name(s, -1) for s in sv.storage],
            [tuple((name(s, i), nb) for s, nb in x) for i, x in enumerate(sv.saves)],
            {i: tuple((name(s, i), nb) for s, nb in x) for i, x in (sv.ungrouped or {}).items()})


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_repeated_layers_save_what_the_whole_run_saves(tracer, monkeypatch):
    """A run of 6 identical layers is run by the fake pass up to its third layer, the later ones
    written as its copies (`saved.Repeats`): the same storages, saves and producers as running all."""
    from autoshard.capture.trace import capture
    from autoshard.planner import saved as SV
    from autoshard.planner.build import chunk_candidates
    from autoshard.planner.cost import CostModel
    from autoshard.planner.problem import Problem
    torch.manual_seed(0)
    model = GPT(vocab=64, h=32, heads=4, blocks=6, seq=16, dropout=0.1).train()
    idx = torch.randint(0, 64, (2, 16))
    gm = capture(model, (idx, idx), tracer=tracer).gm
    prob = Problem(gm, 2, CostModel(), chunk_candidates(gm))
    assert SV.Repeats.of(prob) is not None
    fast = SV.saved_tensors(prob)
    monkeypatch.setattr(SV.Repeats, "of", classmethod(lambda cls, p: None))
    whole = SV.saved_tensors(prob)
    assert fast.exact and whole.exact
    assert _canonical(fast) == _canonical(whole)
