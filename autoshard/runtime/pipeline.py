"""Running pipeline stages: torch.distributed.pipelining's PipelineStage and schedules over the
"pp" process group, around autoshard's stage modules (autoshard.rewrite.stages).

`Pipeline` is an nn.Module whose tree holds this rank's stages' parameters and buffers under the
model's own names (tied aliases included), so `parameters()`, `state_dict()`, optimizers,
`collect_state_dict` and `autoshard.checkpoint` see one module, as for `parallelize`'s. A step
runs the schedule over `M` equal microbatches; the last stage's loss (the mean over microbatches)
is sent to every rank of the pipeline. After backward, gradients are divided by `M` once per
parameter (a parameter two stages of one rank read is scaled once), a parameter several stages on
different ranks read (a tied embedding and head) has its gradient summed over those ranks (Megatron's
embedding group), and where data parallelism runs without FSDP2, plain gradients are averaged over
the "dp" group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import ShardingError
from .autocast import autocast_as

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


def schedule_class(name: str):
    """torch.distributed.pipelining's schedule called `name`, and whether it takes several stages a rank."""
    from torch.distributed import pipelining as P
    classes = {"GPipe": (P.ScheduleGPipe, False), "1F1B": (P.Schedule1F1B, False),
               "Interleaved1F1B": (P.ScheduleInterleaved1F1B, True),
               "InterleavedZeroBubble": (P.ScheduleInterleavedZeroBubble, True)}
    if name not in classes:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return classes[name]


class Stage(nn.Module):
    """One stage of one mode's graph (a module per mode, so one PipelineStage per mode keeps its own
    buffers), run under the autocast its graph was captured under (`recipe`: autocast_state()),
    whatever the caller's: torch.distributed.pipelining's own tensors (metadata, sends) are made
    outside it."""

    def __init__(self, index: int, graph_module: nn.Module, recipe: tuple = ()):
        super().__init__()
        self.index = index
        self.graph = graph_module
        self.recipe = recipe

    def forward(self, *args, **kwargs):
        with autocast_as(self.recipe):
            return self.graph(*args, **kwargs)


def place(root: nn.Module, path: str, obj, persistent: bool = True) -> None:
    """Put `obj` (a module, parameter or buffer) at `path` in `root`, making plain containers on
    the way; an existing object there is kept."""
    *parents, last = path.split(".")
    at = root
    for part in parents:
        nxt = at._modules.get(part)
        if nxt is None:
            nxt = nn.Module()
            at.add_module(part, nxt)
        at = nxt
    if isinstance(obj, nn.Module):
        at._modules.setdefault(last, obj)
    elif isinstance(obj, nn.Parameter):
        at._parameters.setdefault(last, obj)
    elif last not in at._buffers:
        at.register_buffer(last, obj, persistent=persistent)


class Pipeline(nn.Module):
    """This rank's stages of a model, run by a torch.distributed.pipelining schedule (built by
    `autoshard.pipeline`, which documents it). `inputs(args, kwargs)`: the stages' keyword inputs
    of a call; `batched`: those cut into microbatches; `build_eval()`: the evaluation graphs'
    stages, the loss's place among their last stage's outputs and how many there are."""

    def __init__(self, *, stages, inputs, batched, microbatches: int, schedule: str, pp_group, dp_group,
                 num_stages: int, plan=None, build_eval=None, device="cpu"):
        super().__init__()
        self._stage_modules = list(stages)           # Stage per stage index this rank holds (training)
        self._inputs = inputs                        # (args, kwargs) -> {placeholder name: value}
        self._batched = batched                      # placeholder names whose dim 0 is the batch
        self.microbatches = microbatches
        self.schedule_name = schedule
        self._pp, self._dp, self._tied = pp_group, dp_group, []
        self._loss_index = 0                         # the loss among the evaluation graph's outputs
        self.num_stages = num_stages
        self.plan = plan
        self._build_eval = build_eval
        self._device = torch.device(device)
        self._runners = {}                           # training mode -> (schedule, [PipelineStage])
        self._eval_outputs = 1                       # outputs of the evaluation graph's last stage
        self._last_outputs = None

    # ------------------------------------------------------------------ what this rank holds
    @property
    def stages(self) -> list:
        """This rank's stage modules (training graphs), first stage first."""
        return list(self._stage_modules)

    @property
    def stage_indices(self) -> tuple:
        return tuple(s.index for s in self._stage_modules)

    # ------------------------------------------------------------------ schedules
    def _runner(self, training: bool):
        if training in self._runners:
            return self._runners[training]
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate
        if training:
            stages = self._stage_modules
        else:
            stages, self._loss_index, self._eval_outputs = self._build_eval()
        cls, multi = schedule_class(self.schedule_name)
        pipes = [PipelineStage(s, s.index, self.num_stages, self._device, group=self._pp) for s in stages]
        spec = {name: TensorChunkSpec(0) for name in self._batched}

        def loss_fn(output, target):
            return output
        # evaluation: forward only (no loss_fn: the schedule plans no backward); the loss is read
        # from the last stage's outputs
        # the merged outputs are not used (the last stage's chunks are read as they are): each
        # output merged as its first chunk, so that merging a scalar loss does not fail
        leaves = 1 if training else self._eval_outputs
        keep = _CustomReducer(None, lambda kept, x: x if kept is None else kept)
        merge = keep if training else tuple(keep for _ in range(leaves))
        kw = dict(loss_fn=loss_fn if training else None, kwargs_chunk_spec=spec, output_merge_spec=merge,
                  scale_grads=False)
        schedule = cls(pipes if multi else pipes[0], self.microbatches, **kw)
        self._runners[training] = (schedule, pipes, stages, spec, _Replicate)
        return self._runners[training]

    def _split(self, args, kwargs) -> tuple[dict, int]:
        flat = self._inputs(args, kwargs)
        sizes = {n: v.shape[0] for n, v in flat.items() if n in self._batched and isinstance(v, torch.Tensor)}
        if not sizes:
            raise ShardingError("pipeline.step: no input holds the batch (dim 0) the microbatches are cut from")
        batch = next(iter(sizes.values()))
        other = {n: b for n, b in sizes.items() if b != batch}
        if other:
            raise ShardingError(f"pipeline.step: the inputs' batch sizes differ: {sizes}")
        if batch % self.microbatches:
            raise ShardingError(f"pipeline.step: a batch of {batch} does not split into {self.microbatches} equal "
                                f"microbatches (inputs {sorted(sizes)}); pass a batch that is a multiple of "
                                f"{self.microbatches}, or another microbatches=")
        return flat, batch

    def _run(self, args, kwargs, backward: bool):
        # casts cached in the caller's autocast region (planning's fake weights, the last step's
        # values) must not serve this step; each stage runs under its own recipe (Stage.forward)
        torch.clear_autocast_cache()
        with autocast_as(()):
            return self._run_plain(args, kwargs, backward)

    def _run_plain(self, args, kwargs, backward: bool):
        flat, batch = self._split(args, kwargs)
        schedule, pipes, stages, spec, replicate = self._runner(self.training)
        tensors = {n: v for n, v in flat.items() if isinstance(v, torch.Tensor)}
        schedule._kwargs_chunk_spec = {n: spec.get(n, replicate()) for n in tensors}
        target = torch.zeros(batch, device=self._device) if self.training else None
        losses: list = []
        for s in stages:
            s.train(self.training)
        last = next((p for p in pipes if p.is_last), None)
        self._last_outputs = None
        losses = self._schedule(schedule, tensors, target, losses, backward, last)
        if backward:
            self._finish_gradients()
        return self._share_loss(losses)

    def _schedule(self, schedule, tensors: dict, target, losses: list, backward: bool, last) -> list:
        """One run of the schedule; the last stage's losses (their place among its outputs read in
        evaluation)."""
        if backward:
            schedule.step(target=target, losses=losses, return_outputs=False, **tensors)
        elif self.training:                          # forward only through the training graphs: the loss
            with torch.no_grad():
                schedule.eval(target=target, losses=losses, **tensors)
        else:
            with torch.no_grad():
                schedule.step(**tensors)
            if last is not None:
                self._last_outputs = list(last.output_chunks)
                losses = [c[self._loss_index] for c in self._last_outputs]
        return losses

    def _share_loss(self, losses: list) -> torch.Tensor:
        """The batch's loss (mean over microbatches) on every rank of the pipeline."""
        mine = torch.stack([x.detach().float() for x in losses]).mean() if losses \
            else torch.zeros((), device=self._device)
        mine = mine.to(self._device).reshape(1)
        last_rank = dist.get_global_rank(self._pp, (self.num_stages - 1) % dist.get_world_size(self._pp))
        dist.broadcast(mine, src=last_rank, group=self._pp)
        return mine[0]

    def _finish_gradients(self) -> None:
        params = list(dict.fromkeys(p for p in self.parameters() if p.grad is not None))
        for p in params:
            p.grad.div_(self.microbatches)
        for group, names in self._tied:                  # tied across stages on other ranks: summed
            for name in names:
                g = self.get_parameter(name).grad
                if g is None:
                    g = self.get_parameter(name).grad = torch.zeros_like(self.get_parameter(name))
                dist.all_reduce(_local(g), group=group)
        if self._dp is not None and dist.get_world_size(self._dp) > 1:
            plain = [p.grad for p in params if not _is_dtensor(p)]
            if plain:
                flat = torch.cat([g.reshape(-1) for g in plain])
                dist.all_reduce(flat, group=self._dp)
                flat.div_(dist.get_world_size(self._dp))
                at = 0
                for g in plain:
                    g.copy_(flat[at:at + g.numel()].view_as(g))
                    at += g.numel()

    # ------------------------------------------------------------------ public
    def sum_across(self, groups) -> None:
        """[(process group, parameter names)]: after backward, each of those gradients is summed
        over its group (a weight that stages on several ranks read: a tied embedding and head)."""
        self._tied = list(groups)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One training step's forward and backward over the batch (in train mode; forward only in
        eval mode): the batch's loss, the mean over microbatches, on every rank."""
        if self.training and not torch.is_grad_enabled():
            raise ShardingError("pipeline.step in train mode runs backward: call it outside torch.no_grad(), or "
                                "call pipe.eval() first for a forward-only step")
        return self._run(args, kwargs, backward=self.training)

    def forward(self, *args, **kwargs):
        """A forward-only step in the current mode: the batch's loss on every rank, and on the
        ranks of the last stage the model's outputs, microbatches concatenated on the batch dim
        (the loss their mean); elsewhere None. In train mode only the loss is kept by the last
        stage: (loss, None)."""
        loss = self._run(args, kwargs, backward=False)
        chunks = self._last_outputs
        if not chunks or self.training:
            return loss, None
        merged = []
        for k in range(len(chunks[0])):
            parts = [c[k] for c in chunks]
            if k == self._loss_index:
                merged.append(loss)
            elif isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0:
                merged.append(torch.cat(parts, dim=0))
            else:
                merged.append(parts[0])
        return loss, tuple(merged)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor) or isinstance(getattr(t, "grad", None), DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t
