"""Train a small GPT with autoshard: tensor parallelism inside groups of --tp ranks, data
parallelism (DDP) across the groups.

One machine, 4 processes as 2 tensor-parallel x 2 data-parallel (gloo on CPU, NCCL on GPUs):

    torchrun --nproc_per_node 4 docs/examples/train_gpt.py --tp 2

Two machines of 8 GPUs, tensor parallel inside a machine, data parallel across (run on both,
--node_rank 0 and 1):

    torchrun --nnodes 2 --node_rank 0 --master_addr HOST0 --master_port 29500 \
        --nproc_per_node 8 docs/examples/train_gpt.py --tp 8

Every rank builds the same model from the same seed; `autoshard.parallelize` keeps this
rank's shards. Ranks of one tensor-parallel group read the same batch; data-parallel replicas
read different ones. The sharded parameters are registered for DDP to ignore and averaged over
the data-parallel group by autoshard; DDP averages the replicated ones over the same group.
With `--fsdp`, the data-parallel dim shards instead of replicating (tensor parallel inside a
node, FSDP2 across nodes): every block that autoshard keeps as a module, then the root, is
wrapped with `fully_shard` over the data-parallel mesh, so each rank holds 1/(tp x dp) of the
parameters, gradients and AdamW state and gathers one block's shard at a time;
`--checkpoint` also recomputes each block's activations in backward (dropout 0 only):

    torchrun --nproc_per_node 4 docs/examples/train_gpt.py --tp 2 --fsdp --checkpoint

With `--pp N`, the model is also cut into N pipeline stages (`autoshard.pipeline`, run by
torch.distributed.pipelining): the world is a ("pp", "dp", "tp") mesh of N x dp x --tp ranks
(--tp default 1 then; tensor-parallel groups consecutive, pipeline ranks outermost). Each stage
holds some of the blocks (the first also the embeddings, the last the head and loss; the tied
embedding and head are held by both and their gradients summed), and `pipe.step(idx, targets)`
runs a step's forward and backward over `--microbatches` microbatches (default N; they must
divide --batch) in `--schedule` order: GPipe, 1F1B (default), Interleaved1F1B or
InterleavedZeroBubble, the last two with `--stages-per-rank` (default 2) stages a rank, so N x
that many --layers at least. `--fsdp`
shards each block of a rank's stages over "dp" with FSDP2 (`--checkpoint` is not offered with
--pp). On CPU, two pipeline stages of one block each:

    torchrun --nproc_per_node 2 docs/examples/train_gpt.py --pp 2 --steps 5
    torchrun --nproc_per_node 4 docs/examples/train_gpt.py --pp 2 --tp 2 --microbatches 4
    torchrun --nproc_per_node 2 docs/examples/train_gpt.py --pp 2 --layers 4 --schedule Interleaved1F1B

`--timeout` bounds the rendezvous and every collective: a rank that dies or never arrives ends
the others with an error instead of a hang.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import autoshard
from autoshard import distributed as ad


class Block(nn.Module):
    def __init__(self, h, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, LM head tied to the token embedding."""

    def __init__(self, vocab, h, heads, layers, seq, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList([Block(h, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():                  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel degree (consecutive ranks form a group; default: all ranks, "
                         "or 1 with --pp)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages (autoshard.pipeline; default 1: no pipeline); the world is pp x dp x tp")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="with --pp: microbatches a step's batch is cut into (default: --pp; must divide --batch)")
    ap.add_argument("--schedule", choices=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"], default="1F1B",
                    help="with --pp: the pipeline schedule")
    ap.add_argument("--stages-per-rank", type=int, default=None,
                    help="with --pp: stages a pipeline rank holds (default 1; 2 with the Interleaved ones)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel replica per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds the rendezvous and each collective may wait for the other ranks")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with CUDA, else gloo")
    ap.add_argument("--save", default=None, help="write the full (collected) state dict here from rank 0")
    ap.add_argument("--quiet", action="store_true", help="do not print the plan report")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard over the data-parallel ranks with FSDP2, block by block, instead of DDP")
    ap.add_argument("--checkpoint", action="store_true",
                    help="with --fsdp: recompute each block's activations in backward (needs --dropout 0)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        sys.exit("run me under torchrun, e.g.: torchrun --nproc_per_node 2 docs/examples/train_gpt.py --tp 2")
    backend = args.backend or ad.default_backend()
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(ad.local_rank())
    device = torch.device("cuda", ad.local_rank()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    world = int(os.environ["WORLD_SIZE"])
    if args.pp < 1 or world % args.pp:
        sys.exit(f"--pp {args.pp} must be >= 1 and divide the world size {world}")
    tp = (world if args.pp == 1 else 1) if args.tp is None else args.tp
    if args.pp > 1 and (tp < 1 or world % (args.pp * tp)):
        sys.exit(f"--pp {args.pp} x --tp {tp} must divide the world size {world}")
    if args.pp > 1 and args.checkpoint:
        sys.exit("--checkpoint is not wired into the pipeline stages of this example: drop it with --pp")
    ad.init_process_group(tp, backend=backend, timeout=timedelta(seconds=args.timeout))
    try:
        if args.pp > 1:
            return run_pipeline(args, tp, backend, device)
        return run(args, tp, backend, device)
    finally:        # once run's modules and autograd graphs (which hold the groups) are gone
        ad.destroy_process_group()


def run(args, tp: int, backend: str, device: torch.device) -> int:
    """Parallelize the GPT over the tensor-parallel group, wrap it in DDP across groups, train."""
    world, cuda = dist.get_world_size(), device.type == "cuda"
    rank, dp_group = dist.get_rank(), ad.get_data_parallel_group()
    dp, dp_rank = world // tp, rank // tp
    log = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(args.seed)            # the same initial model (and dropout masks) everywhere
    model = GPT(args.vocab, args.hidden, args.heads, args.layers, args.seq, args.dropout).to(device)
    # a tiny synthetic data set: 4 batches of random tokens per replica, cycled (the model memorises
    # them); the ranks of one tensor-parallel group read the same batches
    rng = torch.Generator().manual_seed(args.seed + 1 + dp_rank)
    data = [torch.randint(args.vocab, (args.batch, args.seq + 1), generator=rng) for _ in range(4)]

    def batch(step):
        x = data[step % len(data)]
        return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)    # next-token targets

    t0 = time.perf_counter()
    gm = autoshard.parallelize(model, tp, batch(0))
    plan = gm._autoshard_plan
    if not args.quiet:
        log(plan.report())
    log(f"world {world} = {tp} tensor-parallel x {dp} data-parallel ({backend}); "
        f"planned and sharded in {time.perf_counter() - t0:.1f} s")
    train = gm
    if args.fsdp:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.fsdp import fully_shard
        if args.checkpoint and args.dropout:
            sys.exit("--checkpoint recomputes with other dropout masks: use it with --dropout 0")
        mesh = ad.device_mesh()                          # ("dp", "tp") over autoshard's groups
        for name, block in autoshard.blocks_of(gm).items():
            if args.checkpoint:
                parent, _, last = name.rpartition(".")
                gm.get_submodule(parent)._modules[last] = block = checkpoint_wrapper(block)
            fully_shard(block, mesh=mesh["dp"])           # one block's parameters gathered at a time
        fully_shard(gm, mesh=mesh["dp"])                  # the rest: embeddings, head, final norm
        log(f"FSDP2 over {dp} data-parallel ranks, {len(autoshard.blocks_of(gm))} blocks wrapped"
            f"{' and checkpointed' if args.checkpoint else ''}")
    elif dp > 1:
        autoshard.register_ddp_parameters_to_ignore(gm)
        train = DDP(gm, process_group=dp_group, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(train.parameters(), lr=args.lr)

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx, targets = batch(step)
        with autoshard.runtime.collectives.count_comm() as comm:
            loss = train(idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        shown = loss.detach().clone()
        if dp > 1:                                        # each replica's loss of its own batch
            dist.all_reduce(shown, group=dp_group)
            shown /= dp
        log(f"step {step:3d}  loss {shown.item():.4f}  tensor-parallel bytes sent {comm.bytes / 1e6:.3f} MB "
            f"(plan {plan.comm_bytes / 1e6:.3f} MB{', + the recomputed forwards' if args.checkpoint else ''})  "
            f"{time.perf_counter() - t0:.2f} s")

    if args.save:
        state = gm.state_dict()
        if args.fsdp:                                     # FSDP2's DTensors -> this rank's tensor-parallel shards
            state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
            state = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in state.items()}
        full = autoshard.collect_state_dict(gm, state, dst=0) if dp_rank == 0 else {}
        if rank == 0:
            torch.save(full, args.save)
            log(f"saved the full state dict ({len(full)} tensors) to {args.save}")
    return 0


def run_pipeline(args, tp: int, backend: str, device: torch.device) -> int:
    """Cut the GPT into --pp stages (tensor parallel inside each over --tp ranks, data parallel
    across the rest) with autoshard.pipeline, train with pipe.step."""
    from torch.distributed.device_mesh import init_device_mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    pp, dp = args.pp, world // (args.pp * tp)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))  # tp: consecutive ranks
    dp_rank = mesh["dp"].get_local_rank()
    microbatches = args.microbatches or pp
    interleaved = args.schedule.startswith("Interleaved")
    stages_per_rank = args.stages_per_rank or (2 if interleaved else 1)
    if args.batch % microbatches:
        sys.exit(f"--batch {args.batch} does not split into --microbatches {microbatches} equal microbatches")
    if pp * stages_per_rank > args.layers:
        sys.exit(f"{pp * stages_per_rank} stages (--pp {pp} x {stages_per_rank} a rank) need --layers "
                 f"{pp * stages_per_rank} or more: a stage holds at least one block")
    log = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(args.seed)            # the same initial model (and dropout seed) everywhere
    model = GPT(args.vocab, args.hidden, args.heads, args.layers, args.seq, args.dropout).to(device)
    rng = torch.Generator().manual_seed(args.seed + 1 + dp_rank)      # the ranks of one replica: one batch
    data = [torch.randint(args.vocab, (args.batch, args.seq + 1), generator=rng) for _ in range(4)]

    def batch(step):
        x = data[step % len(data)]
        return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)

    t0 = time.perf_counter()
    pipe = autoshard.pipeline(model, batch(0), mesh=mesh, microbatches=microbatches, schedule=args.schedule,
                              stages_per_rank=stages_per_rank, device=device)
    if not args.quiet:
        log(pipe.plan)
    log(f"world {world} = {pp} pipeline x {dp} data-parallel x {tp} tensor-parallel ({backend}); "
        f"{microbatches} microbatches of {args.batch // microbatches}; planned and cut in "
        f"{time.perf_counter() - t0:.1f} s")
    if args.fsdp:                             # FSDP2 over "dp" per block of this rank's stages; the rest (embeddings,
        from torch.distributed.fsdp import fully_shard      # head, final norm) averaged over "dp" by the pipeline
        for block in autoshard.blocks_of(pipe).values():
            fully_shard(block, mesh=mesh["dp"])
        log(f"FSDP2 over {dp} data-parallel ranks, {len(autoshard.blocks_of(pipe))} blocks of rank 0's stages wrapped")
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx, targets = batch(step)
        loss = pipe.step(idx, targets)       # forward and backward over the microbatches; the loss on every rank
        opt.step()
        opt.zero_grad(set_to_none=True)
        shown = loss.detach().clone()
        if dp > 1:                            # each replica's loss of its own batch
            dist.all_reduce(shown, group=mesh["dp"].get_group())
            shown /= dp
        log(f"step {step:3d}  loss {shown.item():.4f}  {time.perf_counter() - t0:.2f} s")

    if args.save:                             # every stage's full tensors, gathered to rank 0
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pipe.state_dict().items()}
        full = autoshard.collect_state_dict(pipe, state)                  # FSDP2's DTensors -> tp shards -> whole
        first = dp_rank == 0 and mesh["tp"].get_local_rank() == 0
        parts = [None] * world if rank == 0 else None
        dist.gather_object(dict(full) if first else {}, parts, dst=0)
        if rank == 0:
            state = {k: v for part in parts for k, v in part.items()}
            torch.save(state, args.save)
            log(f"saved the full state dict ({len(state)} tensors) to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
