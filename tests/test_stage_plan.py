"""autoshard.planner.stages: balanced stage cuts, pinned splits, and schedule timelines checked
by hand and against the order torch.distributed.pipelining runs (no process group)."""
import itertools
import random
import time

import pytest

from autoshard.errors import ShardingError
from autoshard.planner import stages as S


def totals(costs, starts, first=0.0, last=0.0):
    ends = list(starts[1:]) + [len(costs)]
    out = [sum(costs[a:b]) for a, b in zip(starts, ends)]
    out[0] += first
    out[-1] += last
    return out


# ---- balance ---------------------------------------------------------------------------------

def test_balance_uniform():
    assert S.balance([1.0] * 80, 8) == tuple(range(0, 80, 10))
    assert S.balance([1.0] * 80, 16) == tuple(range(0, 80, 5))
    assert S.balance([2.0] * 7, 1) == (0,)
    assert S.balance([2.0] * 5, 5) == (0, 1, 2, 3, 4)


def test_balance_heavy_head_and_embedding():
    # 8 unit blocks in 2 stages, the head costs 2: 5 + 0 | 3 + 2 -> the last stage gets 3 blocks.
    assert S.balance([1.0] * 8, 2, last=2.0) == (0, 5)
    # 80 blocks in 8 stages, head worth 6 blocks: the last stage's total stays at the others' 10.
    starts = S.balance([1.0] * 80, 8, last=6.0)
    assert 80 - starts[-1] < 10
    assert max(totals([1.0] * 80, starts, last=6.0)) == pytest.approx(86 / 8, abs=1.0)
    # The embedding weighs on the first stage instead.
    assert S.balance([1.0] * 8, 2, first=2.0) == (0, 3)


def test_balance_prefers_even_totals_among_optimal_cuts():
    # Every cut with [4] alone has max 4; (1,3) / (3,1) are as good on max, (2,2) is the most even.
    assert S.balance([1, 1, 1, 1, 4], 3) == (0, 2, 4)
    assert S.balance([4, 1, 1, 1, 1], 3) == (0, 1, 3)


def test_balance_matches_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.0, 3.0, rng.random() * 5]) for _ in range(n)]
        first, last = rng.choice([0.0, 1.5, rng.random() * 4]), rng.choice([0.0, 2.0, rng.random() * 4])
        cuts = [(0,) + c for c in itertools.combinations(range(1, n), parts - 1)]
        best_max = min(max(totals(costs, c, first, last)) for c in cuts)
        even = min(sum(t * t for t in totals(costs, c, first, last)) for c in cuts
                   if max(totals(costs, c, first, last)) <= best_max + 1e-9)
        got = S.balance(costs, parts, first=first, last=last)
        assert len(got) == parts and got[0] == 0 and list(got) == sorted(set(got))
        t = totals(costs, got, first, last)
        assert max(t) == pytest.approx(best_max, abs=1e-9), (costs, parts, first, last, got)
        assert sum(x * x for x in t) == pytest.approx(even, abs=1e-9), (costs, parts, got)


def test_balance_is_fast():
    rng = random.Random(1)
    costs = [rng.uniform(0.5, 1.5) for _ in range(80)]
    start = time.perf_counter()
    S.balance(costs, 8, first=2.0, last=5.0)
    S.balance(costs, 16, first=2.0, last=5.0)
    assert time.perf_counter() - start < 0.2  # each typically ~10 ms


def test_balance_errors():
    with pytest.raises(ShardingError, match=r"5 stages but the model has 3 blocks"):
        S.balance([1.0, 1.0, 1.0], 5)
    with pytest.raises(ValueError):
        S.balance([1.0, 1.0], 0)
    with pytest.raises(ValueError, match=">= 0"):
        S.balance([1.0, -1.0], 1)


# ---- check_split -----------------------------------------------------------------------------

def test_check_split_accepts_starts_and_counts():
    assert S.check_split((0, 3, 6), 8, 3) == (0, 3, 6)
    assert S.check_split([3, 3, 2], 8, 3) == (0, 3, 6)
    assert S.check_split([8], 8, 1) == (0,)
    assert S.check_split([0], 8, 1) == (0,)


@pytest.mark.parametrize("split, match", [
    ([0, 3], r"has 2 entries but the pipeline has 3 stages"),
    ([0, 3, 3], r"start indices must increase"),
    ([0, 3, 8], r"below the model's 8 blocks"),
    ([3, 3, 3], r"8 in all \(they sum to 9\)"),
    ([4, 0, 4], r"at least one block"),
    ([True, 3, 4], r"list of ints"),
    ("034", r"list of ints"),
    ([0, 2.5, 5], r"list of ints"),
])
def test_check_split_errors(split, match):
    with pytest.raises(ShardingError, match=match):
        S.check_split(split, 8, 3)


def test_check_split_more_stages_than_blocks():
    with pytest.raises(ShardingError, match=r"4 stages but the model has 3 blocks"):
        S.check_split([1, 1, 1, 0], 3, 4)


# ---- simulate: by hand -----------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_simulate_by_hand_pp2_m2(schedule):
    # F = 1, B = 2 on both stages. Rank 0: F0 0-1, F1 1-2. Rank 1: F0 1-2, then GPipe F1 2-3,
    # B0 3-5, B1 5-7 (1F1B: B0 2-4, F1 4-5, B1 5-7). Rank 0: B0 after rank 1's B0 (5, 1F1B 4),
    # B1 after 7: 7-9. Makespan 9 = 3 * (M + pp - 1); each rank busy 6.
    t = S.simulate(schedule, 2, 2, [1.0, 1.0], [2.0, 2.0])
    assert t.makespan == 9.0 and t.busy == (6.0, 6.0) and t.idle == (3.0, 3.0)
    assert t.bubble == pytest.approx(1 / 3)
    # Stage 1 twice as slow, 0.5 s per transfer. Rank 0: F0 0-1, F1 1-2. Rank 1: F0 1.5-3.5,
    # F1 3.5-5.5, B0 5.5-9.5, B1 9.5-13.5 (1F1B: B0 3.5-7.5, F1 7.5-9.5, B1 9.5-13.5).
    # Rank 0: B0 from 10 (GPipe) / 8 (1F1B) for 2, B1 from 14: 14-16.
    t = S.simulate(schedule, 2, 2, [1.0, 2.0], [2.0, 4.0], send=0.5)
    assert t.makespan == 16.0 and t.busy == (6.0, 12.0) and t.idle == (10.0, 4.0)
    assert t.per_rank == pytest.approx((10 / 16, 4 / 16))


def test_simulate_interleaved_by_hand():
    # pp=2, 2 stages per rank (rank 0: stages 0, 2; rank 1: 1, 3), M=2, F=1, B=2. Torch's order:
    # rank 0 F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1, rank 1 F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1.
    # Rank 0: F0.0 0-1, F0.1 1-2, F2.0 2-3, F2.1 3-4; rank 1: F1.0 1-2, F1.1 2-3, F3.0 3-4,
    # B3.0 4-6, F3.1 6-7, B3.1 7-9; rank 0: B2.0 6-8, B2.1 9-11; rank 1: B1.0 9-11, B1.1 11-13;
    # rank 0: B0.0 11-13, B0.1 13-15. Makespan 15 = 3 * (2*2 + 1).
    assert S.orders("Interleaved1F1B", 2, 2, 2)[1] == (
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1),
        ("B", 1, 0), ("B", 1, 1))
    t = S.simulate("Interleaved1F1B", 2, 2, [1.0] * 4, [2.0] * 4, stages_per_rank=2)
    assert t.makespan == 15.0 and t.busy == (12.0, 12.0)
    # M < pp... here M=1: one microbatch walks the 4 stages forward (4) and back (8): 12, not the
    # textbook 3 * (2*1 + 1) = 9; each rank idles half the step.
    t = S.simulate("Interleaved1F1B", 2, 1, [1.0] * 4, [2.0] * 4, stages_per_rank=2)
    assert t.makespan == 12.0 and t.bubble == 0.5 > S.ideal_bubble("Interleaved1F1B", 2, 1, 2)


# ---- simulate: against the textbook bubble ---------------------------------------------------

@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_simulate_matches_ideal_bubble(schedule, pp, m):
    t = S.simulate(schedule, pp, m, [1.0] * pp, [2.0] * pp)
    assert t.makespan == pytest.approx(3.0 * (m + pp - 1))
    assert t.bubble == pytest.approx(S.ideal_bubble(schedule, pp, m))
    assert t.per_rank == pytest.approx((S.ideal_bubble(schedule, pp, m),) * pp)


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 3), (2, 8), (4, 4), (4, 5), (4, 6), (4, 8),
                                   (4, 10), (8, 8), (8, 16)])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_matches_ideal_bubble_from_pp_microbatches(pp, m, v):
    # Torch's interleaved order reaches the textbook bubble once M >= pp (any M it accepts).
    n = pp * v
    t = S.simulate("Interleaved1F1B", pp, m, [1.0] * n, [2.0] * n, stages_per_rank=v)
    assert t.makespan == pytest.approx(3.0 * (v * m + pp - 1))
    assert t.bubble == pytest.approx(S.ideal_bubble("Interleaved1F1B", pp, m, v))


def test_ideal_bubble_values():
    assert S.ideal_bubble("GPipe", 4, 8) == pytest.approx(3 / 11)
    assert S.ideal_bubble("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ShardingError, match="one stage per rank"):
        S.ideal_bubble("1F1B", 4, 8, 2)


# ---- simulate: uneven stages, transfers ------------------------------------------------------

@pytest.mark.parametrize("schedule", S.SCHEDULES)
def test_uneven_stages_make_a_larger_bubble(schedule):
    even = S.simulate(schedule, 4, 8, [1.0] * 4, [2.0] * 4)
    # Same total work, one stage 50% slower.
    uneven = S.simulate(schedule, 4, 8, [1.0, 1.5, 0.75, 0.75], [2.0, 3.0, 1.5, 1.5])
    assert sum(uneven.busy) == pytest.approx(sum(even.busy))
    assert uneven.makespan > even.makespan + 1.0
    assert uneven.bubble > even.bubble + 0.05


@pytest.mark.parametrize("schedule, v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)])
def test_sends_lengthen_the_step(schedule, v):
    n = 4 * v
    base = S.simulate(schedule, 4, 8, [1.0] * n, [2.0] * n, stages_per_rank=v)
    slow = S.simulate(schedule, 4, 8, [1.0] * n, [2.0] * n, stages_per_rank=v, send=0.25)
    assert slow.busy == base.busy
    # At least the first microbatch's trip: 2 * (n - 1) transfers, all across ranks.
    assert slow.makespan >= base.makespan + 2 * (n - 1) * 0.25 - 1e-9
    assert slow.bubble > base.bubble


def test_same_rank_transfers_are_free():
    # pp=1: every stage on rank 0, so `send` never applies.
    t = S.simulate("Interleaved1F1B", 1, 2, [1.0, 1.0], [2.0, 2.0], stages_per_rank=2, send=5.0)
    assert t.makespan == 12.0 and t.bubble == 0.0


# ---- errors --------------------------------------------------------------------------------

def test_simulate_errors():
    with pytest.raises(ShardingError, match="unknown schedule 'ZB'"):
        S.simulate("ZB", 2, 2, [1, 1], [2, 2])
    with pytest.raises(ShardingError, match=r"4 stages, but got 2 forward and 2 backward"):
        S.simulate("Interleaved1F1B", 2, 2, [1, 1], [2, 2], stages_per_rank=2)
    with pytest.raises(ShardingError, match="GPipe runs one stage per rank, not 2"):
        S.simulate("GPipe", 2, 2, [1] * 4, [2] * 4, stages_per_rank=2)
    with pytest.raises(ShardingError, match=r"multiple of the number of rounds \(2\)"):
        S.simulate("Interleaved1F1B", 4, 9, [1] * 8, [2] * 8, stages_per_rank=2)
    with pytest.raises(ValueError):
        S.simulate("GPipe", 2, 0, [1, 1], [2, 2])


def test_check_schedule_mirrors_torch():
    S.check_schedule("1F1B", 4, 4)
    S.check_schedule("Interleaved1F1B", 4, 10, 2)
    S.check_schedule("Interleaved1F1B", 4, 3, 2)
    with pytest.raises(ShardingError, match="2 microbatches for 4 stages"):
        S.check_schedule("1F1B", 4, 2)
    with pytest.raises(ShardingError, match=r"9 microbatches .* = 2"):
        S.check_schedule("Interleaved1F1B", 4, 9, 2)
    with pytest.raises(ShardingError, match="one stage per rank"):
        S.check_schedule("GPipe", 4, 8, 2)


def test_deadlock_is_reported(monkeypatch):
    # Rank 0 waits for rank 1's backward before its own forward: nothing can ever start.
    monkeypatch.setattr(S, "orders", lambda *a: ((("B", 0, 0), ("F", 0, 0)),
                                                  (("F", 1, 0), ("B", 1, 0))))
    with pytest.raises(ShardingError, match="deadlocks"):
        S.simulate("GPipe", 2, 1, [1, 1], [2, 2])


# ---- the orders, against torch -------------------------------------------------------------

class RecordingStage:
    """Stands in for a PipelineStage: no communication, records the compute calls."""

    def __init__(self, pp, s):
        self.num_stages, self.stage_index, self.group_size, self.group_rank = pp, s, pp, s
        self.is_first, self.is_last = s == 0, s == pp - 1
        self.log = []

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(("F", self.stage_index, i))

    def backward_one_chunk(self, i, **kwargs):
        self.log.append(("B", self.stage_index, i))

    def perform_reduce_grad(self, *args):
        pass


def torch_run(cls, pp, m, rank):
    stage = RecordingStage(pp, rank)
    schedule = cls(stage, m)
    schedule._stage_forward_initialized = True  # no metadata exchange
    schedule._step_microbatches()
    return tuple(stage.log), schedule.pipeline_order[rank]


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_orders_match_torch_execution(name, pp):
    from torch.distributed.pipelining import schedules as ts

    cls = {"GPipe": ts.ScheduleGPipe, "1F1B": ts.Schedule1F1B}[name]
    ir_ranks, ms = 0, sorted({pp, pp + 1, 2 * pp + 3})
    for m in ms:
        ours = S.orders(name, pp, m)
        for rank in range(pp):
            ran, ir = torch_run(cls, pp, m, rank)
            assert ours[rank] == ran, (name, pp, m, rank)
            ir = tuple((a.computation_type.value, a.stage_index, a.microbatch_index)
                       for a in ir if a is not None and a.computation_type.value in ("F", "B"))
            # torch's 1F1B IR lists F1..FM on the last rank; compare wherever it is consistent.
            if sorted(i for k, _, i in ir if k == "F") == list(range(m)):
                assert ours[rank] == ir, (name, pp, m, rank)
                ir_ranks += 1
    assert ir_ranks >= len(ms) * (pp if name == "GPipe" else pp - 1)


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (4, 8, 2), (4, 3, 3), (8, 16, 4), (4, 4, 1)])
def test_interleaved_order_is_consistent(pp, m, v):
    order = S.orders("Interleaved1F1B", pp, m, v)
    assert len(order) == pp
    for rank, ops in enumerate(order):
        assert {s % pp for _, s, _ in ops} == {rank}  # loop placement: stage s on rank s % pp
        assert sorted(ops) == sorted((k, s, i) for k in "FB" for s in range(rank, pp * v, pp)
                                     for i in range(m))
        assert all(ops.index(("F", s, i)) < ops.index(("B", s, i)) for k, s, i in ops if k == "B")


def test_interleaved_one_stage_per_rank_warms_up_longer_than_1f1b():
    # Forwards before the first backward: interleaved 2 * (pp - 1 - rank) + 1 (capped at M),
    # 1F1B pp - rank: the interleaved schedule holds more activations even at one stage per rank.
    def warmup(ops):
        return next(i for i, (k, _, _) in enumerate(ops) if k == "B")
    inter, plain = S.orders("Interleaved1F1B", 4, 8, 1), S.orders("1F1B", 4, 8)
    assert [warmup(o) for o in inter] == [7, 5, 3, 1]
    assert [warmup(o) for o in plain] == [4, 3, 2, 1]


def test_zero_bubble_splits_backward_and_shrinks_the_bubble():
    """torch's ScheduleInterleavedZeroBubble: each backward split into the input's gradient (I),
    which the previous stage waits for, and the weights' (W), which fills the bubble."""
    ops = S.orders("InterleavedZeroBubble", 2, 4, 2)
    kinds = {k for rank in ops for k, _, _ in rank}
    assert kinds == {"F", "I", "W"}
    for rank in ops:
        for k, s, m in rank:
            if k == "W":
                assert rank.index(("I", s, m)) < rank.index(("W", s, m))
    fwd, bwd = (1.0,) * 4, (2.0,) * 4
    zb = S.simulate("InterleavedZeroBubble", 2, 4, fwd, bwd, stages_per_rank=2)
    one = S.simulate("Interleaved1F1B", 2, 4, fwd, bwd, stages_per_rank=2)
    assert zb.busy == one.busy == (24.0, 24.0)
    assert zb.makespan < one.makespan


def test_block_costs_count_every_block_and_a_tied_head_on_both_ends():
    """Each block holds its own parameters (identical blocks traced once share their nodes' values,
    not their weights); a tied embedding and head counts on the first and the last stage; the final
    norm goes with the head."""
    import torch

    import autoshard
    from autoshard.planner.pipeline import block_costs
    from models import GPT
    torch.manual_seed(0)
    model = GPT(vocab=128, h=64, heads=4, blocks=4, seq=16, tied=True)
    idx = torch.zeros(4, 16, dtype=torch.long)
    pplan = autoshard.plan_pipeline(model, (idx, idx), pp=2, microbatches=2)
    names = [f"blocks.{i}" for i in range(4)]
    first, costs, last, params, first_bytes, last_bytes = block_costs(pplan.tensor_parallel, names)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert params == [block] * 4
    wte, wpe = model.wte.weight.numel() * 4, model.wpe.weight.numel() * 4
    norm = sum(p.numel() * 4 for p in model.ln_f.parameters())
    assert first_bytes == wte + wpe and last_bytes == wte + norm
    assert costs[0] == costs[3] and last > first > 0
