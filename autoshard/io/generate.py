"""`gm.generate(...)`: Hugging Face's own generation loop over the parallel module, the key/value
cache split by heads.

`attach(gm, model)` (called by `io.hf.attach` for a model with `generate`) gives the rank's module
a `generate` method: transformers' `GenerationMixin.generate`, unchanged, run on an adapter whose
forward is one call of the module's *step* signature (`Step`):

    step(input_ids, attention_mask=None, position_ids=None, keys=(), values=())
        -> (last position's logits, keys per layer, values per layer)

captured on the model (a shallow copy whose forward builds a `DynamicCache` from `keys` /
`values`, calls the model's own forward with it and returns the updated cache's tensors), planned
with the parameters' layouts fixed, like any other call signature of the module
(`Signatures.call_step`). The prefill (`keys=()`) and the decode step (one tuple of tensors per
cache) are two signatures, each captured once (batch, prompt and cache lengths are dynamic).
The cache's tensors are *held*: the plan returns them as each rank holds them (its own K/V heads;
K/V heads replicated onto the ranks whose query heads read them when there are fewer K/V heads
than ranks) and the decode step takes them in so (`rewrite.held`): no rank gathers K/V. The
logits come back whole (an all-gather of batch x vocab a token; HF's logits processors need
every vocabulary entry). Greedy, sampling, beam search, stopping, left padding and
`return_dict_in_generate` are HF's own; sampling draws from autoshard's replicated random stream
(`runtime.rng.fork("replicated")`), so every rank draws the same token whatever its own seed.
"""
from __future__ import annotations

import copy
import inspect
import types
import weakref

import torch
import torch.nn as nn

from ..errors import ShardingError
from ..rewrite.held import local_check, localize
from ..runtime import rng
from ..runtime.groups import get_group
from ..runtime.placements import Shard

__all__ = ["attach", "Step", "cache_heads"]


def step_forward(self, input_ids, attention_mask=None, position_ids=None, keys=(), values=()):
    """One generation step of a causal LM (the forward `Step` captures): the logits of the last
    position and the key/value cache after it, as tuples of tensors (one per layer)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache = DynamicCache(config=self.config)
    for layer, k, v in zip(cache.layers, keys, values):
        _fill(layer, k, v)
    for layer in cache.layers[len(keys):]:
        if type(layer) is DynamicLayer:
            layer.update = types.MethodType(_first_update, layer)
    out = type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, logits_to_keep=1, return_dict=True, **{_cache_name(self): cache})
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    return out.logits, tuple(layer.keys for layer in layers), tuple(layer.values for layer in layers)


def _first_update(layer, key_states, value_states, *args, **kwargs):
    """DynamicLayer.update of an empty layer without its concatenation to an empty 1-D tensor
    (the same values; the planner keeps a concatenation with a 1-D tensor whole, which would
    gather the new keys and values)."""
    if layer.is_initialized:
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    _fill(layer, key_states, value_states)
    return key_states, value_states


def _fill(layer, keys, values) -> None:
    """Make `layer` hold `keys` / `values` (as its lazy_initialization and update would, without
    the empty tensors it makes: constants a capture on the meta device could not fill)."""
    layer.device, layer.is_initialized = keys.device, True
    layer.keys, layer.values = keys, values


def _cache_name(model) -> str:
    """The name the model's forward takes its cache by ("cache" in transformers 5.x, else the
    older "past_key_values")."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Step:
    """The step signature of one module, as `Signatures.call_step` takes it: captured with
    whole-shaped stand-ins for the cache pieces the ranks hold, whose layouts the prefill's plan
    fixes (`layouts`: (placement, whole size of its split dim) per cache tensor)."""

    name = "generate.step"

    def __init__(self):
        full = inspect.signature(step_forward)
        self.signature = full.replace(parameters=list(full.parameters.values())[1:])
        self._copies = weakref.WeakKeyDictionary()
        self.layouts = None

    def module(self, model: nn.Module) -> nn.Module:
        """`model` with `step_forward` as its forward: a shallow copy (the same submodules,
        parameters and names), made once per model."""
        out = self._copies.get(model)
        if out is None:
            out = copy.copy(model)
            out.forward = types.MethodType(step_forward, out)
            self._copies[model] = out
        return out

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's inputs as the capture sees them: each cache piece a whole-shaped stand-in
        (zeros expanded from one element: no memory)."""
        pieces = list(kwargs.get("keys", ())) + list(kwargs.get("values", ()))
        if not pieces:
            return args, kwargs
        if self.layouts is None or len(self.layouts) != len(pieces):
            raise ShardingError("the decode step needs the cache of this module's prefill (call generate, or the "
                                "step with keys=() first)")
        whole = []
        for t, (pl, size) in zip(pieces, self.layouts):
            shape = list(t.shape)
            if isinstance(pl, Shard):
                shape[pl.dim] = size
            whole.append(t.new_zeros(()).expand(shape))
        n = len(kwargs["keys"])
        return args, {**kwargs, "keys": tuple(whole[:n]), "values": tuple(whole[n:])}

    @staticmethod
    def held(gm) -> frozenset:
        """Every flat output but the logits (the first): the cache's tensors."""
        return frozenset(range(1, len(_flat_outputs(gm))))

    def localize(self, holder, plan):
        """Take the cache inputs' slices out of the rank's graph (they come in as the rank holds
        them); the prefill fixes the cache's layouts, and every decode step must read and return
        its cache in them. Returns how the input check is made local."""
        names = [n.target for n in holder.graph.nodes if n.op == "placeholder"
                 and n.target.startswith(("keys", "values"))]
        held = localize(holder, plan, names)
        flat = _flat_outputs(plan.graph_module)[1:]
        returned = [(plan.output_placements.get(x.name), _split_size(x, plan.output_placements.get(x.name)))
                    for x in flat]
        if not names:
            self.layouts = returned
        elif [h for h, _ in returned] != [h for h, _ in self.layouts] or [held[n] for n in names] != [h for h, _ in returned]:
            raise ShardingError(f"the decode step reads the cache as {[str(held[n]) for n in names]} and returns "
                                f"it as {[str(h) for h, _ in returned]}, but the prefill returned it as "
                                f"{[str(h) for h, _ in self.layouts]}: the cache would move between steps")
        pg = get_group(holder.__dict__.get("_autoshard_group"))
        p, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
        return lambda check: local_check(check, held, p, rank)


def _flat_outputs(gm) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]


def _split_size(node, placement) -> int | None:
    """The whole size of the split dim of output `node` (its captured shape), None when whole."""
    return int(node.meta["val"].shape[placement.dim]) if isinstance(placement, Shard) else None


def cache_heads(cache) -> list:
    """The number of key heads each layer of `cache` holds on this rank."""
    return [int(layer.keys.shape[1]) for layer in cache.layers if getattr(layer, "is_initialized", False)]


class ParallelCausalLM(nn.Module):
    """What `GenerationMixin.generate` runs on: a rank's module seen as a causal LM whose forward
    is the step signature (the class is made with GenerationMixin as a base in `_adapter`)."""

    def __init__(self, gm, model_class):
        super().__init__()
        self.__dict__["gm"] = gm                       # not a submodule: no parameters of its own
        self.config = gm.config
        self.generation_config = gm.__dict__.get("generation_config")
        self.main_input_name = "input_ids"
        self.step = Step()                             # this module's step signature
        self._cache_name = "cache" if "cache" in inspect.signature(model_class.forward).parameters \
            else "past_key_values"

    @staticmethod
    def is_remote_code() -> bool:
        return False

    @staticmethod
    def get_experts_implementation() -> dict:
        return {}                                      # no experts to switch for the decode stage

    @property
    def device(self):
        return next(self.gm.parameters()).device

    @property
    def dtype(self):
        return next(p for p in self.gm.parameters() if p.is_floating_point()).dtype

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                use_cache=None, logits_to_keep=None, return_dict=None, **kwargs):
        from transformers.cache_utils import Cache, DynamicCache
        from transformers.modeling_outputs import CausalLMOutputWithPast
        if inputs_embeds is not None:
            raise ShardingError("generate with inputs_embeds is not supported by the parallel module: pass input_ids")
        cache = kwargs.pop(self._cache_name, None)
        if cache is not None and not isinstance(cache, DynamicCache):
            raise ShardingError(f"the parallel module generates with a DynamicCache (its K/V heads split over the "
                                f"ranks); got a {type(cache).__name__}")
        unused = {k: v for k, v in kwargs.items() if v is not None and k not in ("cache_position", "output_attentions",
                                                                                  "output_hidden_states")}
        if unused or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise ShardingError(f"generate: the parallel module's step does not take {sorted(unused) or 'outputs of '}"
                                "attentions or hidden states")
        if cache is None:
            cache = DynamicCache(config=self.config)
        layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
        call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    keys=tuple(layer.keys for layer in layers), values=tuple(layer.values for layer in layers))
        logits, keys, values = self.gm.__dict__["_autoshard_signatures"].call_step(self.gm, self.step, (), call)
        if len(keys) != len(cache.layers) and len(keys) != len(layers):
            raise ShardingError(f"the step returned {len(keys)} cache layers for a cache of {len(cache.layers)}")
        for layer, k, v in zip(cache.layers, keys, values):
            _fill(layer, k, v)
        if isinstance(cache, Cache) and isinstance(logits_to_keep, int) and logits_to_keep not in (0, 1):
            raise ShardingError(f"generate: logits_to_keep={logits_to_keep}; the step returns the last position's")
        return CausalLMOutputWithPast(logits=logits, **{self._cache_name: cache})


_ADAPTERS: dict = {}


def _adapter(gm, model_class):
    """A ParallelCausalLM (with transformers' GenerationMixin) for `gm`, made once per module."""
    from transformers import GenerationMixin
    kind = _ADAPTERS.get(model_class)
    if kind is None:
        kind = _ADAPTERS[model_class] = type(f"Parallel{model_class.__name__}", (ParallelCausalLM, GenerationMixin),
                                             {"__module__": __name__})
    adapter = gm.__dict__.get("_autoshard_generator")
    if adapter is None:
        adapter = gm.__dict__["_autoshard_generator"] = kind(gm, model_class)
    return adapter


def generate(self, *args, **kwargs):
    """transformers' `GenerationMixin.generate` on this rank's shards (autoshard.io.generate): call
    it on every rank with the same inputs; every rank returns the same tokens. Sampling draws
    from autoshard's replicated stream (`autoshard.manual_seed`)."""
    adapter = _adapter(self, self.__dict__["_autoshard_hf"]["class"])
    adapter.generation_config = self.__dict__.get("generation_config", adapter.generation_config)
    with rng.fork("replicated", adapter.device):
        return adapter.generate(*args, **kwargs)


def attach(gm, model) -> bool:
    """Give `gm` `generate` where `model` (a Hugging Face model) can generate; False otherwise."""
    can = getattr(model, "can_generate", None)
    try:
        if not (callable(can) and can()):
            return False
    except Exception:  # noqa: BLE001 - a model whose check fails does not generate
        return False
    type(gm).generate = generate
    return True

