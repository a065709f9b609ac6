"""Save and load time of a sharded checkpoint with and without checksums (autoshard.checkpoint).

The GPT of checkpoint_memory.py (vocab 16384, hidden 512, 4 blocks, fused q/k/v, tied; AdamW:
240.7 MB of state) is parallelized at degree 4 and trained one step. Its state is saved with
`autoshard.checkpoint.save` with checksums (`.checksums`: a CRC-32 per 4 MiB block of every saved
item, computed by reading back what each rank wrote) and without (`checksums=False`: what plain
DCP writes), alternating, `--repeats` times; then both checkpoints are loaded with
`autoshard.checkpoint.load` (every block read checked, or, without `.checksums`, nothing
checked) at degree 4 and at degree 2, alternating the same way. A time is rank 0's wall clock
from a barrier before the operation to a barrier after it (so the slowest rank's); beside it,
the CPU time all ranks spent in it (process time, summed), which other work on a shared machine
disturbs less than the wall clock. Each operation starts after a full garbage collection. The
files stay in the page cache: no disk read, the case where checking costs the most, relatively.

    python benchmarks/checkpoint_checksums.py               # ~2 min here
    python benchmarks/checkpoint_checksums.py --quick       # a smaller model

It also prints, on one process, what the checksum itself costs: the CRC-32's speed (zlib's, and
ISA-L's where the `isal` package is installed, which autoshard then uses: same values) and the
time to read the checkpoint's files back from the page cache (what the writer adds on top of it).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from benchmarks.common import launch  # noqa: E402


def build(args, tp):
    """(gm, optimizer) of the GPT at degree tp, one AdamW step taken."""
    import autoshard
    from models import GPT
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, h=args.hidden, heads=8, blocks=args.blocks, seq=64, tied=True, fused=True)
    ids = torch.randint(args.vocab, (2, 64))
    autoshard.distributed.init_process_group(tp)
    gm = autoshard.parallelize(model, tp, (ids, ids))
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    gm(ids, ids).backward()
    opt.step()
    return gm, opt


def timed(fn) -> tuple:
    """(wall seconds from a barrier before fn to a barrier after it, CPU seconds all ranks spent in
    fn). A full garbage collection first: a load allocates enough for Python's collector to run
    its oldest generation (0.2-0.4 s here) every few loads, which in strictly alternating rounds
    falls on one variant far more often than on the other."""
    gc.collect()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - t0
    dist.all_reduce(cpu)
    return wall, cpu.item()


def state(gm, opt) -> dict:
    import autoshard
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
    return {"model": msd, "optim": osd}


def save_rank(args, tmp):
    """Degree 4: save with and without checksums, alternating; then load both at 4."""
    import autoshard
    warnings.filterwarnings("ignore", message="autoshard.checkpoint: .* has no .checksums")
    gm, opt = build(args, 4)
    sd = state(gm, opt)
    times: dict = {}
    for r in range(args.repeats + 1):                        # the first round warms up
        for on in ((False, True) if r % 2 else (True, False)):
            path = os.path.join(tmp, "with" if on else "without")
            t = timed(lambda: autoshard.checkpoint.save(sd, path, checksums=on))
            if r:
                times.setdefault(("save at 4", on), []).append(t)
    for r in range(args.repeats + 1):
        for on in ((False, True) if r % 2 else (True, False)):
            path = os.path.join(tmp, "with" if on else "without")
            t = timed(lambda: autoshard.checkpoint.load(sd, path))
            if r:
                times.setdefault(("load at 4, saved at 4", on), []).append(t)
    return times


def load_rank(args, tmp):
    """Degree 2: load both checkpoints (saved at 4), alternating."""
    import autoshard
    warnings.filterwarnings("ignore", message="autoshard.checkpoint: .* has no .checksums")
    gm, opt = build(args, 2)
    sd = state(gm, opt)
    times: dict = {}
    for r in range(args.repeats + 1):
        for on in ((False, True) if r % 2 else (True, False)):
            path = os.path.join(tmp, "with" if on else "without")
            t = timed(lambda: autoshard.checkpoint.load(sd, path))
            if r:
                times.setdefault(("load at 2, saved at 4", on), []).append(t)
    return times


def crc_costs(path) -> tuple:
    """([zlib.crc32, the CRC-32 autoshard uses] GB/s on 4 MiB blocks, seconds to read the
    checkpoint's .distcp files back from the page cache, seconds to read them and CRC every
    block) on this process."""
    from autoshard.io.checkpoint.checksums import crc32
    block = os.urandom(4 << 20)
    speeds = []
    for fn in (zlib.crc32, crc32):
        t0 = time.perf_counter()
        for _ in range(25):
            fn(block)
        speeds.append(25 * len(block) / (time.perf_counter() - t0) / 1e9)
    files = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".distcp")]
    buf = memoryview(bytearray(4 << 20))

    def read_all(crc):
        for name in files:
            with open(name, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    if crc:
                        crc32(buf[:n])

    costs = []
    for crc in (False, True):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            read_all(crc)
            runs.append(time.perf_counter() - t0)
        costs.append(statistics.median(runs))
    return speeds, costs[0], costs[1]


def quartiles(xs) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="vocab 4096, hidden 256, 2 blocks, 3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.blocks, args.repeats = 4096, 256, 2, 3
    tmp = tempfile.mkdtemp(prefix="ckpt_crc_")
    try:
        times = launch(save_rank, 4, args, tmp)
        times.update(launch(load_rank, 2, args, tmp))
        size = sum(os.path.getsize(os.path.join(tmp, "with", n)) for n in os.listdir(os.path.join(tmp, "with")))
        sums = os.path.getsize(os.path.join(tmp, "with", ".checksums"))
        speed, read_s, read_crc_s = crc_costs(os.path.join(tmp, "with"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"GPT vocab {args.vocab}, hidden {args.hidden}, {args.blocks} blocks, AdamW; checkpoint {size / 2 ** 20:.1f} MiB "
          f"(.checksums {sums} bytes); {args.repeats} rounds, seconds: median [quartiles]; ratios with/without")
    print("| operation | wall, without checksums (s) | wall, with (s) | ratio of medians (paired) "
          "| CPU, without (s) | CPU, with (s) | ratio of medians (paired) |")
    print("|---|---|---|---|---|---|---|")
    for op in ("save at 4", "load at 4, saved at 4", "load at 2, saved at 4"):
        cells = []
        for i in (0, 1):
            off, on = [t[i] for t in times[(op, False)]], [t[i] for t in times[(op, True)]]
            paired = statistics.median(b / a for a, b in zip(off, on))
            cells += [quartiles(off), quartiles(on),
                      f"{statistics.median(on) / statistics.median(off):.3f} ({paired:.3f})"]
        print(f"| {op} | " + " | ".join(cells) + " |")
    from autoshard.io.checkpoint.checksums import CRC32_BY
    print(f"\nCRC-32 computed by {CRC32_BY}. One process: zlib.crc32 {speed[0]:.2f} GB/s, {CRC32_BY} {speed[1]:.2f} GB/s; "
          f"reading the {size / 2 ** 20:.1f} MiB back from the page cache {read_s:.3f} s, reading it and the CRC of "
          f"every 4 MiB block {read_crc_s:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
