"""autoshard: automatic tensor parallelism for PyTorch by torch.fx graph rewriting."""
from . import distributed, placements
from .errors import AutoshardError, CaptureError, ProcessGroupError, ShardingError
from .placements import Partial, Replicate, Shard

__version__ = "0.1.0"
