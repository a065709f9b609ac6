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
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    fakes = [t for v in prob.val for t in _tensors(v) if isinstance(t, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [prob.val[i] for i, k in enumerate(prob.kind) if k == "input"]
    device = next((t.device for v in inputs for t in _tensors(v)), torch.device("cpu"))
    if device.type == "meta":       # a model on meta: capture made the graph's own tensors on CPU (`trace`)
        device = torch.device("cpu")
    rec = _Recorder(prob.gm, mode, device)
    inputs = [rec.fake(v) for v in inputs]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
        rec.run(*inputs)
    storage = []
    for n in prob.nodes:
        ts = _tensors(rec.env.get(n))
        storage.append(_key(ts[0]) if len(ts) == 1 and not isinstance(rec.env.get(n), (tuple, list)) else None)
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
