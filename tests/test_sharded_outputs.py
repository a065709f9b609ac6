"""outputs="sharded": outputs the plan leaves split come back as DTensors (no collective spent on
them), whole ones (the loss) as plain tensors; and one tensor is made whole at most once per
target placement, whatever reads it (the output, a view of it read by the loss), in either mode.

One process: the plans (bytes, placements, no tensor gathered twice). Gloo ranks at world 2 and 4:
a tiny Hugging Face LLaMA (torch.export, input_ids + labels) and the GPT of tests/models.py (which
returns the logits without targets, the loss with them): loss and every gradient equal the
single-process model's, `logits.full_tensor()` equals its logits, the bytes the collectives moved
equal the plan's and drop by the logits' all-gather against outputs="full".
"""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.runtime.collectives import count_comm, ring_bytes  # noqa: E402
from models import GPT  # noqa: E402
from refs import close_to_scale, grads  # noqa: E402

VOCAB = 2048          # x 64 tokens: the vocabulary-parallel head and loss beat gathering the logits
VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous",
         "clone", "alias", "to", "_to_copy", "float"}


def _llama(p, **kw):
    import hf_models
    return hf_models.llama(vocab_size=VOCAB, seq=32, world_size=p, **kw)


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, blocks=1, tied=True)


def _ids(seed=0, batch=2, seq=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (batch, seq), generator=g), torch.randint(VOCAB, (batch, seq), generator=g)


def _op(n) -> str:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name.split(".")[0]


def _base(n):
    """The tensor `n` is a view of (following reshapes, contiguous, same-dtype conversions)."""
    while n.op in ("call_function", "call_method") and _op(n) in VIEWS and n.args and \
            isinstance(n.args[0], torch.fx.Node) and n.meta["val"].numel() == n.args[0].meta["val"].numel() and \
            n.meta["val"].dtype == n.args[0].meta["val"].dtype:
        n = n.args[0]
    return n


def _made_whole_twice(plan) -> list:
    """(tensor, target) pairs with more than one forward collective, a view of a tensor counting as it."""
    nodes = {n.name: n for n in plan.graph_module.graph.nodes}
    seen, twice = {}, []
    for r in plan.redistributions:
        if r.forward:
            key = (_base(nodes[r.node]).name, str(r.dst))
            if key in seen:
                twice.append((seen[key], r.node, str(r.dst)))
            seen[key] = r.node
    return twice


def _logits_gather(plan, name) -> float:
    """Ring bytes of the all-gather of the output `name` (the logits) to Replicate."""
    v = next(n for n in plan.graph_module.graph.nodes if n.name == name).meta["val"]
    return ring_bytes("all_gather", v.numel() * v.element_size(), plan.world_size)


def _own_comm(plan) -> float:
    """Bytes of the collectives ops run themselves (a vocabulary-parallel loss's reductions)."""
    return sum(ring_bytes(k, nb, plan.world_size) for d in plan.nodes.values() for k, nb in d.comm)


def _logits_node(plan):
    return next(name for name, pl in plan.output_placements.items() if "loss" not in name)


# ----------------------------------------------------------------------------- one process: plans

@pytest.mark.parametrize("sizes", [dict(), dict(vocab_size=VOCAB, seq=32)], ids=["vocab256", "vocab2048"])
def test_llama_gathers_its_logits_once_in_either_mode(sizes):
    """The logits were gathered twice (the output reads `to`, the loss its `view`): now the view
    reuses the output's gather; with outputs="sharded" nothing gathers them for the output."""
    import hf_models
    model, kw = hf_models.llama(**sizes)
    full = autoshard.plan(model, 2, kw, tracer="export")
    assert _made_whole_twice(full) == [], full.report()
    sharded = autoshard.plan(model, 2, kw, tracer="export", outputs="sharded")
    assert full.outputs == "full" and sharded.outputs == "sharded"
    assert _made_whole_twice(sharded) == [], sharded.report()
    logits = _logits_node(full)
    assert isinstance(full.output_placements[logits], autoshard.Replicate)
    assert sharded.output_placements[logits] == autoshard.Shard(2)       # vocabulary-split, returned as it is
    assert not any("output" in r.consumers for r in sharded.redistributions)
    if sizes:          # here the loss too runs vocabulary-parallel once the output no longer gathers
        assert sharded.dims["cross_entropy_loss"] == -1
        gather = _logits_gather(full, logits)
        assert sharded.comm_bytes < full.comm_bytes
        # what changes: the output's gather goes; the loss runs on the split logits (its own reductions)
        assert full.comm_bytes - _own_comm(full) - gather == pytest.approx(sharded.comm_bytes - _own_comm(sharded))


@pytest.mark.parametrize("p", [2, 4])
def test_gpt_logits_plan_drops_exactly_the_gather(p):
    idx, _ = _ids()
    full = autoshard.plan(_gpt(), p, (idx,))
    sharded = autoshard.plan(_gpt(), p, (idx,), outputs="sharded")
    logits = _logits_node(full)
    assert sharded.output_placements[logits] == autoshard.Shard(2)
    assert full.comm_bytes - sharded.comm_bytes == _logits_gather(full, logits)
    assert dict(full.layouts) == dict(sharded.layouts)
    for plan in (full, sharded):
        assert _made_whole_twice(plan) == []


def test_unknown_outputs_value_is_a_value_error():
    idx, _ = _ids()
    for call in (lambda: autoshard.plan(_gpt(), 2, (idx,), outputs="split"),
                 lambda: autoshard.parallelize(_gpt(), 2, (idx,), rank=0, outputs="gathered")):
        with pytest.raises(ValueError, match="outputs must be one of 'full', 'sharded'"):
            call()


def test_rank_only_inspection_builds_but_cannot_run_sharded_outputs():
    """rank= with no process group: the module shows its to_dtensor nodes; calling it says why
    it needs the group (a DTensor is over the group's mesh)."""
    assert not dist.is_initialized()
    idx, _ = _ids()
    gm = autoshard.parallelize(_gpt(), 2, (idx,), rank=0, outputs="sharded")
    assert "to_dtensor" in gm.code
    with pytest.raises(autoshard.ProcessGroupError):
        gm(idx)
    plan = autoshard.plan(_gpt(), 2, (idx,))
    with pytest.raises(autoshard.ShardingError, match="outputs='sharded' but the plan was made with outputs='full'"):
        autoshard.parallelize(_gpt(), 2, plan=plan, rank=0, outputs="sharded")


# ----------------------------------------------------------------------------- ranks

class ViewRead(torch.nn.Module):
    """A split activation read whole by an op with no sharding rule, and a view of it read whole
    by another: one all-gather serves both (the view's ops run again on the gathered tensor)."""

    def __init__(self, h=64, f=256):
        super().__init__()
        self.up = torch.nn.Linear(h, f)
        self.down = torch.nn.Linear(f, h)

    def forward(self, x):
        y = self.up(x)                          # split on its last dim
        a = torch.cumsum(y, -1)                 # no rule: reads y whole
        v = y.reshape(-1, y.shape[-1])          # a view of y
        b = torch.cumsum(v, 0)                  # no rule: reads the view whole
        return self.down(a).sum() + b.sum()


def _view_case(rank, p):
    torch.manual_seed(0)
    model = ViewRead()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    gm = autoshard.parallelize(model, p, (x,))
    plan = gm._autoshard_plan
    with count_comm() as c:
        loss = gm(x)
        loss.backward()
    want = ref(x)
    want.backward()
    close_to_scale(loss, want, "loss")
    _check_grads(gm, ref, "view read whole")
    gathers = [r.node for r in plan.redistributions if "all_gather" in r.forward]
    return dict(measured=c.bytes, plan=plan.comm_bytes, gathers=gathers,
                via=[(r.node, r.via) for r in plan.redistributions if getattr(r, "via", None)], twice=_made_whole_twice(plan),
                calls=sum(e.kind == "all_gather" and e.direction == "forward" for e in c.events))


def test_a_view_of_a_gathered_tensor_is_not_gathered_again(dist2):
    for r in dist2.run(_view_case):
        assert r["twice"] == [] and r["gathers"] == ["linear"], r
        # the view reads the gathered tensor (the search sees it made whole by the first reader),
        # or is made whole `via` it: either way one gather
        assert r["via"] in ([("reshape", "linear")], []), r
        assert r["calls"] == 1 and r["measured"] == pytest.approx(r["plan"], rel=1e-9), r


class ViewedGather(torch.nn.Module):
    """A column layer's output gathered for two column layers (their Partial input gradients
    reduce-scattered in the gather's backward), and a view of it read split by a row layer and
    whole by a layer kept whole, whose input gradient is whole (DeepSeek-V3's router and shared
    expert reading the normed stream)."""

    def __init__(self, h=64, f=128):
        super().__init__()
        self.inp = torch.nn.Linear(h, h, bias=False)
        self.gate = torch.nn.Linear(h, f)
        self.up = torch.nn.Linear(h, f)
        self.down = torch.nn.Linear(f, h)
        self.proj = torch.nn.Linear(h, h)
        self.router = torch.nn.Linear(h, 8, bias=False)

    def forward(self, x):
        y = self.inp(x)                                  # split on its last dim
        v = y.reshape(-1, y.shape[-1])                   # a view of it, read split and whole
        scores = F.linear(v.float(), self.router.weight.float()).softmax(-1)
        return (self.down(F.silu(self.gate(y)) * self.up(y)).square().mean() + self.proj(v).square().mean()
                + scores.square().sum())


VIEWED_PINS = {"inp": -1, "gate": -1, "up": -1, "down": 0, "proj": 0, "router": None}


def test_a_whole_gradient_never_joins_a_gathers_reduce_scatter():
    """y gathered for the column layers, its gather's backward a reduce-scatter of their Partial
    gradients; the view read split by the row layer, and, cast, whole by the router kept whole.
    The router's gradient is whole on every rank: joined to that reduce-scatter it would be summed
    once per rank (DeepSeek-V3's eval step at 2 ranks: every gradient upstream of its first router
    off by up to 2% of their scale). It is gathered on its own instead, and charged so."""
    from autoshard.capture import capture
    from autoshard.planner import search as S
    from autoshard.planner.build import chunk_candidates
    from autoshard.planner.cost import CostModel
    from autoshard.runtime.placements import Replicate, Shard
    gm = capture(ViewedGather(), (torch.randn(2, 8, 64),), tracer="symbolic_trace").gm
    prob = S.Problem(gm, 2, CostModel(), chunk_candidates(gm), pins=VIEWED_PINS)
    state = S.greedy(prob)
    place, sidx, at = list(state.place), list(state.sidx), {n.name: i for i, n in enumerate(prob.nodes)}

    def choose(name, wanted):
        i = at[name]
        sidx[i] = next(k for k, s in enumerate(prob.strats[i]) if wanted(s))
        place[i] = prob.strats[i][sidx[i]].output

    choose("reshape", lambda s: s.inputs[0] == Shard(2))                 # the view split on features
    choose("float_1", lambda s: isinstance(s.inputs[0], Shard))
    choose("linear_1", lambda s: all(x is None or isinstance(x, Replicate) for x in s.inputs))
    y, cast = at["linear"], at["float_1"]
    assert prob.root[cast] == y and place[y] == Shard(2)
    assert [c[3] for c in prob.comms_of(y, place, sidx) if isinstance(c[0], Replicate)] == [("reduce_scatter",)]
    (req, grad, fwd, _, _, via), = prob.comms_of(cast, place, sidx)
    assert (req, grad, fwd, via) == (Replicate(), Replicate(), ("all_gather",), None)


def _is_split_dtensor(t, p, dim):
    from torch.distributed.tensor import DTensor, Shard
    return isinstance(t, DTensor) and tuple(t.placements) == (Shard(dim),) and t.device_mesh.size() == p


def _collected_grads(gm):
    return autoshard.collect_state_dict(gm, grads(gm, remove_duplicate=False))


def _check_grads(gm, ref, what):
    got, want = _collected_grads(gm), grads(ref, remove_duplicate=False)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, g in want.items():
        close_to_scale(got[k], g, f"{what}: grad of {k}")


def _llama_case(rank, p, batch):
    """Both modes side by side: the loss's step, counted; the logits as a DTensor; a loss the
    user computes from the DTensor; a call without labels (another signature)."""
    torch.manual_seed(0)
    model, kw = _llama(p, batch=batch)
    ref = copy.deepcopy(model)
    out = {}
    for mode in ("full", "sharded"):
        gm = autoshard.parallelize(copy.deepcopy(model), p, kw, tracer="export", outputs=mode)
        with count_comm() as c:
            res = gm(**kw)
            res.loss.backward()
        out[mode] = dict(measured=c.bytes, plan=gm._autoshard_plan.comm_bytes, loss=res.loss.item(),
                         gather=_logits_gather(gm._autoshard_plan, _logits_node(gm._autoshard_plan)),
                         own=_own_comm(gm._autoshard_plan))
        want = ref(**kw)
        want.loss.backward()
        assert type(res) is type(want)                              # CausalLMOutputWithPast
        assert not isinstance(res.loss, torch.distributed.tensor.DTensor)
        close_to_scale(res.loss, want.loss, f"{mode}: loss")
        _check_grads(gm, ref, mode)
        logits = res.logits.full_tensor() if mode == "sharded" else res.logits
        close_to_scale(logits, want.logits, f"{mode}: logits")
        ref.zero_grad(set_to_none=True)
        if mode == "full":
            assert not isinstance(res.logits, torch.distributed.tensor.DTensor)
            continue
        assert _is_split_dtensor(res.logits, p, 2)
        assert res.logits.to_local().shape[-1] == VOCAB // p

        # a loss of the user's on the DTensor logits: gathered by DTensor, gradients as the model's
        gm.zero_grad(set_to_none=True)
        res = gm(**kw)
        want = ref(**kw)
        (res.logits.full_tensor().square().mean() + res.loss).backward()
        (want.logits.square().mean() + want.loss).backward()
        _check_grads(gm, ref, "sharded, a loss on logits.full_tensor()")
        gm.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        res = gm(**kw)
        res.logits.square().mean().full_tensor().backward()           # a DTensor op, then whole
        ref(**kw).logits.square().mean().backward()
        _check_grads(gm, ref, "sharded, a DTensor op on the logits")

        # another call signature (no labels) follows the option
        gm.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        ids = kw["input_ids"]
        res = gm(input_ids=ids)
        assert res.loss is None and _is_split_dtensor(res.logits, p, 2)
        close_to_scale(res.logits.full_tensor(), ref(input_ids=ids).logits, "sharded, no labels: logits")
    return out


@pytest.mark.parametrize("world, batch", [("dist2", 2), ("dist4", 4)])
def test_llama_sharded_logits(world, batch, request):
    pytest.importorskip("transformers")
    results = request.getfixturevalue(world).run(_llama_case, batch, timeout=300)
    for r in results:
        for mode in ("full", "sharded"):
            assert r[mode]["measured"] == pytest.approx(r[mode]["plan"], rel=1e-9), (mode, r)
            assert r[mode]["loss"] == results[0][mode]["loss"]
        full, sharded = r["full"], r["sharded"]
        # the drop is the logits' all-gather (the loss then runs vocabulary-parallel: its own reductions)
        assert full["measured"] - full["own"] - full["gather"] == pytest.approx(sharded["measured"] - sharded["own"])
        assert full["measured"] - sharded["measured"] > 0.99 * full["gather"]


def _gpt_case(rank, p):
    """GPT returns the logits without targets: a DTensor with outputs="sharded"; with targets it
    returns the loss (another signature), plain; in eval mode (its evaluation graph) a DTensor again."""
    idx, tgt = _ids()
    model = _gpt()
    ref = copy.deepcopy(model)
    measured = {}
    for mode in ("full", "sharded"):
        gm = autoshard.parallelize(copy.deepcopy(model), p, (idx,), outputs=mode)
        with count_comm() as c:
            logits = gm(idx)
        whole = logits.full_tensor() if mode == "sharded" else logits
        want = ref(idx)
        with count_comm() as c2:
            F.cross_entropy(whole.view(-1, VOCAB), tgt.view(-1)).backward()
        F.cross_entropy(want.view(-1, VOCAB), tgt.view(-1)).backward()
        measured[mode] = (c.bytes + c2.bytes, gm._autoshard_plan.comm_bytes)
        close_to_scale(whole, want, f"{mode}: logits")
        _check_grads(gm, ref, mode)
        ref.zero_grad(set_to_none=True)
        if mode == "full":
            assert not isinstance(logits, torch.distributed.tensor.DTensor)
            continue
        assert _is_split_dtensor(logits, p, 2)
        gm.zero_grad(set_to_none=True)
        loss = gm(idx, tgt)                                            # the model's loss: whole, plain
        assert not isinstance(loss, torch.distributed.tensor.DTensor)
        want = ref(idx, tgt)
        loss.backward()
        want.backward()
        close_to_scale(loss, want, "sharded: loss with targets")
        _check_grads(gm, ref, "sharded: loss with targets")
        gm.eval()
        ref.eval()
        with torch.no_grad():
            ev = gm(idx)
            assert _is_split_dtensor(ev, p, 2)
            close_to_scale(ev.full_tensor(), ref(idx), "sharded: eval logits")
    return measured, _logits_gather(gm._autoshard_plan, _logits_node(gm._autoshard_plan))


@pytest.mark.parametrize("world", ["dist2", "dist4"])
def test_gpt_sharded_logits(world, request):
    for measured, gather in request.getfixturevalue(world).run(_gpt_case, timeout=300):
        for mode, (got, planned) in measured.items():
            assert got == pytest.approx(planned, rel=1e-9), (mode, got, planned)
        assert measured["full"][0] - measured["sharded"][0] == pytest.approx(gather, rel=1e-9)


def _mesh_case(rank, p):
    """group= a 1-D DeviceMesh: the logits are a DTensor over that very mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("tp",))
    idx, _ = _ids()
    model = _gpt()
    gm = autoshard.parallelize(copy.deepcopy(model), p, (idx,), group=mesh["tp"], outputs="sharded")
    logits = gm(idx)
    close_to_scale(logits.full_tensor(), model(idx), "logits over the caller's mesh")
    return logits.device_mesh == mesh["tp"]


def test_dtensor_is_over_the_callers_mesh(dist2):
    assert all(dist2.run(_mesh_case))
