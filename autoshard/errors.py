"""Errors autoshard raises: each names the node, module or tensor and the sizes involved."""


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class ShardingError(AutoshardError, ValueError):
    """A requested split cannot be done (does not divide, unknown dim, unknown name)."""


class CaptureError(AutoshardError, RuntimeError):
    """The model could not be captured by any tracer; the message says which failed and why."""


class ProcessGroupError(AutoshardError, RuntimeError):
    """No process group, or one whose size does not match the requested degree."""


class LoadError(AutoshardError, ValueError):
    """A checkpoint does not match the model (missing, unexpected, wrongly shaped keys), or a
    meta tensor has no way to be initialised; raised before any shard is allocated."""
