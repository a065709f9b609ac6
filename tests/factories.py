"""Factories for the planner tests, the CLI and the plan-scaling benchmark.

- zero-argument model factories for `python -m autoshard plan tests.factories:NAME` (the shared
  models of tests/models.py at realistic small sizes);
- `RandomDAG`: seeded random DAGs of Linear layers of random divisible widths, element-wise
  gelu / relu / mul / add and residual adds, as an nn.Module that torch.fx traces.
"""
from __future__ import annotations

import os
import random
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from models import GPT, MLP, Block  # noqa: E402

# Realistic small sizes (see tests/test_plan.py): hidden 128, 8 heads, 2 x 64 tokens and a
# vocabulary 64x the hidden size (GPT-2's ratio is 50257 / 768 = 65).
H, HEADS, SEQ, VOCAB = 128, 8, 64, 8192


def mlp():
    return MLP(H)


def chatty_mlp():
    """An MLP whose build prints to standard output, as a library imported while loading can."""
    print("[WARNING] a library's line on standard output")
    return MLP(H)


def block():
    return Block(H, HEADS)


def fused_block():
    return Block(H, HEADS, fused=True)


def swiglu_block():
    return Block(H, HEADS, swiglu=True)


def gpt():
    """A 2-block GPT with tied embedding and head (input: token ids of shape 2,64)."""
    return GPT(VOCAB, H, HEADS, 2, SEQ, tied=True)


def gpt_untied():
    return GPT(VOCAB, H, HEADS, 2, SEQ, tied=False)


def not_a_module():
    return 42


# ---------------------------------------------------------------------------- random DAGs
class RandomDAG(nn.Module):
    """A random DAG over the activations of one input `x` of shape (tokens, width).

    `program` is a list of steps; each step reads earlier values by index and appends one:
    ("linear", src, layer name), ("act", src, "gelu" | "relu"), ("mul" | "add", a, b).
    `outputs` are the values no step reads (returned as a tuple).
    """

    def __init__(self, widths: list, program: list, outputs: list, in_width: int, tokens: int):
        super().__init__()
        self.in_width, self.tokens = in_width, tokens
        self.widths, self.program, self.outputs = widths, program, outputs
        self.layers = nn.ModuleDict()
        for step in program:
            if step[0] == "linear":
                _, src, name, out, bias = step
                self.layers[name] = nn.Linear(widths[src], out, bias=bias)

    def forward(self, x):
        vals = [x]
        for step in self.program:
            op = step[0]
            if op == "linear":
                vals.append(self.layers[step[2]](vals[step[1]]))
            elif op == "act":
                vals.append(F.gelu(vals[step[1]]) if step[2] == "gelu" else F.relu(vals[step[1]]))
            elif op == "mul":
                vals.append(vals[step[1]] * vals[step[2]])
            else:
                vals.append(vals[step[1]] + vals[step[2]])
        return tuple(vals[i] for i in self.outputs)

    def example(self, device="meta"):
        return (torch.zeros(self.tokens, self.in_width, device=device),)


def random_dag(seed: int, *, linears: tuple = (2, 5), widths: tuple = (32, 64, 128, 256),
               tokens: tuple = (16, 128, 512), locality: int = 6, device="meta") -> RandomDAG:
    """A seeded random DAG with between linears[0] and linears[1] Linear layers.

    Each step draws its operands from the last `locality` values (so the DAGs look like
    networks: chains, branches, residual adds, gated products). Widths come from `widths`
    (all divisible by 8, so every degree up to 8 divides them).
    """
    rng = random.Random(seed)
    n_lin = rng.randint(*linears)
    w0 = rng.choice(widths)
    vw = [w0]                      # width of every value
    program, made = [], 0
    users = [0]

    def pick(pred=lambda i: True):
        cands = [i for i in range(max(0, len(vw) - locality), len(vw)) if pred(i)]
        return rng.choice(cands) if cands else None

    while made < n_lin:
        r = rng.random()
        src = pick()
        if r < 0.45:
            out = rng.choice(widths) if rng.random() < 0.6 else vw[src]
            program.append(("linear", src, f"l{made}", out, rng.random() < 0.7))
            vw.append(out)
            made += 1
        elif r < 0.65:
            program.append(("act", src, rng.choice(("gelu", "relu"))))
            vw.append(vw[src])
        else:
            # a binary op on two values of one width: a residual add when one is much older
            other = pick(lambda i: i != src and vw[i] == vw[src])
            if other is None:
                far = [i for i in range(len(vw)) if i != src and vw[i] == vw[src]]
                other = rng.choice(far) if far else None
            if other is None:
                continue
            program.append(("mul" if r < 0.78 else "add", src, other))
            vw.append(vw[src])
        for i in program[-1][1:3] if program[-1][0] in ("mul", "add") else program[-1][1:2]:
            users.append(i)
    read = set(users)
    outputs = [i for i in range(len(vw)) if i not in read] or [len(vw) - 1]
    with torch.device(device):
        return RandomDAG(vw, program, outputs, w0, rng.choice(tokens))


def dag_size(program_len_target: int, seed: int = 0, **kw) -> RandomDAG:
    """A random DAG of about `program_len_target` steps (for scaling benchmarks)."""
    return random_dag(seed, linears=(int(program_len_target * 0.45),) * 2, **kw)
