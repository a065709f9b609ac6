"""autoshard: automatic tensor parallelism for PyTorch by torch.fx graph rewriting.

The folders are the pipeline (capture -> planner -> rewrite, on top of runtime; io and views
beside them); what users call and import is here: `plan`, `parallelize`, `from_pretrained`, the
Plan and CostModel, placements, errors, and TorchShard's names (`import autoshard as ts`).
"""
from . import amp, distributed, nn
from .errors import (AutoshardError, CaptureError, InputMismatchError, LoadError, MemoryBudgetError, ProcessGroupError,
                     ShardingError)
from .runtime import collectives, placements
from .runtime.placements import Partial, Replicate, Shard
from .runtime.rng import manual_seed
from .runtime.state_dict import (collect_state_dict, get_parallel_dim, layouts, register_ddp_parameters_to_ignore,
                                 register_parallel_attribute, register_parallel_dim, relocate_state_dict, slice)
from .runtime.state_dict import ORDER_TYPE as _ORDER_TYPE, PARALLEL_DIM as _PARALLEL_DIM  # TorchShard's names
from .api import from_pretrained, parallelize, plan
from .plan import Plan
from .planner.cost import CostModel
from .rewrite.blocks import blocks_of
from .pipe import pipeline, plan_pipeline
from .advise import Cluster, Estimate, Layout, advise, estimate

__version__ = "0.1.0"


def __getattr__(name):
    # autoshard.checkpoint imports torch.distributed.checkpoint (over a second): only when used
    if name == "checkpoint":
        import importlib
        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
