"""parallelize(..., overlap=True): each copy_to and the linear layers reading it run as one
autograd function (autoshard.runtime.overlap) whose backward all-reduces the input gradient while
it computes the weight gradients. Same loss, gradients and bytes as without it, in fp32 and under
bf16 autocast, eager and compiled; the GPT's q/k/v and MLP inputs and LLaMA's are fused."""
import copy

import pytest
import torch

import refs


def _build(name):
    import factories
    import hf_models
    torch.manual_seed(0)
    if name == "gpt":
        idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        return factories.gpt(), {"idx": idx, "targets": idx.roll(1, 1)}
    model, kw = hf_models.llama(num_hidden_layers=2)
    return model.train(), kw


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _case(rank, p, name, autocast, compiled):
    import autoshard
    from autoshard.runtime.collectives import count_comm
    from autoshard.runtime.overlap import column_linears
    model, kw = _build(name)
    plain = autoshard.parallelize(copy.deepcopy(model), p, kw)
    fused = autoshard.parallelize(copy.deepcopy(model), p, kw, overlap=True)
    modules = [fused, *autoshard.blocks_of(fused).values()]
    count = sum(n.target is column_linears for m in modules for n in m.graph.nodes)
    assert count >= 2 * 2, count                   # attention's and the MLP's input in each of 2 layers (+ a head)
    run = torch.compile(fused, fullgraph=True) if compiled else fused
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        with count_comm() as a:
            want = _loss(plain(**kw))
            want.backward()
        with count_comm() as b:
            got = _loss(run(**kw))
            got.backward()
    tol = 1e-5 if not autocast else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().item())
    for k, g in refs.grads(plain).items():
        h = refs.grads(fused)[k]
        assert h.dtype == g.dtype, k
        torch.testing.assert_close(h, g, rtol=tol, atol=tol * g.abs().max().item() + 1e-7, msg=lambda m: f"{k}: {m}")
    if not compiled:
        assert b.bytes == a.bytes, (a.bytes, b.bytes)
    return True


@pytest.mark.parametrize("name,autocast,compiled", [("gpt", False, False), ("llama", False, False),
                                                    ("gpt", True, False),
                                                    pytest.param("gpt", False, True, marks=pytest.mark.slow)])
def test_overlap_equals_plain(dist2, name, autocast, compiled):
    assert all(dist2.run(_case, name, autocast, compiled, timeout=900))
