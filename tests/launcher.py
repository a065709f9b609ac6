"""A pool of gloo ranks, spawned once, that runs test cases on every rank.

API (fixtures `dist2` / `dist4` in conftest.py give a session-wide pool of 2 / 4 ranks):

    results = pool.run(fn, *args, timeout=60)

`fn` must be a picklable top-level function (defined at module level in a test file); it is
called as `fn(rank, world_size, *args)` on every rank, inside an initialised default process
group (gloo over tcp://127.0.0.1, 30 s collective timeout, one torch thread per rank), and
`run` returns the list of its return values in rank order (they must be picklable).  If any rank
raises, `run` raises `RankError` with the rank and its traceback text; after a failure or a
parent-side timeout the ranks are killed and a fresh pool is spawned on the next `run`.
After each case the autoshard group registry is reset (the default group stays).

Usage:

    def _case(rank, world_size, n):
        ...
        return value

    def test_something(dist2):
        assert dist2.run(_case, 3) == [...]
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

__all__ = ["RankPool", "RankError"]


_STARTED = "started"     # a worker's first message: (rank, _STARTED, None or the init traceback)
_START_TRIES = 3


class RankError(RuntimeError):
    """A case failed on a rank; the message holds the rank and the remote traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_autoshard() -> None:
    try:
        from autoshard.runtime import groups, rng
    except ImportError:
        return
    groups.forget()
    rng.reset()


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    """One rank: init the default group, then run tasks until told to stop (None)."""
    import torch
    import torch.distributed as dist

    import autoshard.distributed  # before the group exists (see its module comment)

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=30))
    except BaseException:  # noqa: BLE001 - the parent retries on another port
        results.put((rank, _STARTED, traceback.format_exc()))
        return
    results.put((rank, _STARTED, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            value = fn(rank, world_size, *args)
            pickle.dumps(value)      # an unpicklable result fails here, with its traceback, not in
            results.put((rank, True, value))     # the queue's feeder thread (a silent timeout)
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
        finally:
            _reset_autoshard()
    fn = args = None         # drop the last test's objects, then collect them before the teardown
    autoshard.distributed.destroy_process_group()


class RankPool:
    """`world_size` spawned ranks serving `run(fn, *args)` calls; started lazily."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = None

    def _start(self) -> None:
        """Spawn the ranks and wait until every one has joined the group; a failed join (a port
        taken between choosing it and binding it) kills the ranks and tries another port."""
        for _ in range(_START_TRIES):
            self._spawn()
            failed = self._await_start()
            if not failed:
                return
            self.close(kill=True)
        raise RankError(f"the {self.world_size} ranks could not form a gloo group in {_START_TRIES} tries:\n{failed}")

    def _await_start(self, timeout: float = 120.0) -> str:
        """'' once every rank has joined; else what went wrong."""
        for _ in range(self.world_size):
            try:
                rank, _, tb = self._results.get(timeout=timeout)
            except queue.Empty:
                return f"no rank joined within {timeout} s"
            if tb is not None:
                return f"--- rank {rank} ---\n{tb}"
        return ""

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, port, self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 60.0) -> list:
        """fn(rank, world_size, *args) on every rank; the results in rank order."""
        if self._procs is None:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, []
        deadline, answered = time.monotonic() + timeout, 0
        while answered < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0 if not errors else 2.0)
            except queue.Empty:
                if errors:
                    break
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
                if dead:                 # a rank that died (a crash in C++, os._exit) never answers
                    self.close(kill=True)
                    raise RankError(f"{fn.__name__}: rank(s) {sorted(dead)} exited with codes "
                                    f"{[dead[r] for r in sorted(dead)]} before answering")
                if time.monotonic() > deadline:
                    self.close(kill=True)
                    raise TimeoutError(f"{fn.__name__} did not finish on {self.world_size} ranks in {timeout} s")
                continue
            answered += 1
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            self.close(kill=True)
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors))
            raise RankError(f"{fn.__name__} failed on rank(s) {sorted(r for r, _ in errors)}:\n{text}")
        return out

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (politely, or at once with kill=True)."""
        if self._procs is None:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = None
