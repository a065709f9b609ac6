"""Blocks stay modules: a rewritten flat graph becomes a skeleton that calls one GraphModule per block.

A block is a submodule the model calls as a unit (a transformer layer): by default the children
of every `nn.ModuleList` / `nn.Sequential` holding two or more modules of one class (the
outermost such lists: a layer's own list of experts stays inside its layer), or the qualified
names the user gives. Which graph node belongs to which block comes from capture, for both
tracers: `node.meta["nn_module_stack"]` (the module calls that were active when the op ran),
and for `get_attr` nodes the owner of the tensor. Nodes the rewriter added (collectives, local
forms of ops) carry no stack: each joins the block of its readers when they are all in one block
(a block's entry collective: Megatron's copy, a scatter of its input), else the block of its
inputs (the all-reduce after a row-parallel layer), else the skeleton. So a collective the plan
puts on a boundary runs inside the block that reads, or else produces, the tensor, and what
crosses the boundary is the tensor in the plan's placement there.

Each block becomes a `torch.fx.GraphModule` installed at the block's own path, holding the same
submodules and tensors under the same relative names: state-dict keys, TorchShard attributes
and layouts are unchanged, and `fully_shard(block)`, `checkpoint_wrapper(block)` and
`torch.compile(block)` apply to it because the skeleton calls it (`call_module`), which runs its
hooks. A block whose nodes are not one convex piece of the graph (a path leaves it and comes
back) stays inline, with a note.
"""
from __future__ import annotations

import operator
import re
from fractions import Fraction

import torch.fx as fx
import torch.nn as nn

from ..capture.repeats import STACK, find_blocks, owner
from ..errors import ShardingError
from ..runtime.collectives import copy_to, scatter_to, slice_partial

SKELETON = None
# collectives whose forward may return a view of their input (an identity, a contiguous piece): a
# block must not return one beside the tensor it views, since AOT autograd then rebuilds the view
# outside the compiled graph as a plain view and drops the collective's backward (the all-reduce of
# copy_to's gradient): read in several places, they run in the skeleton
VIEWING = (copy_to, scatter_to, slice_partial)


def resolve_blocks(model: nn.Module, blocks) -> list[str]:
    """The blocks to keep: "auto" (find_blocks), None / () (none), or names / module classes."""
    if blocks is None or blocks is False:
        return []
    if blocks == "auto":
        return find_blocks(model)
    if isinstance(blocks, (str, type)):
        blocks = [blocks]
    names = []
    for b in blocks:
        if isinstance(b, type):
            names.extend(n for n, m in model.named_modules() if n and isinstance(m, b))
            continue
        try:
            model.get_submodule(b)
        except AttributeError:
            raise ShardingError(f"blocks: {type(model).__name__} has no submodule {b!r}") from None
        names.append(b)
    names = [n for n in names if not any(n.startswith(o + ".") for o in names)]   # outermost only
    return list(dict.fromkeys(names))


def membership(graph: fx.Graph, names: list[str]) -> dict:
    """{node: block name or None} for every node of `graph`."""
    by_len = frozenset(names)
    label = {}
    unknown = []
    for n in graph.nodes:
        if n.op in ("placeholder", "output", "get_attr", "call_module") or STACK in n.meta:
            label[n] = owner(n, by_len)
        else:
            unknown.append(n)
            label[n] = "?"
    changed = True
    while changed and unknown:                    # added nodes: readers' block, else inputs' block
        changed = False
        for n in list(unknown):
            users = {label[u] for u in n.users}
            inputs = {label[i] for i in n.all_input_nodes}
            if users and "?" not in users and len(users) == 1:
                label[n] = users.pop()
            elif users and "?" not in users and n.op == "call_function" and n.target in VIEWING:
                label[n] = SKELETON
            elif "?" not in inputs and len(inputs - {SKELETON}) == 1:
                label[n] = (inputs - {SKELETON}).pop()
            elif "?" not in users and "?" not in inputs:
                label[n] = SKELETON
            else:
                continue
            unknown.remove(n)
            changed = True
    for n in unknown:
        label[n] = SKELETON
    return label


def _convex(order: dict, members: set) -> bool:
    """No path leaves `members` and comes back (checked up to the last member)."""
    last = max(order[m] for m in members)
    seen, stack = set(), [u for m in members for u in m.users if u not in members and order[u] < last]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in members:
                return False
            if u not in seen and order[u] < last:
                stack.append(u)
    return True


def _relative(target: str, name: str) -> str:
    return target[len(name) + 1:] if target.startswith(name + ".") else target


def _module_at(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, last = path.rpartition(".")
    (root.get_submodule(parent) if parent else root)._modules[last] = module


def keep_blocks(gm: fx.GraphModule, names: list[str], classes: dict | None = None, variant: int = 0) -> list[str]:
    """Turn each block of `gm` (a rewritten flat graph) into a GraphModule called by the
    skeleton (`classes`: block name -> the class name its GraphModule takes; `variant`: the key
    the skeleton passes, for the graphs of other call signatures); returns notes for the blocks
    left inline."""
    classes = classes or {}
    notes = []
    if not names:
        return notes
    graph = gm.graph
    label = membership(graph, names)
    groups: dict[str, list] = {}
    for n in graph.nodes:
        if label[n] is not SKELETON:
            groups.setdefault(label[n], []).append(n)
    order = {n: Fraction(i) for i, n in enumerate(graph.nodes)}      # one order, kept as blocks are cut out
    by_code: dict = {}                                               # block structure -> its class

    def placed(node: fx.Node) -> fx.Node:
        """Number a node just inserted between its neighbours (both already numbered)."""
        order[node] = (order[node.prev] + order[node.next]) / 2
        return node
    for name in names:
        members_list = groups.get(name)
        if not members_list:
            continue
        members = set(members_list)
        if not _convex(order, members):
            notes.append(f"block {name}: its ops are not one piece of the graph (a path leaves and re-enters it); "
                         "it stays inline")
            continue
        shared = [m.target for m in members_list if m.op == "get_attr" and any(u not in members for u in m.users)]
        if shared:              # a tied weight: FSDP2 would free it after the block while others read it
            notes.append(f"block {name}: its tensor {shared[0]} is also read outside it (tied); it stays inline")
            continue
        inputs = []
        for m in members_list:
            for i in m.all_input_nodes:
                if i not in members and i not in inputs:
                    inputs.append(i)
        outputs = [m for m in members_list if any(u not in members for u in m.users)]
        users = [u for o in outputs for u in o.users if u not in members]
        at = min(users, key=order.__getitem__) if users else None
        if at is None or any(order[i] > order[at] for i in inputs):
            notes.append(f"block {name}: its inputs are not all computed before its first reader; it stays inline")
            continue
        sub = fx.Graph()
        env = {}
        for i in inputs:
            env[i] = sub.placeholder(i.name)
            env[i].meta = dict(i.meta)
        moved, local = {}, {}
        for m in members_list:
            env[m] = sub.node_copy(m, lambda a: env[a])
            if m.op in ("get_attr", "call_module"):
                rel = _relative(m.target, name)
                if rel == m.target:       # a module the rewriter added at the root: named by its place in the block
                    if rel not in local:
                        local[rel] = f"{re.sub(r'_[0-9]+$', '', rel)}_{len(local) + 1}"
                        moved[local[rel]] = _module_at(gm, rel)
                    rel = local[rel]
                env[m].target = rel
        sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
        container = gm.get_submodule(name)
        objects = {k: moved[k] if k in moved else _module_at(container, k) for k in _targets(sub)}
        block = fx.GraphModule(objects, sub, class_name=classes.get(name, "Block"))
        for attr in ("_parameters", "_buffers", "_modules"):       # every name the container held, as it was
            getattr(block, attr).clear()
            getattr(block, attr).update(getattr(container, attr))
        block._non_persistent_buffers_set = set(container._non_persistent_buffers_set)
        for k, mod in moved.items():
            block.add_module(k, mod)
        for k in local:
            delattr(gm, k)
        block.train(container.training)
        _dispatching(block, by_code)
        with graph.inserting_before(at):
            call = placed(graph.call_module(name, tuple(inputs), {"autoshard_variant": variant} if variant else {}))
        call.meta[STACK] = {name: (name, type(block))}
        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in members)
        else:
            for k, o in enumerate(outputs):
                with graph.inserting_before(at):
                    item = placed(graph.call_function(operator.getitem, (call, k)))
                o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
        for m in reversed(members_list):
            graph.erase_node(m)
            del order[m]
        _place(gm, name, block)
    graph.lint()
    gm.recompile()
    return notes


def structure(graph: fx.Graph) -> str:
    """What a graph computes, whatever its nodes are named: each node's op, target and arguments
    (other nodes, and inputs, by position). Graphs with the same structure run the same code
    when called with positional inputs."""
    index: dict = {}
    rows = []
    for i, n in enumerate(graph.nodes):
        def ref(a):
            return f"%{index[a]}" if isinstance(a, fx.Node) else a
        index[n] = i
        target = i if n.op == "placeholder" else n.target
        rows.append(repr((n.op, target, fx.node.map_aggregate(n.args, ref), fx.node.map_aggregate(n.kwargs, ref))))
    return "\n".join(rows)


def _dispatching(block: fx.GraphModule, by_code: dict) -> None:
    """Give `block` a forward that runs one of its graphs: its own (variant 0), or the block's
    graph in another call signature's plan (`add_variant`), chosen by the skeleton that calls.
    Blocks whose graphs have the same `structure` share one class (`by_code`), and each
    class its own dispatcher code: `torch.compile` of every block then compiles once for all
    the layers alike (as for a model's own layer class), not once a layer up to its recompile
    limit."""
    key = structure(block.graph)
    cls = by_code.get(key)
    if cls is None:
        cls = by_code[key] = type(block)
        cls._autoshard_graph_forward = cls.forward

        def forward(self, *args, autoshard_variant=0):
            return self.__dict__["_autoshard_variants"][autoshard_variant](self, *args)
        forward.__code__ = forward.__code__.replace(co_filename=f"<autoshard block {cls.__name__} {len(by_code)}>")
        forward.__doc__ = "this block's graph on this rank's shards (autoshard.rewrite.blocks)"
        cls.forward = forward
    else:
        block.__class__ = cls
    block.__dict__["_autoshard_variants"] = {0: cls._autoshard_graph_forward}


def add_variant(block: fx.GraphModule, variant: int, fn) -> None:
    """Let `block` run `fn(block, *inputs)` when called with autoshard_variant=`variant`."""
    block.__dict__["_autoshard_variants"][variant] = fn


def _targets(graph: fx.Graph) -> list[str]:
    return list(dict.fromkeys(n.target for n in graph.nodes if n.op in ("get_attr", "call_module")))


def blocks_of(gm: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: block GraphModule} of a parallel module (what `fully_shard`,
    `checkpoint_wrapper` or `torch.compile` take, one block at a time); the blocks themselves,
    also after a wrapper took their place."""
    return dict(gm.__dict__.get("_autoshard_blocks", {}))
