"""The local form of each op under a plan: what a rank runs in place of the captured op.

Row-parallel layers with a bias reduce and then add it; vocabulary-split embeddings and cross
entropy become their masked / parallel forms; split norms, variances and means reduce their
statistics; grouped convolutions take their local groups; K/V of fewer heads than ranks are
gathered whole; dropout and batch norm become modules that follow train() / eval(); size
arguments of views, expands and splits become this rank's, and size queries on split tensors
report global sizes so that Python shape arithmetic stays in global terms. `LocalOps` is the
half of `rewriter.Rewriter` that does this, after the collectives are in place.
"""
from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..capture.ops import CONV_OPS, LAYER_NORMS, conv_groups, node_arg, norm_params, sliced_range, var_args
from ..errors import ShardingError
from ..nn import experts as EX
from ..nn import functional as PF
from ..nn.dropout import ModeBatchNorm, ParallelAttention, ParallelDropout, TrainOnly
from ..nn.norm import sharded_layer_norm, sharded_rms_norm, sharded_var
from ..runtime import collectives as C
from ..runtime.groups import subgroup
from ..runtime.placements import (Partial, Replicate, ReplicatePartialGrad, Shard, blocks_of, chunk_start, cover_ranges,
                                  groups_of, held_by_groups, layout_of, piece_sizes, shares)

aten = torch.ops.aten

LINEAR_OPS = {F.linear, aten.linear.default}
EMBEDDING_OPS = {F.embedding: (0, 1), aten.embedding.default: (1, 0)}       # op -> (index arg, weight arg)
VIEW_OPS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, aten.view.default, aten.reshape.default,
            aten._unsafe_view.default, torch.Tensor.expand, aten.expand.default, torch.broadcast_to,
            aten.broadcast_to.default}
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


def target_of(n: fx.Node):
    """The op of a call node: its function, `torch.Tensor.<name>` for a method call."""
    return getattr(torch.Tensor, n.target, n.target) if n.op == "call_method" else n.target


@fx.wrap
def global_size(x, dim: int, world_size: int, d=None, full=None):
    """x.size() (or x.size(d)) of the full tensor whose `dim` is split over `world_size` ranks
    (`full`: that dim's full size, where shards differ)."""
    s = list(x.size())
    s[dim] = s[dim] * world_size if full is None else full
    return torch.Size(s) if d is None else s[d]


@fx.wrap
def local_size(size: int, rank: int, world_size: int, unit: int = 1, chunks: int = 1, parts=None, nest: int = 1,
               cover: int = 1) -> int:
    """This rank's share of a size computed at run time (torch.chunk's boundaries, in `unit`s, in
    each of `chunks` blocks, equal or of the sizes `parts`, in groups of `nest` ranks, or the
    units its readers' share reads: `cover`)."""
    return piece_sizes(size, world_size, chunks, unit, parts, nest, cover=cover)[rank]


def shard_kw(placement) -> dict:
    """The `unit=` / `parts=` / `nest=` keywords of a collective for a shard cut in whole units
    (heads), into blocks of unequal sizes or in groups of ranks first, else none."""
    if not isinstance(placement, Shard):
        return {}
    return {**({"unit": placement.unit} if placement.unit != 1 else {}),
            **({"parts": list(placement.parts)} if placement.parts is not None else {}),
            **({"nest": placement.nest} if placement.nest != 1 else {})}



class LocalOps:
    """Mixin of `rewriter.Rewriter`: replaces ops by their local forms (it uses the rewriter's
    plan, graph, `call`, `replace`, `val` and `uneven_size`)."""

    def rewrite_ops(self):
        for n in list(self.graph.nodes):
            d = self.plan.nodes.get(n.name)
            if d is None or n.op not in ("call_function", "call_method", "call_module"):
                continue
            t = target_of(n)
            if d.strategy == "row" and isinstance(d.output, Replicate):
                self._row_with_bias(n, t)
            elif d.strategy == "row" and isinstance(d.output, Partial):
                self._bias_share(n, t)
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
            elif d.strategy == "partial_plus":
                self._whole_share(n, d)
            elif d.strategy == "regroup":
                n.update_arg(1, max(1, n.args[1] // self.p))     # this rank's groups (one, or G / p)
            elif t in SIZE_OPS or (t is getattr and n.args[1] == "shape"):
                self._global_size(n, t)
            elif d.strategy == "column_gather_pg":
                self._gathered_heads(n)
            elif d.strategy == "column_gather_groups":
                self._gathered_heads(n, replicas=groups_of(d.output, self.p)[1])
            elif d.strategy == "column_gather_cover":
                self._gathered_heads(n, cut=d.output)
            elif d.strategy == "replicate_cover":
                self._own_rows(n, t, d.output)
            elif d.strategy == "expert_parallel":        # this rank's experts start at its block
                n.update_arg(EX.FIRST, chunk_start(self.val(n.args[EX.UP].name).shape[0], self.rank, self.p))
            elif d.strategy == "expert_tensor" and n.args[EX.DOWN_BIAS] is not None:
                n.update_arg(EX.SHARE, self.p)             # the down bias added as bias / p
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

    def _gathered_heads(self, n, dim=None, replicas=1, cut=None):
        """K/V of fewer heads than ranks, computed split: the output all-gathered whole along `dim`
        (the last by default; its gradient reduce-scattered back), to be sliced by the heads this
        rank's queries read; with `replicas` = m, gathered within this rank's group of m ranks
        only (`Shard(dim, replicas=m)`: the heads the group's queries read); with `cut` (a shard
        held by the ranks that read it), cut to this rank's heads at once."""
        dim = self.val(n.name).dim() - 1 if dim is None else dim
        size = self.uneven_size(n.name, Shard(dim))
        group = self.key if replicas == 1 else subgroup(self.key, replicas)
        with self.graph.inserting_after(n):
            y = last = self.call(C.all_gather, (n, dim, 1), {"group": group, **({"size": size} if size else {})})
            if cut is not None:
                with self.graph.inserting_after(y):
                    last = self.call(C.slice_held, (y, dim, *self._own_range(n.name, cut)))
        n.replace_all_uses_with(last, delete_user_cb=lambda u: u not in (y, last))

    def _own_range(self, name, held: Shard) -> tuple[int, int]:
        """(start, length) of this rank's piece of tensor `name` held by the ranks that read it."""
        lo, hi = cover_ranges(int(self.val(name).shape[held.dim]), self.p, held.unit, held.cover)[self.rank]
        return lo, hi - lo

    def _own_rows(self, n, t, out: Shard):
        """A K/V projection of replicated weights computing only the heads this rank's queries read
        ("replicate_cover"): the weight's rows and the bias's entries of those heads, sliced
        (`C.slice_held`: their gradients zero-padded, summands the weight's all-reduce sums)."""
        if t in LINEAR_OPS:
            slots = ((1, "weight", 0), (2, "bias", 0))
        elif t in (aten.addmm.default, torch.addmm):
            slots = ((2, "mat2", 1), (0, "input", 0))
        else:
            raise ShardingError(f"{n.format_node()}: no form computing only this rank's K/V heads")
        start, length = self._own_range(n.name, out)
        for pos, name, dim in slots:
            q = node_arg(n, pos, name)
            if not isinstance(q, fx.Node):
                continue
            with self.graph.inserting_before(n):
                piece = self.call(C.slice_held, (q, dim, start, length))
            if pos < len(n.args):
                n.update_arg(pos, piece)
            else:
                n.update_kwarg(name, piece)

    def mode_ops(self):
        """Batch norm (and its num_batches_tracked += 1) as modules that follow train()/eval()."""
        for n in list(self.graph.nodes):
            t = target_of(n)
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

    def _bias_share(self, n, t):
        """A row-parallel op left Partial adds bias / p on every rank (`PF.bias_share`): the sum
        over the ranks adds the bias once, and the bias gets its whole gradient on every rank."""
        if t in LINEAR_OPS or t in CONV_OPS:
            pos, name = 2, "bias"
        elif t in (aten.addmm.default, torch.addmm):
            pos, name = 0, "input"
        else:
            return
        b = node_arg(n, pos, name)
        if not isinstance(b, fx.Node):
            return
        with self.graph.inserting_before(n):
            share = self.call(PF.bias_share, (b, self.p))
        if pos < len(n.args):
            n.update_arg(pos, share)
        else:
            n.update_kwarg(name, share)

    def _whole_share(self, n, d):
        """A Partial summand plus a whole tensor: the whole one enters as this rank's share (1/p,
        `PF.bias_share`), so the ranks' summands add it once."""
        whole = next(a for a, r in zip(n.all_input_nodes, d.inputs) if isinstance(r, Replicate))
        with self.graph.inserting_before(n):
            share = self.call(PF.bias_share, (whole, self.p))
        n.replace_input_with(whole, share)

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
        self.replace(n, global_size, (src, pl.dim, groups_of(pl, self.p)[0]), kw)

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
        groups, m = groups_of(out, self.p)          # a shard held by groups of m ranks: the group's piece
        if isinstance(s, fx.Node):
            with self.graph.inserting_before(n):
                sizes[d] = self.call(local_size, (s, self.rank // m, groups, out.unit, out.chunks, out.parts, out.nest,
                                                  out.cover))
        elif s != -1:
            try:
                sizes[d] = piece_sizes(s, groups, **out.blocking)[self.rank // m]
            except ValueError as e:
                raise ShardingError(f"{n.format_node()}: sharded dim {d} as {out}: {e}") from None
        n.args = (n.args[0], sizes) if packed else (n.args[0], *sizes)

    def _local_blocks(self, n):
        """A slice taking whole blocks of a strided shard `Shard(d, k)`: the same blocks of this
        rank's piece, which holds its share of each block (`block_sizes`: the block / p, or whole
        heads where they do not divide)."""
        src_name = self.old[n.name].args[0].name          # as captured (a rewrite may have replaced it)
        size = self.val(src_name).shape
        d, start, stop = sliced_range(n, size)
        src = self.placement(src_name)
        ends = list(itertools.accumulate(blocks_of(size[d], src.chunks, src.parts), initial=0))
        local_ends = list(itertools.accumulate((s[self.rank] for s in shares(size[d], src, self.p)), initial=0))
        local = slice(local_ends[ends.index(start)], local_ends[ends.index(stop)])   # this rank's bounds
        if n.target is aten.slice.Tensor:
            n.args = (n.args[0], d, local.start, local.stop, *n.args[4:])
        else:          # a getitem: its bounds may be nodes (x.shape[-1]), replaced by their local ints
            idx = tuple(local if isinstance(e, slice) and e != slice(None) else e for e in
                        (n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)))
            n.args = (n.args[0], idx)
        out = self.plan.nodes[n.name].output
        if isinstance(out, ReplicatePartialGrad) or held_by_groups(out):      # a part of too few heads
            self._gathered_heads(n, d, replicas=groups_of(out, self.p)[1])

    def _local_split(self, n):
        """A split of a strided shard into its blocks (`unfuse`): each block's size becomes this
        rank's share of it (the block / p, or whole heads where they do not divide)."""
        out = self.plan.nodes[n.name].output
        unit = next(o.unit for o in out if isinstance(o, Shard))

        def local(s):
            if isinstance(s, int):
                return piece_sizes(s, self.p, 1, unit)[self.rank]
            with self.graph.inserting_before(n):          # a size computed at run time
                return self.call(local_size, (s, self.rank, self.p, unit))
        size = n.args[1]
        size = [local(s) for s in size] if isinstance(size, (list, tuple)) else local(size)
        n.args = (n.args[0], size, *n.args[2:])
        dim = node_arg(n, 2, "dim", 0) % self.val(self.old[n.name].args[0].name).dim()
        for g in list(n.users):            # parts of too few heads: gathered whole where they are cut out
            part = out[g.args[1]] if g.target is operator.getitem else None
            if isinstance(part, ReplicatePartialGrad) or held_by_groups(part):
                self._gathered_heads(g, dim, replicas=groups_of(part, self.p)[1])

    # ------------------------------------------------------------------ driver
