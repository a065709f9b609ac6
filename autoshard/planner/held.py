"""What a rank holds under a plan and how fast its step is, as plans are compared: bytes of
parameters per rank (`state_bytes`, the least any plan reaches, one group's choice) and the
predicted step without the memory term (`step_seconds`). The budget, the relaxing moves and the
optimal search all bound and compare plans by these."""
from __future__ import annotations

from ..runtime.placements import REPLICATE, Shard, local_numel
from .problem import IMBALANCE


def step_seconds(prob, state) -> float:
    """Predicted seconds of a step under `state`: its objective without the memory term."""
    keys = list(prob.param_obj)
    return state.total - memory_term(prob, keys, [state.placement_of_param(k) for k in keys])


def memory_term(prob, params, placements) -> float:
    """The objective's memory term of `params` held at `placements` (`Problem.param_cost`, at the
    problem's price of state now)."""
    return sum(prob.param_cost(k, pl) for k, pl in zip(params, placements))


def param_bytes(prob, key, placement) -> float:
    """Bytes of a parameter a rank holds as the cost model counts them: the ranks' mean plus IMBALANCE
    of the largest rank's excess over it (a split in whole heads that do not divide, 2, 1 and 1 of 4
    heads on 3 ranks, weighs what the ranks hold together, as in `Problem.param_cost`)."""
    obj = prob.param_obj[key]
    mean = obj.numel() / (prob.p if isinstance(placement, Shard) else 1)
    largest = local_numel(obj.shape, placement, prob.p)
    return (mean + IMBALANCE * (largest - mean)) * obj.element_size()


def group_bytes(prob, params, placements) -> float:
    """Bytes a rank holds of `params` at `placements` (one decision group's choice, `param_bytes`)."""
    return sum(param_bytes(prob, k, pl) for k, pl in zip(params, placements))


def state_bytes(prob, state) -> float:
    """Bytes of parameters a rank holds under `state` (`param_bytes`; its training state / state_factor)."""
    return sum(param_bytes(prob, k, state.placement_of_param(k)) for k in prob.param_obj)


def least_state(prob) -> int:
    """The smallest `state_bytes` any choice of the groups reaches (each group at its smallest)."""
    grouped = {k for grp in prob.groups for k in grp.params}
    total = sum(param_bytes(prob, k, REPLICATE) for k in prob.param_obj if k not in grouped)
    for grp in prob.groups:
        total += min(group_bytes(prob, grp.params, ch) for ch in grp.choices)
    return total
