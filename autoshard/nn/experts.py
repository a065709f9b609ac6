"""A mixture of experts' expert computations as one op: `autoshard::experts`.

Every transformers experts module (`use_experts_implementation`: Mixtral, Qwen-MoE, DeepSeek,
OLMoE, GPT-OSS-style layouts, ...) runs the same computation whichever of its implementations
(eager loop, `batched_mm`, `grouped_mm` and its fallback) is selected: for each token t and each
of its k routing slots j, with e = index[t, j] and w = weights[t, j],

    out[t] += w * down_e(gate(up_e(x[t])))          up_e: [2I, h] (or [h, 2I] transposed), down_e: [h, I]

Capture writes that computation as this one op (`capture.experts`) so that one sharding rule
can place it; each rank then runs the same op on its local weights:
- expert parallel: the rank holds the experts [first, first + E_r) whole and computes only the
  slots routed to them (its output a summand of the layer's: Partial);
- expert tensor parallel: every expert's FFN split, its up projection on the intermediate dim
  (the gate and up halves each split) and its down projection on its input dim (Partial too);
  a down bias is added as bias / p (`share`), its gradient passed back whole (`bias_share`).
Tokens routed to no expert of the rank cost nothing; an expert without tokens is skipped.

The op is opaque to torch.compile (a custom op, as transformers' grouped_mm fallback is) and
saves only its inputs: backward recomputes each expert's hidden activations (Megatron's MoE
recompute) under the autocast its forward ran in, so a rank holds no expert activations between
forward and backward, whatever the routing. The backward is written out (the activations' own
derivatives), so it runs under any dispatch mode (FlopCounterMode, a memory tracker); only a
module's own gate or an unknown activation is differentiated by torch.func.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..runtime.autocast import autocast_as, autocast_state

# Activations known by name (what a printed graph shows); others are held by key for the process.
_KNOWN = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
}
_C = math.sqrt(2 / math.pi)


def _gelu_tanh_grad(x):
    t = torch.tanh(_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _C * (1 + 3 * 0.044715 * x * x)


# their derivatives (the element-wise activations: the ones an expert's FFN may be split across)
_DERIV = {
    "silu": lambda x: torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))),
    "gelu": lambda x: 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi),
    "gelu_tanh": _gelu_tanh_grad,
    "relu": lambda x: (x > 0).to(x.dtype),
    "sigmoid": lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)),
}
_BY_CLASS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
             "ReLU": "relu", "Sigmoid": "sigmoid"}
_HELD: dict[str, object] = {}
_COUNT = itertools.count()


def activation_key(act, gate: bool = False) -> str:
    """The name `experts` calls `act` by: a known activation's name, or a key under which this
    process holds the callable itself (a parametrised or unknown activation, run as it is). With
    `gate`, `act` is a module's own gate (`_apply_gate`: [n, 2I] -> [n, I], GPT-OSS's clamped
    SwiGLU), applied to the up projection's output whole: its key starts with "gate:"."""
    name = None if gate else _BY_CLASS.get(type(act).__name__)
    if name is None and not gate and type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is F.gelu:
        name = "gelu"
    if name is not None:
        return name
    for key, held in _HELD.items():
        if held == act and key.startswith("gate:") == gate:
            return key
    key = f"{'gate:' if gate else ''}{getattr(act, '__qualname__', type(act).__name__)}#{next(_COUNT)}"
    _HELD[key] = act
    return key


def own_gate(act: str) -> bool:
    """Whether an experts op's `act` is a module's own gate (applied to the up output whole)."""
    return act.startswith("gate:")


def elementwise(act: str) -> bool:
    """Whether `act` is a known element-wise activation: an expert's FFN may be split across it
    (a module's own gate or an unknown activation may read the hidden features together)."""
    return act in _DERIV


def _act(key: str):
    fn = _KNOWN.get(key) or _HELD.get(key)
    if fn is None:
        raise KeyError(f"autoshard::experts: unknown activation {key!r} (keys are held per process: a graph "
                       f"captured in another process must be captured again)")
    return fn


def _gate(mid, gated: bool, act: str):
    """The hidden activation of an expert from its up projection's output `mid`: the first half
    activated times the second (transformers' default gate, whatever the weights' layout flag),
    the activation alone (ungated), or the module's own gate."""
    fn = _act(act)
    if gated and not own_gate(act):
        g, u = mid.chunk(2, dim=-1)
        return fn(g) * u
    return fn(mid)


def _gate_grad(mid, dh, gated: bool, act: str):
    """The gradient of `_gate` at `mid` for the output gradient `dh`."""
    d = _DERIV.get(act)
    if d is None:
        _, vjp = torch.func.vjp(lambda m: _gate(m, gated, act), mid)
        return vjp(dh)[0]
    if not gated:
        return dh * d(mid)
    g, u = mid.chunk(2, dim=-1)
    return torch.cat([dh * u * d(g), dh * _act(act)(g)], dim=-1)


def _lin(x, w, transposed: bool):
    return x @ w if transposed else F.linear(x, w)


def _ffn(x, up, down, up_bias, down_bias, gated, transposed, act, share):
    """(up output, hidden activation, output) of one expert's FFN on its tokens `x` [n, h]; the
    down bias added as bias / `share`."""
    mid = _lin(x, up, transposed)
    if up_bias is not None:
        mid = mid + up_bias
    h = _gate(mid, gated, act)
    y = _lin(h, down, transposed)
    if down_bias is not None:
        y = y + (down_bias if share == 1 else down_bias / share)
    return mid, h, y


def routed(index: torch.Tensor, first: int, count: int):
    """For each expert of [first, first + count) that some slot is routed to: (its local index,
    its slots (flat positions in `index`), their tokens)."""
    k = index.shape[-1]
    flat = index.reshape(-1) - first
    mine = ((flat >= 0) & (flat < count)).nonzero().squeeze(1)
    local = flat[mine]
    slots = mine[torch.argsort(local, stable=True)]
    start = 0
    for e, n in enumerate(torch.bincount(local, minlength=count).tolist()):
        if n:
            s = slots[start:start + n]
            start += n
            yield e, s, s // k


@torch.library.custom_op("autoshard::experts", mutates_args=())
def experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, first: int, gated: bool,
            transposed: bool, act: str, share: int) -> torch.Tensor:
    """The expert computations of a mixture of experts on tokens `x` [T, h] routed by `index`
    [T, k] with `weights` [T, k], for the experts [first, first + up.shape[0])."""
    acc = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    w = weights.reshape(-1)
    for e, s, tok in routed(index, first, up.shape[0]):
        _, _, y = _ffn(x[tok], up[e], down[e], None if up_bias is None else up_bias[e],
                       None if down_bias is None else down_bias[e], gated, transposed, act, share)
        acc.index_add_(0, tok, (y * w[s, None]).to(acc.dtype))
    return acc.to(x.dtype)


@experts.register_fake
def _experts_fake(x, index, weights, up, down, up_bias, down_bias, first, gated, transposed, act, share):
    check_shapes(x, index, weights, up, down, gated, transposed, act)
    return x.new_empty(x.shape)


def check_shapes(x, index, weights, up, down, gated: bool, transposed: bool, act: str) -> None:
    """Refuse inputs the computation does not read as one (run on fake tensors, so a model that
    passes them fails inside capture, naming the sizes): tokens [T, h], routing [T, k] of an
    integer dtype and weights of the same shape, expert weights [E, ...] whose sizes agree."""
    h_up, mid = (up.shape[1], up.shape[2]) if transposed else (up.shape[2], up.shape[1])
    i_down, h_down = (down.shape[1], down.shape[2]) if transposed else (down.shape[2], down.shape[1])
    problems = [
        (x.dim() == 2, f"tokens of shape {tuple(x.shape)}, not [T, h]"),
        (index.dim() == 2 and index.shape[0] == x.shape[0] and not index.is_floating_point(),
         f"routing indices {tuple(index.shape)} ({index.dtype}), not integers [T={x.shape[0]}, k]"),
        (tuple(weights.shape) == tuple(index.shape), f"routing weights {tuple(weights.shape)}, not the indices' "
                                                     f"{tuple(index.shape)}"),
        (up.dim() == 3 == down.dim() and up.shape[0] == down.shape[0], f"expert weights {tuple(up.shape)} and "
                                                                      f"{tuple(down.shape)}, not [E, ...] both"),
        (x.dim() == 2 and h_up == x.shape[-1] == h_down and (mid == (2 if gated else 1) * i_down or
                                                             not (gated or elementwise(act))),
         f"expert weights {tuple(up.shape)} and {tuple(down.shape)} for tokens of {x.shape[-1]} features"),
    ]
    wrong = [why for ok, why in problems if not ok]
    if wrong:
        raise ValueError("autoshard::experts: " + "; ".join(wrong))


@torch.library.custom_op("autoshard::experts_backward", mutates_args=())
def experts_backward(grad: torch.Tensor, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     up: torch.Tensor, down: torch.Tensor, up_bias: torch.Tensor | None,
                     down_bias: torch.Tensor | None, first: int, gated: bool, transposed: bool,
                     act: str, share: int) -> list[torch.Tensor]:
    """Gradients of `experts` for x, weights, up, down, up_bias, down_bias (empty where a bias is
    absent): each expert's FFN recomputed on its tokens and differentiated by hand."""
    dx = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    dw = torch.zeros(weights.numel(), dtype=weights.dtype, device=weights.device)
    dup, ddown = torch.zeros_like(up), torch.zeros_like(down)
    dub = torch.zeros_like(up_bias) if up_bias is not None else x.new_empty(0)
    ddb = torch.zeros_like(down_bias) if down_bias is not None else x.new_empty(0)
    w = weights.reshape(-1)
    for e, s, tok in routed(index, first, up.shape[0]):
        xe = x[tok]
        mid, h, y = _ffn(xe, up[e], down[e], None if up_bias is None else up_bias[e],
                         None if down_bias is None else down_bias[e], gated, transposed, act, share)
        gy = grad[tok].to(y.dtype)
        dw[s] = (y * gy).sum(-1).to(dw.dtype)                 # out = y * w: d w is <y, d out>
        dy = gy * w[s, None].to(gy.dtype)
        dh = dy @ (down[e].T if transposed else down[e]).to(dy.dtype)
        ddown[e] = (h.T @ dy) if transposed else (dy.T @ h)
        if down_bias is not None:
            ddb[e] = dy.sum(0)                                # bias / p's gradient passed back whole (`bias_share`)
        dmid = _gate_grad(mid, dh.to(mid.dtype), gated, act)
        if up_bias is not None:
            dub[e] = dmid.sum(0)
        dx.index_add_(0, tok, (dmid @ (up[e].T if transposed else up[e]).to(dmid.dtype)).to(dx.dtype))
        dup[e] = (xe.T @ dmid.to(xe.dtype)) if transposed else (dmid.T @ xe.to(dmid.dtype))
    return [dx.to(x.dtype), dw.view(weights.shape), dup, ddown, dub, ddb]


@experts_backward.register_fake
def _experts_backward_fake(grad, x, index, weights, up, down, up_bias, down_bias, first, gated, transposed, act, share):
    return [torch.empty_like(x), torch.empty_like(weights), torch.empty_like(up), torch.empty_like(down),
            torch.empty_like(up_bias) if up_bias is not None else x.new_empty(0),
            torch.empty_like(down_bias) if down_bias is not None else x.new_empty(0)]


def _setup(ctx, inputs, output):
    x, index, weights, up, down, up_bias, down_bias, *rest = inputs
    ctx.save_for_backward(x, index, weights, up, down, up_bias, down_bias)
    ctx.rest, ctx.autocast = rest, autocast_state()


def _backward(ctx, grad):
    x, index, weights, up, down, up_bias, down_bias = ctx.saved_tensors
    with autocast_as(ctx.autocast):         # recomputed as the forward ran, whatever backward's autocast
        dx, dw, dup, ddown, dub, ddb = experts_backward(grad, x, index, weights, up, down, up_bias, down_bias,
                                                        *ctx.rest)
    return (dx, None, dw, dup, ddown, dub if up_bias is not None else None, ddb if down_bias is not None else None,
            None, None, None, None, None)


experts.register_autograd(_backward, setup_context=_setup)

EXPERTS_OPS = (torch.ops.autoshard.experts, torch.ops.autoshard.experts.default)
# argument positions of the op
X, INDEX, WEIGHTS, UP, DOWN, UP_BIAS, DOWN_BIAS, FIRST, GATED, TRANSPOSED, ACT, SHARE = range(12)

__all__ = ["experts", "experts_backward", "routed", "activation_key", "own_gate", "elementwise", "EXPERTS_OPS"]
