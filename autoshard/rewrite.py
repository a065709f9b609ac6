"""Rewrite a captured graph by a Plan into this rank's GraphModule.

Parameters become their shards (one copy of the shard, TorchShard attributes, a layout table
under the original names); every redistribution of the plan becomes collectives of
autoshard.collectives inserted once per tensor and target placement; ops whose local form
differs are replaced (row-parallel linear with bias, vocabulary-split embedding and cross
entropy); size arguments of view/reshape/expand/split become local; size queries on sharded
tensors report global sizes so that Python shape arithmetic stays in global terms.
"""
from __future__ import annotations

import copy
import operator
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import collectives as C
from .capture import dynamic_dims, placeholder_inputs
from .cost import fused_backward, redistribute
from .errors import ShardingError
from .nn import functional as PF
from .nn.dropout import ModeBatchNorm, ParallelAttention, ParallelDropout, TrainOnly
from .nn.norm import sharded_layer_norm, sharded_rms_norm, sharded_var
from .placements import Partial, Replicate, ReplicatePartialGrad, Shard, chunk_sizes, layout_of, split_along, stored
from .rules.conv import CONV_OPS, conv_groups
from .rules.norm import LAYER_NORMS, norm_params, var_args
from .rules.registry import node_arg
from .rules.shape import sliced_dim
from .problem import fetch_attr
from .state_dict import register_parallel_attribute
from .verify import check_local_graph

aten = torch.ops.aten

LINEAR_OPS = {F.linear, aten.linear.default}
EMBEDDING_OPS = {F.embedding: (0, 1), aten.embedding.default: (1, 0)}       # op -> (index arg, weight arg)
CROSS_ENTROPY_OPS = {F.cross_entropy, aten.cross_entropy_loss.default}
VIEW_OPS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, aten.view.default, aten.reshape.default,
            aten._unsafe_view.default, torch.Tensor.expand, aten.expand.default}
SPLIT_OPS = {torch.Tensor.split, torch.split, aten.split.Tensor, aten.split_with_sizes.default}
SIZE_OPS = {torch.Tensor.size, aten.sym_size.int}
# dropout ops (input, p, train/training): replaced by ParallelDropout, as nn.Dropout leaf modules are
DROPOUT_OPS = {F.dropout, torch.dropout, aten.dropout.default}
SDPA_OPS = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
BATCH_NORM_OPS = {aten.batch_norm.default: (1, 2, 3, 4, 6, 7), F.batch_norm: (3, 4, 1, 2, 6, 7)}   # w, b, rm, rv, momentum, eps
# ops whose output is a new tensor of their own: a Partial output only reduce_from reads can be
# summed in place (no copy), as Megatron's row-parallel layer does
FRESH_OUTPUT_OPS = LINEAR_OPS | {torch.mm, torch.bmm, torch.matmul, operator.matmul, torch.Tensor.matmul,
                                 torch.addmm, aten.mm.default, aten.bmm.default, aten.matmul.default,
                                 aten.addmm.default, PF.masked_embedding, *CONV_OPS}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _target(n: fx.Node):
    return getattr(torch.Tensor, n.target, n.target) if n.op == "call_method" else n.target


@fx.wrap
def global_size(x, dim: int, world_size: int, d=None, full=None):
    """x.size() (or x.size(d)) of the full tensor whose `dim` is split over `world_size` ranks
    (`full`: that dim's full size, where shards differ)."""
    s = list(x.size())
    s[dim] = s[dim] * world_size if full is None else full
    return torch.Size(s) if d is None else s[d]


@fx.wrap
def local_size(size: int, rank: int, world_size: int, unit: int = 1) -> int:
    """This rank's share of a size computed at run time (torch.chunk's boundaries, in `unit`s)."""
    return chunk_sizes(size, world_size, unit)[rank]


def shard_tensor(t: torch.Tensor, placement, rank: int, p: int) -> torch.Tensor:
    """This rank's shard of `t` (one contiguous copy of the shard only)."""
    if not isinstance(placement, Shard):
        return t
    piece = split_along(t.detach(), placement.dim, p, placement.chunks, uneven=True, unit=placement.unit)[rank]
    # a view (a dim-0 block is contiguous already) would keep the whole tensor alive: copy it once
    return piece if piece._base is None else piece.clone(memory_format=torch.contiguous_format)


def _unit_kw(placement) -> dict:
    """The `unit=` keyword of a collective for a shard cut in whole units (heads), else none."""
    return {"unit": placement.unit} if isinstance(placement, Shard) and placement.unit != 1 else {}


def _torchshard_attrs(placement: Shard, ndim: int, label) -> tuple[int, int]:
    """(parallel_dim, order_type) that TorchShard reads as a split of tensor dim `placement.dim`."""
    if ndim == 1:
        return -1, 0
    if placement.dim == 0:
        return (0, 1) if label == 0 else (-1, 0)       # vocabulary / Conv1D row  vs  Linear column
    return (0, 0) if label == 0 else (-1, 1)           # Linear row  vs  embedding hidden / Conv1D column


class Rewriter:
    """Applies one Plan to a structural copy of the captured GraphModule for one rank."""

    def __init__(self, plan, rank: int, group_key, model=None, dropout_masks: str = "independent"):
        self.plan, self.rank, self.key, self.dropout_masks = plan, rank, group_key, dropout_masks
        self.p = plan.world_size
        src = plan.graph_module
        memo = {id(t): t for t in list(src.parameters()) + list(src.buffers())}
        for n in src.graph.nodes:                     # share tensors and fake values, copy structure
            if "val" in n.meta:
                memo[id(n.meta["val"])] = n.meta["val"]
        with warnings.catch_warnings():       # torch's own TreeSpec pickling warns on copy (export graphs)
            warnings.simplefilter("ignore", FutureWarning)
            self.gm = copy.deepcopy(src, memo)
        if model is not None:
            _bind_tensors(self.gm, model)
        self.old = {n.name: n for n in src.graph.nodes}
        self.graph = self.gm.graph

    # ------------------------------------------------------------------ helpers
    def val(self, name):
        return self.old[name].meta.get("val")

    def placement(self, name):
        """The plan's placement of node `name` (an element of a split's outputs included)."""
        d = self.plan.nodes.get(name)
        if d is not None:
            return d.output
        n = self.old.get(name)
        if n is not None and n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], int):
            parent = self.plan.nodes.get(getattr(n.args[0], "name", None))
            if parent is not None and isinstance(parent.output, tuple):
                return parent.output[n.args[1]]
        return None

    def replace(self, n, fn, args, kwargs=None) -> fx.Node:
        """Put a call of `fn` where `n` is: its users read the call, and `n` is gone."""
        with self.graph.inserting_before(n):
            out = self.call(fn, args, kwargs)
        n.replace_all_uses_with(out)
        self.graph.erase_node(n)
        return out

    def call(self, fn, args, kwargs=None, name=None):
        node = self.graph.call_function(fn, tuple(args), kwargs or {})
        if name:
            node.name = self.graph._graph_namespace.create_name(name, node)
        return node

    # ------------------------------------------------------------------ parameters
    def shard_parameters(self) -> dict:
        """Replace sharded parameters by this rank's shard under every alias name (tied weights
        stay one Parameter); returns the layout table {state-dict name: Shard}."""
        labels = {}
        for d in self.plan.nodes.values():
            if d.dim is not None:
                for n in self.old[d.node].all_input_nodes:
                    if n.op == "get_attr":
                        labels.setdefault(n.target, d.dim)
        chosen = {}
        for name, pl in self.plan.layouts.items():
            if isinstance(pl, Shard):
                chosen.setdefault(id(fetch_attr(self.plan.graph_module, name)), (pl, labels.get(name)))
        by_name = {name: chosen[id(fetch_attr(self.plan.graph_module, name))] for name, pl in self.plan.layouts.items()
                   if isinstance(pl, Shard)}          # by name: the tensors may be another model's
        new_for, table = {}, {}
        for name, full in list(self.gm.named_parameters(remove_duplicate=False)):
            if name not in by_name:
                continue
            pl, label = by_name[name]
            if id(full) not in new_for:
                local = nn.Parameter(shard_tensor(full, pl, self.rank, self.p), requires_grad=full.requires_grad)
                register_parallel_attribute(local, *_torchshard_attrs(pl, full.dim(), label))
                new_for[id(full)] = local
            owner_name, _, attr = name.rpartition(".")
            (self.gm.get_submodule(owner_name) if owner_name else self.gm).register_parameter(attr, new_for[id(full)])
            table[name] = layout_of(full.shape, stored(pl), self.p)     # held as the plain Shard it is
        return table

    # ------------------------------------------------------------------ collectives
    def uneven_size(self, name, placement):
        """The full size of `placement`'s dim of tensor `name` where its shards differ, else None."""
        layout = layout_of(self.val(name).shape, placement, self.p)
        return layout.size if isinstance(layout, Shard) else None

    def forward(self, x: fx.Node, src, dst) -> fx.Node:
        """Collectives turning `x` from `src` into `dst` (each backward is the dual)."""
        key = self.key
        if isinstance(src, ReplicatePartialGrad):        # whole, its gradient left Partial: a slice at most
            if isinstance(dst, Shard):
                return self.call(C.slice_partial, (x, dst.dim, dst.chunks), {"group": key, **_unit_kw(dst)})
            return x
        kinds = redistribute(src, dst)[0]
        if kinds == ("all_reduce",):
            return self.call(C.reduce_from, (x,), {"group": key})
        if kinds == ("reduce_scatter",):
            return self.call(C.reduce_scatter, (x, dst.dim, dst.chunks), {"group": key, **_unit_kw(dst)})
        if kinds == ("all_gather",):
            size = self.uneven_size(x.name, src)
            return self.call(C.gather_from, (x, src.dim, src.chunks),
                             {"group": key, **({"size": size} if size else {}), **_unit_kw(src)})
        if kinds == ("all_to_all",) or (isinstance(src, Shard) and isinstance(dst, Shard)):
            if src.chunks != 1 or dst.chunks != 1:
                raise ShardingError(f"{x.name}: all-to-all between strided shards {src} -> {dst} is not supported")
            if self.uneven_size(x.name, src) or self.uneven_size(x.name, dst) or src.dim == dst.dim:
                whole = self.forward(x, src, Replicate())                # gathered, then sliced
                return self.call(C.scatter_to, (whole, dst.dim, 1), {"group": key, **_unit_kw(dst)})
            return self.call(C.all_to_all, (x, src.dim, dst.dim), {"group": key})
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            return self.call(C.scatter_to, (x, dst.dim, dst.chunks), {"group": key, **_unit_kw(dst)})
        return x

    def insert_redistributions(self):
        """One forward redistribution per (tensor, placement), before its first consumer; a
        copy_to after it for the consumers that send back Partial gradients. A view made whole
        `via` another tensor made whole is that tensor's collective's result with the view ops
        between them applied again (with their global sizes), so the pair moves its bytes once."""
        nodes = {n.name: n for n in self.graph.nodes}
        groups: dict = {}
        for r in self.plan.redistributions:
            groups.setdefault((r.node, r.dst), []).append(r)
        served: dict = {}                      # (via, dst) -> consumers of the views it serves
        for (name, dst), entries in groups.items():
            if entries[0].via is not None:
                whole = Replicate() if isinstance(dst, Shard) else dst      # a shard sliced from the sum
                served.setdefault((entries[0].via, whole), []).extend(c for r in entries for c in r.consumers)
        moved_of = {}
        for (name, dst), entries in sorted(groups.items(), key=lambda kv: kv[1][0].via is not None):
            x = nodes[name]
            via = entries[0].via
            readers = [nodes[c] for r in entries for c in r.consumers] + [nodes[c] for c in served.get((name, dst), ())]
            first = min(readers, key=lambda n: self._order[n])
            with self.graph.inserting_before(first):
                if via is None and len(entries) == 1 and entries[0].backward == ("reduce_scatter",) \
                        and fused_backward(entries[0].forward, entries[0].grad, dst):
                    src = entries[0].src                 # gathered; the Partial gradient reduce-scattered
                    size = self.uneven_size(x.name, src)
                    moved = self.call(C.all_gather, (x, src.dim, src.chunks),
                                      {"group": self.key, **({"size": size} if size else {}), **_unit_kw(src)})
                elif via is None:
                    moved = self.forward(x, entries[0].src, dst)
                elif isinstance(dst, Shard):             # a slice of the all-reduced sum of it (or of its view parent)
                    whole = self._view_of(moved_of[(via, Replicate())], via, name, nodes)
                    moved = self.call(C.scatter_to, (whole, dst.dim, dst.chunks), {"group": self.key, **_unit_kw(dst)})
                else:
                    moved = self._view_of(moved_of[(via, dst)], via, name, nodes)
                moved_of[(name, dst)] = moved
                for r in entries:
                    y = moved
                    if isinstance(r.grad, Partial) and "all_reduce" in r.backward:
                        if not isinstance(dst, Replicate):
                            raise ShardingError(f"{name}: Partial gradients into a {dst} input are not supported")
                        y = self.call(C.copy_to, (moved,), {"group": self.key})
                    for c in r.consumers:
                        nodes[c].replace_input_with(x, y)
            if moved.target is C.reduce_from and len(x.users) == 1 and _target(x) in FRESH_OUTPUT_OPS:
                moved.update_kwarg("inplace", True)

    def _view_of(self, whole: fx.Node, top: str, name: str, nodes: dict) -> fx.Node:
        """Tensor `name` whole, from `whole` (its view ancestor `top` whole): the view ops from
        `top` down to it (as captured) copied onto `whole`, with their captured (global) sizes."""
        chain, n = [], self.old[name]
        while n.name != top:
            chain.append(nodes[n.name])
            n = n.args[0]
        out = whole
        for n in reversed(chain):
            out_node = self.graph.node_copy(n, lambda a: a)
            out_node.args = (out, *n.args[1:])
            out = out_node
        return out

    def wrap_outputs(self):
        """outputs="sharded": each tensor the output returns split (an ordinary Shard, which the
        plan left as it is) becomes a DTensor over the group (`to_dtensor`: no collective)."""
        if self.plan.outputs != "sharded":
            return
        out = next(n for n in self.graph.nodes if n.op == "output")
        nodes = {n.name: n for n in self.graph.nodes}
        for name, pl in self.plan.output_placements.items():
            x = nodes.get(name)
            if isinstance(pl, Shard) and x is not None and x in out.all_input_nodes:
                size = self.uneven_size(name, pl)
                with self.graph.inserting_before(out):
                    dt = self.call(C.to_dtensor, (x, pl.dim), {"group": self.key, **({"size": size} if size else {})},
                                   name=f"{name}_dtensor")
                out.replace_input_with(x, dt)

    # ------------------------------------------------------------------ ops
    def rewrite_ops(self):
        for n in list(self.graph.nodes):
            d = self.plan.nodes.get(n.name)
            if d is None or n.op not in ("call_function", "call_method", "call_module"):
                continue
            t = _target(n)
            if d.strategy == "row" and isinstance(d.output, Replicate):
                self._row_with_bias(n, t)
            elif d.strategy == "grouped" and t in CONV_OPS:
                self._local_groups(n, t)
            elif d.strategy == "vocab" and t in EMBEDDING_OPS:
                self._vocab_embedding(n, t)
            elif d.strategy == "vocab":
                self._vocab_cross_entropy(n, t)
            elif d.strategy == "split_norm":
                self._split_norm(n, t)
            elif d.strategy == "split_var":
                self.replace(n, sharded_var, (n.args[0], *var_args(n)), {"group": self.key})
            elif d.strategy == "partial_mean":
                self._partial_mean(n)
            elif t in SIZE_OPS or (t is getattr and n.args[1] == "shape"):
                self._global_size(n, t)
            elif d.strategy == "column_gather_pg":
                self._gathered_heads(n)
            if t in DROPOUT_OPS or (n.op == "call_module" and type(self.gm.get_submodule(n.target)) is nn.Dropout):
                self._mode_dropout(n, t, d.output)
            elif t in SDPA_OPS and node_arg(n, 4, "dropout_p", 0.0):
                kwargs = {k: v for k, v in n.kwargs.items() if k != "dropout_p"}       # the module sets it
                shard = layout_of(self.val(n.name).shape, d.output, self.p) if isinstance(d.output, Shard) else None
                self._module_call(n, ParallelAttention(node_arg(n, 4, "dropout_p", 0.0), shard,
                                                       t is not F.scaled_dot_product_attention, self.p, self.rank,
                                                       self.dropout_masks),
                                  "attention", n.args, kwargs)
            if isinstance(d.output, Shard) and t in VIEW_OPS:
                self._local_sizes(n, d.output)
            elif t in SPLIT_OPS and d.strategy.startswith("unfuse"):
                self._local_split(n)
            elif d.strategy.startswith("blocks("):
                self._local_blocks(n)

    def _gathered_heads(self, n):
        """K/V of fewer heads than ranks, computed split: the output all-gathered whole (its
        gradient reduce-scattered back), to be sliced by the heads this rank's queries read."""
        dim = self.val(n.name).dim() - 1
        size = self.uneven_size(n.name, Shard(dim))
        with self.graph.inserting_after(n):
            y = self.call(C.all_gather, (n, dim, 1), {"group": self.key, **({"size": size} if size else {})})
        n.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)

    def _mode_ops(self):
        """Batch norm (and its num_batches_tracked += 1) as modules that follow train()/eval()."""
        for n in list(self.graph.nodes):
            t = _target(n)
            if t in BATCH_NORM_OPS:
                w, b, rm, rv, mom, eps = (n.args[i] if i < len(n.args) else None for i in BATCH_NORM_OPS[t])
                if t is F.batch_norm:
                    w, b, rm, rv = (node_arg(n, i, k, None) for i, k in ((3, "weight"), (4, "bias"),
                                                                        (1, "running_mean"), (2, "running_var")))
                    mom, eps = node_arg(n, 6, "momentum", 0.1), node_arg(n, 7, "eps", 1e-5)
                self._module_call(n, ModeBatchNorm(mom, eps), "batch_norm", (n.args[0], w, b, rm, rv))
            elif t is aten.add_.Tensor and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr" \
                    and n.args[0].target.endswith("num_batches_tracked"):
                self._module_call(n, TrainOnly(), "train_only", tuple(n.args[:2]))

    def _mode_dropout(self, n, t, placement):
        if n.op == "call_module":
            p = self.gm.get_submodule(n.target).p
        else:
            p = node_arg(n, 1, "p", 0.5)
        shard = layout_of(self.val(n.name).shape, placement, self.p) if isinstance(placement, Shard) else None
        self._module_call(n, ParallelDropout(p, shard, self.p, self.rank, self.dropout_masks), "dropout",
                          (n.args[0],))

    def _module_call(self, n, module: nn.Module, name: str, args, kwargs=None) -> fx.Node:
        """Put a call of a new submodule `module` (named autoshard_<name>_<k>) where `n` is."""
        k = self._modules_added = getattr(self, "_modules_added", 0) + 1
        target = f"autoshard_{name}_{k}"
        self.gm.add_submodule(target, module)
        with self.graph.inserting_before(n):
            out = self.graph.call_module(target, tuple(args), kwargs or {})
        out.meta.update(n.meta)
        n.replace_all_uses_with(out)
        self.graph.erase_node(n)
        return out

    def _row_with_bias(self, n, t):
        if t in LINEAR_OPS:
            x, w, b = n.args[0], n.args[1], node_arg(n, 2, "bias")
            op, add = (F.linear, operator.add) if t is F.linear else (aten.linear.default, aten.add.Tensor)
            with self.graph.inserting_before(n):
                y = self.call(op, (x, w))
        elif t in (aten.addmm.default, torch.addmm):
            b, x, w = n.args[:3]
            add = aten.add.Tensor if t is aten.addmm.default else operator.add
            with self.graph.inserting_before(n):
                y = self.call(aten.mm.default if t is aten.addmm.default else torch.mm, (x, w))
        elif t in CONV_OPS:
            w, b = n.args[1], node_arg(n, 2, "bias")
            aten_op = isinstance(t, torch._ops.OpOverload)
            args, kwargs = list(n.args), dict(n.kwargs)
            if len(args) > 2:
                args[2] = None
            else:
                kwargs.pop("bias", None)
            # the bias broadcasts over the spatial dims: (C,) -> (C, 1, ...)
            spatial = self.val(w.name).dim() - 2
            shape = [self.val(b.name).shape[0]] + [1] * spatial
            add = aten.add.Tensor if aten_op else operator.add
            with self.graph.inserting_before(n):
                y = self.call(t, args, kwargs)
                b = self.call(aten.view.default if aten_op else torch.reshape, (b, shape))
        else:
            raise ShardingError(f"{n.format_node()}: no row-parallel form with a bias")
        with self.graph.inserting_before(n):
            y = self.call(C.reduce_from, (y,), {"group": self.key, "inplace": True})     # y: the matmul's own
        self.replace(n, add, (y, b))

    def _local_groups(self, n, t):
        """A grouped convolution split on channels: this rank holds groups / p whole groups."""
        i, g = CONV_OPS[t], conv_groups(n)
        if g % self.p:
            raise ShardingError(f"{n.format_node()}: groups={g} do not divide by the degree {self.p}")
        if len(n.args) > i:
            n.args = (*n.args[:i], g // self.p, *n.args[i + 1:])
        else:
            n.update_kwarg("groups", g // self.p)

    def _vocab_embedding(self, n, t):
        ia, wa = EMBEDDING_OPS[t]
        idx, w = n.args[ia], n.args[wa]
        pad = node_arg(n, 2, "padding_idx")
        if t is not F.embedding and pad == -1:
            pad = None
        kw = {"group": self.key}
        if self.uneven_size(w.name, Shard(0)):
            kw["num_embeddings"] = self.val(w.name).shape[0]
        self.replace(n, PF.masked_embedding, (idx, w, pad), kw)

    def _vocab_cross_entropy(self, n, t):
        logits, target = n.args[0], n.args[1]
        if n.op == "call_module":
            m = self.gm.get_submodule(n.target)
            kw = dict(weight=m.weight, ignore_index=m.ignore_index, reduction=m.reduction,
                      label_smoothing=m.label_smoothing)
            if m.weight is not None:
                raise ShardingError(f"{n.target}: class weights of nn.CrossEntropyLoss modules are not supported "
                                    "in the vocabulary-parallel loss; use F.cross_entropy(weight=...)")
        elif t is F.cross_entropy:
            a = list(n.args) + [None] * 8
            kw = dict(weight=n.kwargs.get("weight", a[2]), ignore_index=n.kwargs.get("ignore_index", a[4] if a[4] is not None else -100),
                      reduction=n.kwargs.get("reduction", a[6] or "mean"),
                      label_smoothing=n.kwargs.get("label_smoothing", a[7] or 0.0))
            if n.kwargs.get("size_average") is not None or n.kwargs.get("reduce") is not None:
                raise ShardingError(f"{n.format_node()}: size_average/reduce are deprecated; use reduction=")
        else:
            a = list(n.args) + [None] * 6
            kw = dict(weight=a[2] if a[2] is not None else n.kwargs.get("weight"),
                      reduction=_REDUCTIONS[a[3] if a[3] is not None else n.kwargs.get("reduction", 1)],
                      ignore_index=a[4] if a[4] is not None else n.kwargs.get("ignore_index", -100),
                      label_smoothing=a[5] if a[5] is not None else n.kwargs.get("label_smoothing", 0.0))
        kw["group"] = self.key
        if self.uneven_size(logits.name, Shard(1)):
            kw["num_classes"] = self.val(logits.name).shape[1]
        self.replace(n, PF.vocab_parallel_cross_entropy, (logits, target), kw)

    def _split_norm(self, n, t):
        """A layer / RMS norm over a split last dim: statistics summed over the ranks."""
        weight, bias = norm_params(n)
        args = list(n.args) + [None] * 6
        if t in LAYER_NORMS:
            eps = n.kwargs.get("eps", args[4] if args[4] is not None else 1e-5)
            fn, call_args = sharded_layer_norm, (n.args[0], args[1] or n.kwargs["normalized_shape"], weight, bias, eps)
        else:
            eps = n.kwargs.get("eps", args[3])
            fn, call_args = sharded_rms_norm, (n.args[0], args[1] or n.kwargs["normalized_shape"], weight, eps)
        self.replace(n, fn, call_args, {"group": self.key})

    def _partial_mean(self, n):
        """A mean over a split dim: this rank's mean over its block, divided by the degree, is
        its summand of the full mean."""
        with self.graph.inserting_after(n):
            out = self.call(operator.truediv, (n, self.p))
        n.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)

    def _global_size(self, n, t):
        src = n.args[0]
        pl = self.placement(src.name)
        if not isinstance(pl, Shard):
            return
        d = n.args[1] if len(n.args) > 1 and t is not getattr else n.kwargs.get("dim")
        kw = {"d": d}
        full = self.uneven_size(src.name, pl)
        if full:
            kw["full"] = full
        self.replace(n, global_size, (src, pl.dim, self.p), kw)

    def _local_sizes(self, n, out: Shard):
        """Divide the size argument of the sharded dim by the degree (a -1 stays -1)."""
        sizes = n.args[1:]
        packed = len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size))
        if packed:
            sizes = sizes[0]
        sizes = list(sizes)
        d = out.dim
        if d >= len(sizes):
            raise ShardingError(f"{n.format_node()}: cannot find the size argument of sharded dim {d}")
        s = sizes[d]
        if isinstance(s, fx.Node):
            with self.graph.inserting_before(n):
                sizes[d] = self.call(local_size, (s, self.rank, self.p, out.unit))
        elif s != -1:
            if s % out.unit or min(chunk_sizes(s, self.p, out.unit)) == 0:
                raise ShardingError(f"{n.format_node()}: size {s} of sharded dim {d} leaves a rank empty at "
                                    f"degree {self.p} (in units of {out.unit})")
            sizes[d] = chunk_sizes(s, self.p, out.unit)[self.rank]
        n.args = (n.args[0], sizes) if packed else (n.args[0], *sizes)

    def _local_blocks(self, n):
        """A slice taking whole blocks of a strided shard: the same blocks of this rank's pieces
        (every block is split evenly, so the bounds divide by the degree)."""
        size = self.val(n.args[0].name).shape
        d, start, stop, step = sliced_dim(n, len(size))
        start, stop, _ = slice(start, stop).indices(size[d])
        local = slice(start // self.p, stop // self.p)       # the bounds as captured, for this rank
        if n.target is aten.slice.Tensor:
            n.args = (n.args[0], d, local.start, local.stop, *n.args[4:])
        else:          # a getitem: its bounds may be nodes (x.shape[-1]), replaced by their local ints
            idx = tuple(local if isinstance(e, slice) and e != slice(None) else e for e in
                        (n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)))
            n.args = (n.args[0], idx)

    def _local_split(self, n):
        def local(s):
            if isinstance(s, int):
                return s // self.p
            with self.graph.inserting_before(n):          # a size computed at run time
                return self.call(operator.floordiv, (s, self.p))
        size = n.args[1]
        size = [local(s) for s in size] if isinstance(size, (list, tuple)) else local(size)
        n.args = (n.args[0], size, *n.args[2:])

    # ------------------------------------------------------------------ driver
    def run(self) -> fx.GraphModule:
        self._order = {n: i for i, n in enumerate(self.graph.nodes)}
        table = self.shard_parameters()
        self.insert_redistributions()
        self.wrap_outputs()
        self.rewrite_ops()
        self._mode_ops()
        self.graph.lint()
        self.gm.recompile()
        self.gm._autoshard_layouts = table
        self.gm._autoshard_group = self.key
        self.gm._autoshard_plan = self.plan
        return self.gm


class InputCheck:
    """Run before a rewritten graph (autoshard.signatures): every tensor input has the number of dims the plan was made for and
    its sizes where the plan fixed them (feature dims, split dims); batch and sequence sizes,
    which capture found free, may be anything. A wrong input gets a ShardingError naming it."""

    def __init__(self, tracer: str, specs: tuple, placeholders: tuple):
        self.tracer, self.specs = tracer, specs          # ((name, example shape, free dims) | None, ...)
        self.placeholders = placeholders                 # the module's placeholder nodes: found once, not per call

    @classmethod
    def of(cls, plan, gm: fx.GraphModule) -> "InputCheck":
        specs = []
        for n in plan.graph_module.graph.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                specs.append((n.target, tuple(int(x) for x in v.shape), dynamic_dims(n))
                             if isinstance(v, torch.Tensor) else None)
        return cls(plan.tracer, tuple(specs), tuple(n for n in gm.graph.nodes if n.op == "placeholder"))

    def __call__(self, module, args, kwargs):
        try:
            flat = placeholder_inputs(module, self.tracer, args, kwargs, self.placeholders)
        except Exception:  # noqa: BLE001 - a call that does not match forward(): its own error follows
            return None
        for spec, x in zip(self.specs, flat):
            if spec is None or not isinstance(x, torch.Tensor):
                continue
            name, shape, free = spec
            if x.dim() != len(shape) or any(x.shape[d] != s for d, s in enumerate(shape) if d not in free):
                want = "(" + ", ".join("*" if d in free else str(s) for d, s in enumerate(shape)) + ")"
                raise ShardingError(f"input {name!r} has shape {tuple(x.shape)}, but the module was planned for "
                                    f"shape {want} (* = any size; the example was {shape}); plan again with an "
                                    f"example of this shape")
        return None


def _bind_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make `gm` hold `model`'s parameters and buffers under the same names (tied ones stay tied;
    a plan may have been captured from another instance of the same architecture), listed in the
    model's order (fx registers submodules in the order forward first uses them)."""
    for named, get, register in ((model.named_parameters(remove_duplicate=False), gm.get_parameter, "register_parameter"),
                                 (model.named_buffers(remove_duplicate=False), gm.get_buffer, "register_buffer")):
        for name, t in named:
            try:
                if get(name) is t:
                    continue
            except AttributeError:
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = gm.get_submodule(owner_name) if owner_name else gm
            if register == "register_parameter":
                owner.register_parameter(attr, t)
            else:
                owner.register_buffer(attr, t, persistent=attr not in owner._non_persistent_buffers_set)
    for name, theirs in model.named_modules(remove_duplicate=False):   # the model's order, not forward's:
        try:                                                            # state_dict() and parameters() match
            ours = gm.get_submodule(name) if name else gm
        except AttributeError:
            continue
        for attr in ("_parameters", "_buffers", "_modules"):
            mine, model_order = getattr(ours, attr), getattr(theirs, attr)
            keys = [k for k in model_order if k in mine] + [k for k in mine if k not in model_order]
            if list(mine) != keys:
                items = [(k, mine[k]) for k in keys]
                mine.clear()
                mine.update(items)


def rewrite(plan, rank: int, group_key=None, model=None, dropout_masks: str = "independent") -> fx.GraphModule:
    """This rank's GraphModule for `plan`, holding `model`'s tensors (default: the planned ones);
    `dropout_masks` is ParallelDropout's `masks`."""
    gm = Rewriter(plan, rank, group_key, model, dropout_masks).run()
    check_local_graph(gm, plan, rank)
    return gm
