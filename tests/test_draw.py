"""Plan.to_networkx agrees with the plan node by node and byte by byte; the picture folds
identical blocks, keeps differently planned ones apart, and Plan.draw / `--draw` write SVG and
PNG files. Single process, shapes only (models on the meta device)."""
import functools
import os
import sys

import networkx as nx
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from models import GPT  # noqa: E402

from autoshard import Replicate, Shard  # noqa: E402
from autoshard.planner.build import plan_graph  # noqa: E402
from autoshard.capture.trace import capture  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402
from autoshard.views.draw import picture_graph  # noqa: E402

V, H, HEADS, B, S = 8192, 128, 8, 2, 64      # sizes of tests/test_plan.py (Megatron's plan wins)


@functools.lru_cache(maxsize=None)
def gpt_graph(blocks):
    with torch.device("meta"):
        model = GPT(V, H, HEADS, blocks, S, tied=True)
    idx = torch.zeros(B, S, dtype=torch.long, device="meta")
    return capture(model, (idx, idx), tracer="symbolic_trace").gm


@functools.lru_cache(maxsize=None)
def gpt_plan(blocks, p=2, **pin):
    """autoshard.plan(GPT(blocks), p, pin=pin) without capturing the same model twice."""
    return plan_graph(gpt_graph(blocks), p, CostModel(), pin=pin or None)


def test_to_networkx_matches_plan():
    plan = gpt_plan(2)
    G = plan.to_networkx()
    fx_nodes = list(plan.graph_module.graph.nodes)
    assert list(G.nodes) == [n.name for n in fx_nodes]                 # one node per graph node, in order
    assert set(G.edges) == {(a.name, n.name) for n in fx_nodes for a in n.all_input_nodes}
    assert nx.is_directed_acyclic_graph(G)
    for name, d in plan.nodes.items():
        assert G.nodes[name]["placement"] == d.output
        node = G.nodes[name]
        assert (node["strategy"], node["module"], node["dim"]) == (d.strategy, d.module, d.dim)
    params = [n for n in fx_nodes if n.op == "get_attr"]
    assert params and all(G.nodes[n.name]["placement"] == plan.layouts[n.target] for n in params)
    wte = G.nodes["wte_weight"]
    assert wte["placement"] == Shard(0) and wte["shape"] == (V, H) and wte["local_shape"] == (V // 2, H)
    assert (wte["bytes"], wte["local_bytes"]) == (V * H * 4, V * H * 2)
    for r in plan.redistributions:                  # bytes of every redistributed tensor are the plan's
        assert G.nodes[r.node]["bytes"] == r.nbytes
        assert G.nodes[r.node]["placement"] == r.src
        for c in r.consumers:
            e = G.edges[r.node, c]
            assert r in e["redistributions"] and e["dst"] == r.dst and e["grad"] == r.grad
    edge_bytes = sum(e["bytes"] for *_, e in G.edges(data=True))
    assert plan.comm_bytes > 0 and edge_bytes == pytest.approx(plan.comm_bytes, rel=1e-12)
    assert G.graph["comm_bytes"] == plan.comm_bytes
    # every collective once: per kind, the edges carry the plan's call counts and bytes
    by_kind = {}
    for *_, e in G.edges(data=True):
        for _direction, kind, nb, _origin in e["collectives"]:
            c = by_kind.setdefault(kind, [0, 0.0])
            c[0] += 1
            c[1] += nb
    assert {k: (c, pytest.approx(b)) for k, (c, b) in by_kind.items()} == dict(plan.comm_by_kind)
    # fp32 parameters: bytes per rank are 4 x the plan's parameter count per rank
    assert G.graph["param_bytes_per_rank"] == 4 * plan.params_per_rank


def test_to_networkx_queries():
    """What a user does with it: the heaviest edges, a path between two modules, a diff of two plans."""
    plan = gpt_plan(2)
    G = plan.to_networkx()
    heavy = sorted(G.edges(data=True), key=lambda e: -e[2]["bytes"])[:3]
    assert all(e["bytes"] == B * S * H * 4 and e["collectives"][0][1] == "all_reduce" for *_, e in heavy)
    of = {d["module"]: n for n, d in G.nodes(data=True) if d["kind"] == "op"}
    path = nx.shortest_path(G, of["blocks.0.attn.q"], of["blocks.1.mlp.fc2"])
    assert {G.nodes[n]["module"] for n in path} >= {"blocks.0.attn.o", "blocks.1.mlp.ln", "blocks.1.mlp.fc1"}
    other = gpt_plan(2, **{"blocks.1.mlp.fc1": None}).to_networkx()
    changed = {G.nodes[n]["module"] for n in G if G.nodes[n]["kind"] == "op"
               and G.nodes[n]["placement"] != other.nodes[n]["placement"]}
    assert "blocks.1.mlp.fc1" in changed and not any(m.startswith("blocks.0") for m in changed)
    assert other.nodes["blocks_1_mlp_fc1_weight"]["placement"] == Replicate()


def test_picture_folds_identical_blocks():
    small, big = picture_graph(gpt_plan(2)), picture_graph(gpt_plan(48))
    assert [(f["prefix"], f["start"], f["end"], f["count"]) for f in big.graph["folds"]] == [("blocks", 0, 47, 48)]
    assert [f["count"] for f in small.graph["folds"]] == [2]
    label = lambda F: sorted((d["kind"], d["label"], d.get("layout")) for _, d in F.nodes(data=True))  # noqa: E731
    assert label(big) == label(small) and big.number_of_edges() == small.number_of_edges()
    layouts = {d["label"]: d["layout"] for _, d in big.nodes(data=True) if d["kind"] == "unit"}
    assert layouts["attn.q"] == "column" and layouts["attn.o"] == "row" and layouts["ln1"] == "replicate"
    assert layouts["wte"] == "vocabulary" and layouts["head"] == "column"
    comms = [d for _, d in big.nodes(data=True) if d["kind"] == "comm"]
    per_step = sum(d["bytes"] * (48 if d["fold"] is not None else 1) for d in comms)
    assert per_step == pytest.approx(gpt_plan(48).comm_bytes)       # folded markers x 48 = the plan's bytes


def test_picture_keeps_differently_planned_blocks_apart():
    F = picture_graph(gpt_plan(4, **{"blocks.2.mlp.fc1": None}))
    assert [(f["start"], f["end"]) for f in F.graph["folds"]] == [(0, 1), (2, 2), (3, 3)]
    assert not picture_graph(gpt_plan(4), fold=False).graph["folds"]


@pytest.mark.parametrize("blocks", [2, 48])
@pytest.mark.parametrize("ext", ["svg", "png"])
def test_draw_writes_file(tmp_path, blocks, ext):
    path = tmp_path / f"plan.{ext}"
    assert gpt_plan(blocks).draw(path) == path
    data = path.read_bytes()
    assert len(data) > 10_000
    if ext == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert b"<svg" in data[:2000]


def test_draw_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"plan\.txt.*\.svg, \.png"):
        gpt_plan(2).draw(tmp_path / "plan.txt")
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.lines", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, mod, None)       # as if matplotlib were not installed
    with pytest.raises(ImportError, match=r"autoshard\[draw\]"):
        gpt_plan(2).draw(tmp_path / "plan.svg")
    assert not (tmp_path / "plan.svg").exists()


def test_cli_draw(tmp_path, capsys):
    from autoshard import cli
    out = tmp_path / "block.svg"
    assert cli.main(["plan", "tests.factories:block", "-n", "2", "--input-shape", "2,16,128", "--draw", str(out)]) == 0
    assert out.stat().st_size > 10_000 and "autoshard plan" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "tests.factories:block", "-n", "2", "--draw", str(tmp_path / "x.jpg")])
    assert e.value.code == 2 and "x.jpg" in capsys.readouterr().err
