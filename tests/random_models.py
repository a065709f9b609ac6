"""Seeded random models for the property test (tests/test_random_models.py).

`make_model(seed) -> RandomModel(model, example, others, description, tracer, world)`: a plain,
`torch.fx.symbolic_trace`-able nn.Module built from randomly chosen blocks with random sizes (some
divide 2, 3 and 4, some do not), its example inputs, two input sets at other shapes (other batch
and sequence lengths; a Linear DAG also gets another number of leading dims) and a readable
description. Everything is a function of `seed` (Python's and torch's generators are seeded
here), so every rank builds the same model and the same inputs.

Two families:
- a Linear DAG on features `(..., d)`: Linear chains with and without bias and activations,
  residual MLPs, gated MLPs, LayerNorm / RMSNorm (torch's and hand-written), concat of two
  branches, chunk/GLU, weights used through `.T` and matmul, replicated scales broadcast against
  the features, reductions over the feature dim, a merge of two earlier branches; logits returned
  or a loss inside (cross entropy on labels, with ignore_index / label smoothing).
- a language model: token embeddings (factorised or not), learned positions or none, attention
  blocks with fused, separate or grouped q/k/v, SDPA or explicit softmax, ALiBi-like biases,
  q/k norms before or after the heads split, view sizes from `x.shape` arithmetic; MLP or gated
  MLP; final norm; a head untied, tied, or through `wte.weight.T`; the loss inside or logits.

`python tests/random_models.py SEED [SEED ...]` prints the description and the module.
"""
from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# sizes: some divide 2, 3 and 4 (12, 24, 36, 48), some only some of them, some none (7, 9, 11, 13)
SIZES = [6, 8, 9, 10, 12, 14, 16, 18, 20, 24, 30, 36, 45, 48, 60, 90, 7, 11, 13]
MAX_T = 16


@dataclass
class RandomModel:
    model: nn.Module
    example: tuple | dict
    others: list            # two more input sets at other shapes
    description: str
    tracer: str             # "auto" (most seeds) or "export"
    world: int              # the degree the property test uses for this seed


def world_of(seed: int) -> int:
    return 2 + seed % 3


# ----------------------------------------------------------------------------- shared pieces

class ManualRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, written out (a reduction over the feature dim)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind, d):
    if kind == "ln":
        m = nn.LayerNorm(d)
    elif kind == "rms":
        m = nn.RMSNorm(d, eps=1e-6)
    else:
        return ManualRMSNorm(d)
    with torch.no_grad():           # not the all-ones default, so a wrong slice of it shows
        m.weight.add_(0.1 * torch.randn(d))
    return m


_ACTS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "none": lambda x: x}


# ----------------------------------------------------------------------------- Linear DAG family

class LinearAct(nn.Module):
    def __init__(self, d_in, d_out, bias, act):
        super().__init__()
        self.fc, self.act = nn.Linear(d_in, d_out, bias=bias), act

    def forward(self, x):
        return _ACTS[self.act](self.fc(x))


class ResidualMLP(nn.Module):
    def __init__(self, d, hidden, norm, bias, act):
        super().__init__()
        self.norm = _norm(norm, d) if norm else None
        self.fc1, self.fc2, self.act = nn.Linear(d, hidden, bias=bias), nn.Linear(hidden, d, bias=bias), act

    def forward(self, x):
        y = self.norm(x) if self.norm is not None else x
        return x + self.fc2(_ACTS[self.act](self.fc1(y)))


class GatedMLP(nn.Module):
    def __init__(self, d, hidden, norm, bias):
        super().__init__()
        self.norm = _norm(norm, d) if norm else None
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=bias)
        self.down = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        y = self.norm(x) if self.norm is not None else x
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Concat(nn.Module):
    """cat of two column-parallel-able branches along the features, then a Linear (row-parallel-able)."""

    def __init__(self, d, a, b, d_out, bias):
        super().__init__()
        self.left, self.right = nn.Linear(d, a, bias=bias), nn.Linear(d, b, bias=bias)
        self.proj = nn.Linear(a + b, d_out, bias=bias)

    def forward(self, x):
        return self.proj(torch.cat([F.gelu(self.left(x)), self.right(x)], dim=-1))


class ChunkGLU(nn.Module):
    """Linear to 2h, chunk in two, a * sigmoid(b) (or a + b), Linear back."""

    def __init__(self, d, hidden, d_out, bias, mode):
        super().__init__()
        self.fc, self.out, self.mode = nn.Linear(d, 2 * hidden, bias=bias), nn.Linear(hidden, d_out, bias=bias), mode

    def forward(self, x):
        a, b = self.fc(x).chunk(2, dim=-1)
        return self.out(a * torch.sigmoid(b) if self.mode == "glu" else a + b)


class TransposeMatmul(nn.Module):
    """A Linear's weight used through `.T` and matmul (plus its bias), then a relu."""

    def __init__(self, d, d_out, bias, how):
        super().__init__()
        self.lin, self.how = nn.Linear(d, d_out, bias=bias), how

    def forward(self, x):
        if self.how == "T":
            y = x @ self.lin.weight.T
        elif self.how == "t":
            y = torch.matmul(x, self.lin.weight.t())
        else:
            y = x @ self.lin.weight.transpose(0, 1)
        if self.lin.bias is not None:
            y = y + self.lin.bias
        return F.relu(y)


class RawWeight(nn.Module):
    """A bare Parameter (d_out, d) used as `x @ w.T` between two Linears."""

    def __init__(self, d, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d) / math.sqrt(d))

    def forward(self, x):
        return torch.tanh(x @ self.w.T)


class ScaleShift(nn.Module):
    """A replicated per-feature scale (and shift) broadcast against the features."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.shift = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x):
        return x * self.scale + self.shift


class Center(nn.Module):
    """x - mean(x) over the features (a reduction over the feature dim) and a sum feature."""

    def forward(self, x):
        return x - x.mean(dim=-1, keepdim=True) + 0.01 * x.sum(-1, keepdim=True)


class DAG(nn.Module):
    """Runs `blocks` in order; block i reads node `srcs[i]` (0 is the input) and `merges` add two
    earlier nodes of equal width. Logits returned, or a cross-entropy loss on `labels`."""

    def __init__(self, blocks, srcs, merges, head, loss):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.srcs, self.merges = srcs, merges
        self.head = head
        self.loss = loss          # None, or (ignore_index, label_smoothing, module?)
        if loss is not None and loss[2]:
            self.crit = nn.CrossEntropyLoss(ignore_index=loss[0], label_smoothing=loss[1])

    def forward(self, x, labels=None):
        nodes = [x]
        for blk, src, merge in zip(self.blocks, self.srcs, self.merges):
            y = blk(nodes[src])
            if merge is not None:
                y = y + nodes[merge]
            nodes.append(y)
        logits = self.head(nodes[-1])
        if labels is None:
            return logits
        flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if self.loss[2]:
            return self.crit(flat, target)
        return F.cross_entropy(flat, target, ignore_index=self.loss[0], label_smoothing=self.loss[1])


def _dag(rng: random.Random):
    d0 = rng.choice(SIZES)
    widths, blocks, srcs, merges, desc = [d0], [], [], [], []
    for _ in range(rng.randint(1, 4)):
        src = len(widths) - 1 if rng.random() < 0.8 else rng.randrange(len(widths))
        d = widths[src]
        bias = rng.random() < 0.6
        kind = rng.choice(["linear", "linear", "mlp", "gated", "concat", "chunk", "transpose", "raw",
                           "scale", "center", "norm"])
        norm = rng.choice([None, "ln", "rms", "manual_rms"])
        out = d
        if kind == "linear":
            out, act = rng.choice(SIZES), rng.choice(list(_ACTS))
            blk, text = LinearAct(d, out, bias, act), f"Linear({d}, {out}, bias={bias}) -> {act}"
        elif kind == "mlp":
            h, act = rng.choice(SIZES), rng.choice(["relu", "gelu", "silu"])
            blk, text = ResidualMLP(d, h, norm, bias, act), f"x + MLP({d} -> {h} -> {d}, {act}, norm={norm}, bias={bias})"
        elif kind == "gated":
            h = rng.choice(SIZES)
            blk, text = GatedMLP(d, h, norm, bias), f"x + GatedMLP({d} -> {h} -> {d}, norm={norm}, bias={bias})"
        elif kind == "concat":
            a, b, out = rng.choice(SIZES), rng.choice(SIZES), rng.choice(SIZES)
            blk, text = Concat(d, a, b, out, bias), f"cat[Linear({d},{a}), Linear({d},{b})] -> Linear({a + b}, {out}), bias={bias}"
        elif kind == "chunk":
            h, out, mode = rng.choice(SIZES), rng.choice(SIZES), rng.choice(["glu", "add"])
            blk, text = ChunkGLU(d, h, out, bias, mode), f"Linear({d}, 2*{h}).chunk(2) {mode} -> Linear({h}, {out}), bias={bias}"
        elif kind == "transpose":
            out, how = rng.choice(SIZES), rng.choice(["T", "t", "transpose"])
            blk, text = TransposeMatmul(d, out, bias, how), f"x @ Linear({d}, {out}).weight.{how} (+bias={bias}) -> relu"
        elif kind == "raw":
            out = rng.choice(SIZES)
            blk, text = RawWeight(d, out), f"tanh(x @ Parameter({out}, {d}).T)"
        elif kind == "scale":
            blk, text = ScaleShift(d), f"x * scale({d}) + shift({d})"
        elif kind == "center":
            blk, text = Center(), "x - x.mean(-1) + 0.01 x.sum(-1)"
        else:
            norm = norm or "ln"
            blk, text = _norm(norm, d), f"{norm}({d})"
        same = [i for i, w in enumerate(widths) if w == out and i != src]
        merge = rng.choice(same) if same and rng.random() < 0.3 else None
        if merge is not None:
            text += f" + node{merge}"
        blocks.append(blk), srcs.append(src), merges.append(merge), widths.append(out)
        desc.append(f"node{len(widths) - 1} = {text} (node{src})")
    classes, hbias = rng.choice(SIZES), rng.random() < 0.5
    head = nn.Linear(widths[-1], classes, bias=hbias)
    desc.append(f"head = Linear({widths[-1]}, {classes}, bias={hbias})")
    loss = None
    if rng.random() < 0.35:
        loss = (rng.choice([-100, 0]), rng.choice([0.0, 0.1]), rng.random() < 0.3)
        desc.append(f"cross_entropy(ignore_index={loss[0]}, label_smoothing={loss[1]}, module={loss[2]})")
    else:
        desc.append("returns logits")
    model = DAG(blocks, srcs, merges, head, loss)

    def inputs(lead, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*lead, d0, generator=g)
        if loss is None:
            return (x,)
        labels = torch.randint(classes, lead, generator=g)
        labels[torch.rand(lead, generator=g) < 0.2] = loss[0]
        return (x, labels)

    b, t = rng.randint(2, 3), rng.randint(3, 7)
    example = inputs((b, t), 1)
    others = [inputs((b + 1, t + 2), 2),
              inputs(rng.choice([(5,), (2, 2, t), (b, 1)]), 3)]
    return model, example, others, "Linear DAG on features (..., %d):\n  " % d0 + "\n  ".join(desc)


# ----------------------------------------------------------------------------- language model family

class Attention(nn.Module):
    def __init__(self, h, heads, kv_heads, qkv, core, shape_style, qk_norm, alibi, bias):
        super().__init__()
        self.h, self.heads, self.kv_heads, self.hd = h, heads, kv_heads, h // heads
        self.qkv_kind, self.core, self.shape_style, self.qk_norm = qkv, core, shape_style, qk_norm
        kvd = kv_heads * self.hd
        if qkv == "fused":
            self.qkv = nn.Linear(h, h + 2 * kvd, bias=bias)
        else:
            self.q = nn.Linear(h, h, bias=bias)
            self.k, self.v = nn.Linear(h, kvd, bias=bias), nn.Linear(h, kvd, bias=bias)
        if qk_norm == "full":                      # over the whole projection, before the heads split
            self.q_norm, self.k_norm = _norm("rms", h), _norm("rms", kvd)
        elif qk_norm == "head":                    # over head_dim, after the split
            self.q_norm, self.k_norm = _norm("rms", self.hd), _norm("rms", self.hd)
        self.o = nn.Linear(h, h, bias=bias)
        self.alibi = alibi
        if alibi:
            self.register_buffer("slopes", torch.tensor([2.0 ** (-(i + 1)) for i in range(heads)]))

    def _heads(self, t, n, B, T):
        if self.shape_style == "size":
            return t.view(B, T, n, self.hd).transpose(1, 2)
        if self.shape_style == "arith":            # sizes computed from the tensor's own shape
            return t.view(t.shape[0], t.shape[1], n, t.shape[-1] // n).transpose(1, 2)
        return t.reshape(B, T, n, -1).permute(0, 2, 1, 3)

    def forward(self, x):
        B, T, C = x.shape
        if self.qkv_kind == "fused":
            kvd = self.kv_heads * self.hd
            if self.kv_heads == self.heads and self.shape_style != "size":
                q, k, v = self.qkv(x).chunk(3, dim=-1)
            else:
                q, k, v = self.qkv(x).split([C, kvd, kvd], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q, self.heads, B, T), self._heads(k, self.kv_heads, B, T), self._heads(v, self.kv_heads, B, T)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kv_heads != self.heads:
            r = self.heads // self.kv_heads
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        pos = torch.arange(T, device=x.device)
        causal = pos[None, :] <= pos[:, None]
        if self.alibi:                             # a (1, heads, T, T) bias against head-sharded scores
            bias = self.slopes.view(1, -1, 1, 1) * (pos[None, :] - pos[:, None]).to(q.dtype)
        if self.core == "sdpa":
            if self.alibi:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")))
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
            if self.alibi:
                att = att + bias
            y = att.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, h, hidden, gated, bias):
        super().__init__()
        self.gated = gated
        self.fc1 = nn.Linear(h, hidden, bias=bias)
        self.gate = nn.Linear(h, hidden, bias=False) if gated else None
        self.fc2 = nn.Linear(hidden, h, bias=bias)

    def forward(self, x):
        if self.gate is not None:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, h, norm, attn, mlp):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = _norm(norm, h), attn, _norm(norm, h), mlp

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    def __init__(self, vocab, h, emb_dim, pos, blocks, norm, head, loss):
        super().__init__()
        self.wte = nn.Embedding(vocab, emb_dim)
        self.emb_proj = nn.Linear(emb_dim, h, bias=False) if emb_dim != h else None
        self.wpe = nn.Embedding(MAX_T, h) if pos else None
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = _norm(norm, h)
        self.head_kind, self.loss = head, loss
        if head == "linear":
            self.head = nn.Linear(h, vocab, bias=False)
        elif head == "tied":
            self.head = nn.Linear(emb_dim, vocab, bias=False)
            self.head.weight = self.wte.weight
        if emb_dim != h and head != "linear":
            self.head_proj = nn.Linear(h, emb_dim, bias=False)
        if loss is not None and loss[2]:
            self.crit = nn.CrossEntropyLoss(ignore_index=loss[0], label_smoothing=loss[1])

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        if self.emb_proj is not None:
            x = self.emb_proj(x)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        if self.head_kind != "linear" and self.emb_proj is not None:
            x = self.head_proj(x)
        if self.head_kind == "wT":
            logits = x @ self.wte.weight.T
        else:
            logits = self.head(x)
        if targets is None:
            return logits
        flat, target = logits.view(-1, logits.size(-1)), targets.view(-1)
        if self.loss[2]:
            return self.crit(flat, target)
        return F.cross_entropy(flat, target, ignore_index=self.loss[0], label_smoothing=self.loss[1])


def _lm(rng: random.Random):
    vocab = rng.choice([40, 48, 60, 64, 67, 96, 120])
    heads = rng.choice([2, 3, 4, 6])
    hd = rng.choice([4, 6, 8])
    h = heads * hd
    factor = rng.random() < 0.2
    emb_dim = rng.choice([d for d in (6, 8, 10, 12, 16) if d < h]) if factor and h > 6 else h
    pos = rng.random() < 0.6
    norm = rng.choice(["ln", "rms", "manual_rms"])
    bias = rng.random() < 0.5
    desc = [f"vocab={vocab} hidden={h} heads={heads}x{hd} bias={bias} norm={norm}",
            f"embedding {vocab}x{emb_dim}" + (f" -> Linear({emb_dim}, {h})" if factor else "") +
            (" + learned positions" if pos else "")]
    blocks = []
    for i in range(rng.randint(1, 2)):
        kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0]) if rng.random() < 0.3 else heads
        qkv = rng.choice(["fused", "separate"])
        core = rng.choice(["sdpa", "softmax"])
        style = rng.choice(["size", "size", "arith", "minus1"])
        qk_norm = rng.choice([None, None, "full", "head"])
        alibi = rng.random() < 0.2
        hidden = rng.choice(SIZES + [4 * h])
        gated = rng.random() < 0.4
        attn = Attention(h, heads, kv, qkv, core, style, qk_norm, alibi, bias)
        blocks.append(Block(h, norm, attn, MLP(h, hidden, gated, bias)))
        desc.append(f"block{i}: attn(q/k/v {qkv}, kv_heads={kv}, {core}, view={style}, qk_norm={qk_norm}, "
                    f"alibi={alibi}) + {'gated ' if gated else ''}MLP({h} -> {hidden})")
    head = rng.choice(["linear", "linear", "tied", "wT"])
    loss = None
    if rng.random() < 0.6:
        loss = (rng.choice([-100, 0]), rng.choice([0.0, 0.1]), rng.random() < 0.3)
    desc.append(f"head={head}" + (f" (Linear({h}, {emb_dim}) first)" if factor and head != "linear" else ""))
    desc.append(f"cross_entropy(ignore_index={loss[0]}, label_smoothing={loss[1]}, module={loss[2]})"
                if loss else "returns logits")
    model = LM(vocab, h, emb_dim, pos, blocks, norm, head, loss)

    def inputs(b, t, seed):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(vocab, (b, t), generator=g)
        if loss is None:
            return (idx,)
        tgt = torch.randint(vocab, (b, t), generator=g)
        tgt[torch.rand(b, t, generator=g) < 0.2] = loss[0]
        return (idx, tgt)

    b, t = rng.randint(2, 3), rng.randint(4, 8)
    example = inputs(b, t, 1)
    others = [inputs(b + 1, t + rng.randint(1, 8), 2), inputs(1, rng.randint(2, t - 1), 3)]
    return model, example, others, "LM: " + "\n  ".join(desc)


# ----------------------------------------------------------------------------- entry points

def make_model(seed: int) -> RandomModel:
    """The model of `seed` (in eval mode, fp32), its example and other inputs, a description."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    family = "lm" if rng.random() < 0.5 else "dag"
    model, example, others, text = (_lm if family == "lm" else _dag)(rng)
    model.eval()
    tracer = "export" if rng.random() < 0.15 else "auto"
    world = world_of(seed)
    shapes = lambda args: ", ".join(str(tuple(a.shape)) for a in args)   # noqa: E731
    text = (f"seed {seed} (world {world}, tracer={tracer}): {text}\n  inputs: {shapes(example)}; other: "
            + "; ".join(shapes(o) for o in others))
    return RandomModel(model, example, others, text, tracer, world)


if __name__ == "__main__":
    for s in sys.argv[1:] or ["0"]:
        rm = make_model(int(s))
        print(rm.description)
        print(rm.model)
        out = rm.model(*rm.example)
        print("output:", tuple(out.shape), float(out.detach().float().sum()))
