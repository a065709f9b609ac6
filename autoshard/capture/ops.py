"""What a captured op's arguments mean: the readers the planner's rules and the rewrite share.

A call node's argument by position or keyword, the one dim a slice takes and its bounds, a
convolution's groups, a norm's weight and bias, a variance's dim and correction, and the tables
of ops these apply to (convolutions, norms, variances, losses). Facts about the captured graph,
so they live with capture: the rules read them to choose strategies, the rewrite to run them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten

# the ops a loss is computed by (the rules' loss family; the views mark their nodes)
LOSS_OPS = (F.cross_entropy, aten.cross_entropy_loss.default, nn.CrossEntropyLoss)


def flat_outputs(nodes) -> list:
    """What a graph's output node returns (of its `nodes`), as a flat list."""
    out = next(n for n in nodes if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]


def is_loss(node: fx.Node, modules: dict) -> bool:
    """Whether `node` is a cross entropy: a function of LOSS_OPS, or a call of a module of one of
    its classes (`modules`: the graph module's named modules)."""
    if node.op == "call_module":
        return isinstance(modules.get(node.target), tuple(op for op in LOSS_OPS if isinstance(op, type)))
    return node.op == "call_function" and node.target in LOSS_OPS


def node_arg(node: fx.Node, pos: int, name: str, default=None):
    """The argument `name` of a call node, given at position `pos` or by keyword (else `default`)."""
    return node.args[pos] if pos < len(node.args) else node.kwargs.get(name, default)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def int_of(x):
    """A bound as an int: itself, or the value captured for a node computing it (x.shape[-1])."""
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else x
    return x


def sliced_dim(node, nd: int):
    """(dim, start, stop, step) of a node that slices one dim (aten.slice, or a getitem with one
    partial slice and full ones elsewhere), else None; bounds computed by nodes read as the
    values captured for them."""
    if node.target is aten.slice.Tensor:
        a = list(node.args) + [None] * 5
        return norm_dim(int(a[1] if a[1] is not None else 0), nd), int_of(a[2]), int_of(a[3]), int_of(a[4])
    idx = node.args[1] if node.target is operator.getitem else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not all(e is Ellipsis or isinstance(e, slice) for e in idx) or sum(e is Ellipsis for e in idx) > 1:
        return None
    partial = [i for i, e in enumerate(idx) if isinstance(e, slice) and e != slice(None)]
    if len(partial) != 1:
        return None
    i = partial[0]
    if Ellipsis in idx and idx.index(Ellipsis) < i:
        d = nd - (len(idx) - i)
    else:
        d = i
    e = idx[i]
    return d, int_of(e.start), int_of(e.stop), int_of(e.step)


def sliced_range(node, shape):
    """(dim, start, stop) of a node that takes one contiguous range of one dim of a tensor of
    `shape` (`sliced_dim` with a unit step and bounds known as ints, normalised to the dim's
    size), else None."""
    cut = sliced_dim(node, len(shape))
    if cut is None:
        return None
    d, start, stop, step = cut
    if step not in (None, 1) or not all(isinstance(b, (int, type(None))) for b in (start, stop)):
        return None
    start, stop, _ = slice(start, stop).indices(int(shape[d]))
    return d, start, stop


CONV_OPS = {op: 6 for op in (F.conv1d, F.conv2d, F.conv3d, aten.conv1d.default, aten.conv2d.default,
                             aten.conv3d.default, aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)}
CONV_OPS[aten.convolution.default] = 8        # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def conv_groups(node) -> int:
    """The `groups` argument of a convolution node (1 when left at its default)."""
    return int(node_arg(node, CONV_OPS[node.target], "groups", 1))


LAYER_NORMS = (F.layer_norm, aten.layer_norm.default)         # mean and variance: two statistics
NORM_ARGS = {F.layer_norm: ("weight", "bias"), aten.layer_norm.default: ("weight", "bias"),
             F.rms_norm: ("weight", None), aten.rms_norm.default: ("weight", None)}


def norm_params(node):
    """(weight, bias) arguments of a layer/RMS norm call (None where absent)."""
    names = NORM_ARGS[node.target]
    args = list(node.args) + [None] * 4
    return tuple(None if name is None else (args[2 + i] if args[2 + i] is not None else node.kwargs.get(name))
                 for i, name in enumerate(names))


VAR_OPS = (torch.var, torch.Tensor.var, aten.var.correction, aten.var.dim)


def var_args(node):
    """(dim, correction, keepdim) of a var call reducing one dim, or None."""
    args, kw = list(node.args) + [None] * 4, node.kwargs
    dim = args[1] if args[1] is not None else kw.get("dim")
    if isinstance(dim, (tuple, list)):
        dim = dim[0] if len(dim) == 1 else None
    if not isinstance(dim, int):
        return None
    unbiased = args[2] if isinstance(args[2], bool) else kw.get("unbiased")
    correction = kw.get("correction", (1 if unbiased is None or unbiased else 0))
    keepdim = args[3] if isinstance(args[3], bool) else kw.get("keepdim", False)
    return dim, (1 if correction is None else correction), bool(keepdim)


def _tensor_of(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _runs_elsewhere(n: fx.Node) -> bool:
    """Ops that must run once, where the plan put them: collectives, dropout and other random ops,
    module calls (blocks, mode modules) and anything impure."""
    if n.op == "call_module":
        return True
    target = n.target
    module = getattr(target, "__module__", "") or ""
    if module.startswith("autoshard.runtime") or module.startswith("autoshard.nn"):
        return True
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return True
    try:
        return n.is_impure()
    except Exception:  # noqa: BLE001 - an op fx cannot judge: keep it where it is
        return True


def kinds(root: nn.Module, graph: fx.Graph) -> tuple[set, set]:
    """(free nodes, parameter reads) of `graph`, whose targets resolve in `root`. A free node is
    computed from the graph's inputs and buffers by pure ops (positions, rotary tables, masks,
    sizes): a pipeline stage recomputes it rather than receive it (planner.pipeline,
    rewrite.stages)."""
    free, params = set(), set()
    for n in graph.nodes:
        if n.op == "placeholder":
            free.add(n)
        elif n.op == "get_attr":
            (params if isinstance(_tensor_of(root, n.target), nn.Parameter) else free).add(n)
        elif n.op in ("call_function", "call_method") and not _runs_elsewhere(n) \
                and all(i in free for i in n.all_input_nodes):
            free.add(n)
    return free, params
