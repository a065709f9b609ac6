"""The Plan: the only thing the search hands to the rewriter and the report (frozen data).

Built by `autoshard.planner.build_plan`; read by the rewriter, the state-dict and loading code
and the views (`report`, `graph`, `draw`, to which `Plan.report/to_networkx/draw` hand over).

For every node: the strategy it runs and the placement it produces; for every tensor that
changes placement: one redistribution per distinct target, with its forward and backward
collectives (a view of a tensor gathered anyway reuses that gather: `via`); for every parameter name (tied aliases included): its layout; TorchShard dims per
module; predicted bytes and times.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx

from .runtime.counters import ring_bytes
from .runtime.placements import Placement

OUTPUTS = ("full", "sharded")      # how a plan returns the graph's outputs (Plan.outputs)


def check_outputs(outputs) -> str:
    """`outputs` if it is one of OUTPUTS, else a ValueError naming them."""
    if not isinstance(outputs, str) or outputs not in OUTPUTS:
        raise ValueError(f"outputs must be one of {', '.join(repr(o) for o in OUTPUTS)}, got {outputs!r}: "
                         "'full' returns every output whole, 'sharded' returns split outputs as DTensors")
    return outputs


@dataclass(frozen=True)
class NodeDecision:
    """How one node runs: its strategy, output placement, input requirements, TorchShard dim."""

    node: str
    op: str
    strategy: str
    output: Any
    inputs: tuple
    grads: tuple
    dim: int | None
    comm: tuple                  # collectives the op runs itself: (kind, full bytes)
    module: str = ""             # qualified name of the module that ran it (the key of Plan.dims)


@dataclass(frozen=True)
class Redistribution:
    """Tensor `node` goes from `src` to `dst` for `consumers`, which send back gradients placed
    as `grad`; `backward` includes the all-reduce of Partial gradients (Megatron's copy). Two
    entries for one (node, dst) share the forward collectives, listed on the first only.

    `via` names another node when `node` is a view of it (reshapes, `contiguous`, a `to` of the
    same dtype) that is made whole anyway: `node` whole is then those view ops applied to `via`
    whole, and this entry has no forward collective of its own (one tensor is gathered once)."""

    node: str
    src: Placement
    dst: Placement
    grad: Placement
    forward: tuple
    backward: tuple
    nbytes: int
    consumers: tuple
    via: str | None = None

    def ring_bytes(self, p: int) -> float:
        return sum(ring_bytes(k, self.nbytes, p) for k in self.forward + self.backward)


@dataclass(frozen=True)
class Plan:
    """A sharding plan for one model at one tensor-parallel degree."""

    world_size: int
    tracer: str
    nodes: Mapping[str, NodeDecision]
    redistributions: tuple
    layouts: Mapping[str, Placement]          # parameter name -> layout (every alias)
    dims: Mapping[str, int | None]            # module qualified name -> TorchShard dim
    comm_bytes: float                         # per rank per training step, forward + backward
    comm_by_kind: Mapping[str, tuple]         # kind -> (calls, bytes)
    comm_time: float
    compute_time: float
    params_total: int
    params_per_rank: int
    unsupported: tuple
    notes: tuple
    fingerprint: tuple                        # (name, shape) of every parameter: "made for this model"
    cost_model: Any                           # the autoshard.planner.cost.CostModel it was planned with
    search: str
    search_seconds: float
    objective: float
    graph_module: fx.GraphModule = field(compare=False, repr=False)
    example: tuple = field(compare=False, repr=False)
    outputs: str = "full"                     # "full": outputs returned whole; "sharded": split ones as DTensors
    output_placements: Mapping[str, Placement] = field(default_factory=dict)   # node the output reads -> as returned
    checkpointed: tuple = ()                  # blocks whose activations are recomputed in backward
    sequence_parallel: int = 0                # ops holding the stream split on tokens (planner.sequence)
    autocast: tuple = ()                      # ((device, dtype), ...): the torch.autocast captured under
    memory_model: Any = field(default=None, compare=False, repr=False)   # Lazy of the step's Memory
    # (checkpointed=(), scores=None, device=None) -> Memory: the step under other recomputation or on another
    # device (planner.memory.memory_of); kept only where planning was asked to (it holds the Problem)
    memory_with: Any = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def memory(self):
        """Bytes per rank of a training step (autoshard.planner.memory.Memory: parameters, gradients,
        optimizer, activations, peak), worked out on first use."""
        return None if self.memory_model is None else self.memory_model()

    @property
    def step_time(self) -> float:
        """Estimated seconds per training step (communication + compute, no overlap)."""
        return self.comm_time + self.compute_time

    def report(self) -> str:
        from .views.report import format_plan
        return format_plan(self)

    def __str__(self) -> str:
        return self.report()

    def to_networkx(self):
        """The captured graph with this plan's placements, bytes and collectives on its nodes and
        edges, as a networkx.DiGraph (autoshard.views.graph)."""
        from .views.graph import to_networkx
        return to_networkx(self)

    def export(self, engine: str, **options):
        """This plan as another engine's plan dictionary ("dtensor": PyTorch's parallelize_module,
        "hf": a transformers tp_plan), with what that engine leaves replicated and why, and the bytes
        each moves (autoshard.views.engines)."""
        from .views.engines import export
        return export(self, engine, **options)

    def to_dtensor_plan(self, model=None, loss_parallel: bool = False) -> dict:
        """`{module name: ParallelStyle}` for torch.distributed.tensor.parallel.parallelize_module
        (`export("dtensor")`; `model`: the model, to place PrepareModuleInput where column layers
        share an input; a warning lists what the plan leaves replicated)."""
        return _warn_dropped(self.export("dtensor", model=model, loss_parallel=loss_parallel)).plan

    def to_hf_tp_plan(self, base_model_prefix: str | None = None) -> dict:
        """`{pattern: style}` as transformers takes a tp_plan: relative to the base model with
        `base_model_prefix` ("model"), else to the whole model (`export("hf")`; a warning lists what
        it leaves replicated)."""
        return _warn_dropped(self.export("hf", base_model_prefix=base_model_prefix)).plan

    def draw(self, path, **options):
        """Write a picture of this plan to `path` (.svg or .png; needs matplotlib, the "draw"
        extra): repeated blocks folded, parameters colored by layout, collectives marked with
        their bytes (autoshard.views.draw)."""
        from .views.draw import draw
        return draw(self, path, **options)


@dataclass(frozen=True)
class PipelinePlan:
    """Which blocks each stage holds and what a step is predicted to cost."""

    schedule: str
    pp: int
    tp: int
    dp: int
    microbatches: int
    stages_per_rank: int
    stages: tuple                 # per stage: tuple of block names
    forward: tuple                # per stage: predicted seconds of one microbatch's forward
    backward: tuple               # per stage: ... backward
    memory: tuple                 # per stage: predicted peak bytes of the rank for that stage's share
    sent_bytes: tuple             # per boundary: bytes one microbatch sends forward (and its gradient back)
    step_time: float              # predicted seconds of a step (the schedule's makespan)
    bubble: float                 # predicted idle fraction, mean over ranks
    idle: tuple                   # predicted idle fraction per rank
    seconds: float = 0.0          # planning time
    tensor_parallel: Any = field(default=None, compare=False, repr=False)   # the Plan inside each stage

    @property
    def stage_times(self) -> tuple:
        return tuple(f + b for f, b in zip(self.forward, self.backward))

    @property
    def balance(self) -> float:
        """The slowest stage's time over the mean."""
        times = self.stage_times
        return max(times) / (sum(times) / len(times))

    def report(self) -> str:
        from .views.stages import format_pipeline
        return format_pipeline(self)

    def __str__(self) -> str:
        return self.report()


class Lazy:
    """A value made by `make()` on the first call, which then drops `make` (and what it holds)."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __call__(self):
        if self.make is not None:
            self.value, self.make = self.make(), None
        return self.value


def _warn_dropped(exported):
    if exported.dropped:
        warnings.warn(f"autoshard: the {exported.engine} plan leaves {len(exported.dropped)} modules replicated "
                      f"that autoshard splits: " + "; ".join(f"{m}: {w}" for m, w in exported.dropped.items()),
                      stacklevel=3)
    return exported
