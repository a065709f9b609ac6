"""What the tensor-parallel input check costs (autoshard.runtime.agreement; `parallelize(check_inputs=N)`).

The benchmark LLaMA of `compile.py` (hidden 256, intermediate 688, 8 / 4 heads, vocab 2048, 2
layers; batch 4 x 128 of input_ids = labels) at tp 2 (gloo, CPU, one thread per rank), trained
with AdamW. Interleaved rounds (the order alternating): a step (forward, backward, optimizer
step) of the module with its check on every call (`every=1`) and with no check (`every=None`);
and, apart, the check alone (`check_same_inputs` on the step's inputs). Each time is the maximum
over ranks after a barrier; medians and quartiles are printed. The check's cost at interval N is
its time / N (the first call of each signature is checked once, whatever N).

    python benchmarks/input_check.py [--rounds 30] [--layers 2]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, SEQ = 4, 128


def _timed(fn):
    dist.barrier()
    t = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _rank(rank, world, port, rounds, layers, out):
    import autoshard  # noqa: F401 - before the group
    from autoshard.runtime import agreement
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import compile as bench
    bench.BATCH, bench.SEQ = BATCH, SEQ
    model, cfg, kw = bench._llama(layers)
    gm = autoshard.parallelize(model, world, kw, tracer="export")
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-4)
    guard = gm._autoshard_guard

    def step():
        gm(**kw).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    arguments = tuple(kw.items())
    for _ in range(3):
        step()
    times = {"every call": [], "none": [], "check alone": []}
    for r in range(rounds):
        order = [("every call", 1), ("none", None)]
        for name, every in (order if r % 2 else order[::-1]):
            guard.every, guard.calls = every, {}
            times[name].append(_timed(step))
        times["check alone"].append(_timed(lambda: agreement.check_same_inputs(gm._autoshard_guard.pg, arguments)))
    if rank == 0:
        q = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
        result = {"config": dict(layers=layers, hidden=cfg.hidden_size, batch=BATCH, seq=SEQ, world=world,
                                 rounds=rounds),
                  "median_s": {k: statistics.median(v) for k, v in times.items()},
                  "quartiles_s": q}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/input_check_{os.getpid()}.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(a.world, port, a.rounds, a.layers, out), nprocs=a.world, join=True)
    r = json.load(open(out))
    os.remove(out)
    m = r["median_s"]
    step, check = m["none"], m["check alone"]
    print(json.dumps(r["config"]))
    for k, v in m.items():
        lo, _, hi = r["quartiles_s"][k]
        print(f"{k:>12}: median {v * 1e3:8.2f} ms  (quartiles {lo * 1e3:.2f} .. {hi * 1e3:.2f})")
    print(f"step with a check on every call / without: {m['every call'] / step:.4f}")
    for n in (1, 10, 100):
        print(f"check every {n:>3} calls: {check / n * 1e3:.3f} ms a step = {100 * check / n / step:.3f}% of a step")


if __name__ == "__main__":
    main()
