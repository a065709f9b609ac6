"""`gm.generate(..., cache_implementation="static")`: Hugging Face's `StaticCache`, each rank's
buffers holding only its own K/V heads, and a decode step that `torch.compile` compiles once.

HF makes the `StaticCache` (its `max_cache_len` by HF's own rules: the call's `max_length`, or
`generation_config.max_cache_len` where larger) and hands it to the adapter's forward
(autoshard.io.generate), which runs:

- the prefill: the dynamic prefill signature (`keys=()`, the same graph as a `DynamicCache`'s),
  whose held K/V pieces HF's own `StaticLayer.update` writes into the layer: it allocates the
  rank's buffers at (batch, the rank's K/V heads, max_cache_len, head dim) and copies the prompt
  in at positions 0..q-1, in place;
- each decode step: the *static step* signature (`StaticStep`)

      static_step(input_ids, attention_mask=None, position_ids=None, length=None, keys=(), values=())
          -> (last position's logits, new keys per layer, new values per layer)

  whose inputs have the same shapes every token: the whole buffers (held, as the prefill's plan
  placed them), the cache's length (a 0-d tensor, HF's `cumulative_length`) and the 2-D mask
  padded to max_cache_len. Inside, the new keys and values are placed at `length` for attention
  by an element-wise `torch.where` (the planner splits it by heads with the buffers); the step
  returns only the new keys and values (batch, heads, 1, head dim), which HF's
  `StaticLayer.update` then writes into the buffers in place (`index_copy_`), so the buffers
  keep their addresses, as HF's do.

Compiling (`compile_options`): the decode step's graph (the served graph of the static
signature, run with the module as `self`) under `torch.compile` with HF's `CompileConfig`
options; its inputs' shapes do not change from token to token, so it compiles once and every
token runs that graph. The adapter's eager work around it (the call's key, the cache's writes)
stays outside the compiled graph.
"""
from __future__ import annotations

import types

import torch

from ..errors import ShardingError
from .step import Step, cache_name

__all__ = ["StaticStep", "run_static", "check_static"]


def static_forward(self, input_ids, attention_mask=None, position_ids=None, length=None, keys=(), values=()):
    """One decode step over a static cache (the forward `StaticStep` captures): the model's own
    forward with a `StaticCache` whose layers hold `keys` / `values` (batch, heads, max_cache_len,
    head dim) and `length` positions; returns the last position's logits and the new keys and
    values (the step's writes, for the caller to put at `length`)."""
    from transformers import StaticCache
    cache = StaticCache(config=self.config, max_cache_len=keys[0].shape[2])
    for layer, k, v in zip(cache.layers, keys, values):
        layer.device, layer.is_initialized = k.device, True
        layer.keys, layer.values, layer.cumulative_length = k, v, length
        layer.update = types.MethodType(_placed, layer)
    out = type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, logits_to_keep=1, return_dict=True, **{cache_name(type(self)): cache})
    return (out.logits, tuple(layer.written[0] for layer in cache.layers),
            tuple(layer.written[1] for layer in cache.layers))


def _placed(layer, key_states, value_states, *args, **kwargs):
    """StaticLayer.update without the write: the buffers with the new (one-position) keys and
    values at `cumulative_length`, for attention; the write itself is the caller's, in place."""
    at = (torch.arange(layer.keys.shape[2], device=layer.keys.device) == layer.cumulative_length).view(1, 1, -1, 1)
    layer.written = (key_states, value_states)
    return torch.where(at, key_states, layer.keys), torch.where(at, value_states, layer.values)


class StaticStep(Step):
    """The static decode step of one module (see the module's docstring): captured with
    whole-shaped stand-ins for the buffers, in the layouts the prefill (`prefill`, the module's
    dynamic step) fixed, and checked against them."""

    name = "generate.static"

    def __init__(self, prefill: Step):
        super().__init__(forward=static_forward)
        self.prefill = prefill

    @property
    def layouts(self):
        return self.prefill.layouts

    @layouts.setter
    def layouts(self, value):
        if value is not None:
            self.prefill.layouts = value


def check_static(cache) -> None:
    """A clear error for a static cache the parallel module cannot serve: layers other than
    full-attention `StaticLayer`s (sliding-window, chunked or shared layers, offloading)."""
    from transformers.cache_utils import StaticLayer
    other = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
    if other or getattr(cache, "offloading", False):
        raise ShardingError(f"generate: the parallel module's static cache serves full-attention StaticLayers only; "
                            f"this cache has {other or 'offloading'} (use the default dynamic cache)")


def run_static(adapter, cache, input_ids, attention_mask, position_ids, compile_options=None):
    """One forward of the adapter over a `StaticCache`: the prefill when its layers are empty,
    else a decode step (compiled with `compile_options`); writes the new K/V into the rank's
    buffers (HF's `StaticLayer.update`) and returns the logits."""
    first = cache.layers[0]
    if not first.is_initialized:
        logits, keys, values = adapter.call(adapter.step, dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, keys=(), values=()))
    else:
        if input_ids.shape[1] != 1:
            raise ShardingError(f"generate: the parallel module's static decode step takes one token a step; got "
                                f"input_ids of shape {tuple(input_ids.shape)} (assisted or chunked decoding is not "
                                "supported with a static cache)")
        size = first.max_cache_len
        if attention_mask is not None and attention_mask.shape[1] != size:
            attention_mask = torch.nn.functional.pad(attention_mask, (0, size - attention_mask.shape[1]))
        call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    length=first.cumulative_length, keys=tuple(layer.keys for layer in cache.layers),
                    values=tuple(layer.values for layer in cache.layers))
        logits, keys, values = adapter.call(adapter.static, call, compile_options)
    if len(keys) != len(cache.layers):
        raise ShardingError(f"the step returned {len(keys)} cache layers for a static cache of {len(cache.layers)}")
    for layer, k, v in zip(cache.layers, keys, values):
        if not layer.is_initialized and k.shape[1] != v.shape[1]:
            _initialize(layer, k, v)
        layer.update(k, v)
    return logits


def _initialize(layer, k, v) -> None:
    """HF's buffers where a rank holds other K heads than V heads (K computed whole, V held by
    the ranks that read it): HF sizes both from the keys; the values' buffer takes theirs."""
    layer.lazy_initialization(k, v)
    layer.values = torch.zeros((v.shape[0], v.shape[1], layer.max_cache_len, v.shape[-1]), dtype=v.dtype,
                               device=v.device)
    torch._dynamo.mark_static_address(layer.values)
