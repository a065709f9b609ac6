"""A script that uses autoshard and ends without destroy_process_group exits with status 0.

Each job is two interpreters (ranks) started as plain subprocesses, as torchrun starts them:
gloo, `autoshard.distributed.init_process_group`, `parallelize` of a small MLP, one forward and
backward, then the script just ends.  A gloo group freed during interpreter teardown aborted
such a process ("terminate called without an active exception", SIGABRT); autoshard's atexit
hook now releases its groups first.  Several jobs run at once (load makes the race likelier).
"""
import os
import subprocess
import sys
import time

from launcher import _free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = 4


def _worker(rank: int, port: int) -> None:
    """One rank of the user script: no destroy_process_group at the end."""
    import torch
    import torch.distributed as dist

    import autoshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    autoshard.distributed.init_process_group(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    gm = autoshard.parallelize(model, 2, (x,))
    gm(x).square().sum().backward()
    y = autoshard.distributed.gather(autoshard.distributed.scatter(x.requires_grad_(), 0), 0)
    y.sum().backward()
    print(f"rank {rank} done", flush=True)


def run_jobs(jobs: int, timeout: float = 240) -> list:
    """Start `jobs` 2-rank runs at once; [(returncode, stderr tail)] for every process."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore")
    procs = []
    for _ in range(jobs):
        port = _free_port()
        for rank in range(2):
            procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(port)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline, out = time.time() + timeout, []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout.strip(), stderr.strip()[-500:]))
    return out


def test_script_without_destroy_exits_cleanly():
    results = run_jobs(JOBS)
    bad = [r for r in results if r[0] != 0 or "terminate called" in r[2] or "done" not in r[1]]
    assert not bad, f"{len(bad)} of {len(results)} rank processes did not exit cleanly: {bad}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--count"]:                  # python tests/test_exit.py --count ROUNDS
        results = [r for _ in range(int(sys.argv[2])) for r in run_jobs(JOBS)]
        bad = [r for r in results if r[0] != 0 or "terminate called" in r[2]]
        print(f"{len(bad)} of {len(results)} rank processes failed; return codes {sorted({r[0] for r in bad})}")
    else:
        _worker(int(sys.argv[1]), int(sys.argv[2]))
