"""Shared-memory all-reduce and all-gather between the CPU ranks of one host (autoshard.runtime.shm):
off by default, an opt-in (AUTOSHARD_SHM=1, shm.enable) for CPU inference.

Default: a training step maps no segment (nothing under /dev/shm in /proc/self/maps) and equals
one process. Opted in, gloo ranks: `raw_all_reduce` (sum, max, min, product, bitwise) and
`gather_pieces` through the shared segment give gloo's own bits at 2 ranks for float32/64,
float16, bfloat16 and integer tensors, contiguous or not, from a scalar up to `LIMIT` bytes a rank
(larger ones, and the groups not opted in, take gloo: the segment's call count says which path
ran); at 4 ranks every rank gets the same bits, gloo's where the sum is exact. Many back-to-back
calls with ranks running ahead of each other (the two banks reused) give the sums computed
locally; the byte counters record the same events on either path; a tiny LLaMA trains with the
same bits through either path; a rank that does not opt in keeps the group on gloo; a rank that
does not arrive, and ranks that run different collectives, sizes or dtypes at one call, are a
ProcessGroupError; no file is left under /dev/shm. Hardening: a rank holding 1100 open files, a
FlopCounterMode on one rank only, a group destroyed and made again 200 times (no descriptor
grows), two threads on one group (one after the other): each exact, none hangs (the pool's
timeout and the group's fail the test instead).
"""
import contextlib
import copy
import os
import random
import time
from datetime import timedelta

import pytest
import torch

SIZES = [(), (5,), (3, 7), (48, 40)]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.uint8]


def _group(on: bool = True, **kw):
    """A new group over every rank, opted in (or not), its path decided by a first collective."""
    import torch.distributed as dist
    from autoshard.runtime.collectives import raw_all_reduce
    before = os.environ.get("AUTOSHARD_SHM")
    os.environ["AUTOSHARD_SHM"] = "1" if on else "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())), **kw)
        raw_all_reduce(torch.zeros(2), group)
    finally:
        if before is None:
            del os.environ["AUTOSHARD_SHM"]
        else:
            os.environ["AUTOSHARD_SHM"] = before
    return group


def _data(dtype, shape, rank, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + 17 * rank + len(shape))
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    high = 256 if dtype == torch.uint8 else 1 << 20
    return torch.randint(0, high, shape, generator=g, dtype=dtype)


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _inputs(rank):
    """(dtype, tensor) cases: every size and dtype, and non-contiguous views."""
    out = [(dt, _data(dt, s, rank)) for dt in FLOATS + INTS for s in SIZES]
    base = _data(torch.float32, (40, 64), rank)
    out += [(torch.float32, base.t()), (torch.float32, base[:, ::3]), (torch.bfloat16, base.to(torch.bfloat16).t())]
    return out


def _equal_to_gloo_case(rank, p):
    import torch.distributed as dist
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    group = _group()
    path = shm.segment_path(group)
    assert path is not None and not any(os.path.exists(f) for f in [path] + [f"{path}.{q}" for q in range(p)]), \
        path                                                     # mapped, its FIFOs open, the files unlinked already
    calls, mismatched = shm.served(group), []
    for dtype, x in _inputs(rank):
        ops = ["sum", "max", "min", "product"] + (["band", "bor", "bxor"] if not dtype.is_floating_point else [])
        for op in ops:
            want = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(want, op=getattr(dist.ReduceOp, op.upper()))     # gloo's own
            got = raw_all_reduce(x, group, reduce_op=op)
            calls += 1
            if not (got.is_contiguous() and got.data_ptr() != x.data_ptr() and torch.equal(_bits(got), _bits(want))):
                mismatched.append((op, dtype, tuple(x.shape)))
        mine = x.clone(memory_format=torch.contiguous_format)
        same = raw_all_reduce(mine, group, inplace=True)
        calls += 1
        want = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(want)
        if same is not mine or not torch.equal(_bits(mine), _bits(want)):
            mismatched.append(("inplace", dtype, tuple(x.shape)))
        for dim in range(x.dim()):
            pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(p)]
            dist.all_gather(pieces, x.contiguous())
            got = gather_pieces(x, dim, 1, group)
            calls += 1
            if not torch.equal(_bits(got), _bits(torch.cat(pieces, dim))):
                mismatched.append(("all_gather", dim, dtype, tuple(x.shape)))
    flags = torch.arange(11) % (rank + 2) == 0
    got = gather_pieces(flags, 0, 1, group)
    calls += 1
    if not torch.equal(got, torch.cat([torch.arange(11) % (r + 2) == 0 for r in range(p)])):
        mismatched.append(("all_gather", torch.bool))
    assert shm.served(group) == calls, (shm.served(group), calls)     # every one of them through shared memory
    return mismatched


def test_small_collectives_equal_gloo(dist2):
    assert dist2.run(_equal_to_gloo_case) == [[], []]


def _limit_case(rank, p):
    """At LIMIT bytes a rank: shared memory; 8 bytes more: gloo; both gloo's bits."""
    import torch.distributed as dist
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    group = _group()
    out = []
    for n in (shm.LIMIT // 4, shm.LIMIT // 4 + 2):
        x = _data(torch.float32, (n,), rank)
        before = shm.served(group)
        want = x.clone()
        dist.all_reduce(want)
        got = raw_all_reduce(x, group)
        gathered = gather_pieces(x.view(-1, 2), 1, 1, group)
        pieces = [torch.empty(n // 2, 2) for _ in range(p)]
        dist.all_gather(pieces, x.view(-1, 2))
        out.append((shm.served(group) - before, torch.equal(got, want), torch.equal(gathered, torch.cat(pieces, 1))))
    return out


def test_limit(dist2):
    for at, above in dist2.run(_limit_case):
        assert at == (2, True, True)           # both calls of LIMIT bytes a rank through shared memory
        assert above == (0, True, True)        # 8 bytes more: gloo


def _four_ranks_case(rank, p):
    import torch.distributed as dist
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import raw_all_reduce
    group = _group()
    x = _data(torch.float32, (257,), rank)
    exact = torch.round(x * 64)                 # sums of these are exact in any order
    out = {}
    for name, t in (("float", x), ("exact", exact), ("int", _data(torch.int64, (33,), rank))):
        want = t.clone()
        dist.all_reduce(want)
        got = raw_all_reduce(t, group)
        out[name] = (got.tolist(), torch.equal(got, want), (got - want).abs().max().item())
    out["served"] = shm.served(group)
    return out


def test_four_ranks_agree(dist4):
    results = dist4.run(_four_ranks_case)
    for r in results:
        assert r["float"][0] == results[0]["float"][0]           # every rank the same bits
        assert r["float"][2] < 1e-5                               # gloo's ring may round in another order
        assert r["exact"][1] and r["int"][1]
        assert r["served"] == 4


def _inference_mode_case(rank, p):
    """A group set up, and a shape first seen, under torch.inference_mode, then used outside it
    (and the other way round), each twice (both banks): the slots stay writable in both."""
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    x, y = torch.full((5,), 1.0 + rank), torch.full((3,), 1.0 + rank)
    with torch.inference_mode():
        group = _group()
        sums = [raw_all_reduce(x, group) for _ in range(2)]
    sums += [raw_all_reduce(x, group) for _ in range(2)]
    gathered = [gather_pieces(y, 0, 1, group) for _ in range(2)]
    with torch.inference_mode():
        gathered += [gather_pieces(y, 0, 1, group) for _ in range(2)]
    return [t.tolist() for t in sums], [t.tolist() for t in gathered], shm.served(group)


def test_inside_and_outside_inference_mode(dist2):
    for sums, gathered, served in dist2.run(_inference_mode_case):
        assert sums == [[3.0] * 5] * 4 and gathered == [[1.0] * 3 + [2.0] * 3] * 4 and served == 9


def _many_case(rank, p, calls):
    """Back to back, ranks running ahead of each other by turns: each result equals the sum (or
    the rank-ordered pieces) of every rank's input, computed locally; a gloo-sized call between."""
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    group = _group()
    start = shm.served(group)
    pause, wrong, fast = random.Random(rank), [], 0
    for i in range(calls):
        n = (1, 7, 1024, 4096)[i % 4]
        xs = [_data(torch.float32, (n,), r, seed=i) for r in range(p)]
        if pause.random() < 0.05:
            time.sleep(0.002)
        if i % 3 == 2:
            got, want = gather_pieces(xs[rank], 0, 1, group), torch.cat(xs)
        else:
            got, want = raw_all_reduce(xs[rank], group), xs[0] + xs[1]
            for x in xs[2:]:
                want = want + x
        fast += 1
        if not torch.equal(got, want):
            wrong.append(i)
        if i % 50 == 49:
            big = _data(torch.float32, (shm.LIMIT // 4 + 8,), rank, seed=i)
            raw_all_reduce(big, group)
    return wrong, shm.served(group) - start, fast


def test_many_calls_reuse_the_slots(dist2):
    for wrong, served, fast in dist2.run(_many_case, 600):
        assert wrong == [] and served == fast


def _counted_case(rank, p):
    """The same collectives counted on a shared-memory group and an opted-out one."""
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import all_gather, copy_to, count_comm, gather_from, reduce_from
    out = {}
    for on in (True, False):
        group = _group(on)
        before = shm.served(group)
        x = _data(torch.float32, (4, 6), rank).requires_grad_(True)
        with count_comm() as c:
            y = reduce_from(copy_to(x, group), group)
            z = gather_from(y, 1, group=group)
            w = all_gather(z[:, :3], 0, group=group)
            (w.sum() + z.square().sum()).backward()
        out[on] = ([(e.op, e.kind, e.direction, e.bytes) for e in c.events], shm.served(group) - before,
                   _bits(w).tolist(), _bits(x.grad).tolist())
    return out


def test_counters_record_the_same(dist2):
    for r in dist2.run(_counted_case):
        events, served, values, grads = r[True]
        assert events and served == len(events) - 1     # all of them but the reduce-scatter (a functional one)
        assert r[False][0] == events and r[False][1] == 0
        assert r[False][2] == values and r[False][3] == grads


def _opt_out_case(rank, p, ranks_opting_out):
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import raw_all_reduce
    group = _group(on=rank not in ranks_opting_out)
    x = _data(torch.float32, (9,), rank)
    got = raw_all_reduce(x, group)
    return shm.served(group), shm.segment_path(group), got.tolist()


@pytest.mark.parametrize("opting_out", [(0, 1), (1,)])
def test_opt_out(opting_out, dist2):
    results = dist2.run(_opt_out_case, opting_out)
    for served, path, got in results:
        assert served == 0 and path is None and got == results[0][2]


def _late_case(rank, p):
    """Rank 1 skips a collective: rank 0 raises after the group's timeout, naming rank 1."""
    import torch.distributed as dist
    from autoshard.errors import ProcessGroupError
    from autoshard.runtime.collectives import raw_all_reduce
    group = _group(timeout=timedelta(seconds=1))
    if rank == 1:
        return None
    t0 = time.monotonic()
    with pytest.raises(ProcessGroupError) as e:
        raw_all_reduce(torch.ones(3), group)
    return str(e.value), time.monotonic() - t0, dist.get_world_size()


def test_a_rank_that_does_not_arrive(dist2):
    message, waited, _ = dist2.run(_late_case)[0]
    assert "all_reduce(sum)" in message and "rank(s) [1]" in message and "1 s" in message, message
    assert 1 <= waited < 10


def _mismatch_case(rank, p):
    """The ranks run different sizes at one call: each raises, naming the ranks' calls."""
    from autoshard.errors import ProcessGroupError
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    group = _group()
    with pytest.raises(ProcessGroupError) as e:
        raw_all_reduce(torch.ones(3 + rank), group)
    group = _group()
    with pytest.raises(ProcessGroupError) as f:       # an all-gather against an all-reduce of as many bytes
        raw_all_reduce(torch.ones(4), group) if rank else gather_pieces(torch.ones(4), 0, 1, group)
    group = _group()
    with pytest.raises(ProcessGroupError) as g:       # as many bytes in another dtype
        raw_all_reduce(torch.ones(4, dtype=torch.int32 if rank else torch.float32), group)
    return str(e.value), str(f.value), str(g.value)


def test_ranks_that_disagree(dist2):
    for sizes, kinds, dtypes in dist2.run(_mismatch_case):
        assert "different collectives at call 2" in sizes, sizes
        assert "0: (12, 'float32', 'all_reduce(sum)'), 1: (16, 'float32', 'all_reduce(sum)')" in sizes, sizes
        assert "0: (16, 'float32', 'all_gather'), 1: (16, 'float32', 'all_reduce(sum)')" in kinds, kinds
        assert "0: (16, 'float32', 'all_reduce(sum)'), 1: (16, 'int32', 'all_reduce(sum)')" in dtypes, dtypes


def _model_case(rank, p):
    """A tiny LLaMA's loss and every gradient: the same bits through shared memory and gloo,
    and one process's values."""
    import autoshard
    import hf_models
    from autoshard.runtime import shm
    model, kw = hf_models.llama(num_hidden_layers=2)
    ref = copy.deepcopy(model)
    out = {}
    for on in (True, False):
        group = _group(on)
        before = shm.served(group)
        gm = autoshard.parallelize(copy.deepcopy(model), p, kw, group=group, tracer="export")
        loss = gm(**kw).loss
        loss.backward()
        grads = {k: _bits(v.grad).tolist() for k, v in gm.named_parameters()}
        out[on] = (loss.item(), grads, shm.served(group) - before)
    ref(**kw).loss.backward()
    return out, ref(**kw).loss.item()


def test_a_model_trains_alike_on_either_path(dist2):
    for out, want in dist2.run(_model_case, timeout=300):
        assert out[True][0] == out[False][0] == pytest.approx(want, rel=1e-5)
        assert out[True][1] == out[False][1]
        assert out[True][2] > 0 and out[False][2] == 0


def _compiled_case(rank, p):
    """A compiled function's all-reduce and all-gather: shared memory's ops under no_grad (the
    segment counts both calls); PyTorch's functional collectives where the raw collective's input
    requires grad (the custom ops have no derivative; it counts none); the same values as eager
    either way."""
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    group = _group()

    def step(x):
        return gather_pieces(raw_all_reduce(x * 2, group) + 1, 1, p, group)

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    x = _data(torch.float32, (3, 8), rank)
    want = step(x)
    out = {}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            before = shm.served(group)
            got = compiled(x.requires_grad_(grad))
            out[grad] = (shm.served(group) - before, torch.equal(got.detach(), want))
    return out


def test_a_compiled_inference_step_uses_the_segment(dist2):
    for out in dist2.run(_compiled_case, timeout=300):
        assert out[False] == (2, True)         # both collectives through shared memory
        assert out[True] == (0, True)          # a raw collective of a tensor that requires grad: functional


def _compiled_training_case(rank, p, reorder):
    """A compiled training step through the autograd collectives (Megatron's reduce_from, then
    gather_from, and copy_to's backward all-reduce): its collectives go through the segment, or,
    where inductor is asked to reorder collectives for overlap, PyTorch's functional ones; the
    output and the input's gradient equal eager's."""
    import torch._inductor.config as inductor_config
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import copy_to, gather_from, reduce_from
    group = _group()

    def step(x):
        y = reduce_from(copy_to(x, group) * 3, group)
        return gather_from(torch.tanh(y), 1, group=group)

    x = _data(torch.float32, (4, 8), rank)
    a = x.clone().requires_grad_()
    want = step(a)
    want.sum().backward()
    torch._dynamo.reset()
    with inductor_config.patch(reorder_for_compute_comm_overlap=reorder):
        compiled = torch.compile(step, fullgraph=True, backend="inductor")
        b = x.clone().requires_grad_()
        before = shm.served(group)
        got = compiled(b)
        got.sum().backward()
        served = shm.served(group) - before
    return served, torch.equal(got.detach(), want.detach()), torch.allclose(b.grad, a.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reorder", [False, True])
def test_a_compiled_training_step(reorder, dist2):
    for served, same, grads in dist2.run(_compiled_training_case, reorder, timeout=300):
        assert same and grads
        # forward all-reduce and all-gather, backward all-reduce (copy_to's): through the segment
        # unless inductor may reorder collectives
        assert served == (0 if reorder else 3), served


def _maps():
    """The files under /dev/shm this process maps (an unlinked segment shows "... (deleted)"),
    but POSIX semaphores (glibc's sem.*: multiprocessing's locks, the test pool's queues' and one
    torch's export makes; a sem_t each, no data)."""
    with open("/proc/self/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return sorted(q for q in paths if q.startswith("/dev/shm/") and not q.startswith("/dev/shm/sem."))


def _default_case(rank, p):
    """No opt-in: a tiny LLaMA's training step maps no segment and equals one process (loss,
    logits, every gradient)."""
    import torch.distributed as dist
    import autoshard
    import hf_models
    import refs
    from autoshard.runtime import shm
    assert os.environ.get("AUTOSHARD_SHM", "0") == "0"
    model, kw = hf_models.llama(num_hidden_layers=2)
    ref = copy.deepcopy(model)
    before = _maps()
    group = dist.new_group(list(range(p)))
    gm = autoshard.parallelize(model, p, kw, group=group, tracer="export")
    refs.hf_step_matches(gm, ref, kw, "llama, default transport")
    return before, _maps(), shm.served(group), shm.segment_path(group)


def test_default_maps_no_segment(dist2):
    for before, after, served, path in dist2.run(_default_case, timeout=300):
        assert before == [] and after == [], (before, after)
        assert served == 0 and path is None


def _many_files_case(rank, p):
    """1100 descriptors held before the group's setup: its FIFOs' numbers pass 1024 (select's
    limit); sleeps make the ranks wait in poll; every sum exact."""
    import resource
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import raw_all_reduce
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        group = _group(timeout=timedelta(seconds=20))
        top = max(os.listdir("/proc/self/fd"), key=int)
        wrong = []
        for i in range(40):
            if i % 4 == rank:
                time.sleep(0.01)                 # the other rank sleeps in poll meanwhile
            got = raw_all_reduce(torch.full((64,), float(rank + i)), group)
            if not torch.equal(got, torch.full((64,), float(2 * i + 1))):
                wrong.append(i)
        return int(top), wrong, shm.served(group)
    finally:
        for fd in held:
            os.close(fd)


def test_a_rank_holding_1100_files(dist2):
    for top, wrong, served in dist2.run(_many_files_case, timeout=120):
        assert top > 1024 and wrong == [] and served == 41


def _flop_counter_case(rank, p):
    """Rank 0 trains under FlopCounterMode, rank 1 without: the path is the group's, decided at
    setup, so both take the segment (before, rank 0 took gloo's and the step hung); loss, logits
    and every gradient equal one process's."""
    import autoshard
    import hf_models
    import refs
    from torch.utils.flop_counter import FlopCounterMode
    from autoshard.runtime import shm
    model, kw = hf_models.llama(num_hidden_layers=1)
    ref = copy.deepcopy(model)
    group = _group(timeout=timedelta(seconds=20))
    gm = autoshard.parallelize(model, p, kw, group=group, tracer="export")
    before = shm.served(group)
    with FlopCounterMode(display=False) if rank == 0 else contextlib.nullcontext():
        refs.hf_step_matches(gm, ref, kw, "llama, FlopCounterMode on rank 0")
    return shm.served(group) - before


def test_a_dispatch_mode_on_one_rank(dist2):
    served = dist2.run(_flop_counter_case, timeout=300)
    assert served[0] == served[1] > 0, served


def _made_again_case(rank, p, times):
    """A group opted in, used and destroyed, `times` over: no descriptor and no mapping grows."""
    import gc
    import torch.distributed as dist
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import raw_all_reduce
    counts, wrong = [], 0
    for i in range(times):
        group = _group(timeout=timedelta(seconds=20))
        got = raw_all_reduce(torch.full((8,), float(rank + i)), group)
        wrong += not torch.equal(got, torch.full((8,), float(2 * i + 1))) or shm.served(group) != 2
        dist.destroy_process_group(group)
        del group
        if i in (9, times - 1):
            gc.collect()
            counts.append((len(os.listdir("/proc/self/fd")), len(_maps())))
    return counts, wrong


def test_a_group_made_again_200_times(dist2):
    for (first, last), wrong in dist2.run(_made_again_case, 200, timeout=240):
        assert wrong == 0 and last[0] <= first[0] and last[1] <= first[1] <= 1, (first, last)


def _threads_case(rank, p):
    """Two threads of each rank run all-reduces on one opted-in group at once: the lock serves
    them one after the other (same shapes and values, so any pairing across ranks is exact)."""
    import threading
    from autoshard.runtime import shm
    from autoshard.runtime.collectives import raw_all_reduce
    group = _group(timeout=timedelta(seconds=20))
    results, errors = {0: [], 1: []}, []

    def work(t):
        try:
            for _ in range(150):
                results[t].append(torch.equal(raw_all_reduce(torch.full((32,), rank + 1.0), group),
                                              torch.full((32,), 3.0)))
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [t.is_alive() for t in threads], errors, results[0] + results[1], shm.served(group)


def test_two_threads_on_one_group(dist2):
    for alive, errors, exact, served in dist2.run(_threads_case, timeout=120):
        assert alive == [False, False] and errors == [] and exact == [True] * 300 and served == 301
