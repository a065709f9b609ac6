"""Shared-memory all-reduce and all-gather of small CPU tensors among the ranks of one host: an
opt-in for CPU inference (`AUTOSHARD_SHM=1`, or `init_process_group(..., shm=True)`).

By default every collective takes c10d's path (gloo, NCCL), eager and compiled. A decode step
runs about ten collectives of a few KiB each; on gloo over loopback each waits about 1.5 ms
(2 processes on 2 cores), as long as the matrix products a rank saves. Opted in, the ranks of a
gloo group exchange such tensors through one shared segment instead: each rank copies its tensor
into its slot, publishes a sequence counter, waits until every rank's counter has reached the
same value, and reduces (or concatenates) all slots in rank order, so every rank computes the
same bits (at 2 ranks gloo's bits for a sum; at more ranks the order may round differently from
gloo's ring, alike on every rank; max and min propagate NaN as torch.maximum does).
`collectives.raw_all_reduce` and the all-gathers of `collectives.gather_pieces` call it, in eager
mode and through their custom ops in a compiled graph (which run c10d's collective where the group
has no segment), for plain CPU tensors of at most `LIMIT` bytes a rank; larger tensors
and other backends keep c10d's path. Autoshard's byte counters record the same collectives and
bytes either way; CommDebugMode, which counts c10d's ops, does not see the segment's.

Limits: the ranks of one host only, x86-64 only (its stores become visible in program order: a
rank writes its data before its counter and reads the counters before the data, with no fence
Python could issue), 2 x p MiB of /dev/shm a group, every rank must set the switch alike.

The path is decided once a group, at its first collective that fits (a collective over gloo that
every rank reaches at the same call), and agreed by every rank: rank 0 creates a file under
/dev/shm (allocated in full, posix_fallocate: a full /dev/shm falls back to gloo, logged) and a
FIFO a rank beside it; the ranks gather their host names, whether they opt in, the file's name and
a random token; each maps the file, opens the FIFOs and checks the token; a gloo all-reduce then
agrees whether every rank did, after which rank 0 unlinks the files. Every later collective of
the group that fits takes the path so decided, whatever dispatch mode, tracer or counter is
active on one rank. The turn-on is logged once a group (logger "autoshard.runtime.shm", INFO),
a fallback where asked for (WARNING, with its reason).

Layout: a 64-byte line holding the token, one line a rank holding its counter and, per bank,
what it wrote there (int64s: bytes, dtype and collective, checked alike on every rank: ranks that
run different collectives, sizes or dtypes at one call raise ProcessGroupError rather than read
garbage), then two banks of p slots of `LIMIT` bytes. Call n uses bank n % 2: a rank that starts
call n has seen every rank publish n - 1, so every rank has finished reading bank n % 2 of call
n - 2, and one wait a call suffices. One thread at a time runs a group's call (a lock a
segment: threads are served one after the other, matched across ranks in the order each rank
issues them, as c10d matches them).

Waiting spins on the counters (tens of microseconds), then sleeps in `poll` on the rank's own
FIFO (any descriptor number), having first marked in its line the call it sleeps in; a rank that
publishes its counter writes a byte to the FIFO of every rank asleep in that call, so the kernel
wakes the sleeper at once. (Spinning longer lost to gloo on a loaded machine: the late rank needs
the core; docs/benchmarks.md section 13.) A lost wake-up (a store reordered after a later load)
is bounded by the sleep's 2 ms limit. A rank that has exited (looked up in /proc every 25 sleeps)
makes the wait raise ProcessGroupError at once, naming it; past the process group's timeout
(300 s where it cannot be read) the wait raises ProcessGroupError naming the late ranks.

A segment's map and descriptors are closed when its process group is freed or destroyed (looked
for at each setup) and by `release_all()` (runtime.groups.forget and destroy_process_group).
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import select
import socket
import tempfile
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..errors import ProcessGroupError

__all__ = ["LIMIT", "enable", "all_reduce", "all_gather", "served", "segment_path", "release_all"]

LIMIT = 1 << 20                 # bytes of one rank's tensor; larger ones take gloo
DIRECTORY = "/dev/shm"
TIMEOUT_S = 300.0               # where the process group's own timeout cannot be read
_LINE = 64                      # bytes: the token, then each rank's counter, on lines of their own
_SPIN = 500                     # counter reads before sleeping on the pipe (tens of us)
_BLOCK_S = 0.002                # the longest sleep before the counters are read again
_LOOK = 25                      # sleeps between looks at whether the late ranks still run (about 50 ms)
_ASLEEP = 3                     # a rank's line: counter, what it wrote in bank 0 and 1, the call it sleeps in

_REDUCE = {"sum": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum,
           "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
_CODES = tuple(_REDUCE)                          # 1 + index: the collective a slot holds (0: all-gather)
_INTS = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
_NUMBERS = _INTS | {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_BYTES = _NUMBERS | {torch.bool, torch.complex64, torch.complex128}
_DTYPES = {dt: i for i, dt in enumerate(sorted(_BYTES, key=str))}       # a dtype's number in a slot's record
_PLAIN = (torch.Tensor, torch.nn.Parameter)     # not FakeTensor, DTensor or other subclasses

_SEGMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # ProcessGroup -> _Segment, or None: off
_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # ProcessGroup -> setups begun (store keys)
_OPTED: weakref.WeakSet = weakref.WeakSet()     # groups opted in by `enable` (besides AUTOSHARD_SHM=1)
_SETUP = threading.Lock()                       # held while a group's setup lock is looked up
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # ProcessGroup -> held while its path is decided
_LOG = logging.getLogger(__name__)


class _Segment:
    """One process group's mapped segment: the counters (a memoryview of int64) and the slots
    (a [2, p, LIMIT] uint8 tensor over the same memory)."""

    def __init__(self, path: str, pg):
        self.p, self.rank = pg.size(), dist.get_rank(pg)
        self.ranks, self.name = dist.get_process_group_ranks(pg), pg.group_name
        self.timeout_s = _timeout_s(pg)
        header = _LINE * (1 + self.p)
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, header + 2 * self.p * LIMIT)
        finally:
            os.close(fd)
        self.pipes = []                 # rank q's FIFO, open to read and write (a rank sleeps on its own)
        try:
            for q in range(self.p):
                self.pipes.append(os.open(f"{path}.{q}", os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            for fd in self.pipes:
                os.close(fd)
            self.map.close()
            raise
        self.path = path
        self._view = memoryview(self.map)
        self.words = self._view[:header].cast("q")
        self.lines = [(1 + q) * (_LINE // 8) for q in range(self.p)]       # word index of rank q's counter
        with torch.inference_mode(False):       # written in place later, inside inference mode or not
            self.banks = torch.frombuffer(self.map, dtype=torch.uint8, offset=header,
                                          count=2 * self.p * LIMIT).view(2, self.p, LIMIT)
        self.seq = 0                    # calls made through this segment
        self.lock = threading.Lock()    # one thread's call at a time (its slots, counter and reads)
        self.poller = select.poll()     # poll, not select: a descriptor past 1024 is fine
        self.poller.register(self.pipes[self.rank], select.POLLIN)
        self.pids = None                # each rank's process id, where this rank can see them (setup)
        self.slots: dict = {}           # (bank, dtype, shape) -> [p, *shape] view of that bank's slots

    def exchange(self, x: torch.Tensor, what: str, code: int) -> torch.Tensor:
        """Every rank's `x`, as a [p, *x.shape] view of the current bank, once all have written
        (`code` names the collective: every rank must run the same one on as many bytes)."""
        seq = self.seq + 1
        bank = seq & 1
        key = (bank, x.dtype, tuple(x.shape))
        slots = self.slots.get(key)
        if slots is None:
            if len(self.slots) > 256:
                self.slots.clear()
            with torch.inference_mode(False):   # a view made in inference mode is not written outside it
                slots = self.banks[bank, :, :x.nbytes].view(x.dtype).view((self.p,) + key[2])
            self.slots[key] = slots
        words, line, call = self.words, self.lines[self.rank], (x.nbytes * 16 + _DTYPES[x.dtype]) * 16 + code
        slots[self.rank].copy_(x)                       # the data and what it is first,
        words[line + 1 + bank] = call
        self.seq = seq
        words[line] = seq                               # then the counter (x86-64 keeps this order)
        for q, ln in enumerate(self.lines):             # and wake the ranks asleep in this call
            if words[ln + _ASLEEP] == seq and q != self.rank:
                try:
                    os.write(self.pipes[q], b"\0")
                except BlockingIOError:                 # its pipe is full: it is awake anyway
                    pass
        self.wait(seq, what, x)
        if any(words[ln + 1 + bank] != call for ln in self.lines):
            names = {i: str(dt).removeprefix("torch.") for dt, i in _DTYPES.items()}
            kinds = ("all_gather",) + tuple(f"all_reduce({op})" for op in _CODES)
            theirs = {r: (w // 256, names[w // 16 % 16], kinds[w % 16])
                      for r, w in ((r, words[ln + 1 + bank]) for r, ln in zip(self.ranks, self.lines))}
            raise ProcessGroupError(
                f"shared-memory {what} of a {tuple(x.shape)} {x.dtype} tensor on process group {self.name!r}: "
                f"the ranks ran different collectives at call {seq} ((bytes, dtype, collective) by rank: {theirs}); "
                "every rank must run the same collectives on tensors of the same size and dtype in the same order")
        return slots

    def wait(self, seq: int, what: str, x) -> None:
        """Until every rank's counter reaches `seq`: spin, then sleep on this rank's pipe."""
        words, spins, naps, deadline, pipe = self.words, 0, 0, None, self.pipes[self.rank]
        for line in self.lines:
            while words[line] < seq:
                spins += 1
                if spins <= _SPIN:
                    continue
                deadline = deadline or time.monotonic() + self.timeout_s
                words[self.lines[self.rank] + _ASLEEP] = seq            # say so, then look again
                if words[line] >= seq:
                    continue
                left = deadline - time.monotonic()
                naps += 1
                if naps % _LOOK == 0 and self.pids is not None:
                    self._check_alive(seq, what, x)
                if left > 0:
                    self.poller.poll(max(1, int(1000 * min(_BLOCK_S, left))))
                    try:
                        os.read(pipe, 4096)                             # the wake-ups, this call's and stale ones
                    except BlockingIOError:
                        pass
                else:
                    late = [r for r, ln in zip(self.ranks, self.lines) if words[ln] < seq]
                    raise ProcessGroupError(
                        f"shared-memory {what} of a {tuple(x.shape)} {x.dtype} tensor on process group "
                        f"{self.name!r} (ranks {self.ranks}): rank(s) {late} did not reach call {seq} within "
                        f"{self.timeout_s:.0f} s (the ranks must run the same collectives in the same order; "
                        "without AUTOSHARD_SHM=1 they go through gloo)")

    def _check_alive(self, seq: int, what: str, x) -> None:
        """Raise if a rank that has not reached call `seq` has exited (gloo sees its socket close)."""
        gone = [(r, pid) for r, ln, pid in zip(self.ranks, self.lines, self.pids)
                if self.words[ln] < seq and not _alive(pid)]
        if gone:
            raise ProcessGroupError(
                f"shared-memory {what} of a {tuple(x.shape)} {x.dtype} tensor on process group {self.name!r} "
                f"(ranks {self.ranks}): rank(s) {[r for r, _ in gone]} (pid {[q for _, q in gone]}) exited before "
                f"reaching call {seq}")

    def close(self) -> None:
        """Close the FIFOs and unmap (the memory goes once every rank has unmapped it; the file
        is already unlinked); a second call does nothing."""
        if self.banks is None:
            return
        self.slots.clear()
        self.banks = None
        for fd in self.pipes:
            os.close(fd)
        self.pipes = []
        self.poller = None
        self.words.release()
        self._view.release()
        try:
            self.map.close()
        except BufferError:     # a view of the slots is still alive somewhere: unmapped when it dies
            pass


def _timeout_s(pg) -> float:
    """The process group's collective timeout in seconds (gloo's own option), else TIMEOUT_S."""
    try:
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return TIMEOUT_S


def enable(group) -> None:
    """Opt `group` in (as AUTOSHARD_SHM=1 does every gloo group): every rank must call it, before
    the group's first collective (its path is decided there, once)."""
    _OPTED.add(group)


def _asked(pg) -> bool:
    """Whether this rank opts `pg` in: AUTOSHARD_SHM=1 or `enable`."""
    return os.environ.get("AUTOSHARD_SHM", "0").strip() == "1" or pg in _OPTED


def _unable() -> str | None:
    """Why this rank cannot take the fast path (None where it can): x86-64 with a /dev/shm."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the machine is {platform.machine()}, not x86-64"
    return None if os.path.isdir(DIRECTORY) else f"there is no {DIRECTORY}"


def _create(pg) -> tuple:
    """Rank 0: (segment, path, token) of a new file under DIRECTORY, or (None, why, None)."""
    try:
        fd, path = tempfile.mkstemp(prefix="autoshard-shm-", dir=DIRECTORY)
    except OSError as e:
        return None, f"{DIRECTORY}: {e}", None
    try:
        os.posix_fallocate(fd, 0, _LINE * (1 + pg.size()) + 2 * pg.size() * LIMIT)
        for q in range(pg.size()):
            os.mkfifo(f"{path}.{q}", 0o600)
        seg = _Segment(path, pg)
    except (OSError, ValueError) as e:
        _unlink(path, pg.size())
        return None, f"reserving {2 * pg.size() * LIMIT >> 20} MiB under {DIRECTORY}: {e}", None
    finally:
        os.close(fd)
    token = secrets.randbits(62)
    seg.words[0] = token
    return seg, path, token


def _unlink(path: str, p: int) -> None:
    """Remove the segment's file and its ranks' FIFOs (those that exist)."""
    for name in [path] + [f"{path}.{q}" for q in range(p)]:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def _setup(pg):
    """This rank's segment of `pg`, or None where the fast path is off (see the module docstring);
    a collective over gloo that every rank of `pg` runs at the same call, where this rank opts in."""
    if "gloo" not in str(dist.get_backend(pg)) or pg.size() < 2:
        return None
    rank, asks = dist.get_rank(pg), _asks(pg)
    if not all(asks):
        if rank == 0 and any(asks):
            _LOG.warning("autoshard: shared-memory collectives on process group %r asked for by rank(s) %s only; "
                         "gloo's path kept (every rank must set AUTOSHARD_SHM=1 or call shm.enable alike)",
                         pg.group_name, [r for r, a in enumerate(asks) if a])
        return None
    _sweep()
    why = _unable()
    seg = path = token = None
    if rank == 0 and why is None:
        seg, path, token = _create(pg)
        if seg is None:
            why, path = path, None
    try:
        info = [None] * pg.size()
        dist.all_gather_object(info, (socket.gethostname(), why, path, token, os.getpid()), group=pg)
        host, _, path, token, _ = info[0]
        why = next((f"rank {r}: {w}" for r, (_, w, _, _, _) in enumerate(info) if w is not None), None)
        why = why or next((f"rank {r} runs on {h}, rank 0 on {host}" for r, (h, *_) in enumerate(info) if h != host),
                          None)
        if why is None and rank != 0:
            try:
                seg = _Segment(path, pg)
            except (OSError, ValueError) as e:        # another /dev/shm (a container of the same name)
                seg, why = None, f"rank {rank} cannot map {path}: {e}"
            if seg is not None and seg.words[0] != token:
                seg.close()
                seg, why = None, f"rank {rank} mapped another {path} (another {DIRECTORY})"
        flag = torch.tensor([int(why is None and seg is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
    finally:
        if rank == 0 and path is not None:
            _unlink(path, pg.size())             # every rank has mapped it or given up
    if not flag.item() and seg is not None:
        seg.close()
        seg = None
    if seg is None:
        if rank == 0:
            _LOG.warning("autoshard: shared-memory collectives asked for on process group %r but off, gloo's "
                         "path kept: %s", pg.group_name, why or "another rank could not map the segment")
        return None
    pids = [i[4] for i in info]
    seg.pids = pids if all(_alive(q) for q in pids) else None     # another PID namespace: the timeout only
    weakref.finalize(pg, seg.close)
    if rank == 0:
        _LOG.info("autoshard: shared-memory collectives on for process group %r (%d ranks, %d MiB of %s; "
                  "tensors of at most %d bytes a rank)", pg.group_name, pg.size(), 2 * pg.size() * LIMIT >> 20,
                  DIRECTORY, LIMIT)
    return seg


def _asks(pg) -> list:
    """Whether each rank of `pg` opts it in, exchanged through the group's store (no collective,
    so a default run's collectives are c10d's alone); keyed by this group's setup count."""
    n = _ROUNDS[pg] = _ROUNDS.get(pg, 0) + 1
    try:
        store, rank = c10d._get_process_group_store(pg), dist.get_rank(pg)
    except (KeyError, AttributeError, RuntimeError):     # a group c10d does not hold: alike on every rank
        return [False] * pg.size()
    store.set(f"autoshard_shm/{n}/{rank}", "1" if _asked(pg) else "0")
    return [store.get(f"autoshard_shm/{n}/{q}") == b"1" for q in range(pg.size())]


def _sweep() -> None:
    """Close the segments of groups that torch.distributed no longer holds (destroyed)."""
    held = getattr(c10d, "_world", None)
    held = getattr(held, "pg_map", None)
    if held is None:
        return
    for pg, seg in list(_SEGMENTS.items()):
        if seg is not None and pg not in held:
            seg.close()
            _SEGMENTS[pg] = None


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X", b"x")


def _segment(x, group, nbytes: int, dtypes):
    """The segment to run a collective of `x` on, or None for c10d's path: the same answer on
    every rank (the group's path, decided and agreed at its setup, and the tensor's size, dtype
    and kind decide; not the rank's dispatch modes)."""
    if not 0 < nbytes <= LIMIT or x.dtype not in dtypes or type(x) not in _PLAIN or x.device.type != "cpu":
        return None
    try:
        return _SEGMENTS[group]
    except KeyError:
        pass
    except TypeError:                            # not a ProcessGroup (no weak reference)
        return None
    with _SETUP:
        lock = _LOCKS.setdefault(group, threading.Lock())
    with lock:
        if group not in _SEGMENTS:
            _SEGMENTS[group] = _setup(group)
    return _SEGMENTS[group]


def all_reduce(x: torch.Tensor, group, reduce_op: str = "sum", inplace: bool = False):
    """`reduce_op` ("sum", "product", "max", "min", "band", "bor", "bxor") of `x` over `group`, the
    slots combined in rank order, in a new contiguous tensor (in `x` with `inplace`, which needs
    `x` contiguous); None where the fast path does not apply (the caller runs c10d's)."""
    fn = _REDUCE.get(reduce_op)
    dtypes = _INTS if reduce_op in ("band", "bor", "bxor") else _NUMBERS
    seg = None if fn is None else _segment(x, group, x.nbytes, dtypes)
    if seg is None:
        return None
    with torch.no_grad(), seg.lock:
        slots = seg.exchange(x, f"all_reduce({reduce_op})", 1 + _CODES.index(reduce_op))
        out = x if inplace else torch.empty(x.shape, dtype=x.dtype)
        fn(slots[0], slots[1], out=out)
        for q in range(2, seg.p):
            fn(out, slots[q], out=out)
    return out


def all_gather(x: torch.Tensor, group):
    """[p, *x.shape]: every rank's `x` in rank order, in a new tensor; None where the fast path
    does not apply."""
    seg = _segment(x, group, x.nbytes, _BYTES)
    if seg is None:
        return None
    with torch.no_grad(), seg.lock:
        return seg.exchange(x, "all_gather", 0).clone(memory_format=torch.contiguous_format)


def served(group) -> int:
    """Collectives `group` has run through shared memory since its setup (0 where it has none)."""
    seg = _SEGMENTS.get(group)
    return 0 if seg is None else seg.seq


def segment_path(group) -> str | None:
    """The (unlinked) file `group`'s segment was made from, None where it has none."""
    seg = _SEGMENTS.get(group)
    return None if seg is None else seg.path


def release_all() -> None:
    """Unmap every group's segment; a group's next collective sets it up again."""
    for seg in list(_SEGMENTS.values()):
        if seg is not None:
            seg.close()
    _SEGMENTS.clear()
