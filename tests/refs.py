"""Single-process references and checks shared by the multi-process tests."""
import torch


def ref_piece(x, dim, p, r, chunks=1):
    """Rank r's part of Shard(dim, chunks) of `x` on p ranks, computed by reshaping."""
    dim %= x.dim()
    size = x.shape[dim]
    blocked = x.reshape(x.shape[:dim] + (chunks, p, size // (chunks * p)) + x.shape[dim + 1:])
    return blocked.select(dim + 1, r).reshape(x.shape[:dim] + (size // p,) + x.shape[dim + 1:])


def seeded(seed, shape):
    """A standard-normal tensor from its own generator (the global RNG is untouched)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def close(a, b, **kw):
    """assert_close at fp32 test tolerance (1e-5); returns True so cases can `return close(...)`."""
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, **kw)
    return True


def close_to_scale(actual, expected, what):
    """fp32 agreement, 1e-5 relative to the expected tensor's largest entry; `what` in the message."""
    expected = expected.detach()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.detach(), expected, rtol=1e-5, atol=1e-5 * scale + 1e-8,
                               msg=lambda m: f"{what}: {m}")


def close_grads(got, want, what):
    """The same gradient names, each gradient within 1e-5 of its own scale plus fp32 noise of the
    largest gradient (`got`, `want`: {name: gradient}); `what` in the message."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    top = max(g.abs().max().item() for g in want.values())
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-5 * g.abs().max().item() + 1e-6 * top,
                                   msg=lambda m: f"{what}: grad of {k}: {m}")


def grads(module, remove_duplicate=True):
    """{parameter name: gradient} of the parameters that have one (tied aliases too with
    remove_duplicate=False)."""
    return {n: p.grad for n, p in module.named_parameters(remove_duplicate=remove_duplicate) if p.grad is not None}


def gathers_near(plan, module, hops=3):
    """All-gathers of a module's outputs or of what is cut from them: the redistributions of the
    module's own nodes and of the nodes up to `hops` uses below them (a fused projection's split
    or slices, the views into heads, the transposes)."""
    by_name = {n.name: n for n in plan.graph_module.graph.nodes}
    near = frontier = {n for n, d in plan.nodes.items() if d.module == module}
    assert near, (module, sorted({d.module for d in plan.nodes.values()}))
    for _ in range(hops):
        frontier = {u.name for n in frontier for u in by_name[n].users}
        near = near | frontier
    return [r for r in plan.redistributions if "all_gather" in r.forward and r.node in near]


def hf_step_matches(gm, ref, kw, what, sharded_logits=False):
    """One step of a parallel Hugging Face causal LM `gm` and of the single-process `ref` on the
    keyword inputs `kw`: the loss, the logits (a DTensor, gathered here, with
    `sharded_logits`) and every gradient (collected whole) must agree. Returns the bytes the
    step's collectives counted, for comparing with the plan's."""
    from autoshard.runtime.collectives import count_comm
    from torch.distributed.tensor import DTensor
    with count_comm() as c:
        res = gm(**kw)
        res.loss.backward()
    want = ref(**kw)
    want.loss.backward()
    close_to_scale(res.loss, want.loss, f"{what}: loss")
    assert isinstance(res.logits, DTensor) == sharded_logits, (what, type(res.logits))
    close_to_scale(res.logits.full_tensor() if sharded_logits else res.logits, want.logits, f"{what}: logits")
    grads_match(gm, ref, what)
    return c.bytes


def dcp_save_model(gm, path):
    """The module's state saved with DCP under "model" (autoshard.checkpoint's view of it)."""
    import autoshard
    import torch.distributed.checkpoint as dcp
    msd, _ = autoshard.checkpoint.get_state_dict(gm)
    dcp.save({"model": msd}, checkpoint_id=path)


def dcp_load_model(gm, path):
    """The DCP checkpoint at `path` loaded into the module; its state dict collected whole."""
    import autoshard
    import torch.distributed.checkpoint as dcp
    msd, _ = autoshard.checkpoint.get_state_dict(gm)
    sd = {"model": msd}
    dcp.load(sd, checkpoint_id=path)
    autoshard.checkpoint.set_state_dict(gm, model_state_dict=sd["model"])
    return autoshard.collect_state_dict(gm, gm.state_dict())


def grads_match(gm, ref, what):
    """Every gradient of the parallel module `gm`, collected whole, agrees with the single-process
    `ref`'s (tied aliases included)."""
    import autoshard
    close_grads(autoshard.collect_state_dict(gm, grads(gm, remove_duplicate=False)),
                grads(ref, remove_duplicate=False), what)


def block_steps_match(gm, ref, x_of, what, seeds=(1, 2)):
    """Steps of a parallel module `gm` and of the single-process `ref` on the batches
    `x_of(seed)`, the output weighted by a fixed ramp: the loss and every gradient agree at each
    step. Returns the bytes the first step's collectives counted."""
    from autoshard.runtime.collectives import count_comm
    measured = []
    for seed in seeds:
        x = x_of(seed)
        gm.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with count_comm() as c:
            out = gm(x)
            scale = torch.linspace(-1, 1, out.numel()).view(out.shape)
            loss = (out * scale).sum()
            loss.backward()
        measured.append(c.bytes)
        want = (ref(x) * scale).sum()
        want.backward()
        close_to_scale(loss, want, f"{what}, batch {seed}: loss")
        grads_match(gm, ref, f"{what}, batch {seed}")
    return measured[0]


def measured_step_peak(module, loss_of, optimizer=None, steps=3):
    """Bytes of one training step's peak as torch's MemTracker sees it (parameters, buffers,
    gradients, optimizer state, activations, temporaries), in the steady state: a first step
    (outside the tracker) makes the optimizer's state, gradients are set to None before each.
    The smallest peak of `steps` tracked steps: now and then (2 steps in 32 of a 2-rank LLaMA)
    MemTracker's peak of one step comes out 4-10% higher than the same step's before and after.
    `loss_of(module)` runs forward and returns the loss. -> (peak, {category: bytes at the peak})."""
    from torch.distributed._tools.mem_tracker import MemTracker
    opt = optimizer or torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of(module).backward()
        opt.step()
    step()
    best = None
    for _ in range(steps):
        tracker = MemTracker()
        tracker.track_external(module, opt)
        with tracker:
            step()
        opt.zero_grad(set_to_none=True)
        parts = {}
        for per_device in tracker.get_tracker_snapshot("peak").values():
            for k, v in per_device.items():
                name = str(k).rpartition(".")[2].lower()
                parts[name] = parts.get(name, 0) + v
        if best is None or parts["total"] < best["total"]:
            best = parts
    return best.pop("total"), best
