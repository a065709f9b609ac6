"""`python -m autoshard demo`: tensor parallelism on CPU processes, checked against one process.

Starts `--world-size` ranks (gloo over 127.0.0.1), builds a small GPT (fused q/k/v, LM head
tied to the token embedding, the loss computed inside the model), prints autoshard's sharding
plan, then trains `--steps` steps of AdamW on random tokens with the parallelized module while
rank 0 trains a single-process copy on the same batches. It prints both losses per step, the
bytes each rank sent (`autoshard.collectives.count_comm`) against the plan's prediction
(`plan.comm_bytes`), and exits with status 0 when the losses agree within `--tol`.
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "main"]


class Block(nn.Module):
    """Pre-norm transformer block: fused q/k/v attention and a GELU MLP."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT whose forward returns the mean cross entropy of `targets`."""

    def __init__(self, vocab: int = 1024, h: int = 64, heads: int = 4, layers: int = 2, seq: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList([Block(h, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m autoshard demo", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", "-n", type=int, default=2, help="tensor-parallel degree = processes (default 2)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest allowed |loss difference| (default 1e-4)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for the others")
    return ap


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f} B"


def _rank(rank: int, opts, port: int, results) -> None:
    """One rank: join the gloo group, run `_train`, tear the group down."""
    import torch.distributed as dist

    from . import distributed as D  # before the group exists: see its module comment

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=opts.world_size, timeout=timedelta(seconds=opts.timeout))
    try:
        _train(rank, opts, results)
    finally:            # after _train's frame (modules, autograd graphs holding the group) is gone
        D.destroy_process_group()


def _train(rank: int, opts, results) -> None:
    """Parallelize, train beside the reference (rank 0), report."""
    import torch.distributed as dist

    import autoshard
    from .runtime.counters import CommCounter, count_comm

    p = opts.world_size
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    torch.manual_seed(opts.seed)                 # every rank builds the same model
    model = GPT(opts.vocab, opts.hidden, opts.heads, opts.layers, opts.seq)
    reference = copy.deepcopy(model) if rank == 0 else None      # parallelize shares replicated weights
    rng = torch.Generator().manual_seed(opts.seed + 1)
    tokens = torch.randint(opts.vocab, (opts.batch, opts.seq + 1), generator=rng)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()   # next-token prediction

    t0 = time.perf_counter()
    gm = autoshard.parallelize(model, p, (idx, targets))
    plan = gm._autoshard_plan
    say(plan.report())
    say(f"\nplanned and sharded in {time.perf_counter() - t0:.1f} s; "
        f"training {opts.steps} steps of AdamW (lr {opts.lr}) on one batch of {opts.batch} x {opts.seq} "
        "random tokens (the model memorises it)\n")
    opt = torch.optim.AdamW(gm.parameters(), lr=opts.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=opts.lr) if rank == 0 else None
    say(f"{'step':>4}  {'loss, ' + str(p) + ' ranks':>14}  {'loss, 1 process':>15}  {'|difference|':>12}")
    worst, t0, comm = 0.0, time.perf_counter(), CommCounter()
    for step in range(1, opts.steps + 1):
        with count_comm() as counted:              # one forward + backward
            loss = gm(idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        comm.events += counted.events
        opt.step()
        if rank == 0:
            ref_loss = reference(idx, targets)
            ref_opt.zero_grad(set_to_none=True)
            ref_loss.backward()
            ref_opt.step()
            diff = abs(loss.item() - ref_loss.item())
            worst = max(worst, diff)
            say(f"{step:4d}  {loss.item():14.6f}  {ref_loss.item():15.6f}  {diff:12.2e}")
    seconds = time.perf_counter() - t0
    mine = torch.tensor([comm.calls / opts.steps, comm.bytes / opts.steps], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(p)]
    dist.all_gather(every, mine)                   # (all_gather_object would need numpy)
    if rank == 0:
        planned = sum(c for c, _ in plan.comm_by_kind.values())
        say("\ncommunication per training step (forward + backward), bytes each rank sent:")
        say(f"{'rank':>4}  {'collectives':>11}  {'measured':>12}  {'predicted':>12}  {'measured/predicted':>18}")
        for r, (calls, nbytes) in enumerate(t.tolist() for t in every):
            say(f"{r:4d}  {calls:11.0f}  {_fmt_bytes(nbytes):>12}  {_fmt_bytes(plan.comm_bytes):>12}  "
                f"{nbytes / plan.comm_bytes if plan.comm_bytes else float('nan'):18.4f}")
        kinds = ", ".join(f"{k} {c / opts.steps:.0f} x {_fmt_bytes(b / opts.steps)}"
                          for k, (c, b) in sorted(comm.by_kind.items()))
        say(f"  measured by kind (rank 0): {kinds}; the plan predicted {planned} collectives, "
            f"{_fmt_bytes(plan.comm_bytes)} (plan.comm_bytes)")
        say(f"\n{opts.steps} steps in {seconds:.1f} s; largest |loss difference| {worst:.2e} "
            f"(tolerance {opts.tol:g})")
        ok = worst <= opts.tol and all(abs(t[1].item() - plan.comm_bytes) <= 0.01 * plan.comm_bytes for t in every)
        say("OK: the tensor-parallel model trains like the single-process one" if ok else
            "MISMATCH: see the numbers above")
        results.put(ok)


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    if opts.world_size < 1:
        print("autoshard demo: --world-size must be >= 1", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    print(f"autoshard demo: {opts.world_size} CPU processes (gloo), GPT(vocab={opts.vocab}, hidden={opts.hidden}, "
          f"heads={opts.heads}, layers={opts.layers}, seq={opts.seq}, tied embeddings, loss inside)", flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.spawn(_rank, args=(opts, _free_port(), results), nprocs=opts.world_size, join=True)
    except Exception as e:  # noqa: BLE001 - a rank failed: its traceback is in the message
        print(f"autoshard demo failed: {e}", file=sys.stderr)
        return 1
    ok = results.get() if not results.empty() else False
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
