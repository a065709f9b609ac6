"""Capture normal form: a transformers experts module written as the one op `autoshard::experts`.

transformers' experts modules (`use_experts_implementation`) hold 3-D weights (`gate_up_proj`
[E, 2I, h] or `up_proj`, `down_proj` [E, h, I], optional biases) and run one of several
implementations (an eager loop over experts, `batched_mm`, `grouped_mm` or its fallback), each a
graph of sorts, histograms, index ops and grouped matmuls no per-op rule can split without
gathering every expert's weights. All of them compute the same thing (`nn.experts`), so for the
duration of a capture each such module's forward calls that one op, which one rule places
(`planner.rules.experts`): experts placed on ranks or each expert's FFN split, never gathered.

A module with a gate of its own (`_apply_gate`: GPT-OSS's clamped SwiGLU) runs that gate inside
the op, on whole experts only (expert parallel); one with a norm after each expert keeps its
captured ops, with a note.
"""
from __future__ import annotations

import contextlib
import inspect
import types

import torch
import torch.nn as nn

from ..nn.experts import activation_key, experts


def _is_experts(m: nn.Module) -> bool:
    """A transformers experts module: 3-D expert weights and the attributes its decorator sets."""
    up = getattr(m, "gate_up_proj", None) if getattr(m, "has_gate", False) else getattr(m, "up_proj", None)
    down = getattr(m, "down_proj", None)
    return all(hasattr(m, a) for a in ("has_gate", "is_transposed", "has_bias")) and \
        isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 == down.dim()


def _has_own_gate(m: nn.Module) -> bool:
    return bool(m.has_gate) and getattr(getattr(type(m), "_apply_gate", None), "__name__", "") != "_default_apply_gate"


def _unlike(m: nn.Module) -> str | None:
    """Why `m`'s computation is not the one `nn.experts` runs, or None."""
    if getattr(m, "has_post_expert_norm", False):
        return "a norm after each expert"
    return None


def _forward(self, *args, **kwargs):
    bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
    hidden_states, top_k_index, top_k_weights = list(bound.arguments.values())[1:4]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    down_bias = self.down_proj_bias if self.has_bias else None
    return experts(hidden_states, top_k_index, top_k_weights, up, self.down_proj, up_bias, down_bias, 0,
                   bool(self.has_gate), bool(self.is_transposed),
                   activation_key(self._apply_gate, gate=True) if _has_own_gate(self) else activation_key(self.act_fn), 1)


@contextlib.contextmanager
def experts_as_one_op(model: nn.Module, notes: list):
    """For the duration, every transformers experts module of `model` runs `autoshard::experts`."""
    patched, kept = [], []
    for name, m in model.named_modules():
        if not _is_experts(m):
            continue
        why = _unlike(m)
        if why is not None:
            kept.append(f"{name} ({why})")
            continue
        patched.append((m, m.__dict__.get("forward")))
        m.forward = types.MethodType(_forward, m)
    if kept:
        notes.append(f"experts kept as captured, their weights gathered where split: {', '.join(kept[:3])}"
                     + (f" and {len(kept) - 3} more" if len(kept) > 3 else ""))
    try:
        yield
    finally:
        for m, own in patched:
            if own is None:
                del m.forward
            else:
                m.forward = own
