"""Reference models shared by the benchmarks (and usable by tests).

Both models are plain ``nn.Module``s that ``torch.fx.symbolic_trace`` and
``torch.export.export`` capture as they are, built deterministically from a seed (the
global RNG is left untouched), so every rank of a benchmark can build the same full model
and take its own shards of it.

- ``MLPStack(blocks=8, hidden=256, expansion=4)``: pre-norm residual MLP blocks,
  ``x + fc2(gelu(fc1(LayerNorm(x))))``, and a final LayerNorm. Megatron's plan: every
  ``blocks.{i}.fc1`` column-parallel, every ``blocks.{i}.fc2`` row-parallel.
- ``TinyGPT(vocab, hidden, heads, blocks, seq)``: a GPT-2-style causal LM with separate
  q/k/v Linears, ``F.scaled_dot_product_attention(is_causal=True)``, learned positions and
  an ``lm_head`` Linear that shares its Parameter with ``wte`` (so ``state_dict()`` has both
  ``wte.weight`` and ``lm_head.weight``); ``forward(idx, targets)`` returns the
  cross-entropy loss, ``forward(idx)`` the logits.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLPBlock", "MLPStack", "CausalSelfAttention", "GPTBlock", "TinyGPT",
           "mlp_megatron_plan", "gpt_megatron_plan"]


@contextlib.contextmanager
def _seeded(seed: int):
    """Seed the default CPU generator inside the ``with``; restore its state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, hidden: int, expansion: int = 4):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, expansion * hidden)
        self.fc2 = nn.Linear(expansion * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MLPStack(nn.Module):
    """``blocks`` residual MLP blocks and a final LayerNorm; input and output ``[..., hidden]``."""

    def __init__(self, blocks: int = 8, hidden: int = 256, expansion: int = 4, *, seed: int = 0):
        super().__init__()
        if blocks < 1 or hidden < 1 or expansion < 1:
            raise ValueError(f"MLPStack needs positive sizes, got blocks={blocks}, "
                             f"hidden={hidden}, expansion={expansion}")
        self.hidden, self.expansion = hidden, expansion
        with _seeded(seed):
            self.blocks = nn.ModuleList(MLPBlock(hidden, expansion) for _ in range(blocks))
            self.ln_f = nn.LayerNorm(hidden)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def mlp_megatron_plan(model: MLPStack) -> dict[str, int]:
    """Megatron's plan for ``MLPStack`` in TorchShard's dims (-1 column, 0 row)."""
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"] = -1
        plan[f"blocks.{i}.fc2"] = 0
    return plan


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections.

    ``self.heads`` is read at run time: a hand-made or DTensor plan that splits the heads
    sets it to the local head count (as PyTorch's own tensor-parallel tests do).
    """

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads, self.head_dim = heads, hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t = x.size(0), x.size(1)
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, expansion: int = 4):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, expansion * hidden)
        self.fc2 = nn.Linear(expansion * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A small GPT-2-style LM: ``forward(idx[B, T], targets[B, T] | None)``.

    With ``targets`` it returns the mean cross-entropy loss (``ignore_index=-100``), without
    it the logits ``[B, T, vocab]``. ``lm_head.weight`` *is* ``wte.weight`` (tied). To trace
    the logits-only graph use ``symbolic_trace(m, concrete_args={"targets": None})``.
    """

    def __init__(self, vocab: int = 512, hidden: int = 128, heads: int = 4, blocks: int = 4,
                 seq: int = 64, *, expansion: int = 4, seed: int = 0):
        super().__init__()
        if min(vocab, hidden, heads, blocks, seq, expansion) < 1:
            raise ValueError("TinyGPT needs positive sizes")
        self.vocab, self.hidden, self.seq = vocab, hidden, seq
        with _seeded(seed):
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(GPTBlock(hidden, heads, expansion) for _ in range(blocks))
            self.ln_f = nn.LayerNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.wte.weight                      # tied
            self._init_weights(blocks)

    @torch.no_grad()
    def _init_weights(self, blocks: int) -> None:
        for name, p in self.named_parameters():                       # GPT-2's init
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * blocks) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                p.normal_(0.0, std)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


def gpt_megatron_plan(model: TinyGPT) -> dict[str, int]:
    """Megatron's plan for ``TinyGPT`` in TorchShard's dims (tied wte/lm_head vocab-split)."""
    plan = {"wte": 0, "lm_head": -1}
    for i in range(len(model.blocks)):
        for n in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{n}"] = -1
        plan[f"blocks.{i}.attn.proj"] = 0
        plan[f"blocks.{i}.fc1"] = -1
        plan[f"blocks.{i}.fc2"] = 0
    return plan
