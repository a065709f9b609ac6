"""The part of a precision recipe that autocast holds: read it, and run under exactly it.

A captured graph bakes the caller's autocast into its casts (torch.export), so a plan records the
state it was captured under and the rewrite runs under it; the experts op's backward recomputes
under the state its forward ran in."""
from __future__ import annotations

import contextlib

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """((device, dtype), ...) of each device where torch.autocast is on: the part of a precision
    recipe a graph is captured under (torch.export bakes its casts and dtypes into the graph)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: tuple):
    """Run under exactly the autocast of `state` (autocast_state()), whatever the caller's."""
    on = dict(state)
    with contextlib.ExitStack() as stack:
        for d in AUTOCAST_DEVICES:
            if d in on or torch.is_autocast_enabled(d):
                stack.enter_context(torch.autocast(d, dtype=on.get(d), enabled=d in on))
        yield
