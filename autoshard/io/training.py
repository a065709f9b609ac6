"""The face a parallel module shows the training loops people use: the Hugging Face Trainer,
accelerate and Lightning (README, "Training with the Trainer, accelerate or Lightning").

`attach(gm, pg, check_inputs)` (called by `parallelize` where the tensor-parallel group has more
than one rank) gives the rank's module:

- `tp_size` and, for a Hugging Face model, a config (a shallow copy of the model's) carrying a
  `DistributedConfig(tp_size, fsdp_size=data-parallel size)`: what transformers' own
  tensor-parallel models carry and what the Trainer reads to build accelerate's
  `ParallelismConfig(tp_size=..., dp_shard_size=...)`, so it splits the data by data-parallel
  rank only, wraps nothing in DDP and divides token counts by `tp_size`; accelerate's
  `prepare` checks the same `tp_size`. transformers does not serialise `distributed_config`.
- its gradients averaged over the data-parallel group at the end of each backward
  (`runtime.replicas.Replicas`; `no_sync()` and `set_requires_gradient_sync()` for gradient
  accumulation, which accelerate's `no_sync` calls);
- `clip_grad_norm_(max_norm)` and `grad_norm()` over every shard; `Accelerator.clip_grad_norm_`
  given exactly such a module's parameters (as the Trainer and accelerate loops call it) uses it;
- a guard run before each call: a DistributedDataParallel across its tensor-parallel ranks is
  refused (`replicas.refuse_ddp`), and the ranks' inputs are compared on the first call of each
  signature and every `check_inputs`-th call after (`runtime.agreement`).
"""
from __future__ import annotations

import copy
import sys
import weakref

import torch.distributed as dist

from ..runtime import agreement, replicas
from ..runtime.groups import get_data_parallel_group

__all__ = ["attach", "data_parallel_of"]

_MODULES: "weakref.WeakSet" = weakref.WeakSet()      # modules whose parameters Accelerator.clip_grad_norm_ knows


def data_parallel_of(pg, group=None):
    """(data-parallel group or None, its size) of the tensor-parallel group `pg`: the other dim of
    the 2-D DeviceMesh that `group` (a 1-D slice of it, as Lightning's `device_mesh["tensor_parallel"]`)
    comes from, else the group of autoshard.distributed.init_process_group, else none (size: the
    world over `pg`)."""
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(group, DeviceMesh):
        root = group._get_root_mesh()
        others = [n for n in (root.mesh_dim_names or ()) if n not in (group.mesh_dim_names or ())]
        if root is not group and root.ndim == 2 and len(others) == 1:
            dp = root[others[0]].get_group()
            return dp, dist.get_world_size(dp)
    dp = get_data_parallel_group()
    if dp is not None and pg in (None, _tp_of_state()):
        return dp, dist.get_world_size(dp)
    return None, dist.get_world_size() // dist.get_world_size(pg)


def _tp_of_state():
    from ..runtime.groups import get_group
    return get_group(None)


def _ddp_wrapping(module):
    """The DistributedDataParallel whose forward is running `module`, or None."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel._active_ddp_module
    if ddp is None:
        return None
    inner = ddp.module
    return ddp if inner is module or any(m is module for m in inner.modules()) else None


def _config_for(gm, p: int, dp_size: int):
    """A shallow copy of `gm.config` carrying transformers' DistributedConfig(tp_size=p, fsdp_size=dp)."""
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:       # an older transformers: its Trainer reads no distributed_config
        return gm.config
    config = copy.copy(gm.config)
    config.distributed_config = DistributedConfig(tp_size=p, fsdp_size=dp_size)
    return config


def patch_accelerate(load: bool = False) -> None:
    """Make accelerate (imported already, or now with `load`) run parallel modules right:

    - `Accelerator.clip_grad_norm_` of exactly a parallel module's parameters computes the norm
      over every shard (the module's `clip_grad_norm_`); other calls are unchanged;
    - accelerate 1.15 accepts a `ParallelismConfig` on GPU-like devices only and refuses it on
      CPU (gloo: "only compatible ... but got DistributedType.MULTI_CPU"), a check about its own
      tensor parallelism; a parallel module runs on gloo as well, so that refusal is let through
      when the config's tp_size is a live parallel module's (nothing else changes on CPU: the
      data is split by data-parallel rank and the module is not wrapped, as on GPU).
    Done once."""
    mod = sys.modules.get("accelerate.accelerator")
    if mod is None and load:
        try:
            import accelerate.accelerator as mod
        except ImportError:
            return
    if mod is None or getattr(mod.Accelerator.clip_grad_norm_, "_autoshard", False):
        return
    original = mod.Accelerator.clip_grad_norm_

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for module in list(_MODULES):
            if ids and ids == {id(p) for p in module.parameters()}:
                self.unscale_gradients()
                return module.clip_grad_norm_(max_norm, norm_type)
        return original(self, parameters, max_norm, norm_type)
    clip_grad_norm_._autoshard = True
    clip_grad_norm_.__doc__ = original.__doc__
    mod.Accelerator.clip_grad_norm_ = clip_grad_norm_

    from accelerate.parallelism_config import ParallelismConfig
    validate = ParallelismConfig._validate_accelerator

    def _validate_accelerator(self, accelerator):
        try:
            return validate(self, accelerator)
        except ValueError as e:
            ours = any(getattr(m, "tp_size", None) == self.tp_size for m in list(_MODULES))
            if not (ours and str(accelerator.distributed_type).endswith("MULTI_CPU") and "only compatible" in str(e)):
                raise
    ParallelismConfig._validate_accelerator = _validate_accelerator


def patch_trainer() -> None:
    """`transformers.Trainer.save_model` (and so its checkpoints' weights) of a parallel module:
    every rank joins the module's `save_pretrained` (full weights, gathered as each tensor is
    written), where the Trainer's own would write global rank 0's shards alone; the training
    arguments are written beside them as the Trainer does. Done once the Trainer is imported."""
    mod = sys.modules.get("transformers.trainer")
    if mod is None or getattr(mod.Trainer.save_model, "_autoshard", False):
        return
    original = mod.Trainer.save_model

    def save_model(self, output_dir=None, _internal_call=False):
        if self.model not in _MODULES:
            return original(self, output_dir, _internal_call)
        import os
        import torch
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.model.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
    save_model._autoshard = True
    save_model.__doc__ = original.__doc__
    mod.Trainer.save_model = save_model


def attach(gm, pg, check_inputs, group=None) -> None:
    """See the module docstring. `check_inputs`: N (first call of each signature and every N-th
    call), 0 (first calls only) or None / False (never); `group`: what parallelize was given."""
    p = dist.get_world_size(pg)
    dp, dp_size = data_parallel_of(pg, group)
    gm.tp_size = p
    if "config" in gm.__dict__:
        gm.config = _config_for(gm, p, dp_size)
    reducer = replicas.Replicas(gm, dp) if dp is not None and dp_size > 1 else None
    gm.__dict__["_autoshard_replicas"] = reducer
    guard = agreement.Guard(pg, None if check_inputs is False else check_inputs, type(gm).__name__)
    gm.__dict__["_autoshard_guard"] = guard          # its `every` may be changed later
    seen_ddp: dict = {}

    def before_call(module, key, arguments) -> None:
        ddp = _ddp_wrapping(module) if _active_ddp() else None
        if ddp is not None and id(ddp) not in seen_ddp:
            replicas.refuse_ddp(module, ddp, pg)
            seen_ddp[id(ddp)] = True
        if reducer is not None:
            reducer.under_ddp = ddp is not None
        if guard.due(key):
            patch_accelerate()
            patch_trainer()
            agreement.check_same_inputs(pg, arguments, type(gm).__name__)
    gm._autoshard_signatures.guard = before_call
    cls = type(gm)                      # unique to this GraphModule (torch.fx)
    cls.no_sync = _no_sync
    cls.set_requires_gradient_sync = _set_requires_gradient_sync
    cls.clip_grad_norm_ = _clip
    cls.grad_norm = _norm
    _MODULES.add(gm)
    patch_accelerate(load="config" in gm.__dict__)       # a Hugging Face model: its Trainer comes next
    patch_trainer()


def _active_ddp() -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel._active_ddp_module is not None


def _no_sync(self):
    """Gradients are not averaged over data-parallel replicas inside this context (accumulate
    them); the next backward outside it averages the accumulated sum, as DDP's no_sync."""
    import contextlib
    reducer = self.__dict__.get("_autoshard_replicas")
    return reducer.no_sync() if reducer is not None else contextlib.nullcontext()


def _set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
    """FSDP2's switch: False defers the data-parallel average as `no_sync` does."""
    reducer = self.__dict__.get("_autoshard_replicas")
    if reducer is not None:
        reducer.sync = bool(requires_gradient_sync)


def _clip(self, max_norm: float, norm_type: float = 2.0):
    """Clip the gradients to a total norm of `max_norm` over every shard (as one process would
    clip the full model's); returns the norm before clipping."""
    return replicas.clip_grad_norm_(self, max_norm, norm_type)


def _norm(self, norm_type: float = 2.0):
    """The total norm of the gradients over every shard."""
    return replicas.grad_norm(self, norm_type)
