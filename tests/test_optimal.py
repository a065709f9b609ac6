"""search="optimal": the integer linear program (autoshard.planner.optimal) against the exact
enumeration on graphs small enough to enumerate, its objective against the greedy's own evaluation,
the solver's report in the plan, scipy kept off the default path, and (zoo marker) the greedy
within 1% of the optimum on every zoo architecture at 2 and 4 ranks."""
import os
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import autoshard  # noqa: E402
from autoshard.capture.trace import capture  # noqa: E402
from autoshard.planner import optimal as O, search as S  # noqa: E402
from autoshard.planner.budget import least_comm, step_seconds  # noqa: E402
from autoshard.planner.build import chunk_candidates, part_candidates, unit_candidates  # noqa: E402
from autoshard.planner.cost import CostModel  # noqa: E402

pytest.importorskip("scipy")

from factories import random_dag  # noqa: E402
from models import GPT, MLP  # noqa: E402
from random_models import make_model  # noqa: E402
from test_search import case  # noqa: E402

REL = 1e-9


def _problem(gm, p, cost):
    return S.Problem(gm, p, cost, chunk_candidates(gm), unit_candidates(gm), part_candidates=part_candidates(gm))


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-30)


def _against_exact(prob):
    """(exact's total, the program's State, the program's group choices propagated as the greedy does)."""
    exact = S.exact(prob, limit=20_000).total
    ilp = O.solve(prob)
    assert ilp.solved.status == "optimal"
    assert _agree(ilp.total, ilp.evaluate())            # (solve checks its own objective too)
    prop = S.State(prob)
    prop.set_choices(dict(enumerate(ilp.choice)))
    # exact is the least over group choices with every op propagated; the program's space holds
    # every such labelling and more (each op's strategy chosen freely)
    assert ilp.total <= exact * (1 + REL) and exact <= prop.total * (1 + REL), (ilp.total, exact, prop.total)
    if not _agree(ilp.total, exact):
        # below the enumeration only through an op strategy the propagation does not take
        assert prop.sidx != ilp.sidx
    return exact, ilp, prop


def test_optimal_equals_exact_on_random_dags():
    """Seeded random Linear DAGs (tests/test_search.py's family, at its prices of state and degrees):
    the program's optimum is the enumeration's, under the same evaluation, except where it runs an op
    in a strategy the greedy's propagation never takes (measured: seeds 12 and 20 of these 20, 5.9% and
    0.3% below, a tensor gathered early and run whole with Partial gradients)."""
    equal = []
    for seed in range(0, 40, 2):
        model, p, cost = case(seed)
        exact, ilp, _ = _against_exact(_problem(capture(model, model.example(), tracer="symbolic_trace").gm, p, cost))
        if _agree(ilp.total, exact):
            equal.append(seed)
    assert len(equal) >= 18, equal


@pytest.mark.parametrize("seed", [1, 2, 5, 8, 13])
def test_optimal_equals_exact_on_random_models(seed):
    """Seeded random models (tests/random_models.py: Linear DAGs with norms, gates, concats, and small
    language models), where the enumeration fits."""
    rm = make_model(seed)
    gm = capture(rm.model, rm.example, tracer=rm.tracer).gm
    prob = _problem(gm, rm.world, CostModel(memory_weight=1e-10))
    if prob.groups and sum(len(g.choices) for g in prob.groups) and \
            __import__("math").prod(len(g.choices) for g in prob.groups) > 20_000:
        pytest.skip("too many combinations to enumerate")
    _against_exact(prob)


def test_optimal_least_comm_objective():
    """Without a price of state, the program bounds the state as least_comm does and is never slower
    than the greedy's plan within that bound; the plan names the solver's status, gap and time."""
    model = GPT()
    prob = _problem(capture(model, None, tokens=128).gm, 2, CostModel())
    greedy = least_comm(prob, S.greedy)
    g = step_seconds(prob, greedy)
    ilp = O.fastest_within(prob)
    assert step_seconds(prob, ilp) <= g * (1 + REL)
    plan = autoshard.plan(model, 2, search="optimal", tokens=128)
    assert plan.search == "optimal"
    note = [n for n in plan.notes if n.startswith("search=optimal")]
    assert note and "HiGHS optimal" in note[0] and "gap" in note[0] and " s solving" in note[0]
    with pytest.raises(ValueError, match="'optimal'"):
        autoshard.plan(model, 2, search="ilp")


def test_optimal_with_price_and_budget():
    """At a user's price of state, and under a memory budget (the ILP inside the budget's price sweep),
    the optimal search plans, never costlier than the greedy at the same price."""
    model = MLP()
    g = autoshard.plan(model, 2, memory_weight=1e-9)
    o = autoshard.plan(model, 2, memory_weight=1e-9, search="optimal")
    assert o.objective <= g.objective * (1 + REL)
    budget = autoshard.plan(model, 2, search="optimal", memory_budget=int(g.memory.peak * 1.5))
    assert budget.memory.peak <= g.memory.peak * 1.5


def test_default_path_does_not_import_scipy():
    """The extra stays an extra: importing autoshard and planning with the default search import no scipy."""
    code = ("import sys, torch, autoshard\n"
            "m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))\n"
            "autoshard.plan(m, 2, (torch.randn(4, 16),))\n"
            "bad = sorted(k for k in sys.modules if k == 'scipy' or k.startswith('scipy.'))\n"
            "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600)


def test_optimal_plan_runs_exactly(dist2):
    """A plan of the optimal search runs on 2 gloo ranks with the single process's loss and gradients."""
    dist2.run(_optimal_rank)


def _optimal_rank(rank, world):
    import copy
    from refs import grads_match
    torch.manual_seed(0)
    model = GPT()
    ids, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    ref = copy.deepcopy(model)
    plan = autoshard.plan(model, world, (ids, targets), search="optimal")
    gm = autoshard.parallelize(model, world, (ids, targets), plan=plan)
    loss, want = gm(ids, targets), ref(ids, targets)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grads_match(gm, ref, "GPT planned by search='optimal'")


@pytest.mark.zoo
@pytest.mark.parametrize("p", [2, 4])
def test_greedy_within_one_percent_of_optimum_on_zoo(p):
    """Every zoo architecture (2 layers): the greedy's predicted step within 1% of the program's
    optimum under the same objective, in the greedy's space (alike layers alike: one block graph; a
    head tied to an embedding on the vocabulary, as decoding wants it: `benchmarks/optimality.py
    --alike --vocabulary`), and the program solved in under 60 s."""
    from autoshard.errors import CaptureError
    from test_zoo import KNOWN
    from zoo import ZOO
    compare = _compare()
    worse = []
    for name, arch in ZOO.items():
        model, kwargs = arch.build()
        t0 = time.perf_counter()
        try:
            r = compare(model, p, kwargs, alike=True, vocabulary=True)
        except CaptureError:
            if name in KNOWN:            # (a capture failure with its cause diagnosed: tests/test_zoo.py)
                continue
            raise
        assert r["solver_s"] < 60, (name, r["solver_s"])
        if r["ratio"] > 1.01:
            worse.append((name, round(r["ratio"], 4), r["differs"][:3]))
        del model
        assert time.perf_counter() - t0 < 600
    assert not worse, worse


def test_classes_too_large_are_enumerated_as_held_depth_first(monkeypatch):
    """A tensor class too large to enumerate (DeBERTa's mask, viewed 7 times: 2.5 million combinations of
    its makers' placements) is solved with every view reading the member it views as that member is held;
    those combinations are now found depth first, a view's choices tried only where its own read holds
    (DeBERTa was refused: "over 2000000 combinations"). Forced onto a small GPT by a small table limit:
    the same program, to the objective and the classes so solved, as filtering every combination."""
    import itertools
    from autoshard.planner import factors
    prob = _problem(capture(GPT(), None, tokens=64).gm, 2, CostModel())
    monkeypatch.setattr(factors, "COMBOS", 100)
    depth_first = O.solve(prob)

    def filtered(prob, r, makers, classes, makes, mset, place):
        for combo in itertools.product(*(range(len(c)) for c in classes)):
            for d, k, cls in zip(makers, combo, classes):
                for m, f in makes[d]:
                    f(cls[k][0]) if m is None else place.__setitem__(m, f(cls[k][0]))
            if all(d[0] != "s" or d[1] not in mset or all(
                    not (j in mset and prob.strats[d[1]][cls[k][0]].inputs[slot] not in (None, place[j]))
                    for slot, j in enumerate(prob.ins[d[1]])) for d, k, cls in zip(makers, combo, classes)):
                yield combo
    monkeypatch.setattr(factors, "held_combos", filtered)
    every = O.solve(prob)
    assert depth_first.solved.held_classes == every.solved.held_classes > 0
    assert _agree(depth_first.total, every.total), (depth_first.total, every.total)


def test_groups_held_together_take_one_choice():
    """`together` (alike layers alike, the greedy's space: benchmarks/optimality.py --alike) holds the
    groups to one choice: the MLP's optimum splits fc1 on outputs and fc2 on inputs; held together,
    both take one choice, at a step no faster than the free optimum's."""
    model = MLP()
    prob = _problem(capture(model, (torch.randn(4, 64, 64),)).gm, 2, CostModel())
    names = [grp.names[0] for grp in prob.groups]
    fc1, fc2 = names.index("fc1.weight"), names.index("fc2.weight")
    free = O.fastest_within(prob)
    assert free.choice[fc1] != free.choice[fc2]
    held = O.fastest_within(prob, together=[[fc1, fc2]])
    assert held.choice[fc1] == held.choice[fc2] and held.total >= free.total * (1 - REL)


def _bound(prob) -> float:
    from autoshard.planner.cost import STATE_TOLERANCE
    from autoshard.planner.held import least_state, param_bytes
    from autoshard.runtime.placements import REPLICATE
    return least_state(prob) + STATE_TOLERANCE * sum(param_bytes(prob, k, REPLICATE) for k in prob.param_obj)


def test_the_optimum_holds_to_the_state_bound(p=8):
    """The program's plan holds no more state per rank than the bound it was solved under, on a model
    of 100 KB (in GB, the solver's tolerance let it exceed the bound by 323 bytes and beat the
    greedy by 9%, which kept to it)."""
    from autoshard.planner.held import state_bytes
    from models import Stages
    model = Stages()
    prob = _problem(capture(model, (torch.randn(8, 64, 16),)).gm, p, CostModel())
    ilp = O.fastest_within(prob)
    assert state_bytes(prob, ilp) <= _bound(prob)
    greedy = least_comm(prob, S.greedy)
    assert state_bytes(prob, greedy) <= _bound(prob)


def _compare():
    """benchmarks/optimality.compare, sys.path left as it was: the benchmark puts benchmarks/ first,
    whose models.py would then shadow tests/models.py in every rank spawned later in the session."""
    saved = list(sys.path)
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
        from optimality import compare
    finally:
        sys.path[:] = saved
    return compare


def _ratio(model, example, p) -> float:
    return _compare()(model, p, example)["ratio"]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_layer_scale_planned_as_the_optimum(p):
    """Residual blocks whose row layer's output a per-channel parameter scales: the scale kept whole
    pays only once the reductions are settled (the row layer's output all-reduced at once, where a
    split scale passes it on Partial, its gradient all-reduced, and the stream reduced later
    anyway), which the relaxing step compares. The greedy's step was 1.16x the optimum's."""
    from models import SummedEmbeddings
    assert _ratio(SummedEmbeddings(), {"ids": torch.randint(0, 96, (4, 64))}, p) <= 1.01


@pytest.mark.parametrize("p", [4, 8])
def test_stages_of_layer_scale_planned_as_the_optimum(p):
    """Stages of different widths, each a layer-scaled block: their families flipped apart (they are not
    alike), a flip that pays but exceeds the state bound paired with one that frees the bytes, and
    a scale with the head it feeds. The greedy's step was 1.19x (4 ranks) and 1.10x (8) the
    optimum's. (At 2 ranks it is 1.028x: the optimum moves three groups at once.)"""
    from models import Stages
    assert _ratio(Stages(), {"x": torch.randn(8, 64, 16)}, p) <= 1.01


@pytest.mark.parametrize("p", [2, 4, 8])
def test_scaled_attention_and_mlp_planned_as_the_optimum(p):
    """Attention and MLP blocks each scaled (BEiT's shape, 17 tokens): the optimum splits the attention's
    output projection on inputs with the scale it feeds whole (its output all-reduced at once, through
    a dropout: `State.reduce_early`), which costs state that the input layer split on outputs frees:
    three families at once, a pair over the state bound that pays now tried with each flip that frees
    bytes (`relax._pairs`). The greedy's step was 1.12x (2 ranks), 1.18x (4) and 1.08x (8) the
    optimum's."""
    from models import ScaledBlocks
    torch.manual_seed(0)
    assert _ratio(ScaledBlocks(), {"x": torch.randn(2, 17, 16)}, p) <= 1.01


@pytest.mark.parametrize("post", [True, False])
@pytest.mark.parametrize("p", [2, 4])
def test_queries_and_keys_normed_whole_planned_as_the_optimum(p, post):
    """q, k and v read one stream and q and k are normed over their whole width (OLMo-2): the optimum
    splits all three on outputs with the norms' weights, five families at once, which no single flip,
    pair or window reached (1.11x the optimum's step with the norms after each branch, 1.14x before).
    A set of three or more families reading one tensor, with the families fed by them, now also takes
    each layout every member has at once (`relax._siblings`, `_uniform`)."""
    from models import QKNormed
    torch.manual_seed(0)
    r = _compare()(QKNormed(post=post), p, {"ids": torch.randint(0, 128, (2, 16))}, alike=True)
    assert r["ratio"] <= 1.01, r


@pytest.mark.parametrize("post", [True, False])
@pytest.mark.parametrize("p", [2, 4])
def test_queries_and_keys_normed_by_heads_kept_split_as_the_optimum(p, post):
    """q and k normed over each head once the heads are cut (Qwen3): split, each norm's weight gradient is
    all-reduced, so each norm alone gathers its input for less, and the attention then runs whole; the
    optimum keeps q, k and v split together and runs it by heads (the greedy's step was 1.07x the
    optimum's at 2 ranks, 1.04x at 4). The outputs of layers reading one tensor are now kept split
    together where that pays (`settle.keep_split`)."""
    from models import QKNormed
    torch.manual_seed(0)
    r = _compare()(QKNormed(post=post, per_head=True), p, {"ids": torch.randint(0, 128, (2, 64))}, alike=True)
    assert r["ratio"] <= 1.01, r


@pytest.mark.parametrize("p", [2, 4])
def test_row_layer_times_a_whole_scale_reduced_at_once(p):
    """ConvNeXt's blocks with all but their MLPs pinned whole (DeepSpeed AutoTP's layout): the row
    layer's output, multiplied by the whole layer scale, was carried Partial to the pooled features
    (the scale's gradient all-reduced too), which no one op's change settles; the greedy split the
    second MLP's down projection on outputs instead, 1.17x (2 ranks) and 1.15x (4) the optimum's
    step. A fresh Partial that a reader applies a parameter to is now tried reduced at once
    (`State.reduce_early`)."""
    from models import CHANNELS_FIRST_PINS, ChannelsFirst
    model, x = ChannelsFirst(), (torch.randn(2, 3, 32, 32),)
    greedy = autoshard.plan(model, p, x, pin=CHANNELS_FIRST_PINS)
    best = autoshard.plan(model, p, x, pin=CHANNELS_FIRST_PINS, search="optimal")
    assert greedy.step_time <= 1.01 * best.step_time
    assert all("gamma" not in r.node for r in greedy.redistributions)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_embedding_gathered_before_its_norm_as_the_optimum(p):
    """An embedding cast to float32 and read by a norm (LLaMA's shape): split on features and gathered
    at once, its output costs half the vocabulary split's all-reduce; propagated, the split went on
    through the cast into the norm's statistics (all-reduced, the stream gathered after all), so the
    greedy kept the vocabulary split: 1.077x (2 ranks) to 1.082x (8) the optimum's step. Gathering a
    split output where that costs less is settled as the relaxing step compares its moves
    (`State.gather_early`)."""
    from models import NormedEmbedding
    assert _ratio(NormedEmbedding(), {"ids": torch.randint(0, 128, (4, 64))}, p) <= 1.01


@pytest.mark.parametrize("p", [2, 4, 8])
def test_parallel_branches_through_transposed_weights_as_the_optimum(p):
    """Two branches reading one norm's output through weights applied as `x @ w.T` (Falcon's ALiBi
    path): both column-parallel share one all-reduce of the input's gradient, but the first reader
    decided, charged all of it, gathered its weight instead, and so did the second. Each reader is
    now charged its share until one has paid (`State._sharers`). The greedy's step was 1.25x (2
    ranks), 1.15x (4) and 1.08x (8) the optimum's."""
    from models import TransposedParallel
    assert _ratio(TransposedParallel(), {"x": torch.randn(2, 64, 64)}, p) <= 1.01


@pytest.mark.parametrize("p,h", [(4, 256), (8, 512)])
def test_norm_made_whole_reads_the_split_embedding_feeding_it_whole(p, h):
    """Pre-norm attention and SwiGLU blocks (LLaMA's shape) on an embedding split on features: the first
    block's norm held its weight split and carried the embedding split, its output gathered for the
    projections. Its weight made whole pays only with the embedding read whole at once before it, an
    early gather at an anchor the flip does not name; a flip that makes a group whole now settles the
    split anchors feeding it too (`relax._feeding`). The greedy's step was 1.026x (4 ranks, 256 wide)
    and 1.028x (8 ranks, 512 wide) the optimum's; LLaMA-2-7B and Mistral-7B at 8 ranks 1.016."""
    from models import QKNormed
    with torch.device("meta"):
        model = QKNormed(vocab=1024, h=h, post=False, qk=False, heads=16)
    ids = torch.zeros(2, 512, dtype=torch.long, device="meta")
    assert _compare()(model, p, {"ids": ids}, tokens=512, alike=True)["ratio"] <= 1.01


@pytest.mark.parametrize("p", [2, 4, 8])
def test_two_norms_reading_one_stream_read_it_whole_together(p):
    """Attention and MLP each normalising the same stream (the parallel residual): each norm alone
    either carries the split stream and has its output gathered, or reads it whole and has its own
    output's gradient all-reduced, so the per-node choice paid two collectives a layer where the
    optimum reads the stream whole once for both norms, their gradients summed before one reduction.
    The greedy's step was 1.11x (2 ranks), 1.16x (4) and 1.08x (8) the optimum's. Siblings now read
    their tensor whole together where that pays (`siblings.read_together`)."""
    from models import TwoNormParallel
    with torch.device("meta"):
        model = TwoNormParallel(vocab=1024, h=512, heads=8)
    ids = torch.zeros(2, 512, dtype=torch.long, device="meta")
    assert _compare()(model, p, {"ids": ids}, tokens=512, alike=True)["ratio"] <= 1.01


@pytest.mark.parametrize("p", [2, 4, 8])
def test_parallel_block_reduces_its_two_summands_at_once(p):
    """Attention and MLP reading one norm's output, each through a dropout, summed into the stream
    (GPT-J's block), with fewer heads than ranks: the attention runs whole. The optimum splits its
    output projection on inputs, its Partial output summed with the MLP's before one all-reduce; the
    MLP's dropout had reduced its row layer's output while the other summand was split, and that flip
    left it reduced (two all-reduces, never undone by `reduce_early`). A reduction next to a Partial
    summand is now tried later (`settle.sum_late`). The greedy's step was 1.10x the optimum's at 8
    ranks (GPT-J, Phi and CodeGen of the zoo 1.20-1.25x)."""
    from models import TwoNormParallel
    torch.manual_seed(0)
    model = TwoNormParallel(vocab=256, h=64, heads=4, norms=1, dropout=0.1, ffn=2)
    assert _ratio(model, {"ids": torch.randint(0, 256, (2, 16))}, p) <= 1.01


@pytest.mark.parametrize("p", [4, 8])
def test_attention_run_whole_flips_its_projections_together(p):
    """Fused q/k/v without biases and a tied head, fewer heads than ranks at 8 (MPT's shape): the
    attention runs whole, its fused projection's output split and gathered before it. The optimum splits
    that projection in thirds and the output projection on outputs, the gathered input read with its
    gradient summed: neither flip pays alone. Families one of which has its output gathered on the way
    to the other's are now flipped together (`relax._across_gathers`). The greedy's step was 1.083x the
    optimum's at 8 ranks (MPT of the zoo the same)."""
    from models import FusedNoBias
    torch.manual_seed(0)
    r = _compare()(FusedNoBias(), p, {"ids": torch.randint(0, 256, (2, 16))}, alike=True, vocabulary=True)
    assert r["ratio"] <= 1.01, r


@pytest.mark.parametrize("p", [4, 8])
def test_summed_embeddings_gathered_once_on_a_random_model(p):
    """Seeded random model 16 (tests/random_models.py): token and position embeddings split on features
    and summed, read by a norm without weights and the residual. Each embedding's reader gathered it
    (two gathers, or the norm carrying the sum split), where the optimum sums them split and gathers
    the sum once: the early gathers now start at the op that sums split anchors' outputs
    (`siblings.summed_sets`, `settle.settle_splits`). The greedy's step was 1.071x the optimum's at 4
    and 8 ranks."""
    from random_models import make_model
    rm = make_model(16)
    assert _compare()(rm.model, p, rm.example, alike=True, vocabulary=True)["ratio"] <= 1.01


@pytest.mark.parametrize("p", [2, 4, 8])
def test_whole_regions_send_back_summed_gradients_together(p):
    """Summed embeddings split on features, gathered once, then weightless norms and column-parallel
    readers: each op of the norms, alone, does better sending back its whole gradient (the readers'
    Partial gradients all-reduced at its output), but all of them sending back summands, together,
    leave one reduction at the gather (`settle.sum_grads_late`). The greedy's step was 1.14x the
    optimum's at 2, 4 and 8 ranks."""
    from models import SummedNormed
    torch.manual_seed(0)
    assert _ratio(SummedNormed(), {"ids": torch.randint(0, 64, (2, 16))}, p) <= 1.01


def _latent(**kw):
    from models import Latent
    with torch.device("meta"):
        return Latent(vocab=1024, h=2048, latent=512, nope=128, pe=64, dv=128, ffn=2816, **kw)


@pytest.mark.parametrize("p", [2, 4])
def test_row_output_reduce_scattered_into_the_split_stream(p):
    """Latent attention with fewer heads than ranks, then a SwiGLU MLP: the optimum keeps the stream split
    and reduce-scatters the MLP's row output into it. Flipping the row layer alone left the residual sum
    Partial (the per-node choice at the sum reads the split stream whole), so no flip paid; the sum is
    now tried reduce-scattered as a move is settled (`settle.scatter_early`). The greedy's step was
    1.037x (2 ranks) and 1.073x (4) the optimum's."""
    ids = torch.zeros(2, 512, dtype=torch.long, device="meta")
    assert _compare()(_latent(heads=2), p, {"ids": ids}, tokens=512, alike=True)["ratio"] <= 1.01


def test_latent_projections_read_the_split_stream_together():
    """Latent attention whose keys are written in place and whose positions are rotated as complex
    numbers (as DeepSeek-V2's code does), so the attention runs whole: the optimum keeps the stream split,
    normed split, and reads it split in both the query and the latent projections (row layers, their
    outputs all-reduced), where the greedy gathered the stream for the two to read whole. Each alone
    keeps the gather; together, with the gather above kept split, they pay (`siblings.read_split`). The
    greedy's step was 1.047x the optimum's at 4 ranks."""
    ids = torch.zeros(2, 512, dtype=torch.long, device="meta")
    assert _compare()(_latent(heads=16, complex_rope=True), 4, {"ids": ids}, tokens=512, alike=True)["ratio"] <= 1.01


def test_weights_gathered_where_smaller_than_the_activations():
    """Weights applied as `x @ w.T` at hidden 64 over 8 ranks, 16 tokens: the weights outweigh the
    activations, and the optimum gathers every weight through its transpose and runs each layer whole.
    One op at a time, a gather or a reduction of activations follows it, so no move paid: 1.232x the
    optimum's step. The ops reading a weight's view are tried whole all at once (`settle.gather_weights`).
    (Falcon's ALiBi path, the zoo's 2 layers: smaller hand-made models of `x @ w.T` layers planned the
    optimum before.)"""
    from zoo import ZOO
    model, kwargs = ZOO["falcon_alibi"].build()
    assert _compare()(model, 8, kwargs, alike=True, vocabulary=True)["ratio"] <= 1.01


@pytest.mark.parametrize("p", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_attention_by_heads_with_its_biases_and_relative_positions_together(p):
    """Disentangled attention (one projection interleaving each head's query, key and value; query and
    value biases apart; relative-position scores from projected position embeddings): the optimum runs
    it by heads, the projection split plainly, the biases and position projections split with it and
    the output layer on its inputs. The greedy split the projection in q/k/v chunks its heads' view
    cannot read and gathered it; flipping any one family kept the gathers of the others, and each op
    ties gathering a split input with slicing a whole one, so none paid. A family gathered at once is
    now tried in each split layout with what then gathers below run split and its partners chosen
    again (`partners.gathered_families`, `settle.split_chain`). The greedy's step was 1.070x (2 ranks)
    and 1.071x (4, `-m slow`) the optimum's."""
    from models import Relative
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    assert _compare()(Relative(), p, {"ids": ids}, alike=True)["ratio"] <= 1.01


def test_the_program_holds_the_greedys_plan_where_views_read_as_held():
    """A view class too large to enumerate is tabled with its views reading their parents as held
    (`factors.held_combos`), which left the greedy's plan out where it redistributes inside one: on
    `Relative` at 8 ranks, 8 such classes, the program's "optimum" was 0.938x the greedy's step, and with
    every group at the greedy's choice the program was infeasible. The greedy's combinations are now
    entries of those tables (`optimal.solve(hints=...)`): the optimum is never worse than the greedy."""
    from models import Relative
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    r = _compare()(Relative(), 8, {"ids": ids}, alike=True)
    assert r["held_classes"] > 0
    assert 1 - 1e-9 <= r["ratio"] <= 1.01, r["ratio"]


def test_gathered_and_shared_patterns_run_exactly(dist2):
    """The patterns above train exactly on 2 gloo ranks (loss and every gradient; dropout on, with one
    process's masks). (The parallel block with dropout, at 8 ranks where its summands are reduced at
    once, was checked so by hand: exact.)"""
    dist2.run(_patterns_rank)


def _patterns_rank(rank, world):
    import copy
    from models import (CHANNELS_FIRST_PINS, ChannelsFirst, FusedNoBias, Latent, NormedEmbedding, QKNormed,
                        Relative, ScaledBlocks, SummedNormed, TransposedParallel, TwoNormParallel)
    from refs import grads_match
    torch.manual_seed(0)
    for model, x, pin in ((NormedEmbedding(), torch.randint(0, 128, (2, 64)), None),
                          (QKNormed(), torch.randint(0, 128, (2, 16)), None),
                          (QKNormed(per_head=True), torch.randint(0, 128, (2, 64)), None),
                          (TransposedParallel(), torch.randn(2, 64, 64), None),
                          (TwoNormParallel(vocab=256, h=256), torch.randint(0, 256, (2, 512)), None),
                          (TwoNormParallel(vocab=256, heads=4, norms=1, dropout=0.1, ffn=2),
                           torch.randint(0, 256, (2, 16)), None),
                          (FusedNoBias(), torch.randint(0, 256, (2, 16)), None),
                          (SummedNormed(), torch.randint(0, 64, (2, 16)), None),
                          (Latent(vocab=256, h=512, heads=4, latent=128, nope=32, pe=16, dv=32, ffn=1024,
                                  complex_rope=True), torch.randint(0, 256, (2, 256)), None),
                          (Relative(dropout=0.1), torch.randint(0, 256, (2, 16)), None),
                          (ScaledBlocks().eval(), torch.randn(2, 17, 16), None),
                          (ChannelsFirst(), torch.randn(2, 3, 32, 32), CHANNELS_FIRST_PINS)):
        ref = copy.deepcopy(model)
        gm = autoshard.parallelize(model, world, (x,), pin=pin, dropout_masks="single_process")
        torch.manual_seed(11)
        want = ref(x).square().mean()
        autoshard.manual_seed(11)
        loss = gm(x).square().mean()
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        grads_match(gm, ref, type(model).__name__)
        if isinstance(model, TwoNormParallel) and model.blocks[0].ln2 is not None:   # (both read the stream whole)
            assert all(gm.get_parameter(f"blocks.{k}.ln{n}.weight").shape == (256,) for k in (0, 1) for n in (1, 2))


def test_relaxing_tries_a_layer_with_the_layer_feeding_it():
    """`relax._together` holds a layer with the layers its input comes from through ops of one
    input (an MLP's fc1 and fc2, through its activation): Persimmon's up and down projections had to
    flip together to reach the optimum (with the settled commit: 1.074x its step before; the zoo
    marker's case)."""
    from autoshard.planner import relax
    prob = _problem(capture(MLP(), (torch.randn(4, 64, 64),)).gm, 2, CostModel())
    fams = relax.families(prob)
    family_of = {g: f for f, fam in enumerate(fams) for g in fam}
    names = {prob.groups[fams[f][0]].names[0]: f for f in range(len(fams))}
    assert (names["fc1.weight"], names["fc2.weight"]) in relax._together(prob, fams, family_of)


def test_summed_embeddings_run_exactly(dist2):
    """Summed token and position embeddings, layer scales and a tied head train exactly on 2 gloo
    ranks (loss and every gradient)."""
    dist2.run(_summed_rank)


def _summed_rank(rank, world):
    import copy
    import torch.nn.functional as F
    from models import SummedEmbeddings
    from refs import grads_match
    torch.manual_seed(0)
    model = SummedEmbeddings(tied=True)
    ids, targets = torch.randint(0, 96, (2, 64)), torch.randint(0, 96, (2, 64))
    ref = copy.deepcopy(model)
    gm = autoshard.parallelize(model, world, (ids,))
    loss = F.cross_entropy(gm(ids).flatten(0, 1), targets.flatten())
    want = F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grads_match(gm, ref, "token and position embeddings summed")
