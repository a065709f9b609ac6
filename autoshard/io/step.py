"""The step signatures of `gm.generate` (autoshard.io.generate): a causal LM's forward as a
function of tensors, captured and planned as a call signature of the parallel module.

`Step` is the prefill and decode step over a dynamic cache:

    step(input_ids, attention_mask=None, position_ids=None, keys=(), values=())
        -> (last position's logits, keys per layer, values per layer)

captured on the model (a shallow copy whose forward builds a `DynamicCache` from `keys` /
`values`, calls the model's own forward with it and returns the updated cache's tensors), planned
with the parameters' layouts fixed (`Signatures.call_step`). The prefill (`keys=()`) and the
decode step are two signatures, each captured once (batch, prompt and cache lengths are dynamic).
The cache's tensors are *held*: the plan returns them as each rank holds them and the decode step
takes them in so (`rewrite.held`): no rank gathers K/V. The static cache's decode step
(autoshard.io.static) is a `Step` over another forward, in the layouts the prefill fixed.
"""
from __future__ import annotations

import copy
import inspect
import types
import weakref

import torch
import torch.nn as nn

from ..capture.ops import flat_outputs
from ..errors import ShardingError
from ..rewrite.held import local_check, localize
from ..runtime.groups import get_group
from ..runtime.placements import Shard

__all__ = ["Step", "step_forward", "fill", "cache_name"]


def step_forward(self, input_ids, attention_mask=None, position_ids=None, keys=(), values=()):
    """One generation step of a causal LM (the forward `Step` captures): the logits of the last
    position and the key/value cache after it, as tuples of tensors (one per layer)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    cache = DynamicCache(config=self.config)
    for layer, k, v in zip(cache.layers, keys, values):
        fill(layer, k, v)
    for layer in cache.layers[len(keys):]:
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
            layer.update = types.MethodType(_first_update, layer)
    out = type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, logits_to_keep=1, return_dict=True, **{cache_name(type(self)): cache})
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    return out.logits, tuple(layer.keys for layer in layers), tuple(layer.values for layer in layers)


def _first_update(layer, key_states, value_states, *args, **kwargs):
    """DynamicLayer.update of an empty layer without its concatenation to an empty 1-D tensor
    (the same values; the planner keeps a concatenation with a 1-D tensor whole, which would
    gather the new keys and values, or, for a piece held by the ranks that read it, cannot run).
    A sliding-window layer keeps the last `sliding_window - 1` tokens, as its update does."""
    if layer.is_initialized or getattr(layer, "record_past", False):
        return type(layer).update(layer, key_states, value_states, *args, **kwargs)
    fill(layer, key_states, value_states)
    window = getattr(layer, "sliding_window", None)
    if window is not None:
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(layer.device)
        layer.cumulative_length += key_states.shape[-2]
        layer.keys, layer.values = key_states[:, :, -window + 1:, :], value_states[:, :, -window + 1:, :]
    return key_states, value_states


def fill(layer, keys, values) -> None:
    """Make `layer` hold `keys` / `values` (as its lazy_initialization and update would, without
    the empty tensors it makes: constants a capture on the meta device could not fill)."""
    layer.device, layer.is_initialized = keys.device, True
    layer.keys, layer.values = keys, values


def cache_name(model_class) -> str:
    """The name the forward of `model_class` takes its cache by ("cache" in transformers 5.x, else
    the older "past_key_values")."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Step:
    """The step signature of one module, as `Signatures.call_step` takes it: captured with
    whole-shaped stand-ins for the cache pieces the ranks hold, whose layouts the prefill's plan
    fixes (`layouts`: (placement, whole size of its split dim) per cache tensor)."""

    name = "generate.step"

    def __init__(self, forward=step_forward):
        full = inspect.signature(forward)
        self.forward = forward
        self.signature = full.replace(parameters=list(full.parameters.values())[1:])
        self._copies = weakref.WeakKeyDictionary()
        self.layouts = None

    def module(self, model: nn.Module) -> nn.Module:
        """`model` with the step's forward as its forward: a shallow copy (the same submodules,
        parameters and names), made once per model."""
        out = self._copies.get(model)
        if out is None:
            out = copy.copy(model)
            out.forward = types.MethodType(self.forward, out)
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

    def held_inputs(self, gm) -> dict:
        """{placeholder: placement} of the cache inputs of captured graph `gm`: as the prefill
        returned them, so a decode step reads and returns its cache in the prefill's layouts."""
        names = _cache_inputs(gm)
        if not names or self.layouts is None or len(names) != len(self.layouts):
            return {}
        return {n: pl for n, (pl, _) in zip(names, self.layouts) if pl is not None}

    @staticmethod
    def held(gm) -> frozenset:
        """Every flat output but the logits (the first): the cache's tensors."""
        return frozenset(range(1, len(flat_outputs(gm.graph.nodes))))

    def localize(self, holder, plan):
        """Take the cache inputs' slices out of the rank's graph (they come in as the rank holds
        them); the prefill fixes the cache's layouts, and every decode step must read and return
        its cache in them. Returns how the input check is made local."""
        names = _cache_inputs(holder)
        held = localize(holder, plan, names)
        flat = flat_outputs(plan.graph_module.graph.nodes)[1:]
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


def _cache_inputs(gm) -> list:
    """The placeholders of `gm` that take the cache's tensors (keys, then values), in graph order."""
    return [n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target.startswith(("keys", "values"))]


def _split_size(node, placement) -> int | None:
    """The whole size of the split dim of output `node` (its captured shape), None when whole."""
    return int(node.meta["val"].shape[placement.dim]) if isinstance(placement, Shard) else None

