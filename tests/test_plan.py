"""The planner finds Megatron-LM's hand-written plan; predicted communication equals DESIGN.md's
formula; pins, errors, the report and the command line. Single process, shapes only.

Sizes (realistic small; the cost model rightly prefers other plans where latency dominates,
e.g. a 512-word vocabulary and 32 tokens): hidden h = 128, 8 heads, T = 2 x 64 tokens,
vocabulary V = 8192 (64 x h; GPT-2's ratio is 50257 / 768 = 65), fp32. Models are built on the
meta device (no weights, no compute); default cost model (50 GB/s, 1 us per ring step).
"""
import functools
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

from models import GPT, MLP, Block  # noqa: E402

import autoshard  # noqa: E402
from autoshard import Replicate, Shard, ShardingError  # noqa: E402
from autoshard.planner.build import plan_graph  # noqa: E402
from autoshard.capture.trace import capture  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402

H, HEADS, B, S, V = 128, 8, 2, 64, 8192
T = B * S
DEGREES = (2, 4, 8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ATTN = {"attn.q": -1, "attn.k": -1, "attn.v": -1, "attn.o": 0}
FUSED = {"attn.qkv": -1, "attn.o": 0}
MLP_DIMS = {"mlp.fc1": -1, "mlp.fc2": 0}
SWIGLU = {"mlp.gate": -1, "mlp.fc1": -1, "mlp.fc2": 0}


def meta(cls, *args, **kwargs):
    with torch.device("meta"):
        return cls(*args, **kwargs)


def x_in():
    return (torch.zeros(B, S, H, device="meta"),)


def ids(targets=True):
    idx = torch.zeros(B, S, dtype=torch.long, device="meta")
    return (idx, idx) if targets else (idx,)


# name -> (factory, example inputs, Megatron's dims). GPT: 1 block so the exact solver (3^groups) is quick.
MODELS = {
    "mlp": (lambda: meta(MLP, H), x_in, {"fc1": -1, "fc2": 0}),
    "block": (lambda: meta(Block, H, HEADS), x_in, {**ATTN, **MLP_DIMS}),
    "fused_qkv": (lambda: meta(Block, H, HEADS, fused=True), x_in, {**FUSED, **MLP_DIMS}),
    "swiglu_mlp": (lambda: meta(MLP, H, swiglu=True), x_in, {"gate": -1, "fc1": -1, "fc2": 0}),
    "swiglu": (lambda: meta(Block, H, HEADS, swiglu=True), x_in, {**ATTN, **SWIGLU}),
    "gpt_tied": (lambda: meta(GPT, V, H, HEADS, 1, S, tied=True), ids,
                 {"wte": 0, "head": -1, "cross_entropy": -1, **{f"blocks.0.{k}": d for k, d in {**ATTN, **MLP_DIMS}.items()}}),
}


@functools.lru_cache(maxsize=None)
def captured(name):
    factory, example, _ = MODELS[name]
    return capture(factory(), example(), tracer="symbolic_trace").gm


@functools.lru_cache(maxsize=None)
def planned(name, p, search="greedy", price=None):
    return plan_graph(captured(name), p, CostModel(memory_weight=price), search=search)


def assert_megatron(plan, expected):
    got = {k: plan.dims.get(k, "missing") for k in expected}
    assert got == expected, f"not Megatron's plan at p={plan.world_size}:\n{plan.report()}"


# ----------------------------------------------------------------------------- Megatron's plan
@pytest.mark.parametrize("name,p", [pytest.param(n, p, marks=pytest.mark.slow) if n == "gpt_tied" and p != 2 else (n, p)
                                    for n in MODELS for p in DEGREES])       # the tied GPT's exact search: 22 s a degree
def test_finds_megatron_plan_and_greedy_equals_exact(name, p):
    plan = planned(name, p)
    assert_megatron(plan, MODELS[name][2])
    exact = planned(name, p, "exact")
    # without a price each search keeps the plan of the price it found it at: compare the steps
    assert math.isclose(plan.step_time, exact.step_time, rel_tol=1e-9), (plan.report(), exact.report())
    assert dict(plan.dims) == dict(exact.dims)
    priced, priced_exact = planned(name, p, price=1e-9), planned(name, p, "exact", price=1e-9)
    assert math.isclose(priced.objective, priced_exact.objective, rel_tol=1e-9), (priced.report(), priced_exact.report())


@pytest.mark.parametrize("p", DEGREES)
def test_block_dims_are_exactly_the_linears(p):
    """plan.dims: module qualified names -> TorchShard dims, nothing else (norms are not listed)."""
    assert dict(planned("block", p).dims) == MODELS["block"][2]
    assert dict(planned("mlp", p).dims) == {"fc1": -1, "fc2": 0}


@pytest.mark.parametrize("p", DEGREES)
def test_fused_qkv_has_a_strided_layout(p):
    plan = planned("fused_qkv", p)
    assert plan.layouts["attn.qkv.weight"] == Shard(0, chunks=3)
    assert plan.layouts["attn.qkv.bias"] == Shard(0, chunks=3)
    assert plan.layouts["attn.o.weight"] == Shard(1) and plan.layouts["attn.o.bias"] == Replicate()
    assert plan.layouts["mlp.fc1.weight"] == Shard(0) and plan.layouts["mlp.fc2.weight"] == Shard(1)


@pytest.mark.parametrize("p", DEGREES)
def test_tied_embedding_and_head_share_one_vocabulary_split(p):
    plan = planned("gpt_tied", p)
    assert plan.layouts["wte.weight"] == Shard(0) == plan.layouts["head.weight"]
    assert plan.dims["wte"] == 0 and plan.dims["head"] == -1 and plan.dims["cross_entropy"] == -1
    assert "all_gather" not in plan.comm_by_kind, "the T x V logits must not be gathered"
    assert plan.params_per_rank < plan.params_total / p * 1.01


@pytest.mark.parametrize("p", DEGREES)
def test_untied_gpt_head_is_vocab_parallel(p):
    plan = autoshard.plan(meta(GPT, V, H, HEADS, 2, S, tied=False), p, ids())
    assert plan.dims["head"] == -1 and plan.dims["cross_entropy"] == -1
    assert plan.dims["wte"] in (0, 1)      # vocabulary or hidden split: the cost model decides
    for b in range(2):
        assert_megatron(plan, {f"blocks.{b}.{k}": d for k, d in {**ATTN, **MLP_DIMS}.items()})


def test_export_capture_finds_the_same_plan():
    model = GPT(V, H, HEADS, 1, S, tied=True)      # on CPU: to_empty() would untie the head
    idx = torch.zeros(B, S, dtype=torch.long)
    plan = autoshard.plan(model, 4, (idx, idx), tracer="export")
    assert plan.tracer == "export"
    expected = dict(MODELS["gpt_tied"][2])
    expected["cross_entropy_loss"] = expected.pop("cross_entropy")   # the aten node's name
    assert_megatron(plan, expected)
    assert plan.comm_bytes == planned("gpt_tied", 4).comm_bytes


# ----------------------------------------------------------------------------- DESIGN.md's formula
def ring_all_reduce(nbytes, p):
    return 2 * (p - 1) / p * nbytes


@pytest.mark.parametrize("p", DEGREES)
def test_block_comm_bytes_equal_megatron_formula(p):
    """Per block: 4 all-reduces of T x h fp32 (2 forward after o and fc2, 2 backward before
    q/k/v and fc1): 4 * 2(p-1)/p * T*h*4 ring bytes per rank per step."""
    for name in ("block", "fused_qkv", "swiglu"):
        plan = planned(name, p)
        expected = 4 * ring_all_reduce(T * H * 4, p)
        assert plan.comm_bytes == expected, (name, plan.comm_bytes, expected, plan.report())
        assert dict(plan.comm_by_kind) == {"all_reduce": (4, expected)}


@pytest.mark.parametrize("p", DEGREES)
@pytest.mark.parametrize("blocks", [2, 3])
def test_gpt_comm_equals_megatron_formula(p, blocks):
    """Full GPT with loss: (4L + 2) all-reduces of T x h (4 per block, the vocabulary-parallel
    embedding, the backward copy before the LM head) plus the vocabulary-parallel loss's small
    all-reduces (3 x T floats in all) and nothing else."""
    plan = autoshard.plan(meta(GPT, V, H, HEADS, blocks, S, tied=True), p, ids())
    loss = plan.nodes["cross_entropy"]
    assert loss.strategy == "vocab" and all(kind == "all_reduce" for kind, _ in loss.comm)
    assert sum(nb for _, nb in loss.comm) == 3 * T * 4
    big = (4 * blocks + 2) * ring_all_reduce(T * H * 4, p)
    small = ring_all_reduce(3 * T * 4, p)
    assert dict(plan.comm_by_kind) == {"all_reduce": (4 * blocks + 2 + len(loss.comm), big + small)}
    assert plan.comm_bytes == big + small


def test_comm_grows_with_degree_and_one_rank_moves_nothing():
    plan1 = autoshard.plan(meta(Block, H, HEADS), 1, x_in())
    assert plan1.comm_bytes == 0 and plan1.params_per_rank == plan1.params_total
    assert all(d is None for d in plan1.dims.values())
    bytes_ = [planned("block", p).comm_bytes for p in DEGREES]
    assert bytes_ == sorted(bytes_)


# ----------------------------------------------------------------------------- pins
def test_pin_head_replicated_on_tied_gpt():
    model = meta(GPT, V, H, HEADS, 1, S, tied=True)
    plan = autoshard.plan(model, 4, ids(), pin={"head": None})
    # tied: one decision, so the embedding stays whole too; the blocks are still Megatron's
    assert plan.dims["head"] is None and plan.dims["wte"] is None
    assert plan.layouts["wte.weight"] == Replicate() == plan.layouts["head.weight"]
    assert_megatron(plan, {f"blocks.0.{k}": d for k, d in {**ATTN, **MLP_DIMS}.items()})


def test_pins_are_respected():
    model = meta(GPT, V, H, HEADS, 1, S, tied=False)
    plan = autoshard.plan(model, 4, ids(), pin={"wte": 1, "head": None, "blocks.0.mlp.fc1": None})
    assert plan.dims["wte"] == 1 and plan.layouts["wte.weight"] == Shard(1)
    assert plan.dims["head"] is None and plan.layouts["head.weight"] == Replicate()
    assert plan.dims["blocks.0.mlp.fc1"] is None
    plan = autoshard.plan(meta(Block, H, HEADS), 2, x_in(), pin={"mlp.fc1": 0, "attn.o": -1})
    assert plan.dims["mlp.fc1"] == 0 and plan.dims["attn.o"] == -1


def test_pin_single_layout_that_is_not_the_cheapest_is_applied():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(H, 12), nn.Linear(12, H)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))
    # at p = 8 fc1's input dim divides and its 12 outputs split unevenly: the pin leaves exactly one (row) layout
    plan = autoshard.plan(meta(Odd), 8, x_in(), pin={"fc1": 0})
    assert plan.dims["fc1"] == 0 and plan.layouts["fc1.weight"] == Shard(1)


# ----------------------------------------------------------------------------- errors
class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        # 6 does not split over 8 ranks even unevenly (fewer features than ranks)
        self.fc1, self.fc2, self.odd = nn.Linear(H, 6), nn.Linear(6, H), nn.Linear(6, 6)

    def forward(self, x):
        return self.fc2(self.odd(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("ws", [0, -2, 1.5, True, "2"])
def test_error_world_size(ws):
    with pytest.raises(ShardingError, match="world_size"):
        autoshard.plan(meta(MLP, H), ws, x_in())


def test_error_nothing_to_shard():
    class NoParams(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2
    with pytest.raises(ShardingError, match="nothing to shard"):
        autoshard.plan(NoParams(), 2, (torch.zeros(2, 8),))


def test_error_pin_unknown_name():
    with pytest.raises(ShardingError, match=r"'mlp\.fc3'.*owns no parameter"):
        autoshard.plan(meta(Block, H, HEADS), 2, x_in(), pin={"mlp.fc3": 0})


@pytest.mark.parametrize("pin", [{"fc1": -1}, {"fc2": 0}, {"odd": -1}, {"odd": 0}])
def test_error_pin_that_cannot_divide(pin):
    (name, dim), = pin.items()
    with pytest.raises(ShardingError, match=rf"cannot pin '{name}' to dim {dim}.*divide by 8"):
        autoshard.plan(meta(Odd), 8, x_in(), pin=pin)


def test_error_pin_bad_dim_and_bad_options():
    with pytest.raises(ShardingError, match="TorchShard dim is None, 0, 1 or -1"):
        autoshard.plan(meta(MLP, H), 2, x_in(), pin={"fc1": 2})
    with pytest.raises(ValueError, match="search must be"):
        autoshard.plan(meta(MLP, H), 2, x_in(), search="beam")
    with pytest.raises(TypeError, match="unknown options"):
        autoshard.plan(meta(MLP, H), 2, x_in(), bandwith=1e9)


def test_undividable_module_stays_replicated_with_a_note():
    plan = autoshard.plan(meta(Odd), 8, x_in())
    assert plan.dims["odd"] is None
    assert any("odd.weight" in n and "do not divide by 8" in n for n in plan.notes)
    assert "note: odd.weight [6, 6] stays replicated" in plan.report()


# ----------------------------------------------------------------------------- report
def test_report_rows_and_totals():
    plan = autoshard.plan(meta(GPT, V, H, HEADS, 2, S, tied=True), 4, ids())
    text = plan.report()
    assert str(plan) == text
    lines = text.splitlines()
    n_rows = int(lines[0].split("(")[1].split()[0])
    header = next(i for i, ln in enumerate(lines) if ln.startswith("module / node"))
    body = [ln for ln in lines[header + 2: header + 2 + 200] if ln and not ln.startswith(" ")]
    body = body[:n_rows]
    assert len(body) == n_rows
    labels = [ln.split()[0] for ln in body]
    # one row per parametered or communicating node: every linear / embedding / the loss
    for module in plan.dims:
        assert module in labels, (module, text)
    assert labels.count("wte") == 1 and labels.count("head") == 1      # lookup and projection
    for key in ("tensor-parallel degree", "tracer / search", "comm per step per rank", "params per rank / full",
                "estimated step time"):
        assert key in text
    assert "all_reduce: 12 x" in text                                 # 4L + 2 + the loss's 2
    assert "[2048, 128]" in text                                      # the local vocabulary shard
    assert "bwd all_reduce" in text and "fwd all_reduce" in text


def test_report_lists_unsupported_ops():
    class WithCumsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

        def forward(self, x):
            return torch.cumsum(self.fc2(torch.relu(self.fc1(x))), dim=1)
    plan = autoshard.plan(meta(WithCumsum), 2, x_in())
    assert plan.unsupported == ("cumsum: cumsum",)
    assert "ops with no sharding rule (run whole, a split input gathered first): cumsum" in plan.report()
    # the op's input is gathered first: never a silent wrong answer
    assert plan.nodes["cumsum"].inputs == (Replicate(),)


def test_plan_fields():
    plan = planned("block", 2)
    assert plan.world_size == 2 and plan.search == "greedy" and plan.tracer == "fx"
    assert plan.search_seconds > 0 and plan.step_time == plan.comm_time + plan.compute_time
    assert plan.params_per_rank * 2 < plan.params_total + 2 * 4 * H            # all but row biases split
    # Megatron's two copies (ln1, mlp_ln) and its two all-reduces, of the row layers' outputs (each
    # left Partial by its layer, with bias / p a rank) before their dropouts
    got = {r.node: (r.forward, r.backward) for r in plan.redistributions}
    assert got == {"layer_norm": ((), ("all_reduce",)), "layer_norm_1": ((), ("all_reduce",)),
                   "linear_3": (("all_reduce",), ()), "linear_5": (("all_reduce",), ())}, plan.report()
    with pytest.raises(Exception):
        plan.world_size = 3                                                   # frozen


# ----------------------------------------------------------------------------- CLI
def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "autoshard", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_subprocess():
    """`python -m autoshard plan` end to end: a report on success, a clear message and status 2 on a
    bad target (two interpreter starts; the other CLI cases run in process below)."""
    r = run_cli("plan", "tests.models:MLP", "--world-size", "2", "--input-shape", "2,64,64")
    assert r.returncode == 0, r.stderr
    assert "autoshard plan" in r.stdout and "fc1" in r.stdout and "column" in r.stdout and "row" in r.stdout
    assert "comm per step per rank" in r.stdout
    r = run_cli("plan", "tests.factories:nope", "--world-size", "2")
    assert r.returncode == 2 and "tests.factories has no 'nope'" in r.stderr


def test_cli_gpt_with_pins_json(capsys):
    from autoshard import cli
    assert cli.main(["plan", "tests.factories:gpt", "--world-size", "4", "--input-shape", "2,64", "--input-shape",
                     "2,64", "--dtype", "long", "--pin", "head=None", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["dims"]["head"] is None and out["dims"]["wte"] is None
    assert out["dims"]["blocks.1.mlp.fc2"] == 0 and out["layouts"]["head.weight"] == "R"
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "tests.factories:mlp", "--world-size", "2", "--pin", "fc9=0"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "'fc9'" in err and "owns no parameter" in err


def test_cli_in_process(capsys):
    from autoshard import cli
    assert cli.main(["plan", "tests.factories:block", "-n", "2", "--input-shape", "2,64,128", "--search", "exact",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["search"] == "exact" and out["dims"] == MODELS["block"][2]
    assert out["comm_by_kind"] == {"all_reduce": [4, 4 * ring_all_reduce(T * H * 4, 2)]}
    for argv, msg in [
        (["plan", "tests.factories", "-n", "2"], "MODULE:FACTORY"),
        (["plan", "no_such_module_xyz:f", "-n", "2"], "cannot import 'no_such_module_xyz'"),
        (["plan", "tests.factories:not_a_module", "-n", "2"], "returned a int, not an nn.Module"),
        (["plan", "tests.factories:mlp", "-n", "0"], "--world-size must be >= 1"),
        (["plan", "tests.factories:mlp", "-n", "2", "--dtype", "long"], "--dtype needs --input-shape"),
        (["plan", "tests.factories:mlp", "-n", "2", "--pin", "fc1=7"], "DIM must be None, 0, 1 or -1"),
        (["plan", "tests.factories:mlp", "-n", "2", "--input-shape", "2,a"], "--input-shape wants"),
        (["plan", "tests.factories:mlp", "-n", "2", "--tracer", "jit"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_cli_pins_and_cost_knobs(capsys):
    from autoshard import cli
    assert cli.main(["plan", "tests.factories:mlp", "-n", "2", "--input-shape", "2,64,128", "--pin", "fc1=None",
                     "--pin", "fc2=none", "--latency", "2e-6", "--bandwidth", "1e11", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dims"] == {"fc1": None, "fc2": None} and out["comm_bytes"] == 0


def test_cli_demo_is_dispatched_lazily(monkeypatch):
    from autoshard import cli
    seen = []
    fake = types.ModuleType("autoshard.demo")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "autoshard.demo", fake)
    assert cli.main(["demo", "--world-size", "2", "--steps", "3"]) == 0
    assert seen == [["--world-size", "2", "--steps", "3"]]


# ----------------------------------------------------------------------------- budgets, tied pins, capture

def test_memory_budget_shards_only_as_much_as_needed():
    block = meta(MLP, H)
    whole = autoshard.plan(block, 2, x_in(), pin={"fc1": None, "fc2": None}).memory.peak    # step peak per rank
    split = autoshard.plan(block, 2, x_in()).memory.peak
    assert split < whole
    roomy = autoshard.plan(block, 2, x_in(), memory_budget=2 * whole)
    assert set(roomy.dims.values()) == {None} and roomy.comm_bytes == 0      # fits whole: no communication
    tight = autoshard.plan(block, 2, x_in(), memory_budget=(split + whole) / 2)
    assert tight.dims == {"fc1": -1, "fc2": 0} and tight.memory.peak <= (split + whole) / 2
    with pytest.raises(autoshard.MemoryBudgetError, match="the smallest peak reachable is"):
        autoshard.plan(block, 2, x_in(), memory_budget=1.0)


@pytest.mark.parametrize("pin", [{"wte": 0}, {"head": -1}, {"wte": 0, "head": -1}])
def test_pins_on_a_tied_weight_apply_per_module(pin):
    plan = autoshard.plan(meta(GPT, V, H, HEADS, 1, S, tied=True), 2, ids(), pin=pin)
    assert plan.dims["wte"] == 0 and plan.dims["head"] == -1
    with pytest.raises(ShardingError, match="cannot pin 'wte' to dim -1"):
        autoshard.plan(meta(GPT, V, H, HEADS, 1, S, tied=True), 2, ids(), pin={"wte": -1, "head": -1})


def test_symbolic_trace_specialises_a_none_default():
    plan = autoshard.plan(meta(GPT, V, H, HEADS, 1, S), 4, ids(targets=False), tracer="symbolic_trace")
    assert plan.tracer == "symbolic_trace" and plan.dims["head"] == -1
    assert not plan.unsupported


@pytest.mark.parametrize("enabled", [True, False])
def test_plan_leaves_the_garbage_collector_as_it_found_it(enabled):
    """`plan` pauses Python's cyclic collector while it captures and searches (each full collection walks
    every object planning made: half a second of an 80-layer plan), then leaves it as it was, also where
    planning fails."""
    import gc
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            seen.append(gc.isenabled())
            return self.fc(x)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        autoshard.plan(Probe(), 2, (torch.randn(2, 8),))
        assert seen and not any(seen) and gc.isenabled() == enabled
        with pytest.raises(ShardingError):
            autoshard.plan(Probe(), 2, (torch.randn(2, 8),), pin={"nowhere": 0})
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
