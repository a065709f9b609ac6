"""Repeated layers are traced once (autoshard.capture.repeats): the graph, and so the plan, equal what a
layer-by-layer capture gives; layers that differ (shapes, dtypes, attributes, per-layer config)
start runs of their own; a loop that does not repeat is traced whole, with a note."""
import torch
import torch.nn as nn
import transformers

from autoshard.capture import repeats
from autoshard.capture.trace import capture
from autoshard.planner.cost import CostModel
from autoshard.planner.build import plan_graph
from models import GPT, Block


def _plan(model, example, world=4, **kw):
    cap = capture(model, example, **kw)
    plan = plan_graph(cap.gm, world, CostModel(), tracer=cap.tracer, notes=cap.notes, example=(cap.args, cap.kwargs))
    return cap, plan


def _digest(plan):
    """What must not change: every layout and TorchShard dim, the redistributions, the bytes."""
    return (sorted((k, str(v)) for k, v in plan.layouts.items()), sorted(plan.dims.items(), key=str),
            sorted((str(r.src), str(r.dst), r.forward, r.backward, r.nbytes, len(r.consumers))    # node names
                   for r in plan.redistributions),                                               # may differ
            plan.comm_bytes, dict(plan.comm_by_kind), plan.params_per_rank)


def _ops(gm):
    """The graph as ops on targets, in order (node names may differ)."""
    return [(n.op, str(n.target)) for n in gm.graph.nodes]


def _same_as_whole(model, example, world=4, layers=None, **kw):
    once, p1 = _plan(model, example, world, **kw)
    whole, p2 = _plan(model, example, world, once=False, **kw)
    assert _digest(p1) == _digest(p2)
    assert sorted(_ops(once.gm)) == sorted(_ops(whole.gm))
    assert sorted(once.gm.state_dict()) == sorted(whole.gm.state_dict())
    if layers is not None:
        assert any(f"{layers} repeated layers traced as" in n for n in once.notes), once.notes
    return once, p1


def test_gpt_traced_once_plans_as_whole():
    torch.manual_seed(0)
    model = GPT(vocab=256, h=64, heads=4, blocks=6, seq=32, tied=False, dropout=0.1)
    idx = torch.randint(0, 256, (2, 32))
    _same_as_whole(model, (idx, idx), world=4, layers=6, tracer="symbolic_trace")


def test_llama_traced_once_plans_as_whole_at_two_degrees():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=5, vocab_size=256)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    for world in (2, 4):
        _same_as_whole(model, {"input_ids": ids, "labels": ids}, world=world, layers=5, tracer="export")


class _Stack(nn.Module):
    """An embedding, `blocks` in a ModuleList, a head."""

    def __init__(self, blocks):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(64, 128)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _mixed():
    """Blocks of two widths: [64, 64, 64, wide, 64, 64, 64]: two runs around the odd one."""
    blocks = [Block(64, 4) for _ in range(7)]
    blocks[3].mlp.fc1, blocks[3].mlp.fc2 = nn.Linear(64, 384), nn.Linear(384, 64)
    return _Stack(blocks)


def test_a_layer_that_differs_splits_the_run():
    torch.manual_seed(0)
    model = _mixed()
    assert repeats.runs(model) == [("blocks", ["0", "1", "2"]), ("blocks", ["4", "5", "6"])]
    assert repeats.tail_runs(model) == [("blocks", ["4", "5", "6"], 1)]      # the one that ends the list is cut
    _same_as_whole(model, (torch.randint(0, 128, (2, 16)),), layers=3, tracer="symbolic_trace")


def test_dtypes_attributes_and_per_layer_config_split_runs():
    model = GPT(vocab=64, h=32, heads=4, blocks=6, seq=8)
    assert repeats.runs(model) == [("blocks", [str(i) for i in range(6)])]
    model.blocks[2].ln1.weight.data = model.blocks[2].ln1.weight.data.double()      # a dtype that differs
    assert repeats.runs(model) == [("blocks", ["3", "4", "5"])]
    model = GPT(vocab=64, h=32, heads=4, blocks=6, seq=8)
    model.blocks[4].attn.heads = 2                                                   # a plain attribute
    assert repeats.runs(model) == [("blocks", ["0", "1", "2", "3"])]
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=6,
                                   vocab_size=64)
    llama = transformers.LlamaForCausalLM(cfg)
    assert repeats.runs(llama) == [("model.layers", [str(i) for i in range(6)])]
    llama.config.layer_types = ["full_attention"] * 3 + ["sliding_attention"] * 3   # a per-layer config list
    assert repeats.runs(llama) == [("model.layers", ["0", "1", "2"]), ("model.layers", ["3", "4", "5"])]


class _Alternating(nn.Module):
    """The loop treats even and odd layers differently: not a pure repeat of one layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.blocks = nn.ModuleList([Block(64, 4) for _ in range(5)])
        self.head = nn.Linear(64, 128)

    def forward(self, idx):
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = b(x if i % 2 == 0 else x * 0.5)
        return self.head(x)


def test_a_loop_that_does_not_repeat_is_traced_whole():
    torch.manual_seed(0)
    model = _Alternating()
    idx = torch.randint(0, 128, (2, 16))
    cap, plan = _same_as_whole(model, (idx,), tracer="symbolic_trace")
    assert any("traced one by one" in n for n in cap.notes), cap.notes
    assert sum(1 for n in cap.gm.graph.nodes if n.target is torch.mul or str(n.target) == "<built-in function mul>") == 2
    want = model(idx)
    torch.testing.assert_close(cap.gm(idx), want)


def test_alternating_layers_traced_once_per_kind():
    torch.manual_seed(0)
    model = _Stack([Block(64, 4, swiglu=i % 2 == 1) for i in range(7)])   # plain and SwiGLU take turns:
    #                                                    A B A B A B A, the tail B A B A B A repeats every 2
    assert repeats.runs(model) == []
    assert repeats.tail_runs(model) == [("blocks", ["1", "2", "3", "4", "5", "6"], 2)]
    _same_as_whole(model, (torch.randint(0, 128, (2, 16)),), layers=6, tracer="symbolic_trace")


def test_gemma2_sliding_and_global_layers():
    cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_hidden_layers=6, vocab_size=256, sliding_window=8)
    model = transformers.Gemma2ForCausalLM(cfg)
    assert [k for _, _, k in repeats.tail_runs(model)] == [2]           # layer_types alternate
    ids = torch.randint(0, 256, (2, 16))
    _same_as_whole(model, {"input_ids": ids, "labels": ids}, world=2, layers=6, tracer="export")


def test_bloom_size_made_in_the_first_layer_is_shared():
    """torch.export makes BLOOM's `batch * heads` (its reshapes' size) once, in the first layer,
    and every later layer reads it: a value from before the rest of the run, not a node the layers
    repeat. Traced once, the module equals the model, also at another batch size (the size is
    symbolic)."""
    cfg = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=6, n_head=4, hidden_dropout=0.0,
                                   attention_dropout=0.0)
    model = transformers.BloomForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    cap, _ = _same_as_whole(model, {"input_ids": ids, "labels": ids}, world=2, layers=6, tracer="export")
    other = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for x in (ids, other):
            torch.testing.assert_close(cap.gm(input_ids=x, labels=x).loss, model(input_ids=x, labels=x).loss)


def test_constants_made_on_meta_repeat():
    """A model built on meta makes its forward's constants on meta (GPT-Neo's
    `torch.tensor(finfo.min, device=x.device)` in every attention): their values are unknown, so
    layers whose constants differ only by being separate meta tensors still repeat (a meta capture
    plans; loading weights into it refuses meta constants)."""
    cfg = transformers.GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=6, num_heads=4,
                                    attention_types=[[["global", "local"], 3]], window_size=8, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.GPTNeoForCausalLM(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    kw = {"input_ids": ids, "labels": ids}
    once, p1 = _plan(model, kw, 2, tracer="export")
    whole, p2 = _plan(model, kw, 2, tracer="export", once=False)
    assert any("6 repeated layers traced as 4" in n for n in once.notes), once.notes
    assert _digest(p1) == _digest(p2)

    def ops(gm):                 # the copies share the second period's constants, named once
        return sorted((n.op, "constant" if "lifted_tensor" in str(n.target) else str(n.target)) for n in gm.graph.nodes)
    assert ops(once.gm) == ops(whole.gm)
    assert sum("lifted_tensor" in str(n.target) for n in whole.gm.graph.nodes) == 6
