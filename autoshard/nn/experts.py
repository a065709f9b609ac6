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
recompute), so a rank holds no expert activations between forward and backward, whatever the
routing.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

# Activations known by name (what a printed graph shows); others are held by key for the process.
_KNOWN = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
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
    """Whether an experts op's `act` is a module's own gate (whose halves no rule may split)."""
    return act.startswith("gate:")


def _act(key: str):
    fn = _KNOWN.get(key) or _HELD.get(key)
    if fn is None:
        raise KeyError(f"autoshard::experts: unknown activation {key!r} (keys are held per process: a graph "
                       f"captured in another process must be captured again)")
    return fn


def expert_ffn(x, up, down, up_bias, down_bias, gated: bool, transposed: bool, act: str,
               share: int = 1):
    """One expert's FFN on its tokens `x` [n, h]: up, gate (the first half activated times the
    second, as transformers' default gate computes it whatever the weights' layout, or the module's
    own), down; the down bias added as bias / `share`."""
    mid = x @ up if transposed else F.linear(x, up)
    if up_bias is not None:
        mid = mid + up_bias
    fn = _act(act)
    if own_gate(act):
        mid = fn(mid)
    elif gated:
        g, u = mid.chunk(2, dim=-1)
        mid = fn(g) * u
    else:
        mid = fn(mid)
    y = mid @ down if transposed else F.linear(mid, down)
    if down_bias is not None:
        y = y + (down_bias if share == 1 else down_bias / share)
    return y


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
        y = expert_ffn(x[tok], up[e], down[e], None if up_bias is None else up_bias[e],
                       None if down_bias is None else down_bias[e], gated, transposed, act, share)
        acc.index_add_(0, tok, (y * w[s, None]).to(acc.dtype))
    return acc.to(x.dtype)


@experts.register_fake
def _experts_fake(x, index, weights, up, down, up_bias, down_bias, first, gated, transposed, act, share):
    return torch.empty_like(x)


@torch.library.custom_op("autoshard::experts_backward", mutates_args=())
def experts_backward(grad: torch.Tensor, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     up: torch.Tensor, down: torch.Tensor, up_bias: torch.Tensor | None,
                     down_bias: torch.Tensor | None, first: int, gated: bool, transposed: bool,
                     act: str, share: int) -> list[torch.Tensor]:
    """Gradients of `experts` for x, weights, up, down, up_bias, down_bias (empty where a bias is
    absent): each expert's FFN recomputed on its tokens and differentiated (torch.func.vjp)."""
    dx = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    dw = torch.zeros(weights.numel(), dtype=weights.dtype, device=weights.device)
    dup, ddown = torch.zeros_like(up), torch.zeros_like(down)
    dub = torch.zeros_like(up_bias) if up_bias is not None else x.new_empty(0)
    ddb = torch.zeros_like(down_bias) if down_bias is not None else x.new_empty(0)
    w = weights.reshape(-1)
    for e, s, tok in routed(index, first, up.shape[0]):
        ub = None if up_bias is None else up_bias[e]
        db = None if down_bias is None else down_bias[e]
        primals = [x[tok], w[s], up[e], down[e]] + [b for b in (ub, db) if b is not None]

        def f(xe, we, u, d, *biases):
            it = iter(biases)
            y = expert_ffn(xe, u, d, None if ub is None else next(it), None if db is None else next(it),
                           gated, transposed, act, share)
            return y * we[:, None]
        out, vjp = torch.func.vjp(f, *primals)
        gx, gw, gu, gd, *gb = vjp(grad[tok].to(out.dtype))
        gub = gb.pop(0) if ub is not None else None
        gdb = gb.pop(0) if db is not None else None
        dx.index_add_(0, tok, gx.to(dx.dtype))
        dw[s] = gw.to(dw.dtype)
        dup[e], ddown[e] = gu, gd
        if ub is not None:
            dub[e] = gub
        if db is not None:
            ddb[e] = gdb * share            # bias / p's gradient passed back whole (`bias_share`)
    return [dx.to(x.dtype), dw.view(weights.shape), dup, ddown, dub, ddb]


@experts_backward.register_fake
def _experts_backward_fake(grad, x, index, weights, up, down, up_bias, down_bias, first, gated, transposed, act, share):
    return [torch.empty_like(x), torch.empty_like(weights), torch.empty_like(up), torch.empty_like(down),
            torch.empty_like(up_bias) if up_bias is not None else x.new_empty(0),
            torch.empty_like(down_bias) if down_bias is not None else x.new_empty(0)]


def _setup(ctx, inputs, output):
    x, index, weights, up, down, up_bias, down_bias, *rest = inputs
    ctx.save_for_backward(x, index, weights, up, down, up_bias, down_bias)
    ctx.rest = rest


def _backward(ctx, grad):
    x, index, weights, up, down, up_bias, down_bias = ctx.saved_tensors
    dx, dw, dup, ddown, dub, ddb = experts_backward(grad, x, index, weights, up, down, up_bias, down_bias, *ctx.rest)
    return (dx, None, dw, dup, ddown, dub if up_bias is not None else None, ddb if down_bias is not None else None,
            None, None, None, None, None)


experts.register_autograd(_backward, setup_context=_setup)

EXPERTS_OPS = (torch.ops.autoshard.experts, torch.ops.autoshard.experts.default)
# argument positions of the op
X, INDEX, WEIGHTS, UP, DOWN, UP_BIAS, DOWN_BIAS, FIRST, GATED, TRANSPOSED, ACT, SHARE = range(12)

__all__ = ["experts", "experts_backward", "expert_ffn", "routed", "activation_key", "own_gate", "EXPERTS_OPS"]
