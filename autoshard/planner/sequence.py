"""Megatron's sequence parallelism as a move on a searched plan (`sequence_parallel=`).

Between a row-parallel layer and the next column-parallel layers a Megatron plan holds the
residual stream, the norms and the dropouts whole on every rank: the row layer's Partial output is
all-reduced, each rank then runs the same element-wise ops on the same tokens and saves the same
activations. Sequence parallelism (Korthikanti et al., 2022) holds that stretch split on the token
dim instead: the Partial output is reduce-scattered onto the tokens (backward: all-gathered), the
ops between run on 1/p of the tokens, and the column layers' input is all-gathered (backward:
reduce-scattered). A ring all-reduce is a reduce-scatter and an all-gather, so the activations move
the same bytes; what changes is memory (the stream's saved tensors, norms' statistics and dropout
masks at 1/p per rank), a little compute (the element-wise ops at 1/p) and the norms' weights,
whose gradients are now sums over each rank's tokens and are all-reduced (a hidden-size vector
each). The search's objective never prefers it (comm-neutral, memory of activations unpriced), so
it is applied here, after the search, to whatever plan it found, for any graph whose stream runs
row layer -> element-wise / norm ops -> column layer, whatever the architecture.

The move: in topological order, an op whose output is held whole (Replicate), or a Partial sum that
reads a whole or moved activation (a residual add left for the next norm to reduce), takes a strategy that
outputs `Shard(token dim)` where each of its inputs is either moved already (read at its new
placement), a Partial tensor (reduce-scattered), one split on another dim (an all-to-all where it
was gathered: a hidden-split embedding's output), a whole activation (sliced locally) or a
parameter read as stored, and at least one is not whole; a view of a row layer's Partial
output that made it whole (the rewrite's flattened tokens viewed back to [b, s, h]) first passes
it on Partial. Readers left as they were read a moved tensor whole: the all-gather. The move is
kept only where the activations' bytes do not grow (the parameters' gradient all-reduces are the
norms' own cost; an all-to-all of a hidden-split embedding's output in place of its gather sends
fewer bytes in more ring steps); else the plan is left as it was. The token dim of a
[..., tokens, features] activation is its second-to-last (`token_dim`).

Where the gathered readers are linear layers (`regathered`), they save only the rank's tokens and
gather them again in backward (Megatron's; `runtime.sequence.gathered_linears`): one all-gather
more per such input, priced in the plan's bytes, for (p - 1)/p of the input's bytes less saved.
"""
from __future__ import annotations

import copy

import torch

from ..runtime.counters import ring_bytes
from ..runtime.placements import Partial, Replicate, Shard
from ..runtime.sequence import column_readers

EPS = 1e-9        # relative slack of the communication check (float sums in another order)


def token_dim(v) -> int | None:
    """The dim sequence parallelism splits a floating activation on: tokens of [..., tokens, features]."""
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
        return v.dim() - 2
    return None


def _whole(pl) -> bool:
    return type(pl) is Replicate


def _split_strategy(prob, i, place, moved, partial=False):
    """The strategy of node i that outputs Shard(token dim) from the inputs `moved` / as held, or None."""
    d = token_dim(prob.val[i])
    if d is None or prob.kind[i] != "op" or not (_whole(place[i]) or partial and _partial_plus(prob, i, place)):
        return None
    want = Shard(d)
    for si, s in enumerate(prob.strats[i]):
        if s.output != want:
            continue
        ok, seeded = True, False
        for slot, j in enumerate(prob.ins[i]):
            req = s.inputs[slot]
            if req is None:
                continue
            src = place[j]
            if prob.kind[j] in ("param", "buffer") or not prob.nbytes[j]:
                ok = req == src
            elif j in moved:
                ok, seeded = req == src, seeded or req == src
            elif token_dim(prob.val[j]) is not None and req == Shard(token_dim(prob.val[j])):
                if isinstance(src, Partial):
                    seeded = True           # a row layer's output: reduce-scattered onto the tokens
                elif not _whole(src):       # split on features (a hidden-split embedding): all-to-all,
                    ok = prob.redistribution(j, src, req) is not None      # where it was gathered whole
                    seeded = seeded or (ok and isinstance(src, Shard))
                # (a whole activation is sliced locally)
            else:
                ok = req == src
            if not ok:
                break
        if ok and seeded:
            return si
    return None


def _partial_plus(prob, i, place) -> bool:
    """Node i keeps a Partial result while reading a whole or moved activation: a residual add that
    leaves the stream's reduction to the next norm (OLMo's plan), or a cast of such a sum once moved.
    Moved, its Partial inputs are reduce-scattered instead. (An op of Partial inputs alone stays
    Partial: one reduction of the sum, GPT-2's token and position embeddings.)"""
    acts = [j for j in prob.ins[i] if prob.nbytes[j] and prob.kind[j] not in ("param", "buffer")]
    return isinstance(place[i], Partial) and not all(isinstance(place[j], Partial) for j in acts)


def _partial_strategy(prob, i, place):
    """The strategy of a whole view / element-wise op i that reads a Partial input and keeps it
    Partial (its one reader then reduce-scatters it), or None."""
    if prob.kind[i] != "op" or not _whole(place[i]) or len(prob.users[i]) != 1:
        return None
    acts = [j for j in prob.ins[i] if prob.nbytes[j] and prob.kind[j] not in ("param", "buffer")]
    if len(acts) != 1 or not isinstance(place[acts[0]], Partial):
        return None
    for si, s in enumerate(prob.strats[i]):
        if isinstance(s.output, Partial) and all(
                req is None or (isinstance(req, Partial) if j == acts[0] else req == place[j])
                for req, j in zip(s.inputs, prob.ins[i])):
            return si
    return None


def of_weights(prob) -> set:
    """Nodes computed from parameters alone (Gemma's norm weight `1 + w`, a weight cast to the
    activations' dtype): their gradients' all-reduces are the weights' own, not the activations'."""
    out = set()
    for i in range(len(prob.nodes)):
        if prob.kind[i] == "param" or (prob.kind[i] in ("op", "select") and prob.ins[i] and
                                       all(j in out or prob.kind[j] == "buffer" for j in prob.ins[i]) and
                                       any(j in out for j in prob.ins[i])):
            out.add(i)
    return out


def _activation_bytes(prob, place, sidx) -> float:
    """Ring bytes a rank sends for the activations (not the parameters' gradients) under a labelling."""
    weights = of_weights(prob)
    return sum(ring_bytes(k, prob.nbytes[j], prob.p) for j in range(len(prob.nodes))
               if prob.nbytes[j] and j not in weights
               for _, _, fwd, bwd, _, _ in prob.comms_of(j, place, sidx) for k in fwd + bwd)


def _near_cost(prob, place, sidx, u) -> float:
    """Communication (seconds) of the tensors whose cost a change of node u's strategy can change."""
    near = {prob.root[j] for j in (u, *prob.ins[u], *prob.users[u]) if prob.kind[j] != "param"}
    return sum(prob.tensor_cost(j, place, sidx) for j in near)


def _prune(prob, place, sidx, moved, state) -> None:
    """Put back moved ops that end the split region (no moved reader) where that sends less, and
    views (which save nothing) where it sends no more: a tail whose reader wants another split
    (the head's slices before a row-parallel head), the logits of a row-parallel head on their
    way to a whole loss (split on tokens, their gradient would be gathered back)."""
    changed = True
    while changed:
        changed = False
        for i in sorted(moved, reverse=True):
            if any(u in moved for u in prob.users[i]):
                continue
            before = _near_cost(prob, place, sidx, i)
            new = sidx[i], place[i]
            sidx[i], place[i] = state.sidx[i], state.place[i]
            after = _near_cost(prob, place, sidx, i)
            if after < before * (1 - EPS) or (prob.root[i] != i and after <= before * (1 + EPS)):
                moved.discard(i)
                changed = True
            else:
                sidx[i], place[i] = new


def _gather_readers(prob, place, sidx, moved) -> None:
    """Let each reader that gathers a moved tensor whole take the strategy (of those keeping its
    output whole) that moves fewest bytes: a view before a column layer then passes the layer's
    Partial input gradient through (`ReplicatePartialGrad`), so the gather's backward is a
    reduce-scatter onto the tokens rather than an all-reduce of the whole gradient."""
    readers = sorted({u for i in moved for u in prob.users[i] if u not in moved and prob.kind[u] == "op"
                      and _whole(place[u])})
    for u in readers:
        best = _near_cost(prob, place, sidx, u), sidx[u]
        for si, s in enumerate(prob.strats[u]):
            if si == best[1] or not isinstance(s.output, Replicate):
                continue
            old = sidx[u], place[u]
            sidx[u], place[u] = si, s.output
            c = _near_cost(prob, place, sidx, u)
            if c < best[0] * (1 - EPS):
                best = c, si
            sidx[u], place[u] = old
        sidx[u], place[u] = best[1], prob.strats[u][best[1]].output


def _whole_region(prob, place, u) -> set:
    """The ops downstream of reader u (u included) that hold their output whole (Replicate) and
    read it from u through whole tensors only: the routing of a mixture of experts (router linear,
    softmax, top-k, normalisation) between the gathered stream and the experts op."""
    region, todo = set(), [u]
    while todo:
        i = todo.pop()
        held = place[i] if isinstance(place[i], tuple) else (place[i],)
        if i in region or prob.kind[i] not in ("op", "select") or not all(pl is None or _whole(pl) for pl in held) \
                or (prob.kind[i] == "op" and not prob.strats[i]):
            continue
        region.add(i)
        todo.extend(prob.users[i])
    return region


def _partial_regions(prob, place, sidx, moved) -> None:
    """Let the whole region after each gathered reader send Partial gradients back (each op of it
    `replicate_pg`: run whole, its gradient left a summand per rank) where that moves fewer bytes:
    a reader gathers the split stream for an op whose input gradient is Partial (the experts, a
    column layer) and for others whose is whole (a replicated router); the whole ones make the
    gradient whole with an all-reduce, and the gather's backward cannot be a reduce-scatter. With
    the region Partial the router's weight gradient is all-reduced instead (experts x hidden), and
    the stream's gradient reduce-scattered onto the tokens as Megatron's sequence-parallel MoE does."""
    readers = sorted({u for i in moved for u in prob.users[i] if u not in moved and prob.kind[u] == "op"
                      and _whole(place[u])})
    for u in readers:
        region = _whole_region(prob, place, u)
        change = {i: si for i in region for si, s in enumerate(prob.strats[i])
                  if s.name == "replicate_pg" and si != sidx[i]}
        if not change:
            continue
        near = sorted({prob.root[j] for i in change for j in (i, *prob.ins[i], *prob.users[i])
                       if prob.kind[j] != "param"} | {prob.root[j] for i in change for j in prob.ins[i]})
        before = sum(prob.tensor_cost(j, place, sidx) for j in near)
        selects = [j for i in change for j in prob.users[i] if prob.kind[j] == "select"]
        old = {i: (sidx[i], place[i]) for i in (*change, *selects)}
        for i, si in change.items():
            sidx[i], place[i] = si, prob.strats[i][si].output
        for j in selects:               # a multi-output op's parts (top-k's values) take its new placements
            place[j] = place[prob.ins[j][0]][prob.nodes[j].args[1]]
        after = sum(prob.tensor_cost(j, place, sidx) for j in near)
        if not after < before * (1 - EPS):
            for i, (si, pl) in old.items():
                sidx[i], place[i] = si, pl


def _moved(prob, state, partial: bool, sent: float):
    """(place, sidx, moved) of the move on `state` (the module docstring), Partial sums that read a
    whole or moved activation moved too where `partial`; None where it moves nothing, sends more
    bytes than `sent` (the state's activations') or leaves a reader unserved."""
    place, sidx = list(state.place), list(state.sidx)
    moved: set[int] = set()
    passed: dict[int, int] = {}         # whole views of a Partial tensor passed on Partial: node -> strategy
    for i in range(len(prob.nodes)):
        si = _split_strategy(prob, i, place, moved, partial)
        if si is None:
            # a whole view of a Partial tensor whose one reader could then take it split
            pi = _partial_strategy(prob, i, place)
            if pi is None:
                continue
            old = place[i], sidx[i]
            place[i], sidx[i] = prob.strats[i][pi].output, pi
            u = prob.users[i][0]
            if _split_strategy(prob, u, place, moved, partial) is None:
                place[i], sidx[i] = old
                continue
            passed[i] = pi
            continue
        sidx[i], place[i] = si, prob.strats[i][si].output
        moved.add(i)
    for i in list(passed):              # passed on, but its reader was not moved: undo
        if prob.users[i][0] not in moved:
            sidx[i], place[i] = state.sidx[i], state.place[i]
    _prune(prob, place, sidx, moved, state)
    _partial_regions(prob, place, sidx, moved)
    _gather_readers(prob, place, sidx, moved)
    if not moved or _activation_bytes(prob, place, sidx) > sent * (1 + EPS):
        return None
    if any(prob.tensor_cost(j, place, sidx) == float("inf") for j in range(len(prob.nodes))):
        return None                     # a reader the moved tensors cannot serve (one that needs a Partial sum)
    return place, sidx, moved


def apply(state) -> int:
    """Apply the move to `state` in place (see the module docstring); returns how many ops now hold
    their output split on tokens (0: nothing to move, or moving would send more bytes). Tried with
    and without moving Partial residual sums (OLMo's stream is one; in Swin moving them sends more),
    the one that splits more ops kept. `state` is an `assignment.State`, not imported: the memory
    model, which the cost model imports, reads this module."""
    prob = state.prob
    sent = _activation_bytes(prob, state.place, state.sidx)
    found = [m for m in (_moved(prob, state, False, sent), _moved(prob, state, True, sent)) if m is not None]
    if not found:
        return 0
    place, sidx, moved = max(found, key=lambda m: len(m[2]))
    relabel(state, place, sidx)
    return len(moved)


def relabel(state, place, sidx) -> None:
    """Give `state` the labelling (`place`, `sidx`: lists of its own, not shared) and the costs that
    follow from it."""
    prob = state.prob
    state.place, state.sidx, state.path = place, sidx, None
    state.tcost = [prob.tensor_cost(j, place, sidx) for j in range(len(prob.nodes))]
    state.total = state.evaluate()


def held_chains(prob, place, sidx) -> list:
    """[(place, sidx)]: for each split tensor that a reader gathers whole only to end in an op that
    makes its own result whole (the loss over logits split on the vocabulary, gathered for a replicated
    cross entropy), the labelling with that chain of readers reading it as held down to that op
    (views, casts, the loss vocabulary-parallel: its statistics all-reduced, a float or two a token),
    the other readers (a returned output) still gathering it. Megatron keeps its logits split into
    the loss so; the search never prefers it (the loss's own collectives against a gather it needs
    anyway for the output), so it is a candidate move of the sequence-parallel twin."""
    found = []
    for j in range(len(prob.nodes)):
        if prob.kind[j] == "param" or not isinstance(place[j], Shard) or not prob.nbytes[j]:
            continue
        if not any(isinstance(req, Replicate) and _whole(place[u]) for u in prob.users[j] if prob.strats[u]
                   for req, k in zip(prob.strats[u][sidx[u]].inputs, prob.ins[u]) if k == j):
            continue
        new_place, new_sidx, held, ended = list(place), list(sidx), {j}, False
        for i in range(j + 1, len(prob.nodes)):
            if prob.kind[i] != "op" or not prob.strats[i] or not held.intersection(prob.ins[i]):
                continue
            cur = prob.strats[i][sidx[i]]
            reads = [si for si, s in enumerate(prob.strats[i]) if si != sidx[i] and all(
                req is None or req == (new_place[k] if k in held else cur.inputs[slot])
                for slot, (req, k) in enumerate(zip(s.inputs, prob.ins[i])))]
            if not reads:
                continue
            si = min(reads, key=lambda si: prob.node_cost[i][si])
            s = prob.strats[i][si]
            new_sidx[i], new_place[i] = si, s.output
            if _whole(s.output):
                ended = ended or bool(s.comm)
            else:
                held.add(i)
        if ended:
            found.append((new_place, new_sidx))
    return found


def with_sequence_parallel(state, tokens):
    """`state` (searched on a Problem whose ops keep tokens whole) as a state of `tokens` (the same
    graph's Problem with `tokens=True`: the token splits offered too) with the move applied, or None
    where it moves nothing (or the two problems' decisions differ). The search runs without token
    splits, so that the plan moved is the plan found without sequence parallelism."""
    prob = state.prob
    if len(tokens.nodes) != len(prob.nodes) or [g.choices for g in tokens.groups] != [g.choices for g in prob.groups]:
        return None
    other = copy.copy(state)
    other.prob, other.choice, other.place = tokens, list(state.choice), list(state.place)
    other.sidx = [tokens.strats[i].index(prob.strats[i][s]) if prob.strats[i] else s for i, s in enumerate(state.sidx)]
    other.param_place = dict(state.param_place)
    if not apply(other):
        return None
    return other


def split_ops(prob, state) -> int:
    """How many ops of `state` hold their output split on the token dim (0 without sequence parallelism)."""
    if not prob.tokens:
        return 0
    return sum(1 for i in range(len(prob.nodes)) if prob.kind[i] == "op" and token_dim(prob.val[i]) is not None
               and state.place[i] == Shard(token_dim(prob.val[i])))


def regathered(prob, state) -> dict:
    """{tensor: its readers} of the token-split tensors gathered whole for linear layers only, which
    then save the rank's tokens and gather them again in backward (`runtime.sequence`): the
    gathers whose backward is one reduce-scatter (the readers send back Partial gradients) and whose
    readers are linear layers on parameters, or one view flattening tokens read by such layers
    (`column_readers`, the test the rewrite fuses by)."""
    if not prob.tokens:
        return {}
    out = {}
    for j in range(len(prob.nodes)):
        d = token_dim(prob.val[j])
        if d is None or prob.kind[j] == "param" or state.place[j] != Shard(d) or not prob.needs_grad[j]:
            continue
        for req, _, fwd, bwd, consumers, via in prob.comms_of(j, state.place, state.sidx):
            if via is None and fwd == ("all_gather",) and bwd == ("reduce_scatter",) and isinstance(req, Replicate) \
                    and column_readers(prob.nodes[j], [prob.nodes[c] for c in consumers]) is not None:
                out[j] = tuple(consumers)
    return out


def regathered_layers(prob, j: int, readers) -> tuple:
    """The linear layers among `regathered`'s readers of tensor j (through a flattening view)."""
    found = column_readers(prob.nodes[j], [prob.nodes[c] for c in readers])
    index = {n: i for i, n in enumerate(prob.nodes)}
    return tuple(index[n] for n in found[0])


def activation_bytes(state) -> float:
    """Ring bytes a rank sends a step for the activations of `state` (the parameters' gradients
    aside), its backward re-gathers included."""
    prob = state.prob
    return _activation_bytes(prob, state.place, state.sidx) + sum(
        ring_bytes("all_gather", prob.nbytes[j], prob.p) for j in regathered(prob, state))


def regather_seconds(prob, state) -> float:
    """Predicted seconds of the backward all-gathers of `regathered` inputs."""
    return sum(prob.cost.comm_time("all_gather", prob.nbytes[j], prob.p) for j in regathered(prob, state))
