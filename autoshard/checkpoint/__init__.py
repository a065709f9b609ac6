"""Sharded checkpoints through PyTorch's distributed checkpoint (DCP), resharded on load.

state.py: `get_state_dict` / `set_state_dict` (the model's and optimizer's state under the
original keys, each sharded tensor carrying its global shape and this rank's boxes).
storage.py: `save` / `load` (atomic save, checked load), `LoadPlanner`, and the converters to and
from one `torch.save` file.
reader.py: `FileSystemReader`, DCP's reader that reads only the requested rows of each saved
tensor (no rank holds a full tensor while loading a checkpoint written unsharded).
"""
from ..errors import CheckpointError
from .reader import FileSystemReader
from .state import get_state_dict, set_state_dict
from .storage import LoadPlanner, check_checkpoint, dcp_to_torch_save, load, save, torch_save_to_dcp

__all__ = ["CheckpointError", "get_state_dict", "set_state_dict", "save", "load", "LoadPlanner",
           "check_checkpoint", "FileSystemReader", "dcp_to_torch_save", "torch_save_to_dcp"]
