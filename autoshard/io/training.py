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
  signature and every `check_inputs`-th call after (`runtime.agreement`);
- the Trainer's checkpoints: full weights from every rank, the shards of module and optimizer
  beside them, resumed rank by rank (`patch_trainer`).
"""
from __future__ import annotations

import copy
import os
import sys
import weakref

import torch
import torch.distributed as dist

from ..errors import LoadError
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


STATE_DIR = "optimizer_autoshard"      # in a Trainer checkpoint: the model's and optimizer's shards (DCP)


def patch_trainer() -> None:
    """The Hugging Face Trainer's checkpoints of a parallel module (done once the Trainer is imported):

    - `save_model` (and so each checkpoint's weights): every rank joins the module's
      `save_pretrained` (full weights, gathered as each tensor is written), where the Trainer's own
      would write global rank 0's shards alone; the training arguments are written beside them;
    - `_save_optimizer_and_scheduler`: the module's and optimizer's shards as one sharded
      checkpoint (`autoshard.checkpoint.save`, every rank its own boxes) in `STATE_DIR` of the
      checkpoint directory, where the Trainer would `torch.save` rank 0's optimizer state alone;
      the scheduler as the Trainer saves it;
    - resume (`_load_from_checkpoint`, `_load_optimizer_and_scheduler`): each rank reads back its
      own boxes from `STATE_DIR` (weights-only, checked); a checkpoint without it (saved with
      `save_only_model`) gives the module its full weights, each rank keeping its shards."""
    mod = sys.modules.get("transformers.trainer")
    if mod is None or getattr(mod.Trainer.save_model, "_autoshard", False):
        return
    Trainer = mod.Trainer
    names = ("save_model", "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler")
    originals = {name: getattr(Trainer, name) for name in names}

    def save_model(self, output_dir=None, _internal_call=False):
        if self.model not in _MODULES:
            return originals["save_model"](self, output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.model.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.model not in _MODULES:
            return originals["_save_optimizer_and_scheduler"](self, output_dir)
        from .checkpoint import get_state_dict, save
        msd, osd = get_state_dict(self.model, _unwrapped(self.optimizer))
        save({"model": msd, "optimizer": osd}, os.path.join(output_dir, STATE_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, mod.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = self.model if model is None else model
        if model not in _MODULES:
            return originals["_load_from_checkpoint"](self, resume_from_checkpoint, model)
        _load_shards(model, None, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or self.model not in _MODULES:
            return originals["_load_optimizer_and_scheduler"](self, checkpoint)
        if _load_shards(self.model, _unwrapped(self.optimizer), checkpoint):
            scheduler = torch.load(os.path.join(checkpoint, mod.SCHEDULER_NAME), weights_only=True)
            self.lr_scheduler.load_state_dict(scheduler)

    for name, fn in (("save_model", save_model), ("_save_optimizer_and_scheduler", _save_optimizer_and_scheduler),
                     ("_load_from_checkpoint", _load_from_checkpoint),
                     ("_load_optimizer_and_scheduler", _load_optimizer_and_scheduler)):
        fn._autoshard = True
        fn.__doc__ = originals[name].__doc__
        setattr(Trainer, name, fn)


def _unwrapped(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer (or `optimizer` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _aliases(gm) -> set:
    """Names of `gm`'s parameters that are another name of an earlier one (tied weights)."""
    seen, out = set(), set()
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
        seen.add(id(p))
    return out


def _load_shards(gm, optimizer, checkpoint: str) -> bool:
    """Give `gm` (and `optimizer`, where given) their state from the Trainer checkpoint
    `checkpoint`: each rank's boxes from its `STATE_DIR`; without one, the module's full weights
    from its safetensors (the optimizer's state is then left as it is: False)."""
    from .checkpoint import get_state_dict, load, set_state_dict
    path = os.path.join(checkpoint, STATE_DIR)
    if os.path.isdir(path):
        msd, osd = get_state_dict(gm, optimizer)
        wanted = {"model": msd} if optimizer is None else {"optimizer": osd}
        load(wanted, path)
        set_state_dict(gm, optimizer, model_state_dict=msd, optim_state_dict=osd or None)
        return True
    if optimizer is None:
        from ..runtime.state_dict import relocate_state_dict
        from .loading import open_source
        source = open_source(checkpoint)
        full = {key: source.read(key, tuple(slice(None) for _ in shape)) for key, (shape, _) in source.entries.items()}
        missing = set(gm.state_dict()) - set(full) - _aliases(gm)
        if missing:
            raise LoadError(f"{checkpoint} lacks {sorted(missing)[:5]} of {type(gm).__name__}'s weights: "
                            "not a checkpoint of this model")
        gm.load_state_dict(relocate_state_dict(gm, full), strict=False)
    return False


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
