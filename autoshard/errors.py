"""Errors autoshard raises: each names the node, module or tensor and the sizes involved."""


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (at most `limit` characters), '' if it has none:
    what an error of ours quotes of the error it reports."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else ""


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class ShardingError(AutoshardError, ValueError):
    """A requested split cannot be done (does not divide, unknown dim, unknown name)."""


class MemoryBudgetError(ShardingError):
    """No plan at this degree fits `memory_budget`: the message gives the smallest peak per rank
    reachable (with every trade the search has: splits, recomputed blocks) and what holds it."""


class CaptureError(AutoshardError, RuntimeError):
    """The model could not be captured by any tracer; the message says which failed and why."""


class ProcessGroupError(AutoshardError, RuntimeError):
    """No process group, or one whose size does not match the requested degree."""


class LoadError(AutoshardError, ValueError):
    """A checkpoint does not match the model (missing, unexpected, wrongly shaped keys), or a
    meta tensor has no way to be initialised; raised before any shard is allocated."""


class CheckpointError(AutoshardError, ValueError):
    """A checkpoint that does not fit the model, or that cannot be read or written."""


class InputMismatchError(ProcessGroupError):
    """The ranks of a tensor-parallel group were given different inputs (a batch split over every
    rank, not by data-parallel rank), or the module is wrapped so that different shards would be
    averaged; the message names the inputs or the wrapper, the ranks, and the fix."""
