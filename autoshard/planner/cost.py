"""Alpha-beta cost model: ring collectives, compute divided by the degree, memory per rank.

Everything is in seconds so one number can be minimised: communication and compute time per
training step, plus a term for the training state (parameter, gradient and optimizer moments) a
rank holds. By default (`memory_weight=None`) no constant price decides: the planner takes the
fastest plan whose state per rank exceeds the least reachable by at most `STATE_TOLERANCE` of the
model's state (`budget.least_comm`), state priced only to break ties. A `memory_weight` in seconds
per byte (1e-9: a GB of state ~ one second) prices state at that constant instead.
`memory_budget` (the peak bytes of a step per rank, `planner.memory`) takes the fastest plan that
fits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.counters import ring_bytes, split_kind
from .memory import optimizer_states, parse_bytes
from .rules.conv import conv_flops
from .rules.experts import experts_flops
from .rules.registry import family_of


# A byte of state priced only to break ties of equal step time toward the smaller state: 500 bytes of
# state weigh what one byte sent does (50 GB/s), a 32-feature norm's state still more than the
# search's 1e-12 improvement threshold.
TIE_PRICE = 1e-14
# No budget, no price: the plan's training state per rank (the largest rank's) may exceed the least
# reachable by this fraction of the whole model's state: small layers (norms, a 768 x 768 transform,
# replicated K/V) may stay whole where that moves fewer bytes, as Megatron keeps them, every large
# weight is split. A fraction of the model, not of 1/p of it, since what Megatron keeps whole is (2.6%
# of a 2-layer BERT-base). At 1.5% BERT-base at 2 layers and 8 ranks split its transform again (1.10
# of Megatron's bytes: the transform is 1.34% of it, with norms and biases more).
STATE_TOLERANCE = 0.02


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Knobs of the objective; validated on construction."""

    bandwidth: float = 50e9          # bytes/s a rank sends
    latency: float = 1e-6            # seconds per ring step (NVLink-class)
    flops: float = 50e12             # flop/s of one rank
    memory_weight: float | None = None   # seconds per byte of training state per rank; None: no price
    state_factor: float = 4.0        # parameter + gradient + two Adam moments
    memory_budget: float | str | None = None   # peak bytes per rank of a training step ("30GB"), or None
    optimizer: str | int = "adamw"   # what holds state per parameter (planner.memory.OPTIMIZER_STATES)

    def __post_init__(self):
        for name in ("bandwidth", "flops", "state_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be > 0, got {getattr(self, name)}")
        for name in ("latency", "memory_weight"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
            if self.memory_budget <= 0:
                raise ValueError(f"CostModel.memory_budget must be > 0 bytes, got {self.memory_budget}")
        optimizer_states(self.optimizer)

    def comm_time(self, kind: str, nbytes: float, p: int) -> float:
        if p <= 1:
            return 0.0
        base, m = split_kind(kind)
        ranks = p if m is None else m
        steps = 2 * (ranks - 1) if base == "all_reduce" else ranks - 1
        return ring_bytes(kind, nbytes, p) / self.bandwidth + steps * self.latency

    def compute_time(self, flop: float) -> float:
        return flop / self.flops

    def memory_cost(self, param_bytes: float, price: float | None = None) -> float:
        """Seconds charged for holding `param_bytes` of parameters (with their gradient and optimizer
        state) at `price` per byte (default: `memory_weight`, or the tie-breaking price without one)."""
        if price is None:
            price = TIE_PRICE if self.memory_weight is None else self.memory_weight
        return price * self.state_factor * param_bytes


def flops(node, s) -> float:
    """Forward + backward flops of a node, whichever strategy `s` runs it (the strategy's
    `compute` scales them): matmul family 3 x 2 * output elements * contraction size,
    convolutions likewise (the contraction is in-channels per group x kernel); others 3 per element."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0.0
    family = family_of(node)
    if family == "conv":
        return conv_flops(node)
    if family == "experts":
        return experts_flops(node)
    if family == "matmul":
        for a in node.all_input_nodes:          # x of linear / addmm(b, x, w), a of a @ b
            x = a.meta.get("val")
            if isinstance(x, torch.Tensor) and x.dim() >= 2:
                return 6.0 * v.numel() * x.shape[-1]
    return 3.0 * v.numel()
