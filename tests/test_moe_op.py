"""`autoshard::experts` (capture's normal form of a transformers experts module) computes what
every transformers implementation computes, for every weight layout the decorator allows:
gate and up concatenated or interleaved, weights transposed or not, with or without biases, gated
or not, and a module's own gate (GPT-OSS's clamped SwiGLU): the output and every gradient
against transformers' `grouped_mm` and `batched_mm` implementations, in one process."""
import itertools

import pytest
import torch
import torch.nn as nn

from autoshard.capture.experts import experts_as_one_op

moe = pytest.importorskip("transformers.integrations.moe")

E, H, I, T, K = 6, 16, 12, 20, 2


class _Config:
    _experts_implementation = "grouped_mm"


def experts_class(gated=True, transposed=False, concatenated=True, bias=False, own_gate=False):
    """A transformers experts module of the given layout (random weights, SiLU)."""
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            up_out = 2 * I if gated else I
            name = "gate_up_proj" if gated else "up_proj"
            g = torch.Generator().manual_seed(0)
            setattr(self, name, nn.Parameter(torch.randn((E, H, up_out) if transposed else (E, up_out, H), generator=g) / 4))
            self.down_proj = nn.Parameter(torch.randn((E, I, H) if transposed else (E, H, I), generator=g) / 4)
            if bias:
                setattr(self, f"{name}_bias", nn.Parameter(torch.randn(E, up_out, generator=g)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError        # the interface's implementations run instead

    if own_gate:
        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(max=1.5)
            return (up.clamp(-1.5, 1.5) + 1) * gate * torch.sigmoid(gate * 1.702)
        Experts._apply_gate = _apply_gate
    return moe.use_experts_implementation(Experts, is_transposed=transposed, is_concatenated=concatenated,
                                          has_bias=bias, has_gate=gated)


def _run(m, x, idx, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    for q in m.parameters():
        q.grad = None
    out = m(x, idx, w)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out, x.grad, w.grad] + [q.grad for q in m.parameters()]


LAYOUTS = [dict(gated=g, transposed=t, concatenated=c, bias=b)
           for g, t, c, b in itertools.product((True, False), (False, True), (True, False), (False, True))
           if g or c] + [dict(gated=True, transposed=True, concatenated=False, bias=True, own_gate=True)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(k for k, v in d.items() if v) or "plain")
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_one_op_equals_transformers(layout, impl):
    cfg = _Config()
    cfg._experts_implementation = impl
    m = experts_class(**layout)(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:5] = torch.tensor([0, 1])                # expert 5 and others: some get no token
    w = torch.rand(T, K, generator=g)
    want = _run(m, x, idx, w)
    notes = []
    with experts_as_one_op(m, notes):
        got = _run(m, x, idx, w)
    assert not notes
    assert "autoshard" not in str(type(m).forward)          # the module's forward is its own again
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_backward_under_dispatch_modes():
    """The op's backward is written out, so it runs under a TorchDispatchMode (a FLOP counter, the
    memory tracker) and gives the same gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode
    m = experts_class(bias=True)(_Config())
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    idx = torch.randint(0, E, (T, K), generator=g)
    with experts_as_one_op(m, []):
        want = _run(m, x, idx, w)
        for mode in (FlopCounterMode(display=False), MemTracker()):
            with mode:
                got = _run(m, x, idx, w)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_recomputes_under_the_forwards_autocast():
    """Forward under bf16 autocast, backward outside it (the usual recipe): the gradients are those
    of the bf16 forward (as transformers' are), the same as a backward run inside autocast."""
    cfg = _Config()
    cfg._experts_implementation = "batched_mm"
    m = experts_class()(cfg)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    idx = torch.randint(0, E, (T, K), generator=g)

    def run(inside):
        xx = x.clone().requires_grad_()
        m.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            out = m(xx, idx, w)
            if inside:
                out.float().sum().backward()
        if not inside:
            out.float().sum().backward()
        return [xx.grad] + [q.grad.clone() for q in m.parameters()]
    hf = run(False)
    with experts_as_one_op(m, []):
        outside, inside = run(False), run(True)
    for a, b, c in zip(outside, inside, hf):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=2e-2, atol=2e-2 * c.abs().max().item())


def test_malformed_routing_is_refused_on_fake_tensors():
    """Routing of the wrong shape fails on fake tensors (inside capture), naming the sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from autoshard.nn.experts import experts
    with FakeTensorMode():
        x, up, down = torch.empty(T, H), torch.empty(E, 2 * I, H), torch.empty(E, H, I)
        idx, w = torch.zeros(T, K, dtype=torch.long), torch.empty(T, K)
        experts(x, idx, w, up, down, None, None, 0, True, False, "silu", 1)       # well formed
        for bad, match in ((dict(index=idx[: T // 2]), r"routing indices \(10, 2\)"),
                           (dict(weights=torch.empty(T, E)), r"routing weights \(20, 6\)"),
                           (dict(index=idx.float()), "not integers"),
                           (dict(x=torch.empty(2, T, H)), r"tokens of shape \(2, 20, 16\)")):
            args = dict(x=x, index=idx, weights=w)
            args.update(bad)
            with pytest.raises(ValueError, match=match):
                experts(args["x"], args["index"], args["weights"], up, down, None, None, 0, True, False, "silu", 1)
