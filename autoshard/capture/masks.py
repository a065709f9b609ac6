"""Hugging Face attention masks captured as the eager model builds them.

Called without `attention_mask` and `position_ids`, a transformers model on `sdpa` builds no mask
in eager mode: it calls `scaled_dot_product_attention(..., is_causal=True)` (no mask at all for
bidirectional attention), which runs the fused kernel and saves only the log-sum-exp. Traced, the
same call materialises the whole B x 1 x T x T mask instead (transformers cannot read a traced
padding mask, so it never skips), and sdpa converts it to a float copy per layer, saved for
backward: the captured step held 59 MiB where the model's own held 26 (LLaMA, 2048 tokens). While
the example call passes none of MASK_INPUTS, `eager_masks` makes the tracer take eager's branch:
what transformers decides when nothing is padded, no window or chunk applies and the query and key
lengths are one size, the same decision eager takes for every such call. A call that passes one
is traced as before (its mask depends on the data).
"""
from __future__ import annotations

import contextlib
import sys

import torch

MASK_INPUTS = ("attention_mask", "position_ids", "past_key_values", "cache_position")


def _causal_skip(original):
    def skip(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if (padding_mask is None and local_attention_size is None and q_length is kv_length
                and not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0):
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)
    return skip


def _bidirectional_skip(original):
    def skip(padding_mask, kv_length, local_attention_size=None):
        if padding_mask is None and local_attention_size is None:
            return True
        return original(padding_mask, kv_length, local_attention_size)
    return skip


def _own_positions(original):
    return lambda position_ids: None        # the model's own positions (none passed): one sequence a row


_PATCHES = {"_ignore_causal_mask_sdpa": _causal_skip, "_ignore_bidirectional_mask_sdpa": _bidirectional_skip,
            "find_packed_sequence_indices": _own_positions}


@contextlib.contextmanager
def eager_masks(passed: set):
    """While capturing a call that passes none of MASK_INPUTS (`passed`: the names it passes),
    transformers' mask builders skip the mask as in eager mode; otherwise nothing changes."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or passed & set(MASK_INPUTS) or not all(hasattr(masking, n) for n in _PATCHES):
        yield
        return
    saved = {n: getattr(masking, n) for n in _PATCHES}
    for name, wrap in _PATCHES.items():
        setattr(masking, name, wrap(saved[name]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(masking, name, fn)
