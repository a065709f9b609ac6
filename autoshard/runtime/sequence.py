"""Column-parallel layers on a sequence-parallel input that save only this rank's tokens (Megatron's
`LinearWithGradAccumulationAndAsyncCommunication` with `sequence_parallel`).

Under sequence parallelism a column layer's input (a norm's output) is held `Shard(token dim)` and
all-gathered before the layer; unfused, autograd then saves the gathered, whole tensor for the
weight gradient, p times what the rank holds. `gathered_linears(x, dim, w1, b1, w2, b2, ...)` is
that gather and the linear layers reading it (q, k and v; gate and up; one fc) as one autograd
function: forward gathers `x` and runs the layers, saving `x` itself (the rank's tokens); backward
sums the input gradient over the layers and reduce-scatters it onto the tokens (the gather's dual),
then gathers `x` again (one gather for all the layers) for their weight gradients. One all-gather
more per step and input, for (p - 1)/p of the input's bytes less saved. Eager and under
torch.compile (functional collectives there, as `collectives`); values as the unfused graph's
(fp32: the input gradient summed in another order).

`column_readers` says which graph nodes the function stands for (linear layers reading the gathered
tensor, or one view of it flattening batch and sequence: GPT-2's Conv1D): the planner prices the
extra gather (`REGATHERED`, a Redistribution's backward) and the rewrite fuses by the same test.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from .collectives import gather_pieces, reduce_scatter_pieces, resolve

__all__ = ["gathered_linears", "linear_parts", "flattening_view", "column_readers", "REGATHERED"]

aten = torch.ops.aten

# a gather whose consumers are fused: backward gathers the input again, then reduce-scatters its gradient
REGATHERED = ("all_gather", "reduce_scatter")

# op -> (position of the input, of the weight, of the bias, their keywords, form): "linear" is
# x @ w.T + b, "addmm" is b + x @ w (a Conv1D's, weight [in, out])
_LINEAR = (0, 1, 2, "weight", "bias", "linear")
_ADDMM = (1, 2, 0, None, None, "addmm")
_FORMS = {F.linear: _LINEAR, aten.linear.default: _LINEAR, torch.addmm: _ADDMM, aten.addmm.default: _ADDMM}


def linear_parts(n: torch.fx.Node, x: torch.fx.Node):
    """(weight, bias or None, form) of a call node `n` that is a linear layer reading `x` as its input
    with its weight and bias held by the graph (`get_attr`), else None."""
    spec = _FORMS.get(n.target) if n.op == "call_function" else None
    if spec is None:
        return None
    xi, wi, bi, weight_kw, bias_kw, form = spec
    args = list(n.args)
    if len(args) <= xi or args[xi] is not x or len(args) > 3 or set(n.kwargs) - {weight_kw, bias_kw}:
        return None
    weight = args[wi] if wi < len(args) else n.kwargs.get(weight_kw) if weight_kw else None
    bias = args[bi] if bi < len(args) else n.kwargs.get(bias_kw) if bias_kw else None
    held = [t for t in (weight, bias) if t is not None]
    if weight is None or not all(isinstance(t, torch.fx.Node) and t.op == "get_attr" for t in held):
        return None
    return weight, bias, form


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
          torch.reshape, torch.Tensor.view, torch.Tensor.reshape}


def flattening_view(n: torch.fx.Node, x: torch.fx.Node, val=None) -> bool:
    """Whether `n` views `x` [..., features] as [tokens, features] (GPT-2's Conv1D flattening batch
    and sequence), so that linear layers reading `n` read `x` flattened (shapes from `meta["val"]`;
    `val`: x's whole value where x has none, a collective inserted by the rewrite)."""
    target = getattr(torch.Tensor, n.target, None) if n.op == "call_method" else n.target
    a, b = x.meta.get("val", val), n.meta.get("val")
    return n.op in ("call_function", "call_method") and target in _VIEWS and bool(n.args) and n.args[0] is x \
        and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() == 2 and a.dim() > 2 \
        and b.shape[-1] == a.shape[-1] and b.numel() == a.numel()


def column_readers(x: torch.fx.Node, readers, val=None):
    """(layers, [(weight, bias, form)], flat) where `readers` of `x` are linear layers reading it
    (`linear_parts`), or one `flattening_view` of it read by linear layers only (flat), else None."""
    readers = list(readers)
    flat = len(readers) == 1 and flattening_view(readers[0], x, val)
    layers, src = (list(readers[0].users), readers[0]) if flat else (readers, x)
    parts = [linear_parts(r, src) for r in layers]
    if not layers or any(q is None for q in parts):
        return None
    return layers, parts, flat


def _layer(x, w, b, form):
    return torch.addmm(b, x, w) if form == "addmm" else F.linear(x, w, b)


class _GatheredLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, size, cut, forms, flat, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.args, ctx.cut, ctx.forms = (dim, 1, group), dict(cut), forms
        ctx.size, ctx.biased = size, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)              # this rank's tokens, not the gathered tensor
        full = gather_pieces(x, dim, 1, group, size, op="gathered_linears", **ctx.cut)
        if flat:
            full = full.reshape(-1, full.size(-1))
        return tuple(_layer(full, w, b, f) for w, b, f in zip(weights, biases, forms))

    @staticmethod
    def backward(ctx, *grads):
        """The input gradient first (reduce-scattered before `x` is gathered again, so the two whole
        tensors are not held at once), then the weight gradients; each in its gradient's dtype (an
        autocast forward's), cast back to its tensor's, as autograd differentiates the casts."""
        x, *weights = ctx.saved_tensors
        gx = sum((g @ (w.to(g.dtype) if f == "linear" else w.to(g.dtype).t())).to(x.dtype)
                 for g, w, f in zip(grads, weights, ctx.forms))
        dim = ctx.args[0] % x.dim()
        gx = gx.reshape(*x.shape[:dim], -1, *x.shape[dim + 1:])       # as gathered (unflattened)
        gx = reduce_scatter_pieces(gx, *ctx.args, op="gathered_linears", direction="backward", **ctx.cut)
        full = gather_pieces(x, *ctx.args, ctx.size, op="gathered_linears", direction="backward", **ctx.cut)
        flat_x = full.reshape(-1, full.size(-1))
        out = []
        for g, w, f, biased in zip(grads, weights, ctx.forms, ctx.biased):
            flat = g.reshape(-1, g.size(-1))
            gw = flat.t() @ flat_x.to(flat.dtype) if f == "linear" else flat_x.to(flat.dtype).t() @ flat
            out += [gw.to(w.dtype), flat.sum(0).to(w.dtype) if biased else None]
        return (gx, None, None, None, None, None, None, *out)


def gathered_linears(x, dim, *params, group=None, size=None, forms=None, flat=False, unit=1, parts=None, nest=1):
    """The outputs of the layers `forms[i]` ("linear": F.linear(whole, w_i, b_i); "addmm":
    torch.addmm(b_i, whole, w_i)) of `whole`, `x` all-gathered on `dim` (`size`, `unit`... as
    `collectives.all_gather`; `flat`: then viewed as [-1, features]), for `params` = (w1, b1, w2,
    b2, ...) (a linear's bias may be None). Backward: the input gradient reduce-scattered onto
    `dim`, `x` gathered again for the weight gradients; only `x` is saved. An FX leaf, as the
    collectives are."""
    forms = tuple(forms or ("linear",) * (len(params) // 2))
    for a in (x, *params):
        if isinstance(a, torch.fx.Proxy):
            return a.tracer.create_proxy("call_function", gathered_linears, (x, dim, *params),
                                         {"group": group, "size": size, "forms": forms, "flat": flat, "unit": unit,
                                          "parts": parts, "nest": nest})
    pg, p = resolve(group)
    if p == 1:
        whole = x.reshape(-1, x.size(-1)) if flat else x
        return tuple(_layer(whole, w, b, f) for w, b, f in zip(params[0::2], params[1::2], forms))
    cut = (("unit", int(unit)), ("parts", None if parts is None else tuple(int(q) for q in parts)), ("nest", int(nest)))
    return _GatheredLinears.apply(x, dim, pg, size, cut, forms, bool(flat), *params)


torch.fx.wrap("gathered_linears")
