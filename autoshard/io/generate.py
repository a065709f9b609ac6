"""`gm.generate(...)`: Hugging Face's own generation loop over the parallel module, the key/value
cache split by heads.

`attach(gm, model)` (called by `io.hf.attach` for a model with `generate`) gives the rank's module
a `generate` method: transformers' `GenerationMixin.generate`, unchanged, run on an adapter whose
forward is one call of the module's *step* signature (autoshard.io.step: the prefill and decode
step over a `DynamicCache`, its K/V held by heads) or, with `cache_implementation="static"`, of
the static decode step (autoshard.io.static). The logits come back whole (an all-gather of batch
x vocab a token; HF's logits processors need every vocabulary entry). Greedy, sampling, beam
search, stopping, left padding and `return_dict_in_generate` are HF's own; sampling draws from
autoshard's replicated random stream (`runtime.rng.fork("replicated")`), so every rank draws the
same token whatever its own seed.

Compiling the decode step follows HF: `generate` compiles the decode steps of a static cache
with `generation_config.compile_config` (HF's `CompileConfig`) where HF would (on an
accelerator, unless `disable_compile`); `gm.generate(..., compile=True)` asks for it on any
device (the CPU included), `compile=False` never. What is compiled is the static decode step's
graph, not the adapter; HF compiles greedy search and sampling, not beam search.
"""
from __future__ import annotations

import functools

import torch.nn as nn

from ..errors import ShardingError
from ..rewrite.signatures import precision
from ..runtime import rng
from .static import StaticStep, check_static, run_static
from .step import Step, cache_name, fill

__all__ = ["attach"]


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
        self.static = StaticStep(self.step)            # its static cache's decode step
        self.compile = None                            # gm.generate's compile=: None (HF's rule), True, False
        self.recipe, self.checked = None, set()        # within one generate: see `call`
        self._cache_name = cache_name(model_class)

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
                use_cache=None, logits_to_keep=None, return_dict=None, autoshard_compile=None, **kwargs):
        from transformers.cache_utils import DynamicCache, StaticCache
        from transformers.modeling_outputs import CausalLMOutputWithPast
        if inputs_embeds is not None:
            raise ShardingError("generate with inputs_embeds is not supported by the parallel module: pass input_ids")
        cache = kwargs.pop(self._cache_name, None)
        if cache is not None and not isinstance(cache, (DynamicCache, StaticCache)):
            raise ShardingError(f"the parallel module generates with a DynamicCache or a StaticCache (cache_implementation"
                                f"=\"static\"), its K/V heads split over the ranks; got a {type(cache).__name__}")
        unused = {k: v for k, v in kwargs.items() if v is not None and k not in ("cache_position", "output_attentions",
                                                                                  "output_hidden_states")}
        if unused or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise ShardingError(f"generate: the parallel module's step does not take {sorted(unused) or 'outputs of '}"
                                "attentions or hidden states")
        if isinstance(logits_to_keep, int) and logits_to_keep not in (0, 1):
            raise ShardingError(f"generate: logits_to_keep={logits_to_keep}; the step returns the last position's")
        if use_cache is False:        # HF passes the whole sequence every step and keeps no cache
            if cache is not None and cache.get_seq_length():
                raise ShardingError("generate: use_cache=False with a filled cache; pass use_cache=True to decode "
                                    "from the cache")
            logits, _, _ = self.call(self.step, dict(input_ids=input_ids, attention_mask=attention_mask,
                                                     position_ids=position_ids, keys=(), values=()))
            return CausalLMOutputWithPast(logits=logits)
        if isinstance(cache, StaticCache):
            check_static(cache)
            logits = run_static(self, cache, input_ids, attention_mask, position_ids, autoshard_compile)
            return CausalLMOutputWithPast(logits=logits, **{self._cache_name: cache})
        if cache is None:
            cache = DynamicCache(config=self.config)
        layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
        call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    keys=tuple(layer.keys for layer in layers), values=tuple(layer.values for layer in layers))
        logits, keys, values = self.call(self.step, call)
        if len(keys) != len(cache.layers) and len(keys) != len(layers):
            raise ShardingError(f"the step returned {len(keys)} cache layers for a cache of {len(cache.layers)}")
        for layer, k, v in zip(cache.layers, keys, values):
            fill(layer, k, v)
        return CausalLMOutputWithPast(logits=logits, **{self._cache_name: cache})

    def call(self, step, kwargs: dict, compile_options=None):
        """One call of `step` (prefill or decode step) on the module. Within a generate call the
        module's precision recipe is read once (its parameters' dtypes do not change between
        tokens) and each signature's inputs are checked on its first call only (the adapter
        builds them alike every token; only the cache's length, a free dim, and values change)."""
        seen = (step.name, bool(kwargs.get("keys")))
        check = self.recipe is None or seen not in self.checked
        self.checked.add(seen)
        return self.gm.__dict__["_autoshard_signatures"].call_step(self.gm, step, (), kwargs, compile_options,
                                                                   self.recipe, check)

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """The 2-D mask as it is (HF builds a 4-D mask here for a compileable cache; the static
        step builds it inside its graph from the mask padded to the cache's length)."""
        return attention_mask

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """HF's rule for compiling the decode steps, overridden by gm.generate's `compile=`."""
        from transformers.cache_utils import StaticCache
        if self.compile is None:
            return super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        if self.compile and not isinstance(model_kwargs.get(self._cache_name), StaticCache):
            raise ShardingError("generate(compile=True): the parallel module compiles the decode step of a static "
                                "cache; pass cache_implementation=\"static\"")
        return bool(self.compile)

    def get_compiled_call(self, compile_config):
        """HF's compiled forward: this adapter with the static decode step's graph compiled under
        `compile_config` (HF's CompileConfig; its defaults where None)."""
        from transformers.generation.configuration_utils import CompileConfig
        options = (compile_config or CompileConfig()).to_dict()
        if options.get("mode") is not None and options.get("options") is not None:
            options.pop("mode")                        # torch.compile takes one of them
        return functools.partial(self.__call__, autoshard_compile=options)


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
    from autoshard's replicated stream (`autoshard.manual_seed`). `compile=True` compiles the
    decode step of a static cache (`cache_implementation="static"`) on any device, `False`
    never; None (the default) does as HF does."""
    adapter = _adapter(self, self.__dict__["_autoshard_hf"]["class"])
    adapter.generation_config = self.__dict__.get("generation_config", adapter.generation_config)
    adapter.compile = kwargs.pop("compile", None)
    adapter.recipe, adapter.checked = precision(self), set()
    try:
        with rng.fork("replicated", adapter.device):
            return adapter.generate(*args, **kwargs)
    finally:
        adapter.recipe = None


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

