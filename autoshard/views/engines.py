"""A Plan as the plan dictionaries other tensor-parallel engines take.

`export(plan, "dtensor")`: `{module name: ParallelStyle}` for PyTorch's
`torch.distributed.tensor.parallel.parallelize_module`; `export(plan, "hf")`: `{pattern: style
name}` in the form of a Hugging Face `tp_plan` (`*` for the layer index), relative to the base
model (`base_model_tp_plan`) or to the whole model (`DistributedConfig(tp_plan=...)`).

Both engines shard nn.Linear (column: weight rows; row: weight columns, the output all-reduced)
and nn.Embedding (vocabulary rows), each split at torch.chunk's boundaries, and make every
module's input and output whole or local by hooks around it. What they cannot run of autoshard's
plan (a strided fused q/k/v, a split in whole heads that does not divide evenly, K/V heads held by
groups of ranks, a tied weight sharded twice, a split norm, a layer other than Linear or
Embedding) runs replicated instead, together with the sibling layers whose layouts go with it
(an attention's q, k, v and output projections), and is listed by module with the reason. The
bytes an engine sends running the exported plan are predicted from its styles and the captured
graph's sizes (`engine_bytes`; tests count them on the engine's own collectives), next to the
plan's own.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..capture.ops import LOSS_OPS
from ..runtime.counters import ring_bytes
from ..runtime.placements import Replicate, Shard, ShardGathered, block_sizes
from .report import fmt_bytes

ENGINES = ("dtensor", "hf")
_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True)
class Exported:
    """A plan exported to one engine: what to hand it, what it leaves replicated and why, bytes."""

    engine: str
    plan: Mapping[str, Any]          # what the engine takes: module name / pattern -> style
    styles: Mapping[str, str]        # module -> the style's name ("colwise", "rowwise", ...), per module
    dropped: Mapping[str, str]       # module -> why it runs replicated instead of as autoshard planned
    comm_bytes: float                # what the engine sends running it, per rank per step (ring bytes)
    autoshard_bytes: float           # the plan's own
    notes: tuple = ()
    source: Mapping[str, str] = field(default_factory=dict)     # dtensor: each style as Python

    def python(self) -> str:
        """The plan as Python to paste into a training script (dtensor) or as JSON (hf)."""
        if self.engine == "hf":
            return json.dumps(dict(self.plan), indent=4)
        body = "".join(f"    {m!r}: {text},\n" for m, text in self.source.items())
        return f"{DTENSOR_IMPORTS}\n\nplan = {{\n{body}}}"

    def __str__(self) -> str:
        lines = [f"{self.engine} plan: {len(self.styles)} sharded modules, {len(self.dropped)} left replicated; "
                 f"comm per step per rank {fmt_bytes(self.comm_bytes)} (autoshard's plan: "
                 f"{fmt_bytes(self.autoshard_bytes)})"]
        lines += [f"  {m}: {style}" for m, style in self.styles.items()]
        lines += [f"  {m}: replicated ({why})" for m, why in self.dropped.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def engine_sizes(n: int, p: int) -> list[int]:
    """Each rank's share of a dim of n as DTensor and transformers split it (torch.chunk's)."""
    c = -(-n // p)
    return [max(0, min(c, n - r * c)) for r in range(p)]


def _why_not(placement, shape, p: int) -> str | None:
    """Why an engine cannot hold a parameter placed so (None where it can)."""
    if not isinstance(placement, Shard):
        return None
    if isinstance(placement, ShardGathered) or placement.replicas > 1 or placement.nest > 1 or placement.groups > 1:
        return f"{placement}: held by groups of ranks (K/V heads shared by the query heads of several ranks)"
    if placement.chunks > 1:
        return f"{placement}: a fused projection cut in {placement.chunks} blocks (a strided shard)"
    n = shape[placement.dim]
    mine = block_sizes(n, p, **placement.blocking)
    if mine is None or list(mine[0]) != engine_sizes(n, p):
        return f"{placement}: {n} split as {list(mine[0]) if mine else '?'} (whole heads), not the engine's " \
               f"even split {engine_sizes(n, p)}"
    return None


def _modules(plan):
    """module -> {param attr: (placement, shape)}, every parameter name (tied aliases too)."""
    gm = plan.graph_module
    shapes = {n: tuple(t.shape) for n, t in gm.named_parameters(remove_duplicate=False)}
    out: dict = {}
    for name, placement in plan.layouts.items():
        module, _, attr = name.rpartition(".")
        out.setdefault(module, {})[attr] = (placement, shapes.get(name))
    return out


def _op_of(plan, module: str) -> str | None:
    """The op family that reads `module`'s weight: "linear", "embedding" or another op's name."""
    kinds = {d.op.split(".")[0] for d in plan.nodes.values() if d.module == module}
    for k in ("linear", "embedding"):
        if k in kinds:
            return k
    return next(iter(sorted(kinds)), None)


def _op_nodes(plan, module: str, family: str) -> list:
    return [n for n, d in plan.nodes.items() if d.module == module and d.op.split(".")[0] == family]


def _chain(plan, nodes: dict, mods: dict, start: list) -> tuple[set, bool]:
    """The nodes that carry a column layer's split output on to its readers (ops whose output the plan
    keeps split, up to a row layer), and whether it must be made whole there (a gather, the graph's
    output or a loss reads it)."""
    whole = {r.node for r in plan.redistributions if isinstance(r.dst, Replicate) and isinstance(r.src, Shard)}
    seen, todo, gathered = set(), list(start), False
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        gathered |= name in whole
        for u in nodes[name].users:
            target = type(mods.get(u.target)) if u.op == "call_module" else u.target
            d = plan.nodes.get(u.name)
            if u.op == "output" or target in LOSS_OPS:
                gathered = True
            elif d is not None and isinstance(d.output, Shard) and d.strategy != "row":
                todo.append(u.name)
    return seen, gathered


def local_columns(plan, styles: dict) -> tuple[set, set]:
    """(column layers whose output the engine may leave split on each rank, the nodes that carry it).

    The engine hands a module's output on either split (`colwise`: local shards, as Megatron's
    column layers) or whole (gathered). Split is exact only where every op that reads it reads the
    other split tensors autoshard's plan pairs it with in the same state: each column layer's
    chain of split readers (`_chain`) must end in row layers, never be gathered, and read no
    tensor the plan holds split that is not itself one of these chains (a residual stream the plan
    split, which the engine holds whole). Column layers that fail are gathered, and the rest checked
    again, until none fails."""
    gm = plan.graph_module
    nodes, mods = {n.name: n for n in gm.graph.nodes}, dict(gm.named_modules())
    cols = {m: _chain(plan, nodes, mods, _op_nodes(plan, m, "linear")) for m, s in styles.items() if s == "colwise"}
    local = {m for m, (_, gathered) in cols.items() if not gathered}
    while True:
        carried = set().union(*(cols[m][0] for m in local)) if local else set()
        bad = set()
        for m in local:
            for name in cols[m][0]:
                for a in nodes[name].all_input_nodes:
                    d = plan.nodes.get(a.name)
                    if d is not None and isinstance(d.output, Shard) and a.name not in carried:
                        bad.add(m)
        if not bad:
            return local, carried
        local -= bad


def _style(plan, module: str, params: dict, p: int) -> tuple[str | None, str | None]:
    """(style name, None) for a module an engine can run as planned, (None, reason) otherwise,
    (None, None) for one the plan keeps whole."""
    if all(not isinstance(pl, Shard) for pl, _ in params.values()):
        return None, None
    for attr, (pl, shape) in params.items():
        why = _why_not(pl, shape, p)
        if why is not None:
            return None, f"{attr} {why}"
    op = _op_of(plan, module)
    w, b = params.get("weight", (None, None))[0], params.get("bias", (None, None))[0]
    if op == "linear" and set(params) <= {"weight", "bias"} and isinstance(w, Shard):
        if w.dim == 0 and (b is None or b == Shard(0)):
            return "colwise", None
        if w.dim == 1 and not isinstance(b, Shard):
            return "rowwise", None
    if op == "embedding" and set(params) == {"weight"} and isinstance(w, Shard):
        return ("embedding_rowwise" if w.dim == 0 else "embedding_colwise"), None
    return None, f"{op or 'a module'} layer split {', '.join(f'{a} {pl}' for a, (pl, _) in params.items())}: " \
                 "the engine splits only Linear and Embedding weights, by rows or columns"


def _tied(plan) -> dict:
    """module -> the other module its weight is tied to."""
    gm = plan.graph_module
    owners: dict = {}
    for name, t in gm.named_parameters(remove_duplicate=False):
        owners.setdefault(id(t), []).append(name.rpartition(".")[0])
    return {m: o for ms in owners.values() if len(ms) > 1 for m in ms for o in ms if o != m}


def choose(plan) -> tuple[dict, dict]:
    """(module -> style name, module -> reason it is left replicated), consistent: a module left
    replicated takes the split layers beside it (the same parent module) along."""
    p = plan.world_size
    styles, dropped = {}, {}
    tied = _tied(plan)
    for module, params in _modules(plan).items():
        style, why = _style(plan, module, params, p)
        if style is not None and module in tied:
            style, why = None, f"its weight is tied to {tied[module]}: the engine would shard it twice, untied"
        if style is not None:
            styles[module] = style
        elif why is not None:
            dropped[module] = why
    changed = True
    while changed:
        changed = False
        for module in list(styles):
            parent = module.rpartition(".")[0]
            culprit = next((m for m in dropped if m.rpartition(".")[0] == parent), None)
            if culprit is not None:
                dropped[module] = f"replicated with {culprit} (their layouts go together)"
                del styles[module]
                changed = True
    local, carried = local_columns(plan, styles)
    for m, s in styles.items():
        if s == "colwise" and m not in local:
            styles[m] = "colwise_gather_output"          # its output made whole, as the model's readers need it
        elif s == "rowwise" and not all(n in carried for n in _row_inputs(plan, m)):
            styles[m] = "rowwise_rep"                    # reads a whole input, cut on each rank
    return styles, dropped


def _row_inputs(plan, module: str) -> list:
    """The activations a row layer reads (its matmul's tensor inputs other than the weight)."""
    gm = plan.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    return [a.name for n in _op_nodes(plan, module, "linear") for a in nodes[n].all_input_nodes[:1]]


# each style as the Python a training script writes (what `python -m autoshard plan --export dtensor`
# prints); the styles handed to parallelize_module are made from the same text
DTENSOR_SOURCE = {
    "colwise": "ColwiseParallel()",
    "colwise_gather_output": "ColwiseParallel(output_layouts=Replicate())",
    "colwise_loss_parallel": "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)",
    "rowwise": "RowwiseParallel()",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate())",
    "embedding_rowwise": "RowwiseParallel(input_layouts=Replicate())",
    "embedding_colwise": "ColwiseParallel(output_layouts=Replicate())",
}
DTENSOR_IMPORTS = ("from torch.distributed.tensor import Replicate, Shard\n"
                   "from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel")


def dtensor_style(source: str):
    """The ParallelStyle a DTENSOR_SOURCE text (or a PrepareModuleInput text) spells."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    names = dict(Replicate=Replicate, Shard=Shard, ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
                 PrepareModuleInput=PrepareModuleInput)
    return eval(source, {"__builtins__": {}}, names)  # noqa: S307 - our own texts, built above



def _reads_loss(plan, module: str) -> bool:
    """Whether a loss reads what `module` computes (through ops that keep it split)."""
    gm = plan.graph_module
    nodes, mods = {n.name: n for n in gm.graph.nodes}, dict(gm.named_modules())
    chain, _ = _chain(plan, nodes, mods, _op_nodes(plan, module, "linear"))
    return any((type(mods.get(u.target)) if u.op == "call_module" else u.target) in LOSS_OPS
               for n in chain for u in nodes[n].users)


def shared_inputs(styles: dict) -> dict:
    """parent module -> its column-split children, where two or more read the parent's input:
    converted to a DTensor once at the parent (`PrepareModuleInput`), their input gradients are
    summed before one all-reduce (Megatron's), not all-reduced one by one."""
    by_parent: dict = {}
    for m, s in styles.items():
        if s == "colwise":
            by_parent.setdefault(m.rpartition(".")[0], []).append(m)
    return {parent: kids for parent, kids in by_parent.items() if len(kids) > 1 and parent}


def call_styles(model, example, parents: dict) -> dict:
    """parent -> ("arg", index, count) or ("kwarg", name) of the input its column children read
    (the tensor whose last dim is their in_features), learnt from one forward of `model` on the
    plan's example; parents not reached are left out."""
    import torch
    found, hooks = {}, []
    for parent, kids in parents.items():
        width = model.get_submodule(kids[0]).weight.shape[-1]

        def hook(module, args, kwargs, parent=parent, width=width):
            def fits(x):
                return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() and x.shape[-1] == width
            where = next((("arg", i, len(args)) for i, a in enumerate(args) if fits(a)), None) or \
                next((("kwarg", k) for k, v in kwargs.items() if fits(v)), None)
            if where is not None:
                found.setdefault(parent, where)
        hooks.append(model.get_submodule(parent).register_forward_pre_hook(hook, with_kwargs=True))
    args, kwargs = example
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return found


def _prepare_input(where) -> str:
    """PrepareModuleInput (as Python) making the input at `where` one replicated DTensor."""
    if where[0] == "kwarg":
        layouts = "{%r: Replicate()}" % where[1]
        return f"PrepareModuleInput(input_kwarg_layouts={layouts}, desired_input_kwarg_layouts={layouts}, " \
               "use_local_output=False)"
    _, i, n = where
    layouts = "(" + ", ".join("Replicate()" if k == i else "None" for k in range(n)) + ("," if n == 1 else "") + ")"
    return f"PrepareModuleInput(input_layouts={layouts}, desired_input_layouts={layouts}, use_local_output=False)"



# per style: (forward collective of the output, backward collective of the input's gradient), as
# the engines run them: a column layer's input gradient is Partial (all-reduced where it becomes a
# local tensor again), a whole input cut for a row layer gathers its gradient back
_MOVES = {"colwise": (None, "all_reduce"), "colwise_gather_output": ("all_gather", "all_reduce"),
          "colwise_loss_parallel": (None, "all_reduce"),        # + loss_parallel's own reductions (3 x tokens)
          "rowwise": ("all_reduce", None), "rowwise_rep": ("all_reduce", "all_gather"),
          "embedding_rowwise": ("all_reduce", None), "embedding_colwise": ("all_gather", None)}


def _sent(kind: str, t, p: int) -> int:
    """Bytes of tensor `t` a collective of `kind` over its last dim moves: an all-gather of a dim
    that does not divide pads every shard to the largest (torch.chunk's ceil(n / p))."""
    if kind != "all_gather" or not t.dim():
        return t.nbytes
    n = t.shape[-1]
    return t.nbytes // n * engine_sizes(n, p)[0] * p if n else t.nbytes


def engine_bytes(plan, styles: dict, shared: dict) -> float:
    """Ring bytes per rank per step that an engine running `styles` sends (`shared`: parent ->
    column layers whose input is made a DTensor once there: one all-reduce of their summed input
    gradient instead of one each), from the captured graph's sizes."""
    gm, p = plan.graph_module, plan.world_size
    nodes = {n.name: n for n in gm.graph.nodes}
    grouped = {kid: parent for parent, kids in shared.items() for kid in kids}
    params = {n for n, t in gm.named_parameters(remove_duplicate=False) if t.requires_grad}
    grad = set()                                 # nodes a gradient flows into: those computed from a parameter
    for n in gm.graph.nodes:
        if (n.op == "get_attr" and n.target in params) or any(a.name in grad for a in n.all_input_nodes):
            grad.add(n.name)
    total, done = 0.0, set()
    for module, style in styles.items():
        fwd, bwd = _MOVES[style]
        for name in _op_nodes(plan, module, "embedding" if style.startswith("embedding") else "linear"):
            n = nodes[name]
            x = n.all_input_nodes[0].meta.get("val")
            out = n.meta.get("val")
            if fwd is not None:
                total += ring_bytes(fwd, _sent(fwd, out, p), p)
            if bwd is not None and n.all_input_nodes[0].name in grad:
                key = (grouped.get(module), n.all_input_nodes[0].name)
                if key[0] is None or key not in done:
                    done.add(key)
                    total += ring_bytes(bwd, _sent(bwd, x, p), p)
    return total


def pattern(module: str, prefix: str = "") -> str:
    """A module name as a transformers plan key: relative to `prefix` (the base model's), the
    layer index as `*`."""
    if prefix and module.startswith(prefix + "."):
        module = module[len(prefix) + 1:]
    return _INDEX.sub(".*", module)


def export(plan, engine: str, *, model=None, loss_parallel: bool = False,
           base_model_prefix: str | None = None) -> Exported:
    """`plan` exported to `engine` ("dtensor" or "hf"). `loss_parallel` (dtensor): a head whose
    vocabulary the plan splits returns its logits as a DTensor sharded on the vocabulary, for a
    loss computed under `torch.distributed.tensor.parallel.loss_parallel()` (else they are
    gathered). `base_model_prefix` (hf): the base model's attribute ("model", "transformer"):
    keys relative to it, as `config.base_model_tp_plan` takes them (modules outside it are left to
    the model class's own plan, and listed); None: keys relative to the whole model, as
    `DistributedConfig(tp_plan=...)` takes them. `model` (dtensor): the model the plan is for; with it,
    each module whose column layers read one input gets a `PrepareModuleInput` (the call style is
    learnt from one forward on the plan's example) so their input gradients are all-reduced once."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    styles, dropped = choose(plan)
    notes, shared = [], {}
    if engine == "dtensor":
        if loss_parallel:                 # a head whose split logits the plan's loss reads: left split
            styles.update({m: "colwise_loss_parallel" for m, s in styles.items()
                           if s == "colwise_gather_output" and _reads_loss(plan, m)})
        source = {m: DTENSOR_SOURCE[s] for m, s in styles.items()}
        parents = shared_inputs(styles)
        if parents and model is not None:
            try:
                for parent, where in call_styles(model, plan.example, parents).items():
                    source[parent] = _prepare_input(where)
                    shared[parent] = parents[parent]
            except Exception as e:  # noqa: BLE001 - the plan is still exact without them; say so
                notes.append(f"the model did not run on the plan's example ({type(e).__name__}); the column layers "
                             "all-reduce their input gradients one by one")
        elif parents:
            notes.append(f"{len(parents)} modules' column layers ({', '.join(list(parents)[:2])}, ...) read one "
                         "input: pass model= to convert it once (PrepareModuleInput) and all-reduce their summed "
                         "input gradient once, as autoshard's plan does")
        if loss_parallel and DTENSOR_SOURCE["colwise_loss_parallel"] in source.values():
            notes.append("compute the loss under torch.distributed.tensor.parallel.loss_parallel(): the logits "
                         "are a DTensor sharded on the vocabulary")
        out = {m: dtensor_style(text) for m, text in source.items()}
    else:
        out = {}
        for m, s in styles.items():
            if base_model_prefix is not None and not m.startswith(base_model_prefix + "."):
                dropped[m] = f"{s}: outside the base model {base_model_prefix!r} (its class's own tp plan decides; " \
                             "export with base_model_prefix=None for the whole model's keys)"
                continue
            key = pattern(m, base_model_prefix or "")
            if out.get(key, s) != s:
                raise ValueError(f"layers matched by {key!r} were planned differently ({out[key]} and {s}); "
                                 "export with a plan whose repeated layers agree")
            out[key] = s
        for m, params in _modules(plan).items():      # named, or transformers' own plan would split them
            if m not in styles and _op_of(plan, m) in ("linear", "embedding") and \
                    (base_model_prefix is None or m.startswith(base_model_prefix + ".")):
                out.setdefault(pattern(m, base_model_prefix or ""), "replicate")
    kept = {m: s for m, s in styles.items() if m not in dropped}
    return Exported(engine, out, kept, dropped, engine_bytes(plan, kept, shared), plan.comm_bytes, tuple(notes),
                    source if engine == "dtensor" else {})
