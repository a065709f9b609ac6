"""The memory of one training step per rank under a plan: what is held, what autograd saves, the peak.

Which tensors autograd saves is read, not tabulated (`saved.saved_tensors`); a grouped-query
sdpa capture wrote ungrouped saves K and V where the plan lets the ranks run it grouped (no
redistribution on the repeat), else their copies. Under a plan each saved tensor takes the
bytes of its local piece: an input at the placement its reader requires (a gathered copy is
whole: Replicate; not where linear readers save the rank's tokens and gather them again in
backward, `sequence.regathered`), an own output at its placement, an op's new tensors at the
share of its largest activation input. Dtypes are the stored ones (bf16 halves).

`step_memory` lays the step out as a timeline (node i's forward at t = i, its backward at
t = 2N - 1 - i, the optimizer step at t = 2N) and sums what is live at each t: parameters,
buffers and optimizer state throughout (the steady state: state made by an earlier step,
gradients set to None before forward); saved tensors from their forward to the last backward that
reads them; other outputs and gathered copies until their last forward reader; gradients from the
backward of their first reader to their producer's (a parameter's until the step's end). The peak
is the largest such sum and where it occurs, not a sum of the parts. Checkpointed blocks keep only
their inputs through the forward and recompute their saved tensors at the start of their backward.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..capture.normalize import repeat_chain
from ..runtime.placements import Shard, local_numel
from .saved import Saved, saved_tensors
from .sequence import regathered, regathered_layers

# optimizer -> moments held per trainable element, in the parameter's dtype (torch.optim's)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "adamax": 2, "nadam": 2, "radam": 2, "sgd": 0, "sgd_momentum": 1,
                    "adagrad": 1, "rmsprop": 1, "none": 0}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40}


def optimizer_states(optimizer) -> int:
    """Moments per trainable element of `optimizer`: a name of OPTIMIZER_STATES, a torch.optim
    class, or a number."""
    if isinstance(optimizer, type):
        optimizer = optimizer.__name__
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    key = str(optimizer).lower().replace("-", "_")
    if key not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, a torch.optim class or a number of "
                         f"moments per parameter, got {optimizer!r}")
    return OPTIMIZER_STATES[key]


def parse_bytes(value) -> float:
    """Bytes from a number or a string such as "30GB", "512 MiB" (GB = 1e9, GiB = 2**30)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"a memory size must be bytes or a string like '30GB' / '512MiB', got {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class Memory(Mapping):
    """Bytes per rank of one training step: `parameters`, `gradients`, `optimizer` (state),
    `activations` (saved for backward at the end of forward) and `peak` (the most live at once,
    over forward, backward and the optimizer step); a mapping of those five keys. `buffers`,
    `peak_at` (when the peak occurs) and `largest` ((what, bytes) of the largest items live then)
    say more."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int
    buffers: int = 0
    peak_at: str = ""
    largest: tuple = ()
    exact: bool = True             # False: the saved tensors were estimated (the fake run failed)

    KEYS = ("parameters", "gradients", "optimizer", "activations", "peak")

    def __getitem__(self, key):
        if key not in self.KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

def _fraction(val, placement, p: int) -> float:
    """The share of `val` one rank holds as `placement` (the largest rank's)."""
    if not isinstance(placement, Shard) or not isinstance(val, torch.Tensor):
        return 1.0                     # (whole, Partial, or not a tensor: all of it)
    try:
        return _shape_fraction(tuple(val.shape), placement, p)
    except TypeError:                  # (a size that does not hash)
        return _shape_fraction.__wrapped__(val.shape, placement, p)


@functools.lru_cache(maxsize=1 << 16)
def _shape_fraction(shape, placement, p: int) -> float:
    try:
        return local_numel(shape, placement, p) / math.prod(shape)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError):
        return 1.0


def _own_fraction(prob, state, i, s, p: int, shape) -> float:
    """The share one rank holds of a tensor op `i` saves of its own (attention's probabilities and
    dropout noise, a float copy of its mask, a norm's statistics, a loss's log-softmax), of `shape`:
    split as its largest input or its output is where it spans that tensor's split dim whole
    (probabilities [B, H, T, S] follow queries split on heads; a [B, 1, T, S] mask copy, or a norm's
    [T, 1] statistics beside features split, do not), the smaller share of the two. One with an
    input's elements is that input's copy (autocast's cast of a linear's input, in the 2-D shape its
    matmul reads) and is held as the op reads that input."""
    ins = [(prob.nbytes[k], q, k) for q, k in enumerate(prob.ins[i]) if isinstance(prob.val[k], torch.Tensor)
           and prob.kind[k] not in ("param", "buffer")]
    if not ins or s is None:
        return _fraction(prob.val[i], state.place[i], p)
    copies = [(nb, q, k) for nb, q, k in ins if _copy_of(shape, prob.val[k])]
    if copies:
        _, q, k = max(copies)
        return _fraction(prob.val[k], s.inputs[q] or state.place[k], p)
    _, q, k = max(ins)
    shares = [_aligned_share(prob.val[k], s.inputs[q] or state.place[k], p, shape)]
    if isinstance(prob.val[i], torch.Tensor) and prob.val[i].numel() > 1:
        shares.append(_aligned_share(prob.val[i], state.place[i], p, shape))
    shares = [f for f in shares if f is not None]
    return min(shares) if shares else 1.0


def _copy_of(shape, val) -> bool:
    """Whether a tensor an op saves of its own, of `shape`, has `val`'s elements: a copy of that
    input (autocast's cast, in the 2-D shape its matmul reads)."""
    return shape is not None and isinstance(val, torch.Tensor) and math.prod(shape) == val.numel()


def _aligned_share(val, placement, p: int, shape) -> float | None:
    """`_fraction(val, placement)` for a tensor of `shape` that `val`'s split splits alike; None where
    `shape` has val's rank but not its split dim's size (that split leaves it whole)."""
    d = getattr(placement, "dim", None)
    if shape is not None and isinstance(d, int) and isinstance(val, torch.Tensor) and len(shape) == val.dim() \
            and shape[d % val.dim()] != val.shape[d % val.dim()]:
        return None
    return _fraction(val, placement, p)


def _block_ranges(prob, blocks) -> dict:
    """{block name: (first node, last node)} of the nodes that module `name` (or one inside it) ran."""
    from .decisions import module_of
    spans = {}
    for i, k in enumerate(prob.kind):
        if k not in ("op", "select"):
            continue
        mod = module_of(prob, i)
        for b in blocks:
            if mod == b or mod.startswith(b + "."):
                a, z = spans.get(b, (i, i))
                spans[b] = (min(a, i), max(z, i))
    return spans


def _runs_grouped(prob, state, i: int, strat) -> bool:
    """Whether the ranks run sdpa node `i`, which capture wrote ungrouped, grouped again
    (`rewrite.grouped`): no redistribution on the repeat of its K or of its V under `state`."""
    n = prob.nodes[i]
    for a in n.args[1:3]:
        chain = repeat_chain(a)
        if chain is None:
            return False
        for reader, x in zip((n, *chain[:-1]), chain):
            r, k = prob.idx[reader], prob.idx[x]
            s = strat(r)
            need = s.inputs[prob.ins[r].index(k)] if s is not None else None
            if need is not None and need != state.place[k]:
                return False
    return True


def _loss_backward_bytes(prob, i: int, k: int) -> int:
    """Bytes torch's cross entropy `i` makes in backward beside the gradient of its logits `k`: the
    log-softmax's gradient, in the loss's dtype. Where the loss computes in a wider dtype than its
    logits (one call under autocast, which runs it in float32), the logits' gradient is made in that
    dtype too before its cast back, of which the cast is counted as the logits' gradient."""
    logits, loss = prob.val[k], prob.val[i]
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        return prob.nbytes[k]
    wide = logits.numel() * loss.element_size()
    return wide + max(0, wide - prob.nbytes[k])


def _autocast_cache(prob, state, cached, p: int) -> list:
    """Timeline items of the bf16 casts of weights that gathered linears make under autocast: not
    saved for backward (made inside the layers' forward), but held by autocast's cache of casts of
    leaf tensors until the autocast region ends, taken as the end of forward. `cached`: (node,
    strategy, storage, bytes, shape) of each own tensor of such a layer that is not its input's cast."""
    from .decisions import module_of
    out, seen = [], set()
    for i, s, st, nb, shape in cached:
        weights = [(q, k) for q, k in enumerate(prob.ins[i])
                   if prob.kind[k] == "param" and _copy_of(shape, prob.val[k])]
        if not weights or st in seen:
            continue
        seen.add(st)
        q, k = weights[0]
        f = _fraction(prob.val[k], (s.inputs[q] if s is not None else None) or state.place[k], p)
        out.append([int(nb * f), i, len(prob.nodes) - 1, f"cast of a weight of {module_of(prob, i)}", "temporary"])
    return out


def step_memory(prob, state, saved: Saved, optimizer="adamw", checkpointed=(), device: str = "cpu",
                scores=frozenset(), before: str | None = None) -> Memory:
    """Memory of one training step per rank under `state` (a search State of `prob`);
    `checkpointed`: names of blocks whose activations are recomputed in backward; `scores` (node
    names: attention's scores and what is made of them) are recomputed (Megatron's selective
    recomputation: what their ops save of them is made again at its backward, not held from forward).
    `device="cuda"`: a dropout's mask is held as CUDA's kernel holds it, one byte an element;
    `before` (a node's name): `activations` counts only what ops before that node save (a pipeline's
    first stage's share)."""
    from .decisions import module_of
    n, p = len(prob.nodes), prob.p
    end = 2 * n

    def bwd(i):
        return end - 1 - i

    def strat(i):
        return prob.strats[i][state.sidx[i]] if prob.strats[i] else None

    items = []                                    # [bytes, first t, last t, what, kind]

    # parameters, buffers, gradients of parameters, optimizer state
    params = grads = 0
    largest_param = 0
    seen = set()
    last_use: dict[int, int] = {}
    for key, idxs in prob.param_nodes.items():
        last_use[key] = max((u for i in idxs for u in prob.users[i]), default=0)
    for name, t in prob.gm.named_parameters():
        if id(t) in seen:
            continue
        seen.add(id(t))
        pl = state.placement_of_param(id(t)) if id(t) in prob.param_obj else None
        nb = int(t.numel() * _fraction(t, pl, p)) * t.element_size() if pl is not None else t.numel() * t.element_size()
        params += nb
        largest_param = max(largest_param, nb)
        if t.requires_grad:
            grads += nb
            first = bwd(last_use.get(id(t), n - 1))
            items.append([nb, first, end, f"grad {name}", "gradients"])
    buffers = sum(b.numel() * b.element_size() for b in prob.gm.buffers())
    states = optimizer_states(optimizer)
    opt = states * grads
    if states:          # torch.optim's single-tensor update (CPU) makes one temporary the size of a parameter
        items.append([largest_param if device == "cpu" else grads, end, end, "optimizer update", "optimizer"])

    spans = _block_ranges(prob, checkpointed) if checkpointed else {}
    block_of = {}
    for b, (a, z) in spans.items():
        for i in range(a, z + 1):
            block_of[i] = b

    # saved tensors, keyed by (storage, share); an own output read at its own placement is "own", and so
    # is a gathered input its linear readers save as this rank's tokens (gathered again in backward)
    gathered = regathered(prob, state)
    again = {i: k for k, readers in gathered.items() for i in regathered_layers(prob, k, readers)}
    keyed: dict = {}
    cached = []                 # autocast's casts of weights inside gathered linears (_autocast_cache)
    for i in range(n):
        s = strat(i)
        saves = saved.saves[i]
        if i in (saved.ungrouped or {}) and not _runs_grouped(prob, state, i, strat):
            saves = saved.ungrouped[i]                  # the repeat's copies per query head
        for st, nb in saves:
            j = saved.producer.get(st)
            slot = next((q for q, k in enumerate(prob.ins[i]) if saved.storage[k] == st), None)
            if slot is not None and s is not None:
                k = prob.ins[i][slot]
                moved = s.inputs[slot] is not None and s.inputs[slot] != state.place[k]
                if i in again and saved.storage[again[i]] == st:
                    k, moved = again[i], False          # the rank's tokens, gathered again in backward
                f = _fraction(prob.val[k], s.inputs[slot] if moved else state.place[k], p)
            elif j is not None and saved.storage[j] == st:
                k, moved, f = j, False, _fraction(prob.val[j], state.place[j], p)
            elif i in again:            # gathered linears save this rank's tokens and the weights only;
                k = again[i]            # autocast's casts are made inside their forward: the cast of the
                shape = (saved.shapes or {}).get(st)      # input stands for the tokens, in their dtype
                if not _copy_of(shape, prob.val[k]):
                    cached.append((i, s, st, nb, shape))
                    continue
                st, nb, j, moved = saved.storage[k], prob.nbytes[k], k, False
                f = _fraction(prob.val[k], state.place[k], p)
            else:                       # a tensor of the op's own: split as the op's work is
                f = _own_fraction(prob, state, i, s, p, (saved.shapes or {}).get(st))
                j, moved = i, False
                if device == "cuda" and _is_dropout(prob.nodes[i]) and _copy_of((saved.shapes or {}).get(st),
                                                                                 prob.val[i]):
                    nb = prob.val[i].numel()            # CUDA's fused dropout keeps a bool mask
            key = (st, round(f, 9)) if moved else (st, "own")
            rec = keyed.setdefault(key, [int(nb * f), i if moved or j is None else j, [], module_of(prob, i)])
            rec[2].append(i)
    items += _autocast_cache(prob, state, cached, p)
    activations = 0
    kept_inputs = {}
    held_own = set()                    # own tensors saved by an op outside every checkpointed block
    early, first_of = 0, next((i for i, x in enumerate(prob.nodes) if x.name == before), -1)
    for key, (nb, born, savers, what) in keyed.items():
        outside = [i for i in savers if i not in block_of]
        last = max(bwd(i) for i in savers)
        if scores and outside and prob.nodes[born].name in scores:
            items.append([nb, bwd(max(savers)), last, f"scores recomputed in {what}", "activations"])
        elif outside:
            activations += nb
            early += nb if min(savers) < first_of else 0
            items.append([nb, born, last, f"saved by {what}", "activations"])
            if key[1] == "own":
                held_own.add(key[0])
        else:                           # recomputed at the start of its block's backward
            b = block_of[savers[0]]
            items.append([nb, bwd(spans[b][1]), last, f"recomputed in {b}", "activations"])
    for b, (a, z) in spans.items():     # a checkpointed block keeps its inputs
        for i in range(a, z + 1):
            for k in prob.ins[i]:
                if (k < a) and prob.kind[k] in ("op", "select") and saved.storage[k] is not None:
                    kept_inputs[(b, saved.storage[k])] = (int(prob.nbytes[k] * _fraction(prob.val[k], state.place[k], p)),
                                                          k, bwd(a), b)
    for nb, k, last, b in kept_inputs.values():     # (held anyway where an op outside the block saves it)
        if saved.storage[k] not in held_own:
            activations += nb
            items.append([nb, k, last, f"input of {b}", "activations"])

    # other outputs and gathered copies while forward reads them
    own = {st for st, tag in keyed if tag == "own"}
    last_read: dict = {}
    for i in range(n):      # the output node too: the caller keeps the loss and drops the rest
        for k in prob.ins[i]:
            st = saved.storage[k]
            if st is not None:
                last_read[st] = max(last_read.get(st, 0), i)
    for i in range(n):
        st = saved.storage[i]
        if prob.kind[i] == "op" and st is not None and saved.producer.get(st) == i and st not in own:
            nb = int(prob.nbytes[i] * _fraction(prob.val[i], state.place[i], p))
            items.append([nb, i, max(i, last_read.get(st, i)), f"output of {module_of(prob, i)}", "temporary"])
        s = strat(i)
        if prob.kind[i] == "output":    # gathered for the output alone: the pieces stacked, then joined
            for k in prob.ins[i]:
                if isinstance(prob.val[k], torch.Tensor) and prob.kind[k] == "op" and any(
                        fwd == ("all_gather",) and list(cons) == [i] and via is None
                        for _, _, fwd, _, cons, via in prob.comms_of(k, state.place, state.sidx)):
                    items.append([2 * prob.nbytes[k], i, i, f"{prob.nodes[k].name} gathered for the output",
                                  "temporary"])
        if s is None or prob.kind[i] != "op":
            continue
        for q, k in enumerate(prob.ins[i]):
            req = s.inputs[q]
            if req is not None and isinstance(prob.val[k], torch.Tensor) and req != state.place[k] \
                    and (saved.storage[k], round(_fraction(prob.val[k], req, p), 9)) not in keyed:
                items.append([int(prob.nbytes[k] * _fraction(prob.val[k], req, p)), i, i,
                              f"{prob.nodes[k].name} redistributed", "temporary"])

    for i in prob.losses:   # torch's cross entropy backward: the log-softmax's gradient beside the logits'
        s = strat(i)        # (not the vocabulary-parallel loss's, which makes the logits' gradient only)
        if prob.ins[i]:
            k = prob.ins[i][0]
            pl = s.inputs[0] if s is not None and s.inputs[0] is not None else state.place[k]
            if not isinstance(pl, Shard):
                items.append([_loss_backward_bytes(prob, i, k), bwd(i), bwd(i), f"backward of {module_of(prob, i)}",
                              "temporary"])

    for k, readers in gathered.items():     # gathered again where the readers' one backward runs
        items.append([prob.nbytes[k], bwd(min(readers)), bwd(min(readers)), f"{prob.nodes[k].name} gathered again",
                      "temporary"])

    # gradients of activations: from the backward of their first reader to their producer's
    reader: dict = {}
    members: dict = {}                  # a tensor and its views: one gradient, read at each view's placement
    for i in range(n):
        st = saved.storage[i]
        if st is not None:
            root = saved.producer.get(st, i)
            # with a loss in the graph the caller's backward starts there: no gradient comes back
            # through the other outputs (the logits returned beside it)
            users = [u for u in prob.users[i] if not (prob.losses and prob.kind[u] == "output")]
            reader[root] = max(reader.get(root, -1), max(users, default=-1))
            members.setdefault(root, []).append(i)
    for i in range(n):
        if not prob.needs_grad[i] or prob.kind[i] not in ("op", "select"):
            continue
        st = saved.storage[i]
        if st is None or saved.producer.get(st) != i or reader.get(i, -1) <= i:
            continue
        f = max([_fraction(prob.val[i], state.place[i], p)] +
                [_fraction(prob.val[m], strat(u).inputs[q], p) for m in members.get(i, ()) for u in prob.users[m]
                 if strat(u) is not None and prob.kind[u] != "output"     # no gradient comes back through
                 for q, k in enumerate(prob.ins[u]) if k == m and strat(u).inputs[q] is not None])  # a dropped output
        items.append([int(prob.nbytes[i] * f), bwd(reader[i]), bwd(i), f"grad of {module_of(prob, i)}", "gradients"])

    held = params + buffers + opt
    delta = [0] * (end + 2)
    for nb, a, z, *_ in items:
        delta[a] += nb
        delta[z + 1] -= nb
    live, best, at = 0, -1, 0
    for t in range(end + 1):
        live += delta[t]
        if live > best:
            best, at = live, t
    where = "optimizer step" if at == end else (f"forward of {prob.nodes[at].name}" if at < n
                                                  else f"backward of {prob.nodes[bwd(at)].name}")
    at_peak = {}
    for nb, a, z, what, _ in items:
        if a <= at <= z:
            at_peak[what] = at_peak.get(what, 0) + nb
    at_peak.update({"parameters": params, "optimizer state": opt})
    largest = tuple(sorted(at_peak.items(), key=lambda kv: -kv[1])[:6])
    if before is not None:
        activations = early
    return Memory(parameters=params, gradients=grads, optimizer=opt, activations=activations, peak=held + best,
                  buffers=buffers, peak_at=where, largest=largest, exact=saved.exact)


def memory_of(prob, state, checkpointed=(), scores=frozenset(), device: str | None = None,
              before: str | None = None) -> Memory:
    """`step_memory` of `state`, the saved tensors read once per graph (kept on the Problem);
    `device`: where the step runs (default: the inputs' device)."""
    if getattr(prob, "saved", None) is None:
        prob.saved = saved_tensors(prob)
    device = device or next((v.device.type for i, v in enumerate(prob.val) if prob.kind[i] == "input"
                             and isinstance(v, torch.Tensor)), "cpu")
    return step_memory(prob, state, prob.saved, prob.cost.optimizer, checkpointed, device, scores, before)


def _is_dropout(node) -> bool:
    """Whether `node` is a dropout (F.dropout, torch.dropout, aten's native_dropout)."""
    name = getattr(node.target, "__name__", str(node.target))
    return node.op == "call_function" and "dropout" in name and "feature" not in name
