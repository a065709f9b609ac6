"""Shared benchmark machinery: a multi-process launcher, interleaved timing, per-rank memory,
a collective counter built on CommDebugMode, and JSON / PNG / table output.

Conventions every benchmark follows (and prints in its JSON):

- Ranks are processes started with the ``spawn`` method, one per rank, each with
  ``torch.set_num_threads(1)`` and a gloo process group on ``tcp://127.0.0.1:<free port>``.
- A *step* is forward + loss + backward (+ the optimizer step when one is given), then
  ``zero_grad(set_to_none=True)``.
- Timing: warm-up steps for every variant, then rounds in which each variant runs one step
  in turn (the order rotates by one each round so no variant always goes first), until a
  round cap or a time budget is reached. Every timed step is preceded by
  ``dist.barrier()``; a step's time is the *maximum over ranks* of the wall time from
  leaving the barrier to finishing the step. Reported: the median (and quartiles) over
  rounds.
- Memory: ``param_bytes`` is the storage of the parameters this rank holds (DTensor: the
  local shard). ``step_peak_bytes`` is the peak, above the level at the start of the step,
  of bytes held by torch's CPU allocator during one step, from ``torch.profiler``'s
  memory events (``profile_memory=True``): activations, gradients, optimizer state and
  communication buffers that go through the allocator. It is *not* tracemalloc (which does
  not see tensor storage) and *not* ``ru_maxrss`` (a process-wide high-water mark that cannot
  be reset between variants); the process's ``ru_maxrss`` is recorded once per rank as
  context only.
- Collectives: counted with ``torch.distributed.tensor.debug.CommDebugMode`` over one
  forward (+ loss) and, separately, one backward; counts per collective type, plus payload
  bytes (all-reduce: the tensor; all-gather / reduce-scatter: the full, unsharded tensor).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import autoshard.distributed
from autoshard.views.report import fmt_bytes as report_fmt_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

__all__ = [
    "REPO_ROOT", "RESULTS_DIR", "launch", "TrainStep", "time_interleaved", "summarize",
    "step_peak_bytes", "param_bytes", "maxrss_bytes", "CollectiveCounter", "count_collectives",
    "measure_step",
    "fmt_counts", "write_json", "save_figure", "print_table", "env_info", "fmt_bytes",
    "use_agg_backend",
]


# ----------------------------------------------------------------------------- launcher

def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status() -> dict:
    """VmRSS and VmHWM of this process in bytes (its own, never a child's: not ru_maxrss)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, kwargs: dict,
               queue, threads: int, timeout_s: float, backend: str = "gloo") -> None:
    try:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(*args, **kwargs)
        finally:                        # autoshard's teardown: gc first, so no group outlives it
            autoshard.distributed.destroy_process_group()
        queue.put((rank, "ok", result if rank == 0 else None))
    except BaseException:                                        # noqa: BLE001 - report, then exit
        queue.put((rank, "error", traceback.format_exc()))


_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "timed out",
              "Timed out", "Broken pipe")      # how a rank fails when another rank died first


def launch(fn: Callable, world_size: int, *args, timeout_s: float = 900.0,
           collective_timeout_s: float = 120.0, threads: int = 1, backend: str = "gloo", **kwargs) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks and return rank 0's result.

    ``fn`` must be a picklable top-level function; inside it ``torch.distributed`` is
    initialised (``backend``: gloo unless told) and ``torch.get_num_threads() == threads``. If any rank raises, the
    parent waits a moment for the others' reports, terminates the rest, and raises a
    ``RuntimeError`` with the tracebacks, the likely root cause first (a rank that failed
    on its own rather than because a peer went away); it raises too when a rank dies
    without reporting or ``timeout_s`` seconds pass.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, fn, args, kwargs, queue, threads,
                               collective_timeout_s, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    name = getattr(fn, "__name__", str(fn))
    deadline = time.monotonic() + timeout_s
    result, done, errors, grace = None, set(), {}, float("inf")
    try:
        while len(done) < world_size:
            if queue.empty():
                now = time.monotonic()
                if errors and now > grace:
                    break
                if now > deadline:
                    raise RuntimeError(f"launch({name}): ranks {sorted(set(range(world_size)) - done)}"
                                       f" did not finish within {timeout_s:.0f} s")
                dead = [r for r, p in enumerate(procs)
                        if r not in done and not p.is_alive() and p.exitcode not in (0, None)]
                if dead and queue.empty() and not errors:
                    raise RuntimeError(f"launch({name}): rank(s) {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]}) without reporting")
                time.sleep(0.02)
                continue
            rank, status, payload = queue.get()
            done.add(rank)
            if status == "error":
                if not errors:
                    grace = time.monotonic() + 3.0           # let the peers report too
                errors[rank] = payload
            elif rank == 0:
                result = payload
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 5)
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
    if errors:
        order = sorted(errors, key=lambda r: (any(s in errors[r] for s in _SECONDARY), r))
        text = "\n".join(f"--- rank {r} of {world_size}:\n{errors[r]}" for r in order)
        raise RuntimeError(f"launch({name}): rank {order[0]} failed "
                           f"({len(errors)} rank(s) reported errors):\n{text}")
    return result


# ----------------------------------------------------------------------------- steps and timing

@dataclass
class TrainStep:
    """One training step of ``model`` on ``inputs``: ``loss_fn(model(*inputs))``, backward,
    the optimizer step when given, then ``zero_grad(set_to_none=True)``.

    ``loss_fn`` may be None when the model returns its loss itself.
    """
    model: torch.nn.Module
    inputs: tuple
    loss_fn: Callable | None = None
    optimizer: torch.optim.Optimizer | None = None

    def forward(self) -> torch.Tensor:
        out = self.model(*self.inputs)
        return out if self.loss_fn is None else self.loss_fn(out)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    def __call__(self) -> float:
        loss = self.forward()
        self.backward(loss)
        return float(loss.detach().item())


def time_interleaved(steps: dict[str, Callable[[], Any]], *, warmup: int = 3, rounds: int = 20,
                     group=None, budget_s: float | None = None,
                     min_rounds: int = 5) -> dict[str, list[float]]:
    """Time ``steps`` (name -> a callable running one step) in interleaved rounds.

    Call on every rank with the same names in the same order. Each variant first runs
    ``warmup`` untimed steps. Then, in round ``r``, every variant runs one step, the order
    rotated by ``r``; each step is preceded by a ``dist.barrier`` and timed on every rank.
    With ``budget_s``, rounds stop once that many seconds have passed since the first
    round began (the ranks agree after each round; never fewer than ``min_rounds``, never
    more than ``rounds``). Returns name -> per-round step times in milliseconds, each the
    maximum over ranks (identical on every rank).
    """
    names = list(steps)
    distributed = dist.is_available() and dist.is_initialized()
    barrier = (lambda: dist.barrier(group=group)) if distributed else (lambda: None)
    for name in names:
        for _ in range(warmup):
            barrier()
            steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            barrier()
            t0 = time.perf_counter()
            steps[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
        if budget_s is not None and r + 1 >= min_rounds:
            over = torch.tensor([float(time.perf_counter() - start > budget_s)])
            if distributed:                                      # every rank must agree
                dist.all_reduce(over, op=dist.ReduceOp.MAX, group=group)
            if over.item():
                break
    if distributed:
        t = torch.tensor([times[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times = {n: t[i].tolist() for i, n in enumerate(names)}
    return times


def note_load() -> float:
    """The 1-minute load average before a run, with a note on stderr when other work is running."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: 1-minute load average is {load:.2f} on {os.cpu_count()} cores before the "
              "run; other processes will perturb the timings", file=sys.stderr)
    return load


def summarize(ms: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and count of a list of step times."""
    xs = sorted(ms)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median_ms": statistics.median(xs), "p25_ms": q[0], "p75_ms": q[2],
            "min_ms": xs[0], "n": len(xs)}


# ----------------------------------------------------------------------------- memory

def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds (a DTensor counts its local shard)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null (kineto prints "USDT ... profiler_start/stop"
    lines unconditionally, from C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_peak_bytes(step: Callable[[], Any]) -> int:
    """Peak bytes held by torch's CPU allocator during one call of ``step``, above the
    level at its start (torch.profiler memory events, all threads of this process)."""
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def maxrss_bytes() -> int:
    """This process's resident-set high-water mark (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------- collectives

_KIND = (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"),
         ("all_gather", "all_gather"), ("allgather", "all_gather"),
         ("reduce_scatter", "reduce_scatter"), ("alltoall", "all_to_all"),
         ("all_to_all", "all_to_all"), ("broadcast", "broadcast"))


def _kind(op_name: str) -> str:
    name = op_name.lower().split(".")[-1]
    for needle, kind in _KIND:
        if needle in name:
            return kind
    return name


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def _make_counter_class():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class _Counter(CommDebugMode):
        """CommDebugMode that also adds up each collective's payload bytes."""

        def __init__(self):
            super().__init__()
            self.comm_bytes: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or any(t is DTensor for t in types) \
                    or isinstance(func, torch._ops.HigherOrderOperator):
                return out
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                kind = _kind(str(packet))
                # max over arguments: all-reduce -> the tensor; legacy all-gather -> the
                # outputs; reduce-scatter -> the full input
                n = max((_tensor_bytes(a) for a in args), default=0)
                if "all_gather_into_tensor" in str(packet) and not isinstance(args[1], torch.Tensor):
                    n = _tensor_bytes(args[0]) * int(args[1])      # functional: (shard, group_size, ..)
                self.comm_bytes[kind] += n
            return out

    return _Counter


class CollectiveCounter:
    """Counts collectives (CommDebugMode) in the forward and backward of one step, apart.

    >>> counter = CollectiveCounter()
    >>> with counter.phase("forward"):
    ...     loss = model(x).sum()
    >>> with counter.phase("backward"):
    ...     loss.backward()
    >>> counter.summary()   # {"forward": {"all_reduce": 8}, "backward": {...}, "bytes": {...}, ...}
    """

    def __init__(self):
        self._cls = _make_counter_class()
        self.counts: dict[str, dict[str, int]] = {}
        self.bytes: dict[str, dict[str, int]] = {}
        self.raw: dict[str, dict[str, int]] = {}

    def phase(self, name: str):
        counter, mode = self, self._cls()

        class _Phase:
            def __enter__(self):
                mode.__enter__()
                return mode

            def __exit__(self, *exc):
                mode.__exit__(*exc)
                c, raw = defaultdict(int), {}
                for op, n in mode.get_comm_counts().items():
                    c[_kind(str(op))] += n
                    raw[str(op)] = n
                counter.counts[name] = dict(c)
                counter.bytes[name] = dict(mode.comm_bytes)
                counter.raw[name] = raw
                return False

        return _Phase()

    def summary(self) -> dict[str, Any]:
        total: dict[str, int] = defaultdict(int)
        nbytes = 0
        for phase, c in self.counts.items():
            for k, n in c.items():
                total[k] += n
            nbytes += sum(self.bytes.get(phase, {}).values())
        return {**{p: dict(c) for p, c in self.counts.items()}, "total": dict(total),
                "n_total": sum(total.values()), "bytes_total": nbytes,
                "bytes": {p: dict(b) for p, b in self.bytes.items()},
                "raw_ops": self.raw}


def count_collectives(step: TrainStep) -> dict[str, Any]:
    """Collectives issued by one forward (+ loss) and one backward of ``step`` (the
    optimizer step, if any, counts under "optimizer")."""
    counter = CollectiveCounter()
    with warnings.catch_warnings():
        # CommDebugMode's module tracker installs full backward hooks, which warn when no
        # input of a module requires grad
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with counter.phase("forward"):
            loss = step.forward()
        with counter.phase("backward"):
            loss.backward()
        with counter.phase("optimizer"):
            if step.optimizer is not None:
                step.optimizer.step()
                step.optimizer.zero_grad(set_to_none=True)
            else:
                step.model.zero_grad(set_to_none=True)
    out = counter.summary()
    if not out.get("optimizer"):                                 # no optimizer or no collectives
        for d in (out, out["bytes"], out["raw_ops"]):
            d.pop("optimizer", None)
    return out


def measure_step(step: TrainStep) -> tuple[dict[str, Any], int]:
    """One step, both counted (``count_collectives``) and profiled (``step_peak_bytes``):
    returns (collective summary, peak bytes)."""
    box: dict[str, Any] = {}
    peak = step_peak_bytes(lambda: box.setdefault("comm", count_collectives(step)))
    return box["comm"], peak


def fmt_counts(counts: dict[str, int] | None) -> str:
    """``{"all_reduce": 16}`` -> ``"16 all_reduce"``; empty -> ``"0"``."""
    if not counts:
        return "0"
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


# ----------------------------------------------------------------------------- output

def fmt_bytes(n: float | None) -> str:
    """autoshard's byte format (autoshard.views.report.fmt_bytes); "-" for a missing figure."""
    return "-" if n is None else report_fmt_bytes(n)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info() -> dict[str, Any]:
    """Machine and software facts to store beside the figures."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "threads_per_rank": 1, "backend": "gloo", "git_commit": _git_commit(),
            "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(name: str, obj: Any) -> Path:
    """Write ``obj`` to ``benchmarks/results/<name>.json`` and return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def save_figure(fig, name: str) -> Path:
    """Save a matplotlib figure to ``benchmarks/results/<name>.png`` and close it."""
    import matplotlib.pyplot as plt
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], title: str | None = None,
                floatfmt: str = ".2f") -> str:
    """Print (and return) a tabulate table."""
    from tabulate import tabulate
    text = tabulate(rows, headers=headers, tablefmt="github", floatfmt=floatfmt)
    if title:
        text = f"{title}\n{text}"
    print(text, flush=True)
    return text


def use_agg_backend() -> None:
    """Select matplotlib's non-interactive backend (call before importing pyplot)."""
    import matplotlib
    matplotlib.use("Agg")
