"""Peak memory per rank while saving and loading a sharded checkpoint (autoshard.checkpoint + DCP).

A GPT (tied embeddings, fused q/k/v) is parallelized at degree p, trained one AdamW step, and its
model + optimizer state saved with `dcp.save`; then loaded at degree q with `dcp.load` and
`autoshard.checkpoint.set_state_dict`, once with PyTorch's FileSystemReader and once with
autoshard's (`autoshard.checkpoint.FileSystemReader`, what `autoshard.checkpoint.load` uses).
Each rank reports the rise of its peak resident memory (VmHWM from /proc/self/status, reset
through /proc/self/clear_refs just before the operation; not ru_maxrss, which a spawned child
inherits from its parent) above its resident memory before the operation, beside the bytes of its own shard of the state and of the full state. For contrast the
same is measured for `collect_state_dict` + `torch.save` on rank 0 (today's full-gather way).

    python benchmarks/checkpoint_memory.py                 # vocab 16384, hidden 512, 4 blocks
    python benchmarks/checkpoint_memory.py --quick         # a smaller model (~1 min)

glibc's adaptive mmap threshold would keep freed tensors resident (so the numbers would show the
allocator, not autoshard): the ranks run with MALLOC_MMAP_THRESHOLD_=65536.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")        # before the ranks are spawned

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from benchmarks.common import launch, proc_status  # noqa: E402

MB = 2 ** 20


def _peak_rise(fn) -> tuple:
    """(bytes VmHWM rose above VmRSS while fn ran, seconds)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                   # VmHWM := VmRSS
    base = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    fn()
    return proc_status()["VmHWM"] - base, time.perf_counter() - t0


def _build(args, tp):
    import autoshard
    from models import GPT
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, h=args.hidden, heads=8, blocks=args.blocks, seq=64, tied=True, fused=True)
    full = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    ids = torch.randint(args.vocab, (2, 64))
    autoshard.distributed.init_process_group(tp)
    gm = autoshard.parallelize(model, tp, (ids, ids))
    del model
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    return gm, opt, full, ids


def _state_bytes(gm, opt) -> int:
    seen, n = set(), 0
    tensors = list(gm.state_dict().values()) + [v for st in opt.state.values() for v in st.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def _save_rank(args, tp, path, collect_path):
    import torch.distributed.checkpoint as dcp
    import autoshard
    gm, opt, full, ids = _build(args, tp)
    gm(ids, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    mine = _state_bytes(gm, opt)

    def save():
        msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def collect():
        sd = autoshard.collect_state_dict(gm, gm.state_dict())
        if dist.get_rank() == 0:
            torch.save(sd, collect_path)

    rise_save, t_save = _peak_rise(save)
    rise_collect, _ = _peak_rise(collect)
    return _gather(dict(rank=dist.get_rank(), shard=mine, full=full * 3, save=rise_save, seconds=t_save,
                        collect=rise_collect))


def _load_rank(args, tp, path, reader):
    import torch.distributed.checkpoint as dcp
    import autoshard
    gm, opt, full, _ = _build(args, tp)
    msd, osd = autoshard.checkpoint.get_state_dict(gm, opt)          # initialises the optimizer state
    mine = _state_bytes(gm, opt)

    def load():
        sd = {"model": msd, "optim": osd}
        if reader:                                  # autoshard's reader: only this rank's rows
            dcp.load(sd, storage_reader=autoshard.checkpoint.FileSystemReader(path))
        else:                                       # PyTorch's: each saved chunk whole, then narrowed
            dcp.load(sd, checkpoint_id=path)
        autoshard.checkpoint.set_state_dict(gm, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    rise, seconds = _peak_rise(load)
    return _gather(dict(rank=dist.get_rank(), shard=mine, full=full * 3, load=rise, seconds=seconds))


def _gather(row):
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def _to_full_file(path, out):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    dcp_to_torch_save(path, out + ".pt")
    torch_save_to_dcp(out + ".pt", out)
    os.remove(out + ".pt")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="vocab 4096, hidden 256, 2 blocks")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.blocks = 4096, 256, 2
    tmp = tempfile.mkdtemp(prefix="ckpt_mem_")
    try:
        print(f"GPT vocab {args.vocab}, hidden {args.hidden}, {args.blocks} blocks, fused q/k/v, tied; AdamW "
              f"(state = parameters + 2 moments); peak RSS rise per rank (VmHWM - VmRSS before), MB")
        print(f"{'operation':<44} {'rank':>4} {'own shard':>9} {'full':>7} {'peak rise':>9} {'s':>6}")
        for p in (4, 2):
            rows = launch(_save_rank, p, args, p, os.path.join(tmp, f"p{p}"), os.path.join(tmp, "full.pt"))
            for r in rows:
                print(f"{f'save at {p} (dcp.save)':<44} {r['rank']:>4} {r['shard'] / MB:>9.1f} {r['full'] / MB:>7.1f} "
                      f"{r['save'] / MB:>9.1f} {r['seconds']:>6.2f}")
            for r in rows:
                print(f"{f'collect_state_dict at {p} + torch.save':<44} {r['rank']:>4} {r['shard'] / MB:>9.1f} "
                      f"{r['full'] / MB:>7.1f} {r['collect'] / MB:>9.1f} {'':>6}")
        _to_full_file(os.path.join(tmp, "p4"), os.path.join(tmp, "p1"))
        for saved, q in (("p4", 4), ("p4", 2), ("p2", 4), ("p1", 4)):
            what = {"p4": "saved at 4", "p2": "saved at 2", "p1": "unsharded"}[saved]
            for reader in (False, True):
                rows = launch(_load_rank, q, args, q, os.path.join(tmp, saved), reader)
                how = "autoshard reader" if reader else "dcp reader"
                for r in rows:
                    print(f"{f'load at {q}, {what}, {how}':<44} {r['rank']:>4} {r['shard'] / MB:>9.1f} "
                          f"{r['full'] / MB:>7.1f} {r['load'] / MB:>9.1f} {r['seconds']:>6.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
