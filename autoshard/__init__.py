"""autoshard: automatic tensor parallelism for PyTorch by torch.fx graph rewriting."""
from . import distributed, placements
from .errors import AutoshardError, CaptureError, LoadError, ProcessGroupError, ShardingError
from .placements import Partial, Replicate, Shard
from . import collectives, nn
from .state_dict import (collect_state_dict, get_parallel_dim, layouts, register_ddp_parameters_to_ignore,
                         register_parallel_attribute, register_parallel_dim, relocate_state_dict, slice)

from .state_dict import ORDER_TYPE as _ORDER_TYPE, PARALLEL_DIM as _PARALLEL_DIM  # TorchShard's names

__version__ = "0.1.0"
from .api import from_pretrained, parallelize, plan
from .blocks import blocks_of
from .rng import manual_seed
from .cost import CostModel
from .plan import Plan


def __getattr__(name):
    # autoshard.checkpoint imports torch.distributed.checkpoint (over a second): only when used
    if name == "checkpoint":
        import importlib
        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
