"""Rewrite a captured graph by a Plan into this rank's GraphModule.

Parameters become their shards (one copy of the shard, TorchShard attributes, a layout table
under the original names); every redistribution of the plan becomes collectives of
autoshard.collectives inserted once per tensor and target placement; then ops whose local form
differs are replaced (`local_ops`); each rank's module is checked on fake tensors (`verify`)
and checks its inputs at call time (`InputCheck`).
"""
from __future__ import annotations

import copy
import operator
import warnings
from dataclasses import replace

import torch
import torch.fx as fx
import torch.nn as nn

from ..capture.dynamic import dynamic_dims
from ..capture.repeats import STACK
from ..capture.shapes import fetch_attr, placeholder_inputs
from ..errors import ShardingError
from ..runtime import collectives as C
from ..runtime.groups import subgroup
from ..runtime.pieces import split_along
from ..runtime.placements import (Partial, Replicate, ReplicatePartialGrad, Shard, cover_cut, cover_ranges,
                                  held_by_groups, held_by_readers, layout_of, shares, stored)
from ..runtime.sequence import REGATHERED
from ..runtime.state_dict import register_parallel_attribute
from ..runtime.transitions import fused_backward, redistribute
from .grouped import regroup_kv_heads
from .local_ops import FRESH_OUTPUT_OPS, LocalOps, shard_kw, target_of
from .outputs import Outputs
from .overlap import fuse_column_linears, fuse_gathered_linears
from .verify import check_local_graph


def shard_tensor(t: torch.Tensor, placement, rank: int, p: int) -> torch.Tensor:
    """This rank's shard of `t` (one contiguous copy of the shard only)."""
    if not isinstance(placement, Shard):
        return t
    piece = split_along(t.detach(), placement.dim, p, uneven=True, **placement.blocking)[rank]
    # a view (a dim-0 block is contiguous already) would keep the whole tensor alive: copy it once
    return piece if piece._base is None else piece.clone(memory_format=torch.contiguous_format)


def _torchshard_attrs(placement: Shard, ndim: int, label) -> tuple[int, int]:
    """(parallel_dim, order_type) that TorchShard reads as a split of tensor dim `placement.dim`."""
    if ndim == 1:
        return -1, 0
    if placement.dim == 0:
        return (0, 1) if label == 0 else (-1, 0)       # vocabulary / Conv1D row  vs  Linear column
    return (0, 0) if label == 0 else (-1, 1)           # Linear row  vs  embedding hidden / Conv1D column


class Rewriter(LocalOps, Outputs):
    """Applies one Plan to a structural copy of the captured GraphModule for one rank."""

    def __init__(self, plan, rank: int, group_key, model=None, dropout_masks: str = "independent",
                 overlap: bool = False):
        self.plan, self.rank, self.key, self.dropout_masks, self.overlap = plan, rank, group_key, dropout_masks, overlap
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
        """The plan's placement of node `name` (an element of a split's outputs included; a parameter's
        layout: a slice of a parameter held in blocks, a size read of a split one)."""
        d = self.plan.nodes.get(name)
        if d is not None:
            return d.output
        n = self.old.get(name)
        if n is not None and n.op == "get_attr":
            return self.plan.layouts.get(n.target)
        if n is not None and n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], int):
            parent = self.plan.nodes.get(getattr(n.args[0], "name", None))
            if parent is not None and isinstance(parent.output, tuple):
                return parent.output[n.args[1]]
        return None

    def replace(self, n, fn, args, kwargs=None) -> fx.Node:
        """Put a call of `fn` where `n` is: its users read the call, and `n` is gone."""
        with self.graph.inserting_before(n):
            out = self.call(fn, args, kwargs)
        if STACK in n.meta:                     # the module that ran `n` runs its local form (blocks)
            out.meta[STACK] = n.meta[STACK]
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
                return self.call(C.slice_partial, (x, dst.dim, dst.chunks), {"group": key, **shard_kw(dst)})
            return x
        if held_by_readers(src) or held_by_readers(dst):
            return self._cut_held(x, src, dst)
        if isinstance(src, Replicate) and held_by_groups(dst) and dst.chunks == 1:   # a held cache: its group's piece
            sizes, m = shares(int(self.val(x.name).shape[dst.dim]), dst, self.p)[0], dst.replicas
            start = sum(sizes[k * m] for k in range(self.rank // m))
            return self.call(C.slice_held, (x, dst.dim, start, sizes[self.rank]))
        if held_by_groups(src):          # the group's piece, cut to this rank's own within the group
            if dst == src:
                return x
            return self.call(C.slice_partial, (x, dst.dim, dst.chunks),
                             {"group": subgroup(key, src.replicas), **shard_kw(replace(dst, nest=1))})
        kinds = redistribute(src, dst)[0]
        if isinstance(src, Shard) and isinstance(dst, Shard):
            if kinds == ("all_to_all",) and not (self.uneven_size(x.name, src) or self.uneven_size(x.name, dst)):
                return self.call(C.all_to_all, (x, src.dim, dst.dim), {"group": key})
            whole = self.forward(x, src, Replicate())                    # gathered, then sliced
            return self.call(C.scatter_to, (whole, dst.dim, dst.chunks), {"group": key, **shard_kw(dst)})
        if kinds == ("all_reduce",):
            return self.call(C.reduce_from, (x,), {"group": key})
        if kinds == ("reduce_scatter",):
            return self.call(C.reduce_scatter, (x, dst.dim, dst.chunks), {"group": key, **shard_kw(dst)})
        if kinds == ("all_gather",):
            size = self.uneven_size(x.name, src)
            return self.call(C.gather_from, (x, src.dim, src.chunks),
                             {"group": key, **({"size": size} if size else {}), **shard_kw(src)})
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            return self.call(C.scatter_to, (x, dst.dim, dst.chunks), {"group": key, **shard_kw(dst)})
        return x

    def _cut_held(self, x: fx.Node, src, dst, name: str | None = None) -> fx.Node:
        """A shard held by the ranks that read it, cut to this rank's piece of `dst` (its query
        heads), or a whole tensor cut to this rank's piece of it (`dst`): a local slice whose
        gradient is zero-padded (`C.slice_held`). `name`: the captured tensor (default `x`)."""
        if src == dst:
            return x
        held = src if held_by_readers(src) else dst
        n = int(self.val(name or x.name).shape[held.dim])
        if held_by_readers(src):
            start, length = cover_cut(n, src, dst, self.p)[self.rank]
        else:
            lo, hi = cover_ranges(n, self.p, dst.unit, dst.cover)[self.rank]
            start, length = lo, hi - lo
        return self.call(C.slice_held, (x, held.dim, start, length))

    def insert_redistributions(self):
        """One forward redistribution per (tensor, placement), before its first consumer; a
        copy_to after it for the consumers that send back Partial gradients. A view made whole
        `via` another tensor made whole is that tensor's collective's result with the view ops
        between them applied again (with their global sizes), so the pair moves its bytes once."""
        nodes = {n.name: n for n in self.graph.nodes}
        self.regathered = []                   # all-gathers the plan gathers again in backward
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
                if via is None and len(entries) == 1 and entries[0].backward in (("reduce_scatter",), REGATHERED) \
                        and fused_backward(entries[0].forward, entries[0].grad, dst):
                    src = entries[0].src                 # gathered; the Partial gradient reduce-scattered
                    size = self.uneven_size(x.name, src)
                    moved = self.call(C.all_gather, (x, src.dim, src.chunks),
                                      {"group": self.key, **({"size": size} if size else {}), **shard_kw(src)})
                    if entries[0].backward == REGATHERED:  # fused with its linear readers (after rewrite_ops)
                        self.regathered.append(moved)
                elif via is None and held_by_readers(dst) and "all_reduce" in entries[0].backward:
                    # a whole tensor cut to the heads this rank's queries read: the summands of
                    # its gradient all-reduced whole
                    moved = self._cut_held(self.call(C.copy_to, (x,), {"group": self.key}), entries[0].src, dst, name)
                elif via is None:
                    moved = self.forward(x, entries[0].src, dst)
                elif isinstance(dst, Shard):             # a slice of the all-reduced sum of it (or of its view parent)
                    whole = self.view_of(moved_of[(via, Replicate())], via, name, nodes)
                    moved = self.call(C.scatter_to, (whole, dst.dim, dst.chunks), {"group": self.key, **shard_kw(dst)})
                else:
                    moved = self.view_of(moved_of[(via, dst)], via, name, nodes)
                moved_of[(name, dst)] = moved
                for r in entries:
                    y = moved
                    if isinstance(r.grad, Partial) and "all_reduce" in r.backward:
                        if not isinstance(dst, Replicate):
                            raise ShardingError(f"{name}: Partial gradients into a {dst} input are not supported")
                        y = self.call(C.copy_to, (moved,), {"group": self.key})
                    for c in r.consumers:
                        nodes[c].replace_input_with(x, y)
            if moved.target is C.reduce_from and len(x.users) == 1 and target_of(x) in FRESH_OUTPUT_OPS:
                moved.update_kwarg("inplace", True)

    def run(self) -> fx.GraphModule:
        self._order = {n: i for i, n in enumerate(self.graph.nodes)}
        table = self.shard_parameters()
        self.insert_redistributions()
        self.wrap_outputs()
        self.rewrite_ops()
        self.mode_ops()
        regroup_kv_heads(self.gm)
        fuse_gathered_linears(self.gm, self.regathered)
        if self.overlap:
            fuse_column_linears(self.gm)
        self.graph.lint()
        self.gm.recompile()
        self.gm._autoshard_layouts = table
        self.gm._autoshard_group = self.key
        self.gm._autoshard_plan = self.plan
        return self.gm


class InputCheck:
    """Run before a rewritten graph (autoshard.rewrite.signatures): every tensor input has the number of dims the plan was made for and
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


def rewrite(plan, rank: int, group_key=None, model=None, dropout_masks: str = "independent",
            overlap: bool = False) -> fx.GraphModule:
    """This rank's GraphModule for `plan`, holding `model`'s tensors (default: the planned ones);
    `dropout_masks` is ParallelDropout's `masks`; `overlap`: column-parallel layers' input-gradient
    all-reduce overlapped with their weight gradients (autoshard.rewrite.overlap)."""
    gm = Rewriter(plan, rank, group_key, model, dropout_masks, overlap).run()
    check_local_graph(gm, plan, rank)
    return gm
