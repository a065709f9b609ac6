"""Repeated blocks: found on the module tree, captured once, and repeated in the graph.

A deep model is mostly one layer repeated: tracing all 80 layers of a LLaMA-3-70B takes 80 times
as long as tracing one, for 80 copies of one graph. Capture therefore traces the model with each
run of identical consecutive layers cut to its first two (the module list is swapped for the
capture only), checks that the second is a pure repeat of the first, and writes the rest of
the run into the graph as copies of the second layer's nodes, renamed to each layer's tensors,
sharing its shapes and dynamic-dim marks.

- **Identical layers** (`runs`; a run is cut when it ends its list, `tail_runs`): same class, same parameter and buffer names, shapes, dtypes and
  requires_grad, the same plain attributes on every submodule (ints, floats, strings, bools:
  an attention's sliding window, a layer type; indices such as `layer_idx` excepted, which only
  address caches), and the same entry in every per-layer list of the model's config
  (`layer_types`). A layer that differs ends a run and starts another.
- **A pure repeat** (`expand`): the second layer's graph is the first's node for node (the same
  ops on the same relative targets and constants); where the first layer reads a value from
  before the run, the second reads either that same value (shared: the mask, the rotary
  embeddings) or the first layer's matching output (carried: the hidden state), whose shape and
  dtype the second layer's matching output repeats; the first layer's outputs feed only the
  second. Size arithmetic one layer makes and later layers read (torch.export's `batch * heads`
  in BLOOM's first layer) counts as a value from before the run; constants the tracer lifted are
  the same if equal, or both made on meta (values unknown, never run). Anything else is a
  `RepeatError`, and capture traces the whole model instead.

Which node belongs to which block (`owner`) comes from the tracers themselves:
`node.meta["nn_module_stack"]` for ops, the tensor's owner for `get_attr`.
"""
from __future__ import annotations

import contextlib
import copy
import re

import torch
import torch.fx as fx
import torch.nn as nn

STACK = "nn_module_stack"
INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "block_idx", "idx"})
_PLAIN = (bool, int, float, str, type(None))


class RepeatError(Exception):
    """The layers kept are not a pure repetition: capture the whole model instead."""


def block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, list) of every ModuleList / Sequential of two or more modules of one class,
    outermost first (lists inside a chosen list's children are skipped)."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        if len({type(c) for c in m.children()}) != 1:
            continue
        if any(name.startswith(f + ".") for f, _ in found):
            continue
        found.append((name, m))
    return found


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the children of `block_lists(model)`: a transformer's layers."""
    return [f"{name}.{k}" if name else k for name, m in block_lists(model) for k in m._modules]


def _plain(v):
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return tuple(v)
    return None


def _fingerprint(module: nn.Module, extra: tuple) -> tuple:
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)] if t is not None)
    attrs = []
    for name, m in module.named_modules():
        for k, v in sorted(vars(m).items()):
            if k.startswith("_") or k == "training" or k in INDEX_ATTRS:
                continue
            p = _plain(v)
            if p is not None or v is None:
                attrs.append((name, k, p))
        attrs.append((name, type(m).__qualname__))
    return type(module), tensors, tuple(attrs), extra


def _per_layer_config(model: nn.Module, n: int) -> list[tuple]:
    """For layer i: the i-th entry of every list of length n in the model's config."""
    config = getattr(model, "config", None)
    lists = []
    if config is not None:
        for k, v in sorted(getattr(config, "__dict__", {}).items()):
            if isinstance(v, (list, tuple)) and len(v) == n and all(isinstance(x, _PLAIN) for x in v):
                lists.append((k, v))
    return [tuple((k, v[i]) for k, v in lists) for i in range(n)]


def _prints(model: nn.Module, lst: nn.Module) -> list:
    keys = list(lst._modules)
    extra = _per_layer_config(model, len(keys))
    return [_fingerprint(lst._modules[k], extra[i]) for i, k in enumerate(keys)]


def runs(model: nn.Module, shortest: int = 3) -> list[tuple[str, list[str]]]:
    """(list name, keys) of every run of at least `shortest` identical consecutive layers."""
    out = []
    for name, lst in block_lists(model):
        keys, prints = list(lst._modules), _prints(model, lst)
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or prints[i] != prints[start]:
                if i - start >= shortest:
                    out.append((name, keys[start:i]))
                start = i
    return out


def tail_runs(model: nn.Module, longest_period: int = 4) -> list[tuple[str, list[str], int]]:
    """(list name, keys, period) of the layers `cut` can shorten in each list: the longest tail
    that repeats a pattern of `period` layers (1: identical layers; 2: alternating kinds, such as
    sliding and global attention or dense and MoE layers) at least three times over, in whole
    periods. Only a tail: a list keeps its keys 0..n-1 when its last layers go, and models index
    and slice their layers by position."""
    out = []
    for name, lst in block_lists(model):
        keys, prints = list(lst._modules), _prints(model, lst)
        n, best = len(keys), None
        for k in range(1, longest_period + 1):
            i = n - 1
            while i - k >= 0 and prints[i] == prints[i - k]:
                i -= 1
            start = i + 1 - k                      # layers start.. repeat with period k
            start += (n - start) % k               # whole periods only
            if (n - start) // k >= 3 and (best is None or n - start - 2 * k > best[0]):
                best = (n - start - 2 * k, start, k)
        if best is not None:
            out.append((name, keys[best[1]:], best[2]))
    return out


@contextlib.contextmanager
def cut(model: nn.Module, found: list):
    """The model with each tail cut to its first two periods (keys kept), for the capture only."""
    saved = []
    try:
        for name, keys, k in found:
            lst = model.get_submodule(name)
            saved.append((lst, dict(lst._modules)))
            drop = set(keys[2 * k:])
            kept = {k: m for k, m in lst._modules.items() if k not in drop}
            lst._modules.clear()
            lst._modules.update(kept)
        yield
    finally:
        for lst, modules in saved:
            lst._modules.clear()
            lst._modules.update(modules)


def module_paths(node: fx.Node) -> list[str]:
    """The module paths of a node's module stack, outermost first."""
    out = []
    for key, v in (node.meta.get(STACK) or {}).items():
        out.append(v[0] if isinstance(v, tuple) and v and isinstance(v[0], str) else key)
    return out


def owner(node: fx.Node, names) -> str | None:
    """The block of `names` that `node` belongs to (None: none): for get_attr and a module call
    recorded without a stack, the owner of its target; else, for the outermost path of its module
    stack within a block, the innermost block holding it. `names` may be a set (a caller asking for
    many nodes passes one: each lookup is then a few prefixes, whatever the number of blocks)."""
    if node.op in ("placeholder", "output"):
        return None
    if node.op == "get_attr" or (node.op == "call_module" and STACK not in node.meta):
        paths = [node.target]
    elif STACK in node.meta:
        paths = module_paths(node)
    else:
        return None
    known = names if isinstance(names, (set, frozenset)) else set(names)
    for path in paths:
        parts = path.split(".")
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if prefix in known:
                return prefix
    return None


def layer_key(name: str):
    """(the name with its first layer index blanked, that index), or None outside numbered layers."""
    m = re.search(r"\.(\d+)\.", name)
    return None if m is None else ((name[:m.start()], name[m.end():]), int(m.group(1)))


def _rename(target: str, old: str, new: str) -> str:
    return new + target[len(old):] if target == old or target.startswith(old + ".") else target


def _renamed_stack(stack: dict, old: str, new: str) -> dict:
    out = {}
    for key, v in stack.items():
        if isinstance(v, tuple) and v and isinstance(v[0], str):
            out[_rename(key, old, new)] = (_rename(v[0], old, new), *v[1:])
        else:
            out[_rename(key, old, new)] = v
    return out


class _Match:
    """Node-for-node correspondence of the tail's first period (L0: layers b0) and second (L1:
    layers b1); `r0` / `r1` give each node's position in its period."""

    def __init__(self, l0: list, l1: list, b0: tuple, b1: tuple, root: nn.Module):
        if len(l0) != len(l1):
            raise RepeatError(f"{', '.join(b1)} have {len(l1)} graph nodes, {', '.join(b0)} {len(l0)}")
        self.l0, self.l1, self.b0, self.b1, self.root = l0, l1, b0, b1, root
        self.r0 = {n: b0.index(owner(n, b0)) for n in l0}
        self.r1 = {n: b1.index(owner(n, b1)) for n in l1}
        self.i0 = {n: i for i, n in enumerate(l0)}
        self.i1 = {n: i for i, n in enumerate(l1)}
        self.carried = {}                    # index j of L0's output read by L1 -> what L0 read there

    def same(self, a0, a1) -> bool:
        if isinstance(a1, fx.Node):
            if not isinstance(a0, fx.Node):
                return False
            if a1 in self.i1:
                return self.i0.get(a0) == self.i1[a1]
            if a1 in self.i0:                               # L1 reads L0's output: carried
                if a0 in self.i0:
                    return False
                return self.carried.setdefault(self.i0[a1], a0) is a0
            return a0 is a1 or self._same_constant(a0, a1)  # shared, from before the run
        if isinstance(a1, (list, tuple)):
            return isinstance(a0, (list, tuple)) and len(a0) == len(a1) and all(map(self.same, a0, a1))
        if isinstance(a1, dict):
            return isinstance(a0, dict) and a0.keys() == a1.keys() and all(self.same(a0[k], a1[k]) for k in a1)
        if isinstance(a1, slice):
            return isinstance(a0, slice) and all(self.same(getattr(a0, f), getattr(a1, f))
                                                 for f in ("start", "stop", "step"))
        if isinstance(a1, torch.Tensor) or isinstance(a0, torch.Tensor):
            return a0 is a1
        return type(a0) is type(a1) and (a0 == a1 or (a0 != a0 and a1 != a1))

    def _same_constant(self, a0: fx.Node, a1: fx.Node) -> bool:
        """Two constants the tracer lifted for each layer (torch.export's `_tensor_constant<k>`,
        made by the same line of the layer's code): the same if equal in shape, dtype and value."""
        if a0.op != "get_attr" or a1.op != "get_attr":
            return False
        try:
            t0, t1 = (self.root.get_submodule(a.target.rpartition(".")[0]) if "." in a.target else self.root
                      for a in (a0, a1))
            t0, t1 = getattr(t0, a0.target.rpartition(".")[2]), getattr(t1, a1.target.rpartition(".")[2])
        except AttributeError:
            return False
        if not (isinstance(t0, torch.Tensor) and isinstance(t1, torch.Tensor)) or isinstance(t0, nn.Parameter):
            return False
        if t0.shape != t1.shape or t0.dtype != t1.dtype or t0.is_meta != t1.is_meta:
            return False
        # made on meta (a model captured on meta: GPT-Neo's `torch.tensor(finfo.min, device=x.device)`)
        # the values are unknown, and never used: such a capture is for planning, and loading
        # weights into it refuses meta constants (`loading`)
        return t0.is_meta or bool(torch.equal(t0, t1))

    def check(self) -> None:
        self.constants = set()      # l1's constants equal to l0's under another name: the copies share them
        for n0, n1 in zip(self.l0, self.l1):
            t0, t1 = n0.target, n1.target
            if n1.op in ("get_attr", "call_module"):
                t0 = _rename(t0, self.b0[self.r0[n0]], f"@{self.r0[n0]}")
                t1 = _rename(t1, self.b1[self.r1[n1]], f"@{self.r1[n1]}")
            if n1.op == "get_attr" and t0 != t1 and self._same_constant(n0, n1):
                self.constants.add(n1)  # torch.export numbers lifted tensors across the graph (lifted_tensor_<k>)
                t1 = t0
            if n0.op != n1.op or t0 != t1 or self.r0[n0] != self.r1[n1] or \
                    not (self.same(n0.args, n1.args) and self.same(n0.kwargs, n1.kwargs)):
                raise RepeatError(f"{owner(n1, self.b1)}'s node {n1.format_node()} does not repeat "
                                  f"{owner(n0, self.b0)}'s {n0.format_node()}")
        for j in self.carried:
            v0, v1 = self.l0[j].meta.get("val"), self.l1[j].meta.get("val")
            if not (isinstance(v0, torch.Tensor) and isinstance(v1, torch.Tensor)) or \
                    v0.shape != v1.shape or v0.dtype != v1.dtype:
                raise RepeatError(f"{self.b1[-1]} does not give its successor what {self.b0[-1]} gave it "
                                  f"({self.l1[j].name} against {self.l0[j].name})")
        for n in self.l0:
            if any(u not in self.i0 and u not in self.i1 for u in n.users):
                raise RepeatError(f"{owner(n, self.b0)}'s {n.name} is read after the tail's second period")


def _is_size(n: fx.Node) -> bool:
    """Integer arithmetic on sizes (`sym_size`, `operator.mul` of a symbolic batch and a head count)."""
    return n.op == "call_function" and isinstance(n.meta.get("val"), (int, torch.SymInt)) and \
        (getattr(n.target, "__module__", None) == "_operator" or n.target is torch.ops.aten.sym_size.int)


def _shared_sizes(graph: fx.Graph, blocks: tuple) -> set:
    """Size arithmetic one layer computes and others read: torch.export makes an expression once
    (BLOOM's `batch * heads` for its reshapes, in the first layer) and every later layer reads it.
    Such a node is a value from before the rest of the run, not a node the layers repeat."""
    shared = set()
    for n in reversed(list(graph.nodes)):
        b = owner(n, blocks) if _is_size(n) else None
        if b is not None and any(u in shared or owner(u, blocks) != b for u in n.users):
            shared.add(n)
    return shared


def expand(gm: fx.GraphModule, model: nn.Module, found: list) -> int:
    """Write the layers `cut` left out into `gm` (captured with them cut), as copies of each
    run's second layer; returns the number of layers written. `model` is whole again; the caller
    registers the new layers' tensors on `gm` and recompiles it."""
    written = 0
    graph = gm.graph
    for name, keys, k in found:
        qualified = [f"{name}.{key}" if name else key for key in keys]
        b0, b1 = tuple(qualified[:k]), tuple(qualified[k:2 * k])
        shared = _shared_sizes(graph, b0 + b1)
        l0 = [n for n in graph.nodes if owner(n, b0) is not None and n not in shared]
        l1 = [n for n in graph.nodes if owner(n, b1) is not None and n not in shared]
        if not l0 or not l1:
            raise RepeatError(f"no graph nodes of {', '.join(b0 if not l0 else b1)}")
        match = _Match(l0, l1, b0, b1, gm)
        match.check()
        in1 = set(l1)
        post = [u for n in l1 for u in n.users if u not in in1]
        if not post:
            raise RepeatError(f"nothing reads {', '.join(b1)}")
        order = {n: i for i, n in enumerate(graph.nodes)}
        at = min(post, key=order.__getitem__)
        prev = l1
        for m in range(2, len(keys) // k):
            bm = qualified[m * k:(m + 1) * k]
            env = {}

            def arg(a, prev=prev, env=env):
                if a in env:
                    return env[a]
                if a in match.i0:                   # the previous period's matching output
                    return prev[match.i0[a]]
                return a
            with graph.inserting_before(at):
                new = []
                for n in l1:
                    old_name, new_name = b1[match.r1[n]], bm[match.r1[n]]
                    c = graph.node_copy(n, arg)
                    if n.op in ("get_attr", "call_module") and n not in match.constants:
                        c.target = _rename(n.target, old_name, new_name)
                        if n.op == "call_module":
                            gm.add_submodule(c.target, model.get_submodule(c.target))
                    c.meta = copy.copy(n.meta)
                    if STACK in n.meta:
                        c.meta[STACK] = _renamed_stack(n.meta[STACK], old_name, new_name)
                    env[n] = c
                    new.append(c)
            prev = new
            written += k
        last = {n: prev[i] for i, n in enumerate(l1)}
        for n in l1:
            for u in [u for u in n.users if u not in in1 and u in order]:
                u.replace_input_with(n, last[n])
    return written
