"""`autoshard.checkpoint`: sharded checkpoints through PyTorch's distributed checkpoint (DCP).

The public path of `autoshard.io.checkpoint` (its docstring says what each part does), imported
on first use: torch.distributed.checkpoint takes over a second to import.
"""
from .io.checkpoint import (CheckpointError, FileSystemReader, FileSystemWriter, LoadPlanner, check_checkpoint,
                            dcp_to_torch_save, get_state_dict, load, save, set_state_dict, torch_save_to_dcp, verify)

__all__ = ["CheckpointError", "get_state_dict", "set_state_dict", "save", "load", "LoadPlanner",
           "check_checkpoint", "FileSystemReader", "FileSystemWriter", "verify", "dcp_to_torch_save",
           "torch_save_to_dcp"]
