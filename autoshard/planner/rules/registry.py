"""The sharding-rule registry: one function per op family lists the strategies a node may take.

A rule is called with a `NodeInfo` and returns `OpStrategy`s; the all-Replicate strategy is
implicit and always added. Rules are keyed by op object: the function of a `call_function`
node, `torch.Tensor.<name>` for a `call_method` node, the module class of a `call_module` node.
Adding an op is adding one decorated function; the search never changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ...capture.dynamic import dynamic_dims
from ...capture.ops import node_arg
from ...nn.functional import regroup
from ...runtime.counters import split_kind
from ...runtime.placements import (PARTIAL, REPLICATE, REPLICATE_PG, Partial, Placement, Replicate,
                                   ReplicatePartialGrad, Shard, ShardGathered, block_sizes, cover_ranges, divides,
                                   splits)

_RULES: dict[Any, Callable] = {}
_FAMILY: dict[Callable, str] = {}     # rule -> family name ("matmul", "embedding", "conv")
# The families of TorchShard's parallel layers: Plan.dims lists their modules (None when whole).
PARALLEL_LAYERS = ("matmul", "embedding", "conv", "experts")
# Ops whose result is shape metadata (size, dim, ...): they accept any input placement.
SHAPE_OPS: set[Any] = set()


@dataclass(frozen=True)
class OpStrategy:
    """One way to run a node: what it needs of each input and what it produces.

    `inputs` follows `node.all_input_nodes`; None means "no requirement" (a non-tensor input).
    `grads[i]` is the placement of the gradient the node sends back to input i. `NodeInfo.req`
    derives it: a Replicate input of a node whose output is sharded or Partial gets a Partial
    gradient (its gradient sums over the split dim: a column-parallel linear's input, Megatron's
    "copy"; a broadcast operand; a replicated weight of a batch-split op); otherwise the required
    placement, Partial read as Replicate.
    `compute` is the share of the op's work a rank does; `comm` lists collectives the op runs
    itself as (kind, full-tensor bytes); `dim` is TorchShard's label (None / 0 / -1 / 1).
    `uneven`: the op's local form is exact with shards of unequal sizes (torch.chunk's
    boundaries; see placements), so its contiguous shards need not divide by the degree.
    """

    name: str
    output: Any                       # Placement, tuple of them (multi-output), or None
    inputs: tuple
    grads: tuple | None = None
    compute: float = 1.0
    comm: tuple = ()
    dim: int | None = None
    uneven: bool = False

    def grad(self, i: int):
        if self.grads is not None:
            return self.grads[i]
        req = self.inputs[i]
        return REPLICATE if isinstance(req, Partial) else req


def group_size(size: int, units, world_size: int) -> int | None:
    """The group size m in which a projection's output of `size` features, heads that do not divide
    over the ranks (kv heads: the largest unit in `units` the features are cut into; 4 on 8
    ranks, or Phi-3-medium's 10 on 4), can be gathered so that each group of m consecutive ranks
    holds whole heads: m = p / gcd(heads, p), strictly between 1 and p (at p the whole tensor:
    `REPLICATE_PG`), the features splitting evenly over the ranks; None where there is none."""
    heads = [size // u for u in units if 1 < u <= size and size % u == 0]
    if not heads or size % world_size:
        return None
    m = world_size // math.gcd(min(heads), world_size)
    return m if 1 < m < world_size else None


def group_sizes(nodes, vals, units, part_candidates, world_size: int) -> tuple:
    """Every group size of `rules.group_size` that a projection of the graph, or a part of a fused
    one, offers (K and V of fewer heads than ranks): the shards held by groups of ranks the rules
    may pass on."""
    sizes = {q for parts in part_candidates for q in parts}
    sizes.update(int(v.shape[-1]) for n, v in zip(nodes, vals)
                 if isinstance(v, torch.Tensor) and v.dim() and family_of(n) == "matmul")
    return tuple(sorted({m for m in (group_size(q, units, world_size) for q in sizes) if m is not None}))


def reader_counts(nodes, vals, units, world_size: int) -> tuple:
    """The numbers g of query heads a K/V head reads where K/V of fewer heads than ranks have no
    groups of ranks to hold them (`rules.group_size` None: 2 kv heads on 3 ranks): each
    `expand` that repeats K/V heads [.., K, 1, s, d] to [.., K, g, s, d] (`repeat_kv`) with
    1 < K < p. Their shards are held by the ranks that read them (`Shard(d, cover=g)`)."""
    found = set()
    for n, v in zip(nodes, vals):
        src = n.all_input_nodes[0].meta.get("val") if n.all_input_nodes else None
        op = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if n.op not in ("call_function", "call_method") or op not in ("expand", "broadcast_to") or \
                not isinstance(v, torch.Tensor) or not isinstance(src, torch.Tensor) or src.dim() != v.dim() or \
                v.dim() < 3:
            continue
        grown = [d for d in range(1, v.dim()) if src.shape[d] == 1 < v.shape[d]]
        if len(grown) == 1:
            d = grown[0]
            kv, g = int(src.shape[d - 1]), int(v.shape[d])
            if 1 < kv < world_size and group_size(kv * int(v.shape[-1]), units, world_size) is None:
                found.add(g)
    return tuple(sorted(found))


@dataclass
class NodeInfo:
    """What a rule may look at: the node, its module, static shapes and the degree."""

    node: fx.Node
    world_size: int
    module: torch.nn.Module | None = None
    chunk_candidates: tuple = ()
    inputs: list = field(default_factory=list)
    unit_candidates: tuple = ()        # sizes of indivisible units the graph cuts features into (head dims)
    part_candidates: tuple = ()        # sizes of unequal parts the graph cuts a dim into (q, k, v features)
    replica_candidates: tuple = ()     # group sizes m of `Shard(d, replicas=m)` (K/V heads fewer than ranks)
    cover_candidates: tuple = ()       # query heads g a K/V head of `Shard(d, cover=g)` (where there are no groups)
    tokens: bool = False               # sequence parallelism: the token dim may be split (`valid`)
    inference: bool = False            # a step run without backward (generation): gradients never placed

    def __post_init__(self):
        self.inputs = list(self.node.all_input_nodes)

    @staticmethod
    def val(n):
        return n.meta.get("val") if isinstance(n, fx.Node) else n

    def shape(self, n=None) -> tuple | None:
        v = self.val(self.node if n is None else n)
        return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None

    @property
    def out_shape(self):
        return self.shape()

    def units(self, size: int) -> tuple:
        """Units (head sizes) a dim of `size` may be split in where they do not divide evenly
        over the ranks: each gives the whole-unit shard `Shard(d, unit=u)` (`chunk_sizes`'
        boundaries over size/u units: at least one a rank)."""
        p = self.world_size
        return tuple(u for u in self.unit_candidates
                     if 1 < u < size and size % u == 0 and (size // u) % p and size // u >= p)

    def shards(self, d: int, size: int) -> list:
        """Every Shard of dim `d` (of `size`) the rules offer: contiguous, strided in k blocks for
        each chunk count the graph uses (a fused q/k/v: k = 3), and in whole units where the units
        do not divide over the ranks, of the dim or of each of its k blocks (GPT-2's fused q/k/v
        of 12 heads on 8 ranks: `Shard(d, 3, unit=64)`); where K/V heads are gathered within
        groups of m ranks, held by such groups (`Shard(d, replicas=m)`) and, where the dim does
        not divide, split over the groups first (`Shard(d, nest=m)`: query heads matching them);
        where there are no such groups, held by the ranks that read them (`cover_shards`)."""
        found = [Shard(d, k) for k in (1, *self.chunk_candidates)]
        for k in (1, *self.chunk_candidates):
            if size % k == 0:
                found += [Shard(d, k, unit=u) for u in self.units(size // k)]
        for m in self.replica_candidates:
            if size % (self.world_size // m) == 0:
                found.append(Shard(d, replicas=m))             # held by groups of m ranks
            # where the split is uneven, over the groups of m ranks first
            found += ([Shard(d, nest=m)] if size % self.world_size else []) + \
                [Shard(d, unit=u, nest=m) for u in self.units(size)]
        return found + self.part_shards(d, size) + self.cover_shards(d, size)

    def cover_shards(self, d: int, size: int) -> list:
        """Shards of dim `d` (of `size`) held by the ranks that read them (`Shard(d, unit=u,
        cover=g)`, K/V of fewer heads than ranks where no groups of ranks hold them): for each
        number g of query heads a K/V head reads, in units of 1, of g (K/V expanded to the query
        heads) or of a head's features."""
        found = []
        for g in self.cover_candidates:
            for u in sorted({1, g, *self.unit_candidates}):
                if size % u == 0 and 1 < size // u < self.world_size and cover_ranges(size, self.world_size, u, g):
                    found.append(Shard(d, unit=u, cover=g))
        return found

    def plain_shards(self, d: int, size: int | None = None) -> list:
        """The contiguous Shard of dim `d` and its forms held by groups of ranks, and, for a dim of
        `size` that does not divide, split over those groups first (what a rule that moves only
        contiguous shards passes on)."""
        uneven = size is not None and size % self.world_size
        return [Shard(d), *(Shard(d, replicas=m) for m in self.replica_candidates),
                *(Shard(d, nest=m) for m in (self.replica_candidates if uneven else ()))]

    def group_size(self, size: int) -> int | None:
        """`group_size` of a projection's output of `size` features."""
        return group_size(size, self.unit_candidates, self.world_size)

    def part_shards(self, d: int, size: int) -> list:
        """Shards of dim `d` in blocks of unequal sizes (a grouped q/k/v: q, k and v features),
        each block split evenly, or in whole units where some block's units do not divide (a block
        of fewer units than ranks then cut in elements: `placements.block_sizes`)."""
        p, found = self.world_size, []
        for parts in self.part_candidates:
            if sum(parts) != size:
                continue
            if all(q % p == 0 for q in parts):
                found.append(Shard(d, len(parts), parts=parts))
            for u in self.unit_candidates:
                if u > 1 and all(q % u == 0 for q in parts) and any(q // u >= p and (q // u) % p for q in parts) \
                        and block_sizes(size, p, len(parts), u, parts) is not None:
                    found.append(Shard(d, len(parts), unit=u, parts=parts))
        return found

    def group_shards(self, d: int, size: int) -> list:
        """Shards of dim `d` in grouped blocks (`Shard(d, G * K, groups=G)`) for each reader that
        reorders them block by block (`regroup_readers`): the output of CodeGen's fused projection,
        a group of its q, v and k a group of ranks (only that reader takes it: the planner never
        moves a grouped shard)."""
        found = []
        for g, k in regroup_readers(self.node):
            if g > 1 and block_sizes(size, self.world_size, g * k, groups=g) is not None:
                found.append(Shard(d, g * k, groups=g))
        return found

    def fewer_units(self, size: int) -> bool:
        """Whether a dim of `size` holds fewer whole units (heads) than ranks for some unit the
        graph cuts features into: fewer K/V heads than ranks, which can only be replicated."""
        return any(1 < u <= size and size % u == 0 and size // u < self.world_size for u in self.unit_candidates)

    def is_tensor(self, n) -> bool:
        return isinstance(self.val(n), torch.Tensor)

    def index(self, n) -> int:
        return self.inputs.index(n)

    def arg(self, pos: int, name: str, default=None):
        """A positional-or-keyword argument of the node (call_function/call_method)."""
        return node_arg(self.node, pos, name, default)

    def req(self, mapping: dict, name: str, output, *, grads: dict | None = None, compute=None,
            comm=(), dim=None, uneven=False) -> OpStrategy:
        """Build a strategy from {input node: placement}; tensor inputs not named need Replicate.
        `compute` (the share of the work a rank does) defaults to 1, or to a rank's mean share of
        an output held by the ranks that read it (the heads it holds)."""
        if compute is None:
            compute = 1.0
            if isinstance(output, Shard) and output.cover > 1 and self.out_shape is not None:
                n = self.out_shape[output.dim]
                compute = sum(b - a for a, b in cover_ranges(n, self.world_size, output.unit, output.cover)) / \
                    (self.world_size * n)
        ins = tuple(mapping.get(n, REPLICATE if self.is_tensor(n) else None) for n in self.inputs)
        split = not _all_replicate(output)
        gr = tuple((grads or {}).get(n, PARTIAL if split and isinstance(r, Replicate) else
                                     (REPLICATE if isinstance(r, Partial) else r))
                   for n, r in zip(self.inputs, ins))
        return OpStrategy(name, output, ins, gr, compute, tuple(comm), dim, uneven)


def regroup_readers(node: fx.Node) -> tuple:
    """(groups, chunks) of each `regroup` (`nn.functional.regroup`) that reads `node`, sorted."""
    return tuple(sorted({(int(u.args[1]), int(u.args[2])) for u in node.users
                         if u.op == "call_function" and u.target is regroup}))


def may_differ(placement: Shard) -> bool:
    """Whether a rule's local form holds `placement` with shards of unequal sizes: contiguous
    ones (torch.chunk's boundaries) and those in whole units; a strided shard in elements stays
    even (`placements.block_sizes`)."""
    return placement.chunks == 1 or placement.unit > 1


def _all_replicate(output) -> bool:
    if isinstance(output, tuple):
        return all(_all_replicate(o) for o in output)
    return output is None or isinstance(output, Replicate)


def register_rule(*ops, family: str | None = None):
    """Decorator: `fn(info) -> list[OpStrategy]` is the rule of every op in `ops`; `family` names
    the op family where other stages care (flop counts, which modules Plan.dims lists)."""
    def deco(fn):
        for op in ops:
            _RULES[op] = fn
        if family is not None:
            _FAMILY[fn] = family
        return fn
    return deco


def register_shape_op(*ops):
    for op in ops:
        SHAPE_OPS.add(op)


def op_key(node: fx.Node, modules: dict):
    """The registry key of a node: function, Tensor method, or module class."""
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, node.target)
    if node.op == "call_module":
        return type(modules[node.target])
    return None


def lookup(node: fx.Node, modules: dict):
    """The rule for a node, walking a module's class hierarchy; None if none is registered."""
    key = op_key(node, modules)
    if node.op == "call_module":
        for cls in type(modules[node.target]).__mro__:
            if cls in _RULES:
                return _RULES[cls]
        return None
    return _RULES.get(key)


def family_of(node: fx.Node) -> str | None:
    """The family of a call_function / call_method node's rule (None for the others)."""
    if node.op not in ("call_function", "call_method"):
        return None
    return _FAMILY.get(_RULES.get(op_key(node, {})))


def replicate_strategy(info: NodeInfo) -> OpStrategy:
    out = _replicate_like(info.val(info.node))
    return info.req({}, "replicate", out)


def partial_grad_strategy(info: NodeInfo) -> OpStrategy | None:
    """The op run whole on whole inputs, its gradients left Partial ("Rp"): exact for any op,
    since a gradient is linear in the output's gradient (the sum of every rank's backward of
    its summand is the backward of the sum). What an Rp input (K and V computed for replicated
    K/V heads) runs on until it is sliced; None where no output is a floating tensor."""
    v = info.val(info.node)
    if not any(t.is_floating_point() for t in _tensors(v)):
        return None
    ins = tuple(REPLICATE if info.is_tensor(n) else None for n in info.inputs)
    grads = tuple(PARTIAL if r is not None else None for r in ins)
    return OpStrategy("replicate_pg", _replicate_like(v, partial_grad=True), ins, grads)


def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    return [t for x in v for t in _tensors(x)] if isinstance(v, (tuple, list)) else []


def _replicate_like(v, partial_grad: bool = False):
    """Replicate for every tensor of an op's value (`partial_grad`: REPLICATE_PG for floating ones)."""
    if isinstance(v, torch.Tensor):
        return REPLICATE_PG if partial_grad and v.is_floating_point() else REPLICATE
    if isinstance(v, (tuple, list)):
        return tuple(_replicate_like(x, partial_grad) for x in v)
    return None


def _fits(placement, v, p, dynamic, uneven=False, tokens=False) -> bool:
    if placement is None or isinstance(placement, (Replicate, Partial)):
        return True
    if isinstance(placement, tuple):
        dyn = dynamic if isinstance(dynamic, tuple) else (dynamic,) * len(placement)
        return isinstance(v, (tuple, list)) and all(_fits(pl, x, p, d, uneven, tokens)
                                                    for pl, x, d in zip(placement, v, dyn))
    fits = splits if uneven else divides
    return isinstance(v, torch.Tensor) and fits(v.shape, placement, p) and \
        (placement.dim not in dynamic or (tokens and uneven and token_shard(placement, v.dim())))


def token_shard(placement, ndim: int) -> bool:
    """Whether `placement` is sequence parallelism's split of a [..., tokens, features] tensor: a
    contiguous shard of its token (second-to-last) dim at torch.chunk's boundaries."""
    return isinstance(placement, Shard) and ndim >= 2 and placement.dim == ndim - 2 and \
        placement == Shard(ndim - 2)


def _holders(placement) -> set:
    """How the shards of a placement (or tuple of them) that every rank of a group holds are held:
    ("replicas", m) for groups of m ranks, ("cover", g) for the ranks that read them."""
    if isinstance(placement, tuple):
        return set().union(*(_holders(pl) for pl in placement))
    if not isinstance(placement, Shard):
        return set()
    return {("replicas", placement.replicas)} if placement.replicas > 1 else \
        ({("cover", placement.cover)} if placement.cover > 1 else set())


def closed_groups(s: OpStrategy, backward: bool = True) -> bool:
    """Whether a strategy keeps a shard held by groups of ranks (`Shard(d, replicas=m)`: every
    rank of a group holds the piece, each a summand of its gradient) or by the ranks that read it
    (`Shard(d, cover=g)`, overlapping pieces, the same) exact: an op reading one sends back such
    gradients only when every tensor it makes is held the same way; a sum over the split dim
    (Partial) or a whole result would count each piece as often as it is held. Only a strategy
    that gathers it within the groups itself (an `all_gather@m` of its own: a K/V projection, a
    kv part cut out of a fused one) starts groups from other placements; a piece held by its
    readers starts from whole inputs whose gradients go back Partial (each rank's backward of
    its piece's summand) or weights the op gathers itself (`ShardGathered`); in a step without
    `backward` (generation), from any whole inputs."""
    ins = set().union(*(_holders(pl) for pl in s.inputs))
    if not ins:
        made = _holders(s.output)
        gathered = {("replicas", split_kind(k)[1]) for k, _ in s.comm if split_kind(k)[0] == "all_gather"}
        covered = all(r is None or isinstance(r, ShardGathered) or (isinstance(r, Replicate) and
                                                                  (not backward or isinstance(s.grad(i), Partial)))
                      for i, r in enumerate(s.inputs))
        return {k for k in made if k[0] == "replicas"} <= gathered and \
            (covered or not any(k[0] == "cover" for k in made))
    outs = s.output if isinstance(s.output, tuple) else (s.output,)
    return len(ins) == 1 and all(o is None or _holders(o) == ins for o in outs)


def valid(info: NodeInfo, s: OpStrategy) -> bool:
    """Every shard of every input and output divides evenly over the degree (or, for a strategy
    marked `uneven`, splits at `chunk_sizes`' boundaries with no rank empty), and no dim whose
    size follows the inputs (batch, sequence) is split: the plan must hold for every size; a
    shard held by groups of ranks stays exact (`closed_groups`)."""
    p = info.world_size
    if not closed_groups(s, backward=not info.inference) or \
            any(_holders(pl) and n.op == "get_attr" for pl, n in zip(s.inputs, info.inputs)):
        return False                 # (a parameter is held split or whole, never by groups of ranks or readers)
    if not _fits(s.output, info.val(info.node), p, dynamic_dims(info.node), s.uneven, info.tokens):
        return False
    return all(_fits(pl, info.val(n), p, dynamic_dims(n), s.uneven, info.tokens) for pl, n in zip(s.inputs, info.inputs))


def strategies(info: NodeInfo) -> tuple[list[OpStrategy], bool]:
    """All valid strategies of a node (Replicate first) and whether a rule covered it."""
    node = info.node
    key = op_key(node, {} if info.module is None else {node.target: info.module})
    if key in SHAPE_OPS and not info.is_tensor(node):
        return [OpStrategy("shape", None, tuple(None for _ in info.inputs))], True
    rule = lookup(node, {node.target: info.module} if info.module is not None else {})
    base = replicate_strategy(info)
    own_weights = info.module is not None and any(q.requires_grad for q in info.module.parameters())
    rp = None if own_weights else partial_grad_strategy(info)
    if rule is None:
        tensor_in = any(info.is_tensor(n) for n in info.inputs)
        side_effect_only = not info.is_tensor(node) and not node.users      # export's input guards
        return [base] + ([rp] if rp is not None and tensor_in else []), not tensor_in or side_effect_only
    found = [s for s in rule(info) if valid(info, s)] + ([rp] if rp is not None else [])
    if own_weights:
        # a leaf module's own weights are not graph inputs: nothing would all-reduce their
        # gradient if a split input made it partial, so such a module runs replicated
        found = []
    seen, out = set(), [base]
    for s in found:
        if (s.output, s.inputs) not in seen and (s.output, s.inputs) != (base.output, base.inputs):
            seen.add((s.output, s.inputs))
            out.append(s)
    return out, True


__all__ = ["OpStrategy", "NodeInfo", "group_size", "register_rule", "REPLICATE_PG", "ReplicatePartialGrad", "ShardGathered", "register_shape_op", "strategies", "lookup", "family_of",
           "REPLICATE", "PARTIAL", "Shard", "Replicate", "Partial", "Placement"]
