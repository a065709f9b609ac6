"""Small models the tests share: written so torch.fx.symbolic_trace captures them."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Pre-norm residual MLP block (optionally SwiGLU)."""

    def __init__(self, h=64, expansion=4, swiglu=False, dropout=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, expansion * h)
        self.gate = nn.Linear(h, expansion * h, bias=False) if swiglu else None
        self.fc2 = nn.Linear(expansion * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        y = self.ln(x)
        if self.gate is not None:
            y = F.silu(self.gate(y)) * self.fc1(y)
        else:
            y = F.gelu(self.fc1(y))
        return x + self.drop(self.fc2(y))


class Attention(nn.Module):
    """Causal self-attention with separate or fused q/k/v projections."""

    def __init__(self, h=64, heads=4, fused=False, dropout=0.0):
        super().__init__()
        self.heads, self.fused = heads, fused
        if fused:
            self.qkv = nn.Linear(h, 3 * h)
        else:
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.o = nn.Linear(h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        if self.fused:
            q, k, v = self.qkv(x).split(C, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.o(y))


class Block(nn.Module):
    def __init__(self, h=64, heads=4, fused=False, swiglu=False, dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(h)
        self.attn = Attention(h, heads, fused, dropout)
        self.mlp = MLP(h, 4, swiglu, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return self.mlp(x)


class GPT(nn.Module):
    """GPT-style LM: token + position embeddings, blocks, final norm, head tied to wte or not;
    returns the loss when targets are given, else the logits."""

    def __init__(self, vocab=128, h=64, heads=4, blocks=2, seq=32, tied=True, fused=False, swiglu=False,
                 dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(h, heads, fused, swiglu, dropout) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        B, T = idx.size()
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MLPStack(nn.Module):
    """`blocks` residual MLP blocks and a final norm (the benchmark model)."""

    def __init__(self, blocks=2, h=64, expansion=4):
        super().__init__()
        self.blocks = nn.ModuleList([MLP(h, expansion) for _ in range(blocks)])
        self.ln = nn.LayerNorm(h)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.ln(x)


class ScaledMLP(nn.Module):
    """`x + gamma * fc2(gelu(fc1(norm(x))))`: a residual MLP whose output a learned per-channel
    scale multiplies (layer scale: ConvNeXt, CaiT, DINOv2)."""

    def __init__(self, h=32):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.gamma = nn.Parameter(torch.full((h,), 0.1))

    def forward(self, x):
        return x + self.gamma * self.fc2(F.gelu(self.fc1(self.norm(x))))


class ScaledBlock(nn.Module):
    """Pre-norm attention and MLP, each output dropped out, scaled by a learned per-channel parameter
    and dropped out again before its residual add (BEiT's and CaiT's layer scales)."""

    def __init__(self, h=64, heads=4, dropout=0.1):
        super().__init__()
        self.n1, self.attn = nn.LayerNorm(h), Attention(h, heads, dropout=dropout)
        self.n2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.l1, self.l2 = nn.Parameter(torch.full((h,), 0.1)), nn.Parameter(torch.full((h,), 0.1))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.l1 * self.attn(self.n1(x)))
        return x + self.drop(self.l2 * self.drop(self.fc2(F.gelu(self.fc1(self.n2(x))))))


class ScaledBlocks(nn.Module):
    """An input layer, two `ScaledBlock`s, features pooled over the tokens, a norm and a classifier."""

    def __init__(self, h=64, features=16, classes=10, blocks=2):
        super().__init__()
        self.inp = nn.Linear(features, h)
        self.blocks = nn.ModuleList(ScaledBlock(h) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, classes)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x.mean(1)))


class Stages(nn.Module):
    """Stages of different widths (32, then 64), each a width-changing linear and a layer-scaled
    block, and a classifier: ConvNeXt's shape without the convolutions."""

    def __init__(self, widths=(32, 64), features=16, classes=10):
        super().__init__()
        self.inp = nn.Linear(features, widths[0])
        self.stages = nn.ModuleList(
            nn.Sequential(*([nn.Linear(widths[k - 1], d)] if k else []), ScaledMLP(d)) for k, d in enumerate(widths))
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x):
        x = self.inp(x)
        for s in self.stages:
            x = s(x)
        return self.head(x)


class ChannelsFirstBlock(nn.Module):
    """ConvNeXt's block: a depthwise convolution on channels-first maps, then channels-last a norm, an
    MLP and a layer scale, added back channels-first to the block's input."""

    def __init__(self, c=32):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 4 * c)
        self.fc2 = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.1))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.gamma * self.fc2(F.gelu(self.fc1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ChannelsFirst(nn.Module):
    """A patchifying stem, two ConvNeXt blocks with a downsampling convolution between them, pooled
    features, a norm and a classifier (`CHANNELS_FIRST_PINS`: all but the blocks' MLPs whole, DeepSpeed
    AutoTP's layout)."""

    def __init__(self, widths=(32, 64), classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 4, stride=4)
        self.b0 = ChannelsFirstBlock(widths[0])
        self.down = nn.Conv2d(widths[0], widths[1], 2, stride=2)
        self.b1 = ChannelsFirstBlock(widths[1])
        self.norm = nn.LayerNorm(widths[1])
        self.head = nn.Linear(widths[1], classes)

    def forward(self, x):
        x = self.b1(self.down(self.b0(self.stem(x))))
        return self.head(self.norm(x.mean((-2, -1))))


CHANNELS_FIRST_PINS = {m: None for m in ("stem", "b0", "b0.dw", "b0.norm", "down", "b1", "b1.dw", "b1.norm", "norm", "head")}


class SummedEmbeddings(nn.Module):
    """Token and position embeddings summed (the token's cast to float32 first, as GPT-2's is), two
    layer-scaled blocks and a head (`tied`: the token embedding's weight)."""

    def __init__(self, vocab=96, h=32, positions=64, tied=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, h)
        self.pos = nn.Embedding(positions, h)
        self.blocks = nn.ModuleList(ScaledMLP(h) for _ in range(2))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        x = self.tok(ids).to(torch.float32) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, in float32 (LLaMA's norm)."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        x = x.to(torch.float32)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class NormedEmbedding(nn.Module):
    """An embedding cast to float32 and read first by a norm's statistics, then pre-norm residual
    SwiGLU blocks and an untied head: LLaMA's shape without attention. Split on features and
    gathered before the norm, the embedding's output costs half the vocabulary split's all-reduce."""

    def __init__(self, vocab=128, h=32, blocks=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(norm=RMSNorm(h), gate=nn.Linear(h, 3 * h, bias=False),
                                                       up=nn.Linear(h, 3 * h, bias=False),
                                                       down=nn.Linear(3 * h, h, bias=False))) for _ in range(blocks))
        self.norm = RMSNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids).to(torch.float32)
        for b in self.blocks:
            y = b["norm"](x)
            x = x + b["down"](F.silu(b["gate"](y)) * b["up"](y))
        return self.head(self.norm(x))


class QKNormBlock(nn.Module):
    """Attention whose query and key projections are each normed over their whole width (OLMo-2's q_norm
    and k_norm) before the heads are cut, or with `per_head` over each head after (Qwen3's), then a
    SwiGLU MLP; norms after each branch (`post`, OLMo-2) or before it. Without `qk`, q and k are not
    normed (with `post=False`: LLaMA's block)."""

    def __init__(self, h=64, heads=4, post=True, per_head=False, qk=True):
        super().__init__()
        self.heads, self.post, self.per_head = heads, post, per_head
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = (RMSNorm(h // heads if per_head else h) if qk else nn.Identity() for _ in range(2))
        self.n1, self.n2 = RMSNorm(h), RMSNorm(h)
        self.gate, self.up = nn.Linear(h, 2 * h, bias=False), nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(self, x):
        B, T, H = x.shape
        y = x if self.post else self.n1(x)
        if self.per_head:
            q, k, v = (norm(t.view(B, T, self.heads, -1)).transpose(1, 2)
                       for t, norm in ((self.q(y), self.q_norm), (self.k(y), self.k_norm), (self.v(y), nn.Identity())))
        else:
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                       for t in (self.q_norm(self.q(y)), self.k_norm(self.k(y)), self.v(y)))
        a = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H))
        x = x + (self.n1(a) if self.post else a)
        z = x if self.post else self.n2(x)
        m = self.down(F.silu(self.gate(z)) * self.up(z))
        return x + (self.n2(m) if self.post else m)


class BlockLM(nn.Module):
    """An embedding, `count` blocks made by `block()`, the norm `norm` and an untied head."""

    def __init__(self, vocab, h, block, count, norm):
        super().__init__()
        self.tok = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(block() for _ in range(count))
        self.norm, self.head = norm, nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class QKNormed(BlockLM):
    """An embedding, two `QKNormBlock`s, a norm and an untied head."""

    def __init__(self, vocab=128, h=64, blocks=2, post=True, per_head=False, qk=True, heads=4):
        super().__init__(vocab, h, lambda: QKNormBlock(h, heads, post=post, per_head=per_head, qk=qk), blocks,
                         RMSNorm(h))


class TransposedParallel(nn.Module):
    """Blocks whose attention-like and MLP branches both read one norm's output (parallel residual,
    Falcon's and GPT-J's) through weights applied as `x @ w.T` (Falcon's ALiBi path: the weight
    passes a transpose, so it could be gathered whole where it is read)."""

    def __init__(self, h=64, blocks=2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(h) for _ in range(blocks))
        self.w_in = nn.ParameterList(nn.Parameter(torch.randn(3 * h, h) / h ** 0.5) for _ in range(blocks))
        self.w_out = nn.ParameterList(nn.Parameter(torch.randn(h, 3 * h) / h ** 0.5) for _ in range(blocks))
        self.w_up = nn.ParameterList(nn.Parameter(torch.randn(4 * h, h) / h ** 0.5) for _ in range(blocks))
        self.w_down = nn.ParameterList(nn.Parameter(torch.randn(h, 4 * h) / h ** 0.5) for _ in range(blocks))

    def forward(self, x):
        for k, norm in enumerate(self.norms):
            y = norm(x)
            a = torch.tanh(y @ self.w_in[k].T) @ self.w_out[k].T
            m = F.gelu(y @ self.w_up[k].T) @ self.w_down[k].T
            x = x + a + m
        return x


class TwoNormBlock(nn.Module):
    """Attention and MLP each normalising the same stream, their outputs summed into it (the parallel
    residual of GPT-NeoX, Pythia and Falcon-40B: two norms reading one tensor); with `norms=1` both
    read one norm's output (GPT-J's, Phi's, CodeGen's), with `dropout` each output passes a dropout."""

    def __init__(self, h, heads, norms=2, dropout=None, ffn=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.ln2 = nn.LayerNorm(h) if norms == 2 else None
        self.qkv, self.out = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn * h), nn.Linear(ffn * h, h)
        self.drop = nn.Identity() if dropout is None else nn.Dropout(dropout)

    def forward(self, x):
        b, t, h = x.shape
        y = self.ln1(x)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in self.qkv(y).split(h, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = self.drop(self.out(a.transpose(1, 2).reshape(b, t, h)))
        return x + a + self.drop(self.fc2(F.gelu(self.fc1(y if self.ln2 is None else self.ln2(x)))))


class TwoNormParallel(BlockLM):
    """An embedding, `TwoNormBlock`s, a norm and an untied head."""

    def __init__(self, vocab=128, h=64, heads=8, blocks=2, norms=2, dropout=None, ffn=4):
        super().__init__(vocab, h, lambda: TwoNormBlock(h, heads, norms, dropout, ffn), blocks, nn.LayerNorm(h))


class FusedNoBiasBlock(nn.Module):
    """A pre-norm block with q, k and v fused in one projection, no biases anywhere (MPT's)."""

    def __init__(self, h, heads, ffn=2):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(h, bias=False), nn.LayerNorm(h, bias=False)
        self.qkv, self.o = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.up, self.down = nn.Linear(h, ffn * h, bias=False), nn.Linear(ffn * h, h, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.n1(x)).chunk(3, dim=-1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class FusedNoBias(BlockLM):
    """An embedding, `FusedNoBiasBlock`s, a norm and a head tied to the embedding."""

    def __init__(self, vocab=256, h=64, heads=4, blocks=2):
        super().__init__(vocab, h, lambda: FusedNoBiasBlock(h, heads), blocks, nn.LayerNorm(h, bias=False))
        self.head.weight = self.tok.weight


class WeightlessNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps): an RMS norm without a weight."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SummedNormed(nn.Module):
    """Token and position embeddings summed, a weightless norm, a SwiGLU block, a weightless norm and an
    untied head (the shape of the random language models of tests/random_models.py)."""

    def __init__(self, vocab=64, h=24, positions=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(positions, h)
        self.n1, self.n2 = WeightlessNorm(), WeightlessNorm()
        self.fc1, self.gate = nn.Linear(h, 4 * h, bias=False), nn.Linear(h, 4 * h, bias=False)
        self.fc2, self.head = nn.Linear(4 * h, h, bias=False), nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        y = self.n1(x)
        x = x + self.fc2(F.silu(self.gate(y)) * self.fc1(y))
        return self.head(self.n2(x))


class LatentBlock(nn.Module):
    """Multi-head latent attention (DeepSeek-V2's): the queries and a compressed key/value latent with a
    shared positional key projected from the normed stream (two layers reading one tensor), the latent
    normed and projected up to every head's keys and values; then a SwiGLU MLP. With `complex_rope`, the
    positional parts rotated as complex numbers (`torch.view_as_complex`) and the keys written in place
    into a new tensor, as Hugging Face's DeepSeek-V2 does."""

    def __init__(self, h, heads, latent, nope, pe, dv, ffn, complex_rope=False):
        super().__init__()
        self.heads, self.latent, self.nope, self.pe, self.dv = heads, latent, nope, pe, dv
        self.complex_rope = complex_rope
        self.n1, self.n2, self.kv_norm = RMSNorm(h), RMSNorm(h), RMSNorm(latent)
        self.q = nn.Linear(h, heads * (nope + pe), bias=False)
        self.kv_a = nn.Linear(h, latent + pe, bias=False)
        self.kv_b = nn.Linear(latent, heads * (nope + dv), bias=False)
        self.o = nn.Linear(heads * dv, h, bias=False)
        self.gate, self.up = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        y = self.n1(x)
        q = self.q(y).view(b, t, self.heads, self.nope + self.pe).transpose(1, 2)
        c, k_pe = self.kv_a(y).split([self.latent, self.pe], dim=-1)
        c = self.kv_norm(c).view(b, 1, t, self.latent) if self.complex_rope else self.kv_norm(c)
        kv = self.kv_b(c).view(b, t, self.heads, self.nope + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k_pe = k_pe.view(b, 1, t, self.pe)
        if self.complex_rope:
            q_nope, q_pe = q.split([self.nope, self.pe], dim=-1)
            angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32),
                                 torch.arange(self.pe // 2, device=x.device, dtype=torch.float32))
            turn = torch.polar(torch.ones_like(angles), angles)
            q_pe, k_pe = (torch.view_as_real(torch.view_as_complex(z.float().reshape(*z.shape[:-1], -1, 2)) * turn)
                          .flatten(-2).type_as(z) for z in (q_pe, k_pe))
            q = torch.cat([q_nope, q_pe], dim=-1)
        if self.complex_rope:            # (the keys written in place into a new tensor, as DeepSeek-V2's code does)
            k = kv.new_empty(b, self.heads, t, self.nope + self.pe)
            k[..., :self.nope].copy_(k_nope)
            k[..., self.nope:].copy_(k_pe.expand(b, self.heads, t, self.pe))
        else:
            k = torch.cat([k_nope, k_pe.expand(b, self.heads, t, self.pe)], dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, self.heads * self.dv))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Latent(BlockLM):
    """An embedding, `LatentBlock`s, a norm and an untied head."""

    def __init__(self, vocab=128, h=64, heads=4, latent=16, nope=8, pe=4, dv=8, ffn=128, blocks=2, complex_rope=False):
        super().__init__(vocab, h, lambda: LatentBlock(h, heads, latent, nope, pe, dv, ffn, complex_rope), blocks,
                         RMSNorm(h))


class RelativeBlock(nn.Module):
    """Disentangled attention (DeBERTa's): one projection makes each head's query, key and value side by
    side (interleaved by heads), the query and value biases added apart, and scores from relative
    positions (a table of position embeddings shared by the blocks, projected to keys and to queries,
    each position's picked by distance with `gather`: content-to-position and position-to-content)
    added to the query-key scores, padding masked; norms after the residual sums, and a GELU MLP."""

    def __init__(self, h, heads, span, ffn, dropout=0.0):
        super().__init__()
        self.heads, self.span = heads, span
        self.in_proj = nn.Linear(h, 3 * h, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(h) * 0.02), nn.Parameter(torch.randn(h) * 0.02)
        self.pos_proj, self.pos_q_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h)
        self.o, self.up, self.down = nn.Linear(h, h), nn.Linear(h, ffn), nn.Linear(ffn, h)
        self.n1, self.n2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.drop = nn.Dropout(dropout)

    def _by_heads(self, z):
        """(b, t, heads * k) -> (b, heads, t, k)."""
        return z.view(z.shape[0], z.shape[1], self.heads, -1).permute(0, 2, 1, 3)

    def forward(self, x, rel, mask):
        b, t, h = x.shape
        q, k, v = self._by_heads(self.in_proj(x)).chunk(3, dim=-1)
        scale = (3 * h // self.heads) ** 0.5
        q = (q + self._by_heads(self.q_bias[None, None, :])) / scale
        v = v + self._by_heads(self.v_bias[None, None, :])
        pos_k = self._by_heads(self.pos_proj(rel)[None])
        pos_q = self._by_heads(self.pos_q_proj(rel)[None]) / scale
        at = torch.arange(t, device=x.device)
        dist = at[:, None] - at[None, :]
        c2p = torch.gather(q @ pos_k.transpose(-1, -2), -1,
                           (dist + self.span).clamp(0, 2 * self.span - 1).expand(b, self.heads, t, t))
        p2c = torch.gather(k @ pos_q.transpose(-1, -2), -1,
                           (self.span - dist).clamp(0, 2 * self.span - 1).expand(b, self.heads, t, t)).transpose(-1, -2)
        scores = (q @ k.transpose(-1, -2) + (c2p + p2c)).masked_fill(~mask, torch.finfo(x.dtype).min)
        a = self.drop(torch.softmax(scores, dim=-1)) @ v
        x = self.n1(x + self.drop(self.o(a.permute(0, 2, 1, 3).reshape(b, t, h))))
        return self.n2(x + self.drop(self.down(F.gelu(self.up(x)))))


class Relative(BlockLM):
    """An embedding normed (BERT's), `RelativeBlock`s sharing a table of relative-position embeddings
    (2 x `reach` rows, the 2 x `span` around the middle read), a norm and an untied head; token 0 pads."""

    def __init__(self, vocab=256, h=64, heads=4, span=16, reach=64, ffn=128, blocks=2, dropout=0.0):
        super().__init__(vocab, h, lambda: RelativeBlock(h, heads, span, ffn, dropout), blocks, nn.LayerNorm(h))
        self.embedded = nn.LayerNorm(h)
        self.rel = nn.Parameter(torch.randn(2 * reach, h) * 0.02)
        self.reach, self.span = reach, span

    def forward(self, ids):
        mask = (ids != 0)[:, None, None, :]
        rel = self.rel[self.reach - self.span:self.reach + self.span]
        x = self.embedded(self.tok(ids))
        for b in self.blocks:
            x = b(x, rel, mask)
        return self.head(self.norm(x))
