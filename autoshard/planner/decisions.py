"""Decision groups: parameters that take one layout together, and the layouts they may take.

A linear's weight and bias, or a weight tied between an embedding and a head, is decided as one
group (parameters sharing a consumer: `decision_groups`, a union-find); each group's choices are
the layouts every consumer can run with (`layout_choices`, all-Replicate first), narrowed by the user's
TorchShard pins (`apply_pins`) or fixed to a built module's layouts (`fix_layouts`). Works on a
`problem.Problem` (its strategies, consumers and parameter tables), which calls it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from ..runtime.placements import REPLICATE, Partial, Replicate


@dataclass(frozen=True)
class Group:
    """Parameters decided together and the layouts they may take (choice 0 is all-Replicate)."""

    params: tuple            # param keys (id of the Parameter)
    names: tuple             # qualified names, for messages and the report
    choices: tuple           # tuple of tuples of placements, aligned with params
    anchors: tuple           # node indices consuming these params


def decision_groups(prob, pins: dict) -> list[Group]:
    """Union parameters whose consumers choose their layouts jointly, each group with the
    layouts it may take (`layout_choices`), pins applied."""
    options: dict[int, dict[int, set]] = {}          # param key -> consumer -> placements offered
    for i, key in prob.param_key.items():
        for c in prob.users[i]:
            for s in prob.strats[c]:
                for slot, k in enumerate(prob.ins[c]):
                    if k == i:
                        options.setdefault(key, {}).setdefault(c, set()).add(s.inputs[slot])
    decision = [k for k, per in options.items()
                if any(len(v) > 1 for v in per.values())]
    consumers: dict[int, list] = {}
    for k in decision:
        for c in options[k]:
            consumers.setdefault(c, []).append(k)
    from networkx.utils import UnionFind          # here: networkx stays out of `import autoshard`
    joint = UnionFind(decision)                  # parameters sharing a consumer decide together
    for ks in consumers.values():
        joint.union(*ks)
    groups = []
    for ks in joint.to_sets():
        ks = sorted(ks, key=lambda k: min(prob.param_nodes[k]))
        anchors = sorted({c for k in ks for c in options[k]})
        names = tuple(prob.param_names[k][0] for k in ks)
        layouts = apply_pins(names, layout_choices(prob, ks, anchors), ks, prob, anchors, pins)
        groups.append(Group(tuple(ks), names, tuple(layouts), tuple(anchors)))
    groups.sort(key=lambda g: g.anchors[0])
    check_pins_known(pins, groups, prob)
    return groups


def layout_choices(prob, keys, anchors):
    """Layouts of `keys` that every consumer can run with; all-Replicate first."""
    per_consumer = []
    for c in anchors:
        slots = [[slot for slot, k in enumerate(prob.ins[c]) if prob.param_key.get(k) == key] for key in keys]
        combos = set()
        for s in prob.strats[c]:
            combos.add(tuple(s.inputs[sl[0]] if sl else None for sl in slots))
        per_consumer.append(combos)
    candidates = set()
    for combos in per_consumer:
        candidates |= combos
    out = []
    for cand in candidates:
        if any(isinstance(x, Partial) for x in cand):
            continue                     # a parameter is stored whole or split, never as a summand
        full = tuple(REPLICATE if x is None else x for x in cand)
        if all(any(all(a is None or a == b for a, b in zip(co, full)) for co in combos) for combos in per_consumer):
            if full not in out:
                out.append(full)
    rep = tuple(REPLICATE for _ in keys)
    out.sort(key=lambda ch: (ch != rep, str(ch)))
    if not out or out[0] != rep:
        out.insert(0, rep)
    return out


def fix_layouts(prob, layouts: dict) -> list:
    """Keep, in every group, only the choice that gives each parameter its layout in `layouts`
    (name -> placement: a module already built, planned again for another call signature); a
    layout no choice offers, or a split parameter the graph gives no choice, is a ShardingError."""
    def wanted(k):
        found = {layouts[n] for n in prob.param_names[k] if n in layouts}
        return found.pop() if len(found) == 1 else (REPLICATE if not found else None)
    out = []
    for grp in prob.groups:
        want = tuple(wanted(k) for k in grp.params)
        if want not in grp.choices:
            shown = {n: str(w) for n, w in zip(grp.names, want)}
            raise ShardingError(f"this call needs other layouts for {shown}: the ops that use them here "
                                f"({', '.join(prob.nodes[a].name for a in grp.anchors[:4])}) cannot run with "
                                "the layouts the module's parameters already have")
        out.append(Group(grp.params, grp.names, (want,), grp.anchors))
    grouped = {k for grp in prob.groups for k in grp.params}
    for k, names in prob.param_names.items():
        if k not in grouped and not isinstance(wanted(k), Replicate):
            raise ShardingError(f"this call cannot keep parameter {names[0]} {list(prob.param_obj[k].shape)} split as "
                                f"{wanted(k)}: no op of its graph can use it split")
    return out


def owner_of(name: str) -> str:
    """The module qualified name owning parameter `name`."""
    return name.rpartition(".")[0]


def apply_pins(names, choices, keys, prob, anchors, pins):
    """The `choices` of a group that its owners' pins (module name -> TorchShard dim) allow."""
    owners = sorted({owner_of(n) for k in keys for n in prob.param_names[k]})   # same order on every rank
    pinned = [o for o in owners if o in pins]
    if not pinned:
        return choices
    out = list(choices)
    for o in pinned:
        want = pins[o]
        if want not in (None, 0, 1, -1):
            raise ShardingError(f"pin for {o!r} is {want!r}; a TorchShard dim is None, 0, 1 or -1")
        keep = []
        for ch in out:
            dims = dims_for_choice(prob, keys, ch, anchors, o)
            if want is None and all(isinstance(pl, Replicate) for pl in ch):
                keep.append(ch)
            elif want is not None and dims and all(d == want or (d in (1, -1) and want in (1, -1)) for d in dims):
                keep.append(ch)
        if not keep:
            shapes = {n: tuple(prob.param_obj[k].shape) for k in keys for n in prob.param_names[k]}
            raise ShardingError(
                f"cannot pin {o!r} to dim {want}: no layout of {shapes} splits that way into "
                f"{prob.p} shards (sizes must divide by {prob.p}, or hold at least one unit a rank "
                f"where every op using them allows unequal shards) and agrees with the other pins on "
                f"these parameters ({ {k: v for k, v in pins.items() if k in owners} })")
        out = keep
    return out


def module_of(prob, i: int) -> str:
    """Qualified name of the module that ran node i: a call_module's target, the innermost
    module of the node's nn_module_stack, or else its parameter's owner (or the node name)."""
    n = prob.nodes[i]
    if n.op == "call_module":
        return n.target
    stack = n.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        if path:
            return path
    for k in prob.ins[i]:
        if k in prob.param_key:
            return prob.nodes[k].target.rpartition(".")[0]
    return n.name


TRANSPOSES = ("numpy_T", "t", "transpose", "permute")


def transposed(prob, c: int) -> bool:
    """Whether anchor c only transposes its parameter (Falcon's `x @ self.weight.T`): the op
    that uses the weight, and whose strategy names a TorchShard dim, is its reader."""
    n = prob.nodes[c]
    name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
    return n.op == "call_function" and (name in TRANSPOSES or (name == "getattr" and n.args[1:] == ("T",))) \
        and not any(s.dim is not None for s in prob.strats[c])


def dims_for_choice(prob, keys, choice, anchors, owner):
    """TorchShard dims the anchors run by module `owner` would have under `choice` (a weight
    tied between `wte` and `head` is pinned per module: the lookup 0, the projection -1); an
    anchor that transposes the weight answers for the op reading it."""
    place = dict(zip(keys, choice))
    dims = []
    own = [c for c in anchors if module_of(prob, c) == owner] or anchors
    for c in own:
        for s in prob.strats[c]:
            ok = all(prob.param_key.get(k) not in place or s.inputs[slot] == place[prob.param_key[k]]
                     for slot, k in enumerate(prob.ins[c]))
            if ok and s.dim is not None:
                dims.append(s.dim)
                break
            if ok and transposed(prob, c):
                found = [r.dim for u in prob.users[c] for r in prob.strats[u] if r.dim is not None and
                         any(k == c and r.inputs[slot] == s.output for slot, k in enumerate(prob.ins[u]))]
                if found:
                    dims.append(found[0])
                    break
    return dims


def check_pins_known(pins, groups, prob):
    known = {owner_of(n) for names in prob.param_names.values() for n in names}
    decided = {owner_of(n) for g in groups for k in g.params for n in prob.param_names[k]}
    for name, want in pins.items():
        if name not in known:
            sample = ", ".join(sorted(known)[:8])
            raise ShardingError(f"pin names {name!r}, which owns no parameter of the model; known: {sample}, ...")
        if want not in (None, 0, 1, -1):
            raise ShardingError(f"pin for {name!r} is {want!r}; a TorchShard dim is None, 0, 1 or -1")
        if want is not None and name not in decided:      # no layout but Replicate: the pin cannot hold
            shapes = {n: tuple(prob.param_obj[k].shape) for k, names in prob.param_names.items()
                      for n in dict.fromkeys(names) if owner_of(n) == name}
            raise ShardingError(
                f"cannot pin {name!r} to dim {want}: no layout of {shapes} splits into {prob.p} shards "
                f"(sizes must divide by {prob.p}, or hold at least one unit a rank where "
                f"every op using them allows unequal shards; and the ops using them need a sharding rule)")
