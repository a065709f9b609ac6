"""What a training step's forward saves for backward, read from autograd itself.

The captured graph is run once on fake tensors (no memory, no compute) under
`torch.autograd.graph.saved_tensors_hooks`, and every saved tensor is traced to the node whose
output owns its storage (`Saved`): a matmul's inputs, a softmax's output, a dropout's mask (a new
tensor of the op's own), a norm's statistics. A grouped-query sdpa that capture wrote ungrouped
is recorded both ways, grouped (K and V saved, as the ranks' modules run it where its K/V come
straight from the repeat: `rewrite.grouped`) and as written (their copies per query head): which
one a plan runs is the plan's (`memory.step_memory`). Where fake tensors cannot run the graph, every
op saves its floating activation inputs (an upper bound). `memory.step_memory` prices the result.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from ..capture.normalize import UNGROUPED, repeat_chain
from ..capture.repeats import layer_key, owner
from ..capture.shapes import fetch_attr, reads_scalar, stand_in_scalar


@dataclass(frozen=True)
class Saved:
    """What a graph's forward saves for backward, by storage (ints naming storages of one run).

    storage[i]: the storage of node i's output (None: not one tensor); producer: storage -> the
    first node whose output holds it; saves[i]: ((storage, bytes), ...) node i saves, tensors held
    anyway (parameters, buffers, the inputs) left out; exact: False where a stand-in table was used."""

    storage: tuple
    producer: Mapping
    saves: tuple
    exact: bool = True
    shapes: Mapping = None     # storage -> the shape it was saved with (None: the stand-in table)
    ungrouped: Mapping = None  # sdpa node -> what it saves run as capture wrote it (saves: run grouped)


def _tensors(v):
    return [t for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(fx.Interpreter):
    """Runs a captured graph on fake tensors, noting each node's output storage and what each
    node's autograd saves."""

    def __init__(self, gm, mode, device):
        super().__init__(gm, garbage_collect_values=False)
        self.mode, self.device, self.fakes, self.ungrouped = mode, device, {}, {}
        self.current, self.producer, self.records = -1, {}, []
        self.skip = {}
        self.index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def fake(self, t):
        from torch._subclasses.fake_tensor import FakeTensor
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in self.fakes:
            meta = t.device.type == "meta"
            if isinstance(t, FakeTensor) and t.fake_mode is self.mode and not (meta and self.device.type != "meta"):
                f = t
            else:
                with self.mode:
                    f = torch.empty(t.shape, dtype=t.dtype, device=self.device if meta else t.device)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            self.fakes[id(t)] = f
        return self.fakes[id(t)]

    def run_node(self, n):
        if n in self.skip:                         # a later copy of a repeated layer (`Repeats`)
            return self.env[self.skip[n]]
        self.current = self.index[n]
        if reads_scalar(n):
            return stand_in_scalar(self.env[n.all_input_nodes[0]])
        chains = [repeat_chain(a) for a in n.args[1:3]] if n.meta.get(UNGROUPED) else [None]
        if None in chains:
            out = super().run_node(n)
        else:             # both ways a rank may run it: grouped (`rewrite.grouped`), then as written
            args = (self.env[n.args[0]], *(self.env[c[-1]] for c in chains), *self.map_nodes_to_values(n.args[3:], n))
            out = n.target(*args, **{**self.map_nodes_to_values(n.kwargs, n), "enable_gqa": True})
            records, self.records = self.records, []
            alike = {_key(a): _key(b) for a, b in zip(_tensors(super().run_node(n)), _tensors(out))}
            self.ungrouped[self.current] = [(i, alike.get(s, s), nb, t) for i, s, nb, t in self.records]
            self.records = records                      # (its output stands for the grouped call's)
        for t in _tensors(out):
            self.producer.setdefault(_key(t), self.current)
        return out

    def get_attr(self, target, args, kwargs):
        return self.fake(fetch_attr(self.module, target))

    def call_module(self, target, args, kwargs):
        from torch.func import functional_call
        mod = self.fetch_attr(target)
        state = {k: self.fake(t) for k, t in [*mod.named_parameters(remove_duplicate=False),
                                               *mod.named_buffers(remove_duplicate=False)]}
        return functional_call(mod, state, args, kwargs)

    def pack(self, t):
        self.records.append((self.current, _key(t), t.untyped_storage().nbytes(), t))
        return t


def saved_tensors(prob) -> Saved:
    """The graph of `prob` (a planner Problem) run once on fake tensors under saved-tensor hooks."""
    try:
        return _recorded(prob)
    except Exception:                  # an op fake tensors cannot run: every activation input saved
        return _stand_in(prob)


def _recorded(prob) -> Saved:
    reps = Repeats.of(prob)
    if reps is not None:
        try:
            out = _recorded_once(prob, reps)
        except Exception:              # (the whole graph run says what fails, or that nothing does)
            out = None
        if out is not None:
            return out
    return _recorded_once(prob, None)


def _recorded_once(prob, reps) -> Saved | None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    fakes = [t for v in prob.val for t in _tensors(v) if isinstance(t, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [prob.val[i] for i, k in enumerate(prob.kind) if k == "input"]
    device = next((t.device for v in inputs for t in _tensors(v)), torch.device("cpu"))
    if device.type == "meta":       # a model on meta: capture made the graph's own tensors on CPU (`trace`)
        device = torch.device("cpu")
    rec = _Recorder(prob.gm, mode, device)
    if reps is not None:
        rec.skip = reps.skip(prob)
    inputs = [rec.fake(v) for v in inputs]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        rec.run(*inputs)
    storage = []
    for n in prob.nodes:
        ts = _tensors(rec.env.get(n))
        storage.append(_key(ts[0]) if len(ts) == 1 and not isinstance(rec.env.get(n), (tuple, list)) else None)
    if reps is not None and not reps.extend(rec, storage):
        return None
    held = {s for s, i in rec.producer.items() if prob.kind[i] in ("param", "buffer", "input")}
    shapes = {}

    def kept(records) -> dict:
        out = {}
        for _, s, nb, t in records:
            if s not in held:
                out[s] = max(nb, out.get(s, 0))
                shapes.setdefault(s, tuple(t.shape))
        return out

    by_node = [[] for _ in prob.nodes]
    for r in rec.records:
        if r[0] >= 0:
            by_node[r[0]].append(r)
    return Saved(tuple(storage), dict(rec.producer), tuple(tuple(kept(r).items()) for r in by_node), shapes=shapes,
                 ungrouped={i: tuple(kept(r).items()) for i, r in rec.ungrouped.items()})


def _stand_in(prob) -> Saved:
    """Where the fake run fails: every op saves its floating activation inputs (an upper bound)."""
    storage = tuple(i if prob.kind[i] in ("op", "select") else None for i in range(len(prob.nodes)))
    producer = {i: i for i in range(len(prob.nodes)) if storage[i] is not None}
    saves = []
    for i, k in enumerate(prob.kind):
        ins = [j for j in prob.ins[i] if storage[j] is not None and isinstance(prob.val[j], torch.Tensor)
               and prob.val[j].is_floating_point()] if k == "op" else []
        saves.append(tuple((j, prob.nbytes[j]) for j in ins))
    return Saved(storage, producer, tuple(saves), exact=False)


class Repeats:
    """The longest run of numbered layers (five or more) whose layers from the third on are the
    second's nodes again (same ops, targets renamed, the same shapes; inputs from the layer itself or
    the one before at the same positions, or the same node from outside), each layer's values read
    only by itself and the next (the last's by anything): its layers' nodes in graph order."""

    def __init__(self, layers: list):
        self.layers = layers
        self.at = {i: (j, q) for j, nodes in enumerate(layers) for q, i in enumerate(nodes)}

    @classmethod
    def of(cls, prob):
        """The run of `prob`'s graph (None: none), found once and kept in its search memo."""
        if "repeats" not in prob.search_memo:
            prob.search_memo["repeats"] = cls._found(prob)
        return prob.search_memo["repeats"]

    @classmethod
    def _found(cls, prob):
        found: dict = {}
        for names in prob.param_names.values():
            for name in names:
                key = layer_key(name)
                if key is not None:
                    found.setdefault(key[0][0], set()).add(key[1])
        best = None
        for prefix, idx in found.items():
            idx = sorted(idx)
            if len(idx) >= 5 and idx == list(range(idx[0], idx[0] + len(idx))) and \
                    (best is None or len(idx) > len(best[1])):
                best = prefix, idx
        if best is None:
            return None
        names = {f"{best[0]}.{i}": k for k, i in enumerate(best[1])}
        layers = [[] for _ in names]
        known = set(names)
        for i, n in enumerate(prob.nodes):
            o = owner(n, known)
            if o is not None:
                layers[names[o]].append(i)
        if len({len(x) for x in layers}) != 1 or not layers[0]:
            return None
        reps = cls(layers)
        return reps if reps._alike(prob, [f"{best[0]}.{i}" for i in best[1]]) else None

    def _alike(self, prob, names) -> bool:
        for i, (j, _) in self.at.items():
            if j < len(self.layers) - 1 and any(self.at.get(prob.idx[u], (-1,))[0] not in (j, j + 1)
                                                and not _size(u, self.at, prob) for u in prob.nodes[i].users):
                return False
        for j in range(2, len(self.layers)):
            for a, b in zip(self.layers[j], self.layers[1]):
                if not self._same(prob, prob.nodes[a], prob.nodes[b], j, names[j], names[1]):
                    return False
        return True

    def _same(self, prob, n, m, j, name, name1) -> bool:
        if n.op != m.op or n.meta.get(UNGROUPED) != m.meta.get(UNGROUPED):
            return False
        if n.op in ("get_attr", "call_module"):
            t = m.target
            if n.target != t and not (t.startswith(name1 + ".") and n.target == name + t[len(name1):]):
                return False
        elif n.target != m.target:
            return False
        if _meta(n.meta.get("val")) != _meta(m.meta.get("val")):
            return False

        def same(a, b) -> bool:
            if isinstance(a, fx.Node) or isinstance(b, fx.Node):
                if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                    return False
                la, lb = self.at.get(prob.idx[a]), self.at.get(prob.idx[b])
                if la is None or lb is None:      # the same node, or sizes of the same value
                    return a is b or (_size(a, self.at, prob) and _size(b, self.at, prob) and
                                      str(a.meta.get("val")) == str(b.meta.get("val")))
                return la[1] == lb[1] and (la[0] - j, lb[0] - 1) in ((0, 0), (-1, -1))
            if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
                return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            if isinstance(a, dict) or isinstance(b, dict):
                return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            try:
                return type(a) is type(b) and bool(a == b)
            except Exception:
                return False
        return same(n.args, m.args) and same(n.kwargs, m.kwargs)

    def skip(self, prob) -> dict:
        """{node of a layer from the fourth on: the third layer's node it stands for}."""
        return {prob.nodes[i]: prob.nodes[self.layers[2][q]]
                for nodes in self.layers[3:] for q, i in enumerate(nodes)}

    def extend(self, rec, storage: list) -> bool:
        """Write the skipped layers' storages, producers and records into `rec` and `storage`
        (their nodes' outputs), the third layer's values read after the run renamed to the last
        layer's; False where the second layer does not save, relative to itself, what the third does."""
        made: dict = {}                         # storage -> its producer's outputs, in order
        for s, i in rec.producer.items():
            made.setdefault(i, []).append(s)
        by_node: dict = {}
        for r in rec.records:
            by_node.setdefault(r[0], []).append(r)
        if self._relative(rec, 1, by_node, made, storage) != self._relative(rec, 2, by_node, made, storage):
            return False
        last, first_skipped = len(self.layers) - 1, min(self.layers[3])
        fresh: dict = {}

        def key(s, j, copy=True):
            """Storage `s` of the third layer's run as layer j holds it (`copy`: in a copy of it)."""
            i = rec.producer.get(s)
            if i is None:                     # an op's own tensor (not an output): one a layer
                return fresh.setdefault((j, s), -1 - len(fresh)) if copy else s
            at = self.at.get(i)
            if at is None or at[0] not in (1, 2):
                return s
            layer, q = (j if at[0] == 2 else j - 1), at[1]
            k = made[i].index(s)
            if layer <= 2:
                return made[self.layers[layer][q]][k]
            return fresh.setdefault((layer, q, k), -1 - len(fresh))

        records = [r for r in rec.records if r[0] < first_skipped or self.at.get(r[0], (0,))[0] < 3]
        records = [r if r[0] < first_skipped or r[0] in self.at else (r[0], key(r[1], last, False), r[2], r[3])
                   for r in records]
        for j in range(3, len(self.layers)):
            for q, i in enumerate(self.layers[j]):
                t = self.layers[2][q]
                storage[i] = None if storage[t] is None else key(storage[t], j)
                for s in made.get(t, ()):
                    rec.producer[key(s, j)] = i
                records += [(i, key(s, j), nb, x) for _, s, nb, x in by_node.get(t, ())]
                if t in rec.ungrouped:
                    rec.ungrouped[i] = [(i, key(s, j), nb, x) for _, s, nb, x in rec.ungrouped[t]]
        for i in range(first_skipped, len(storage)):
            if i not in self.at and storage[i] is not None:
                storage[i] = key(storage[i], last, False)
        rec.records = records
        return True

    def _relative(self, rec, j, by_node, made, storage) -> list:
        """What layer j's nodes output and save, storages named relative to layer j."""
        def name(s):
            i = rec.producer.get(s)
            if i is None:
                return "own"
            at = self.at.get(i)
            if at is None:
                return s
            return at[0] - j, at[1], made[i].index(s)
        out = []
        for q, i in enumerate(self.layers[j]):
            out.append((None if storage[i] is None else name(storage[i]), len(made.get(i, ())),
                        tuple((name(s), nb) for _, s, nb, _ in by_node.get(i, ())),
                        tuple((name(s), nb) for _, s, nb, _ in rec.ungrouped.get(i, ()))))
        return out


def _size(n: fx.Node, at: dict, prob) -> bool:
    """A size read off a tensor outside the layers (torch.export's sym_size): no tensor of its own."""
    return prob.idx[n] not in at and not isinstance(n.meta.get("val"), torch.Tensor) and n.op == "call_function"


def _meta(v):
    return [(tuple(t.shape), t.dtype) for t in _tensors(v)] if isinstance(v, (torch.Tensor, tuple, list)) else type(v)
