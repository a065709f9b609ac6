"""Sharded checkpoints through PyTorch's distributed checkpoint (DCP), resharded on load.

state.py: `get_state_dict` / `set_state_dict` (the model's and optimizer's state under the
original keys, each sharded tensor carrying its global shape and this rank's boxes; layout.py
wraps a local tensor as the DTensor or ShardedTensor DCP saves).
storage.py: `save` / `load` (atomic save, checked load), `LoadPlanner`, and the converters to and
from one `torch.save` file.
reader.py: `FileSystemReader`, DCP's reader that reads only the requested rows of each saved
tensor (no rank holds a full tensor while loading a checkpoint written unsharded), checking every
block it reads against `.checksums`.
writer.py: `FileSystemWriter`, DCP's writer that also writes `.checksums` (checksums.py: the
CRC-32 of every block of every saved item).
verify.py: `verify`, a whole checkpoint checked (`python -m autoshard verify CKPT_DIR`).
safe.py: what a checkpoint from elsewhere may make autoshard build: `.metadata` through an
allowlist of DCP's metadata classes, non-tensor items weights-only (load, verify, both
converters); `trust_checkpoint=True` reads as PyTorch does.
"""
from ...errors import CheckpointError
from .reader import FileSystemReader
from .state import get_state_dict, set_state_dict
from .storage import LoadPlanner, check_checkpoint, dcp_to_torch_save, load, save, torch_save_to_dcp
from .verify import verify
from .writer import FileSystemWriter

__all__ = ["CheckpointError", "get_state_dict", "set_state_dict", "save", "load", "LoadPlanner",
           "check_checkpoint", "FileSystemReader", "FileSystemWriter", "verify", "dcp_to_torch_save",
           "torch_save_to_dcp"]
