"""Latency of a small all-reduce and all-gather between CPU ranks: gloo against shared memory.

autoshard's eager collectives (`raw_all_reduce`, `gather_pieces`) on two process groups over the
same ranks: one on gloo (the default: loopback, c10d's own ops), one opted in (`AUTOSHARD_SHM=1`) to the
shared-memory segment (autoshard.runtime.shm). Per size (bytes a rank's tensor: 4 KiB and 64 KiB
by default) and collective, rounds alternate the transports (the order rotated each round); a
round times `--calls` back-to-back calls one by one after a barrier. Reported: the median latency
of a call over all rounds (the slower rank's median), and gloo's over shared memory's.

Usage: python benchmarks/shm_latency.py [--world 2] [--sizes 4096 65536] [--calls 200] [--rounds 5]
       [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import launch, note_load  # noqa: E402


def _group(shm_on: bool):
    """A new group over every rank whose first collective sets up (or not) its segment."""
    from autoshard.runtime import shm
    os.environ["AUTOSHARD_SHM"] = "1" if shm_on else "0"
    group = dist.new_group(list(range(dist.get_world_size())))
    from autoshard.runtime.collectives import raw_all_reduce
    raw_all_reduce(torch.ones(8), group)                     # the setup
    if bool(shm.served(group)) != shm_on:
        raise RuntimeError(f"the {'shared-memory' if shm_on else 'gloo'} group did not take that path")
    return group


def _run(sizes, calls: int, rounds: int) -> dict:
    from autoshard.runtime.collectives import gather_pieces, raw_all_reduce
    groups = {"gloo": _group(False), "shm": _group(True)}
    ops = {"all_reduce": lambda x, g: raw_all_reduce(x, g),
           "all_gather": lambda x, g: gather_pieces(x, 0, 1, g)}
    out = {}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        for name, op in ops.items():
            times = {t: [] for t in groups}
            for r in range(rounds):
                order = list(groups) if r % 2 == 0 else list(groups)[::-1]
                for transport in order:
                    g = groups[transport]
                    for _ in range(10):                        # warm
                        op(x, g)
                    dist.barrier()
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        op(x, g)
                        times[transport].append(time.perf_counter() - t0)
            medians = torch.tensor([statistics.median(times[t]) * 1e6 for t in groups], dtype=torch.float64)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
            out[f"{name} {nbytes}"] = dict(zip(groups, medians.tolist()))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536], help="bytes of a rank's tensor")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()
    load = note_load()
    res = launch(_run, args.world, args.sizes, args.calls, args.rounds, timeout_s=900)
    after = os.getloadavg()[0]
    print(f"{'collective':>10} {'bytes/rank':>10} {'gloo us':>9} {'shm us':>8} {'gloo/shm':>8}")
    for key, t in res.items():
        name, nbytes = key.split()
        print(f"{name:>10} {nbytes:>10} {t['gloo']:>9.1f} {t['shm']:>8.1f} {t['gloo'] / t['shm']:>8.1f}")
    print(f"{args.world} ranks, one thread each; median of {args.rounds} x {args.calls} calls, the slower rank's; "
          f"1-minute load average {load:.2f} before, {after:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps({"world": args.world, "results": res, "load": load,
                                               "load_after": after}, indent=1))


if __name__ == "__main__":
    main()
