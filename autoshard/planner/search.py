"""Search: choose a placement for every node so the cost model's total is smallest.

Decisions live on parameters only: a group of parameters that must agree (a linear's weight and
bias, a weight tied between an embedding and a head) takes one of the layouts its consumers
offer. Every other node follows: given its inputs' placements it takes its locally cheapest
strategy, so a plan is evaluated by one forward propagation, and a change is evaluated by
re-propagating only the nodes whose inputs changed (`assignment.State`).

`greedy` visits windows (a group, the groups meeting it within a few ops, the groups it feeds),
tries every combination in the window and keeps the best, sweeping until nothing improves;
windows with the same structure and boundary reuse their answer (identical blocks solve once).
Where a norm's weight can be enumerated with the layers reading it, those joint windows then
refine the plan, kept only where cheaper.
`exact` enumerates every combination of every group: the reference for tests and benchmarks.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..capture.repeats import layer_key, owner
from .assignment import State  # noqa: F401  (search.State: the state greedy and exact return)
from .decisions import transposed
from .problem import INF, Problem  # noqa: F401  (search.Problem is what callers build)

WINDOW_DEPTH = 10        # ops a window looks ahead of its anchors
WINDOW_GROUPS = 4        # groups a window enumerates at most (q, k, v and the out-projection)
WINDOW_COMBOS = 3 ** 4   # combinations a window enumerates at most
UNIT_COMBOS = 3 ** 7     # combinations of one group's siblings past which only its own module's enter
SIGNATURE_DEPTH = 6      # ops past a window's anchors that its cached answer depends on
READERS = 8              # readers of a tensor past which a flip's region leaves them out (`_flip_region`)



# -------------------------------------------------------------------- windows
def _reach(prob: Problem, anchors, anchor_set, limit: int = WINDOW_DEPTH) -> dict[int, int]:
    """Nodes reachable from `anchors` within `limit` ops, stopping at other anchors; never the
    graph's output node (no decision there, and its fan-in can be the whole graph)."""
    depth = {a: 0 for a in anchors}
    frontier = list(anchors)
    while frontier:
        nxt = []
        for i in frontier:
            if depth[i] >= limit:
                continue
            for u in prob.users[i]:
                if u not in depth and prob.kind[u] != "output":
                    depth[u] = depth[i] + 1
                    if u not in anchor_set:
                        nxt.append(u)
        frontier = nxt
    return depth


def acting(prob: Problem, grp) -> list[int]:
    """The nodes that use a group's parameters: its anchors, but for an anchor that only
    transposes its weight (`x @ self.weight.T`: Falcon's linears) the ops reading it."""
    return [u for a in grp.anchors for u in (prob.users[a] if transposed(prob, a) else (a,))]


def primary_groups(prob: Problem) -> set:
    """The groups whose ops name a TorchShard dim (linears, embeddings): those the windows are
    built around; the others (a norm's weight) are flipped alone, then refined with the nearest of
    them they feed (`greedy`)."""
    return {g for g, grp in enumerate(prob.groups)
            if any(s.dim is not None for a in acting(prob, grp) for s in prob.strats[a])}


def windows(prob: Problem) -> tuple[list, dict]:
    """(windows, joint). `windows[g]`: the groups group g is enumerated with: its siblings (anchors
    reading the same activation: q, k and v; fc1 and a gate; where they are too many to enumerate
    together, those of its own module), the groups it feeds before the next
    anchors (the out-projection after q/k/v, fc2 after fc1) and their siblings, nearest first; a
    group that is not primary (a norm's weight) alone. `joint[g]`, for such a group: itself with the
    nearest primary groups it feeds and their siblings, where that unit fits a window. Derived once
    a problem."""
    if "windows of" in prob.search_memo:
        return prob.search_memo["windows of"]
    anchor_group = {}
    for g, grp in enumerate(prob.groups):
        for a in acting(prob, grp):
            anchor_group.setdefault(a, g)
    anchor_set = set(anchor_group)
    readers: dict[int, set] = {}          # activation node -> groups whose anchors read it
    for a, g in anchor_group.items():
        for j in prob.ins[a]:
            if prob.kind[j] not in ("param", "buffer"):
                readers.setdefault(j, set()).add(g)

    def siblings(h):
        out = set()
        for a in acting(prob, prob.groups[h]):
            for j in prob.ins[a]:
                out |= readers.get(j, set())
        return out

    primary = primary_groups(prob)
    out, joint = [], {}
    for g, grp in enumerate(prob.groups):
        own = g in primary
        dist = {h: 0 for h in (siblings(g) | {g}) & primary} if own else {}
        for i, d in _reach(prob, acting(prob, grp), anchor_set).items():
            if d > 0 and i in anchor_group and anchor_group[i] in primary:
                for h in (siblings(anchor_group[i]) | {anchor_group[i]}) & primary:
                    dist[h] = min(dist.get(h, INF), d)
        # a group no op names a dim for (a norm's weight) enters with the layers reading its output,
        # where their unit fits a window: splitting it pays only with their layouts changed too
        # (Falcon-11B's shared norm kept split while the fused q/k/v reads it row-parallel)
        chosen, combos = ([], 1) if own else ([g], len(grp.choices))
        first = g if own else min(dist, key=lambda h: (dist[h], h), default=None)
        for h in sorted(dist, key=lambda h: (h != first, dist[h], h)):
            unit = [u for u in sorted((siblings(h) | {h}) & primary) if u not in chosen]
            n = math.prod(len(prob.groups[u].choices) for u in unit)
            if n > UNIT_COMBOS:       # (Cohere's q, k, v, gate and up read one norm: 10^5 combinations)
                unit = [u for u in unit if _parent(prob.groups[u]) == _parent(prob.groups[h])]
                n = math.prod(len(prob.groups[u].choices) for u in unit)
            if h == first and not own and n > WINDOW_COMBOS:
                break                         # its readers' unit alone fills a window: flipped alone
            if h == first or (len(chosen) + len(unit) <= WINDOW_GROUPS and combos * n <= WINDOW_COMBOS):
                chosen += unit                # siblings enter a window together or not at all
                combos *= n
        out.append(tuple(sorted(chosen)) if own else (g,))
        if not own and len(chosen) > 1:
            joint[g] = tuple(sorted(chosen))
    prob.search_memo["windows of"] = out, joint
    return out, joint


def _parent(grp) -> str:
    """The module holding a group's first parameter (`layers.0.self_attn` of its q_proj.weight)."""
    return grp.names[0].rsplit(".", 2)[0]


def _window_shape(prob: Problem, win, reach_nodes):
    """The structure of a window's region (state-independent) and the outside nodes it reads,
    whose placements complete its signature."""
    region = sorted(reach_nodes)
    pos = {i: k for k, i in enumerate(region)}
    rows, boundary = [], []
    for i in region:
        n = prob.nodes[i]
        v = prob.val[i]
        refs = []
        for j in prob.ins[i]:
            if j in pos:
                refs.append(pos[j])
            else:
                refs.append(("x", tuple(prob.val[j].shape) if isinstance(prob.val[j], torch.Tensor) else None))
                boundary.append(j)
        if n.op == "call_module":
            tgt = type(prob.gm.get_submodule(n.target)).__name__
        elif n.op in ("call_method", "call_function"):
            tgt = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        else:
            tgt = n.op
        rows.append((n.op, str(tgt), tuple(v.shape) if isinstance(v, torch.Tensor) else None, tuple(refs)))
    groups = tuple(len(prob.groups[g].choices) for g in win)
    return (tuple(rows), groups), tuple(boundary)


def _signature(prob: Problem, win, reach_nodes, state: State):
    """Structure of a window's region plus its boundary placements: equal keys, equal answers."""
    shape, boundary = _window_shape(prob, win, reach_nodes)
    return shape, tuple(state.place[j] for j in boundary)


def anchor_nodes(prob: Problem) -> frozenset:
    """Every group's anchors (where the windows' and flips' regions stop), derived once a problem."""
    if "anchors" not in prob.search_memo:
        prob.search_memo["anchors"] = frozenset(a for grp in prob.groups for a in grp.anchors)
    return prob.search_memo["anchors"]


def _sweep(prob: Problem, state: State, wins, max_sweeps: int) -> bool:
    """Visit each window in turn, enumerate it exhaustively and commit its best combination where
    the total drops, until a sweep commits nothing; returns whether anything was. Answers are
    cached by (window structure, boundary placements): identical blocks are solved once."""
    anchor_set = anchor_nodes(prob)
    regions = prob.search_memo.setdefault("windows", {})
    shapes = prob.search_memo.setdefault("window shapes", {})
    changed = False
    for _ in range(max_sweeps):
        cache: dict = {}
        improved = False
        for win in dict.fromkeys(wins):
            if win not in regions:      # (structure id, boundary nodes): the structure is fixed
                nodes = set()
                for g in win:
                    nodes |= set(_reach(prob, prob.groups[g].anchors, anchor_set, SIGNATURE_DEPTH))
                shape, boundary = _window_shape(prob, win, nodes)
                regions[win] = (shapes.setdefault(shape, len(shapes)), boundary)
            shape_id, boundary = regions[win]
            key = (shape_id, tuple(state.place[j] for j in boundary))
            best = cache.get(key)
            if best is None:
                best, best_d = tuple(state.choice[g] for g in win), 0.0
                for combo in itertools.product(*(range(len(prob.groups[g].choices)) for g in win)):
                    d, _ = state.trial({g: c for g, c in zip(win, combo) if c != state.choice[g]})
                    if d < best_d - 1e-15:
                        best, best_d = combo, d
                cache[key] = best
            d, ov = state.trial({g: c for g, c in zip(win, best) if c != state.choice[g]})
            if d < -1e-12 * max(1.0, abs(state.total)):
                state.commit(d, ov)
                improved = changed = True
        if not improved:
            break
    return changed


def _descend(prob: Problem, state: State, wins, max_sweeps: int) -> None:
    """The windows until none improves, then single flips, whole layers, and the first layer made
    like the others."""
    _sweep(prob, state, wins, max_sweeps)
    improve_single(state)
    if improve_by_layers(state):
        improve_single(state)
    uniform_layers(state)


def greedy(prob: Problem, max_sweeps: int = 4, joint: bool = True) -> State:
    """Windowed greedy search from all-Replicate; see the module docstring. With `joint`, the plan
    the windows and flips end at is then refined with the joint windows (`windows`: a norm's
    weight with the layers reading it): one sweep of them and, where one pays, the search again
    from there with them in place of the norms' own; the refined plan is kept only where its
    total is lower. So the joint windows find what no single flip reaches (Falcon-11B's shared
    norm with its fused q/k/v) and the search never ends costlier than without them, which
    enumerating them from the start did not ensure: a move that pays when tried can lead the later
    sweeps to a costlier end (Falcon-40B's norms at the fixed price)."""
    wins, joints = windows(prob)
    state = State(prob)
    _descend(prob, state, wins, max_sweeps)
    if not (joint and joints):
        return state
    refined = state.copy()
    if not _sweep(prob, refined, list(joints.values()), 1):
        return state
    _descend(prob, refined, [joints.get(g, w) for g, w in enumerate(wins)], max_sweeps)
    return refined if refined.total < state.total - 1e-12 * max(1.0, abs(state.total)) else state


def improve_by_layers(state: State) -> bool:
    """Give a numbered layer the decisions of the layer after or before it, all at once, where the
    total drops: the windows decide a layer from what its neighbours hold, and the first layer,
    which reads the embedding's side, can settle on other choices than every later one (BLOOM's
    layer 0 and the embedding's norm kept split, no flip alone paying off), tried with each choice
    of the group just before and just after the layer. Returns whether anything changed."""
    prob = state.prob
    layers: dict = {}
    for g, grp in enumerate(prob.groups):
        key = layer_key(grp.names[0])
        if key is not None:
            layers.setdefault(key[1], {})[key[0]] = g
    changed = False
    for i in sorted(layers):
        for j in (i + 1, i - 1):
            if j not in layers or set(layers[j]) != set(layers[i]):
                continue
            move = {}
            for key, g in layers[i].items():
                want = prob.groups[layers[j][key]].choices[state.choice[layers[j][key]]]
                if want in prob.groups[g].choices and prob.groups[g].choices.index(want) != state.choice[g]:
                    move[g] = prob.groups[g].choices.index(want)
            if not move:
                continue
            # with it, any choice of the group just before or after the layer (the embedding's norm)
            edges = [e for e in (min(layers[i].values()) - 1, max(layers[i].values()) + 1)
                     if 0 <= e < len(prob.groups) and e not in move]
            tries = [move] + [{**move, e: c} for e in edges for c in range(len(prob.groups[e].choices))
                              if c != state.choice[e]]
            d, ov = min((state.trial(t) for t in tries), key=lambda r: r[0])
            if d < -1e-12 * max(1.0, abs(state.total)):
                state.commit(d, ov)
                changed = True
    return changed


def _layer_signature(state: State, members: list[int]) -> tuple:
    """What a layer runs under `state`, whatever its nodes are named: each op's strategy and output
    placement, and the placements of the tensors it reads from outside the layer."""
    inside = set(members)
    return tuple((state.sidx[i], state.place[i], tuple(state.place[j] for j in state.prob.ins[i] if j not in inside))
                 for i in members)


def _runs(prob: Problem) -> list:
    """(layers, {layer: {name: group}}, {layer: op nodes} of the first three) of each run of at least
    three alike numbered layers (the same groups by name), derived once a problem."""
    if "runs" in prob.search_memo:
        return prob.search_memo["runs"]
    layer_groups: dict[str, dict] = {}
    runs: dict[str, list[str]] = {}
    for g, grp in enumerate(prob.groups):
        key = layer_key(grp.names[0])
        if key is not None:
            (prefix, rest), index = key
            layer = f"{prefix}.{index}"
            if layer not in layer_groups:
                runs.setdefault(prefix, []).append(layer)
            layer_groups.setdefault(layer, {})[rest] = g
    out = []
    for layers in runs.values():
        layers.sort(key=lambda n: int(n.rpartition(".")[2]))
        if len(layers) < 3 or any(set(layer_groups[x]) != set(layer_groups[layers[0]]) for x in layers):
            continue
        members = {x: [] for x in layers[:3]}
        for i, n in enumerate(prob.nodes):
            if prob.kind[i] == "op":
                at = owner(n, layers[:3])
                if at is not None:
                    members[at].append(i)
        out.append((layers, layer_groups, members))
    prob.search_memo["runs"] = out
    return out


def first_layers_alike(state: State) -> frozenset:
    """The runs of alike layers (by their first layer's name) whose first layer runs as the second
    does under `state` (`uniform_layers`): a later move keeps them so."""
    out = set()
    for layers, _, members in _runs(state.prob):
        if _layer_signature(state, members[layers[0]]) == _layer_signature(state, members[layers[1]]):
            out.add(layers[0])
    return frozenset(out)


def uniform_layers(state: State) -> bool:
    """Give the first of a run of alike layers what every later one runs, where that costs at most
    one all-reduce of the largest tensor entering it: the first layer reads the embedding's side
    and can settle on other placements (LLaMA's layer 0 reads the embedding's output split on
    features and gathers it twice, where the others read the stream Partial and all-reduce it).
    Alike layers are then one graph, one class and one compile (autoshard.rewrite.blocks), as in
    Megatron, whose vocabulary-parallel embedding hands layer 0 what every layer hands the next.
    Tried: layer 0 taking layer 1's choices, with each choice of the group just before it (the
    embedding). Returns whether anything changed."""
    prob = state.prob
    changed = False
    for layers, layer_groups, members in _runs(prob):
        sig = {x: _layer_signature(state, m) for x, m in members.items()}
        first, second, third = layers[:3]
        if sig[second] != sig[third] or sig[first] == sig[second] or len(members[first]) != len(members[second]):
            continue
        inside = set(members[first])
        entering = max((j for i in inside for j in prob.ins[i] if j not in inside and prob.kind[j] != "param"),
                       key=lambda j: prob.nbytes[j], default=None)
        if entering is None:
            continue
        slack = prob.cost.comm_time("all_reduce", prob.nbytes[entering], prob.p)
        move = {g: state.choice[layer_groups[second][k]] for k, g in layer_groups[first].items()}
        edge = min(layer_groups[first].values()) - 1
        tries = [move] + ([{**move, edge: c} for c in range(len(prob.groups[edge].choices))] if edge >= 0 else [])
        before = {g: state.choice[g] for t in tries for g in t}
        best = None
        for t in tries:
            d, ov = state.trial({g: c for g, c in t.items() if c != state.choice[g]})
            if d > slack or (best is not None and d >= best[0]):
                continue
            state.commit(d, ov)
            if _layer_signature(state, members[first]) == sig[second]:
                best = (d, t)
            state.set_choices(before)
        if best is not None:
            state.set_choices(best[1])
            changed = True
    return changed


def _flip_region(prob: Problem, g: int, anchor_set, shapes: dict):
    """(structure id, nodes) of group g's flips: the ops within SIGNATURE_DEPTH of its anchors,
    the tensors they read and those tensors' other readers (q's siblings k and v; not those of a
    tensor every layer reads, rotary's cos and sin), in an order that alike layers share. Equal
    ids and equal labels of those nodes: equal flips."""
    hit = prob.search_memo.get(("flip", g))
    if hit is None:
        region = set(_reach(prob, prob.groups[g].anchors, anchor_set, SIGNATURE_DEPTH))
        shape, boundary = _window_shape(prob, (g,), region)
        readers = [tuple(u for u in prob.users[j] if u not in region) if len(prob.users[j]) <= READERS else ()
                   for j in boundary]
        extra = tuple(tuple(str(prob.nodes[u].target) for u in us) for us in readers)
        nodes = (*sorted(region), *boundary, *(u for us in readers for u in us))
        hit = prob.search_memo["flip", g] = (shapes.setdefault((shape, extra), len(shapes)), nodes)
    return hit


def improve_single(state: State) -> None:
    """Flip one group at a time while the total drops (a final polish after the windows). Within a
    pass, a flip that did not pay is not tried again on a group whose region (`_flip_region`) is
    labelled as the rejected one's was: each alike layer of a stack is tried once a pass, not
    once per layer (a trial is still made before any flip is kept)."""
    prob = state.prob
    anchor_set = anchor_nodes(prob)
    shapes = prob.search_memo.setdefault("flip shapes", {})
    for _ in range(3):
        improved, rejected = False, set()      # (for one pass, as `_sweep`'s answers: see there)
        for g in range(len(prob.groups)):
            sid, nodes = _flip_region(prob, g, anchor_set, shapes)
            for c in range(len(prob.groups[g].choices)):
                if c == state.choice[g]:
                    continue
                key = (sid, c, *((state.sidx[i], state.place[i]) for i in nodes))
                if key in rejected:
                    continue
                d, ov = state.trial({g: c})
                if d < -1e-12 * max(1.0, abs(state.total)):
                    state.commit(d, ov)
                    improved = True
                else:
                    rejected.add(key)
        if not improved:
            return


def exact(prob: Problem, limit: int = 200_000) -> State:
    """Every combination of every group (the product must stay under `limit`)."""
    state = State(prob)
    state.path = None        # every combination once: nothing to share, no trial kept (`State.path`)
    sizes = [len(g.choices) for g in prob.groups]
    total = math.prod(sizes)
    if total > limit:
        raise ValueError(f"exact search over {len(sizes)} groups needs {total} evaluations (> {limit})")
    best, best_cost = tuple(state.choice), state.total
    for combo in itertools.product(*(range(n) for n in sizes)):
        state.set_choices(dict(enumerate(combo)))
        if state.total < best_cost - 1e-15:
            best, best_cost = combo, state.total
    state.set_choices(dict(enumerate(best)))
    state.total = state.evaluate()
    return state
