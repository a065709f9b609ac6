"""Every call the original forward accepts, served by the one module `parallelize` returns.

The module's own graph serves the call signature of the example it was planned with. A call
with other arguments (no labels, an attention_mask, keywords for positionals) is captured on a
meta copy of the model, planned with the layouts the module's parameters already have, and
rewritten on its first use (`build`, given by the entry point); its code then runs with the
module itself as `self`, so one set of parameters, buffers and mode modules serves every
signature, and train()/eval(), .to() and state dicts see no difference. A signature is its
present arguments: name, and for a tensor its number of dims and dtype, for a constant its value;
None counts as absent.
"""
from __future__ import annotations

import copy
import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import CodeGen
from torch.utils import _pytree as pytree

from ..capture.shapes import placeholder_inputs
from ..capture.trace import apart, recipe_copy
from ..runtime.autocast import autocast_state
from ..errors import ShardingError, first_line
from .blocks import add_variant, keep_blocks, structure
from .rewriter import InputCheck

_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device)


def _fsdp_param_dtype(module: nn.Module):
    """FSDP2's `MixedPrecisionPolicy.param_dtype` of a `fully_shard`ed module (the dtype its
    parameters compute in), else None."""
    get = getattr(type(module), "_get_fsdp_state", None)
    return getattr(getattr(get(module), "_mp_policy", None), "param_dtype", None) if get is not None else None


def _walk(module: nn.Module, visit, prefix: str = "", cast=None) -> None:
    """visit(name, tensor, compute dtype) for every parameter, and (cast None) every buffer: its
    dtype, or the param_dtype of the nearest FSDP2 module with a mixed-precision policy."""
    cast = _fsdp_param_dtype(module) or cast
    for k, t in module._parameters.items():
        if t is not None:
            visit(prefix + k, t, cast if cast is not None and t.is_floating_point() else t.dtype)
    for k, t in module._buffers.items():
        if t is not None:
            visit(prefix + k, t, t.dtype)
    for k, c in module._modules.items():
        if c is not None:
            _walk(c, visit, f"{prefix}{k}.", cast)


def compute_dtypes(module: nn.Module) -> dict:
    """{name: (dtype, device)} of every parameter and buffer of `module` as forward computes with it."""
    out = {}
    _walk(module, lambda name, t, dtype: out.__setitem__(name, (dtype, t.device)))
    return out


def precision(module: nn.Module) -> tuple:
    """The caller's precision recipe, part of every call's key: the autocast dtype of each device
    where autocast is on, and the dtypes the module's parameters compute in (`.to(torch.bfloat16)`,
    FSDP2's MixedPrecisionPolicy; not its buffers, which other signatures' graphs add to). A graph
    is captured under its recipe, since torch.export bakes dtypes into the graph. (About a
    microsecond a module, each call.)"""
    dtypes = []
    _walk(module, lambda name, t, dtype: dtypes.append(dtype) if isinstance(t, nn.Parameter) else None)
    return autocast_state(), tuple(dtypes)


def meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s structure with every parameter and buffer on meta (ties kept): nothing is
    copied but Python objects and small non-tensor state."""
    memo = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for _, t in named:
            if t is None or id(t) in memo:
                continue
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _value_key(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dim(), v.dtype)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _value_key(x)) for k, x in v.items())))
    if isinstance(v, _CONSTANTS) or v is None:
        return ("constant", v)
    return ("object", type(v).__qualname__)


@dataclass(frozen=True)
class Call:
    """A call bound to forward's parameters: the present arguments by name (None dropped;
    `**kwargs` entries by their own names) and those that must go by position."""

    arguments: tuple            # ((name, value), ...) in forward's order
    positional: tuple           # names of positional-only / *args entries

    @property
    def key(self) -> tuple:
        return tuple((name, _value_key(v)) for name, v in self.arguments)

    def arrangement(self) -> "Arrangement":
        """Positional-only and *args entries by position, the rest by keyword."""
        return Arrangement(self.positional, tuple(n for n, _ in self.arguments if n not in self.positional))

    def describe(self) -> str:
        def show(v):
            if isinstance(v, torch.Tensor):
                return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
            if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
                inner = ", ".join(show(x) for x in v)                       # a cache's tensors: shapes, not values
                return f"({inner},)" if isinstance(v, tuple) and len(v) == 1 else \
                    (f"({inner})" if isinstance(v, tuple) else f"[{inner}]")
            return type(v).__name__ if _value_key(v)[0] == "object" else repr(v)
        return ", ".join(f"{n}={show(v)}" for n, v in self.arguments)


def bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> Call:
    """`args`/`kwargs` as forward's parameters (a TypeError, as Python's, when they do not fit)."""
    bound = signature.bind(*args, **kwargs)
    out, positional = [], []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.extend((k, v) for k, v in value.items() if v is not None)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            for i, v in enumerate(value):
                out.append((f"*{i}", v))
                positional.append(f"*{i}")
        elif value is not None:
            out.append((name, value))
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(name)
    return Call(tuple(out), tuple(positional))


def _positional_names(signature: inspect.Signature, count: int) -> tuple:
    """The names `bind` gives the first `count` positional arguments."""
    out = []
    for q in signature.parameters.values():
        if len(out) == count:
            break
        if q.kind is q.VAR_POSITIONAL:
            out.extend(f"*{i}" for i in range(count - len(out)))
        elif q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD):
            out.append(q.name)
    return tuple(out)


@dataclass(frozen=True)
class Arrangement:
    """How a graph takes its inputs: which names by position, which by keyword (the capture's)."""

    positional: tuple
    keywords: tuple

    def split(self, call: Call) -> tuple[tuple, dict]:
        given = dict(call.arguments)
        return tuple(given.get(n) for n in self.positional), {n: given.get(n) for n in self.keywords}


class Served:
    """One signature's graph: its input check and how to run it with the module as `self`."""

    def __init__(self, arrangement: Arrangement, check: InputCheck, holder: fx.GraphModule, fn, out_spec=None):
        self.arrangement, self.check, self.holder = arrangement, check, holder
        self.fn, self.out_spec = fn, out_spec        # fn(self, *inputs); out_spec: an export graph's outputs
        self.compiled = {}                           # torch.compile's options -> fn under torch.compile

    def __call__(self, module: nn.Module, call: Call, compile_options=None, check=True):
        args, kwargs = self.arrangement.split(call)
        if check:
            self.check(self.holder, args, kwargs)
        fn = self.fn if compile_options is None else self.compile_with(compile_options)
        if self.out_spec is None:                    # the module's own graph, or a symbolic_trace one
            return fn(module, *args, **kwargs)
        flat = placeholder_inputs(self.holder, "export", args, kwargs)
        return pytree.tree_unflatten(list(fn(module, *flat)), self.out_spec)

    def compile_with(self, options: dict):
        """This graph's function under `torch.compile(**options)`, made once per options (the
        module is its first argument, which dynamo guards on as a compiled method's `self`)."""
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = torch.compile(self.fn, **options)
        return fn


class Signatures:
    """The call dispatcher kept by a parallel module (`module._autoshard_signatures`)."""

    def __init__(self, signature: inspect.Signature, first: Call, served: Served, build, modules=frozenset(),
                 copy_error=None, recipe=((), ())):
        self.signature, self.build, self.modules = signature, build, modules   # modules: the model's own names
        self.served = {(True, first.key, recipe): served}    # (training, call key, precision): its graph
        self.plans = {(True, first.key, recipe): None}       # the module's own plan is module._autoshard_plan
        self.copy_error, self.first, self.recipe = copy_error, first, recipe
        self.guard = None        # guard(module, key, arguments) before each call (autoshard.io.training)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        call = bind(self.signature, args, kwargs)
        key = (module.training, call.key, precision(module))
        if self.guard is not None:
            self.guard(module, key, call.arguments)
        served = self.served.get(key)
        if served is None:
            served = self._add(module, call, key)
        return served(module, call)

    def call_step(self, module: nn.Module, step, args: tuple, kwargs: dict, compile_options=None, recipe=None,
                  check=True):
        """A call of another forward than the model's on this module's shards: `step`
        (autoshard.io.step: a causal LM's prefill or decode step) gives its `signature`, the
        model it is captured on (`step.module(model)`), the outputs kept as each rank holds them
        (`step.held`) and the inputs that come in so (`step.localize`); served as any other call,
        its graph run under `torch.compile(**compile_options)` where given. A caller that calls
        the step once a token may pass the precision `recipe` it read once (`precision`: a walk
        of every parameter) and skip the input `check` of calls after the first."""
        call = bind(step.signature, args, kwargs)
        key = (module.training, call.key, precision(module) if recipe is None else recipe, step.name)
        served = self.served.get(key)
        if served is None:
            served, check = self._add(module, call, key, step), True
        return served(module, call, compile_options, check)

    def prepare(self, module: nn.Module) -> None:
        """Build the example call's graph for the module's current mode now (a model parallelized in
        eval mode runs its evaluation graph from the first call, planned inside parallelize)."""
        key = (module.training, self.first.key, precision(module))
        if key not in self.served:
            self._add(module, self.first, key)

    def _add(self, module: nn.Module, call: Call, key: tuple, step=None) -> Served:
        mode = "training" if module.training else "evaluation"
        if self.copy_error is not None:
            raise ShardingError(f"this module cannot capture the {mode} graph of ({call.describe()}), which it "
                                f"was not planned with: the model could not be copied for capture "
                                f"({self.copy_error}); plan with an example of this call")
        with apart():                                # planned apart from the caller's modes and hooks
            holder, plan = self.build(call, module.training, module if key[2] != self.recipe else None, step)
        local = step.localize(holder, plan) if step is not None else None
        served = adopt(module, holder, len(self.served), call.arrangement(), plan, self.modules)
        if local is not None:
            served.check = local(served.check)        # the held inputs checked at their local shapes
        self.served[key] = served
        self.plans[key] = plan
        return served


def _resolves(root: nn.Module, target: str):
    try:
        obj = root
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj
    except AttributeError:
        return None


def _bind(owner: nn.Module, source: nn.Module, graph: fx.Graph, k: int, names: set) -> None:
    """Point the get_attr / call_module targets of `graph` (made in `source`) at `owner`: those in
    `names` (parameters, buffers, the model's own submodules) by name, shapes checked; anything
    else (new mode modules, an export graph's helpers and constants) added to `owner` under
    autoshard_call<k>_* names."""
    renamed = {}
    for n in graph.nodes:
        if n.op not in ("get_attr", "call_module"):
            continue
        if n.target in names:
            ours, theirs = _resolves(owner, n.target), _resolves(source, n.target)
            if isinstance(theirs, torch.Tensor) and tuple(ours.shape) != tuple(theirs.shape):
                raise ShardingError(f"this call's plan holds {n.target} as {list(theirs.shape)} on this rank, the "
                                    f"module as {list(ours.shape)}")
            continue
        if n.target not in renamed:
            obj = _resolves(source, n.target)
            new = f"autoshard_call{k}_{n.target.replace('.', '_')}"
            if isinstance(obj, nn.Module):
                meta = [q for q, t in list(obj.named_parameters()) + list(obj.named_buffers()) if t.is_meta]
                if meta:
                    raise ShardingError(f"this call uses module {n.target} ({type(obj).__name__}), which the "
                                        f"module's own graph does not, and its tensors {meta[:3]} cannot be "
                                        "filled; plan with an example of this call")
                obj.train(owner.training)
                owner.add_module(new, obj)
            elif isinstance(obj, torch.Tensor):
                if obj.is_meta:
                    raise ShardingError(f"this call's graph holds a constant {n.target} {list(obj.shape)} made on "
                                        "meta: the model was gone, so the call was captured on a meta copy; keep "
                                        "the model alive, or plan with an example of this call")
                owner.register_buffer(new, obj, persistent=False)
            else:
                setattr(owner, new, obj)
            renamed[n.target] = new
        n.target = renamed[n.target]


_COMPILED: dict = {}        # (structure, globals) -> forward: one function for graphs alike


def _compiled(graph: fx.Graph, what: str, positional: bool = False):
    """`graph`'s forward as a function of (self, *inputs); with `positional` (a block's: called
    with its inputs by position) graphs of the same structure (the layers of a model) share one
    function, so torch.compile of their blocks compiles it once."""
    code = graph.python_code(root_module="self")
    names = () if positional else tuple(n.target for n in graph.nodes if n.op == "placeholder")
    key = (structure(graph), names, tuple(sorted((k, id(v)) for k, v in code.globals.items())))
    if key not in _COMPILED:
        scope = dict(code.globals)
        exec(compile(code.src, f"<autoshard {what}>", "exec"), scope)  # noqa: S102 - fx's own codegen
        _COMPILED[key] = scope["forward"]
    return _COMPILED[key]


def _own_names(module: nn.Module, model_modules=frozenset(), prefix: str = "") -> set:
    """What a graph may refer to by name in `module`: its parameters, buffers and the model's own
    submodules (`model_modules`, qualified from the root; `prefix`: module's path there)."""
    return {n for n, _ in module.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in module.named_buffers(remove_duplicate=False)} | \
        {n for n, m in module.named_modules(remove_duplicate=False) if prefix + n in model_modules}


def adopt(module: nn.Module, holder: fx.GraphModule, k: int, arrangement: Arrangement, plan,
          model_modules=frozenset()) -> Served:
    """Make `holder` (a rewritten graph on meta tensors) run against `module`: its parameters,
    buffers and the model's own submodules (`model_modules`: a symbolic_trace leaf such as a batch
    norm) by their names in `module` (shapes checked), everything else the graph refers to added
    to `module` under autoshard_call<k>_* names (`_bind`). Where `module` keeps blocks as modules
    (autoshard.rewrite.blocks), the holder's graph is split at the same blocks and each block's graph
    becomes that block's variant k, so this call, too, runs every block through its module (FSDP2's
    and checkpointing's hooks included); returns the compiled Served."""
    blocks = module.__dict__.get("_autoshard_blocks", {})
    if blocks:
        keep_blocks(holder, list(blocks), variant=k)
        for name, mine in blocks.items():
            theirs = _resolves(holder, name)
            if isinstance(theirs, fx.GraphModule) and theirs is not holder:
                _bind(mine, theirs, theirs.graph, k, _own_names(mine, model_modules, name + "."))
                add_variant(mine, k, _compiled(theirs.graph, f"call signature {k}, block {name}", positional=True))
    graph = holder.graph
    _bind(module, holder, graph, k, _own_names(module, model_modules))
    out_spec = getattr(holder, "_out_spec", None) if plan.tracer == "export" else None
    if out_spec is not None:
        graph.set_codegen(CodeGen())                  # flat inputs and outputs: the specs are applied here
    return Served(arrangement, InputCheck.of(plan, holder), holder, _compiled(graph, f"call signature {k}"), out_spec)


def install(module: fx.GraphModule, model: nn.Module, example: tuple, build) -> None:
    """Give `module` (a rank's rewrite of `model`) the dispatcher: the example's signature in
    training mode runs the module's graph; another one, or any in eval mode, is built on first use
    by `build(capture_on, bind_to, call, train) -> (holder, plan)`: captured on `model` while the caller keeps it (a weak reference: its real
    constants are then right), else on its meta copy, and rewritten on the meta copy's tensors."""
    signature = inspect.signature(model.forward)
    args, kwargs = example
    first = bind(signature, args, kwargs)
    arrangement = Arrangement(_positional_names(signature, len(args)), tuple(kwargs))
    graph_forward = type(module).forward
    served = Served(arrangement, InputCheck.of(module._autoshard_plan, module), module, graph_forward)
    try:
        on_meta, error = meta_copy(model), None
    except Exception as e:  # noqa: BLE001 - reported on the first call that needs it
        on_meta, error = None, f"{type(e).__name__}: {first_line(e, 160)}"
    alive = weakref.ref(model)

    def build_for(call, train, recipe_of=None, step=None):
        """Captured on the model, else its meta copy; under another precision recipe than the
        example's (`recipe_of`: the module, whose dtypes and devices it takes), on a fake copy
        (`step`: see Signatures.call_step)."""
        model = alive()
        if recipe_of is not None:
            like = compute_dtypes(recipe_of)
            return build(recipe_copy(on_meta, like), recipe_copy(on_meta, like, fake=False), call, train, step)
        return build(model if model is not None else on_meta, on_meta, call, train, step)
    modules = frozenset(n for n, _ in model.named_modules(remove_duplicate=False) if n)
    module._autoshard_signatures = Signatures(signature, first, served, build_for, modules, error, precision(module))
    module._autoshard_signatures.prepare(module)

    def forward(self, *args, **kwargs):
        return self.__dict__["_autoshard_signatures"](self, args, kwargs)
    forward.__doc__ = f"{type(model).__name__}.forward on this rank's shards (autoshard.rewrite.signatures)"
    forward.__signature__ = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                               *signature.parameters.values()])
    type(module).forward = forward
