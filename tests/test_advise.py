"""autoshard.estimate / autoshard.advise: the step of a whole job from autoshard's plan of one layer.

Cheap checks on a small GPT (planned on meta with one layer, once per tensor-parallel degree and
sequence parallelism: the module's profile cache), and the published table of Korthikanti et al.
2022 (Table 5 iteration times, Figure 1 memory) behind -m slow (two plans of a large layer a row).
"""
from __future__ import annotations

import re

import pytest
import transformers

import autoshard
from autoshard import Cluster, Layout
from autoshard.errors import MemoryBudgetError
from autoshard.planner.cluster import USABLE

GiB = 2 ** 30


def small(layers=8, h=512, heads=8, attn="eager"):
    cfg = transformers.GPT2Config(vocab_size=8192, n_positions=512, n_embd=h, n_layer=layers, n_head=heads,
                                  activation_function="gelu", use_cache=False)
    cfg._attn_implementation = attn
    cfg.dtype = "float16"
    return cfg


SEQ = 512


def test_estimate_deterministic_and_parts():
    cfg = small()
    c = Cluster(gpus=8, gpu="A100-80GB")
    lay = Layout(tp=2, pp=2, dp=2, microbatch=2)
    a = autoshard.estimate(cfg, c, lay, global_batch=32, seq_len=SEQ)
    b = autoshard.estimate(cfg, c, lay, global_batch=32, seq_len=SEQ)
    assert a == b
    assert a.step_time > 0 and 0 < a.mfu < 1
    assert set(a.breakdown) == {"compute", "tp_comm", "recompute", "pipeline", "dp_comm"}
    assert a.memory == sum(a.parts.values())
    assert a.tokens_per_s_per_gpu == pytest.approx(32 * SEQ / a.step_time / 8)


def test_more_data_parallel_never_slower_per_sample():
    cfg = small()
    times = []
    for dp in (1, 2, 4, 8):
        c = Cluster(gpus=2 * dp, gpu="H100-SXM")
        e = autoshard.estimate(cfg, c, Layout(tp=2, dp=dp, microbatch=2), global_batch=64, seq_len=SEQ)
        times.append(e.step_time / 64)
    assert all(b <= a for a, b in zip(times, times[1:])), times


@pytest.mark.parametrize("sp", [False, True])
def test_recomputation_never_more_memory(sp):
    cfg = small()
    c = Cluster(gpus=4, gpu="A100-40GB")
    mem = [autoshard.estimate(cfg, c, Layout(tp=2, pp=2, microbatch=2, sequence_parallel=sp, recompute=rc),
                              global_batch=16, seq_len=SEQ).memory for rc in ("none", "selective", "full")]
    assert mem[0] >= mem[1] >= mem[2], mem
    assert mem[0] > mem[2]


def test_layer_activations_match_megatron_formula():
    """Korthikanti et al.'s per-layer activations, sbh(10 + 24/t + 5as/(ht)) bytes (fp16, 1-byte dropout
    masks), and with SP + selective recomputation 34sbh/t: autoshard's memory model of its own plan of
    the layer agrees within 10%."""
    from autoshard.advise import profile_of
    h, a, t, s = 512, 8, 2, SEQ
    cfg = small(h=h, heads=a)
    none = profile_of(cfg, t, False, s).activations["none"]
    sel = profile_of(cfg, t, True, s).activations["selective"]
    assert none == pytest.approx(s * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=0.10)
    assert sel == pytest.approx(34 * s * h / t, rel=0.10)


def test_advise_fits_and_is_no_slower_than_a_given_layout():
    cfg = small()
    c = Cluster(gpus=2, gpu="A100-40GB")
    best = autoshard.advise(cfg, c, global_batch=16, seq_len=SEQ, top=3)
    assert 1 <= len(best) <= 3
    assert all(e.fits and e.memory <= USABLE * c.memory for e in best)
    assert [e.step_time for e in best] == sorted(e.step_time for e in best)
    given = autoshard.estimate(cfg, c, Layout(tp=2, microbatch=1), global_batch=16, seq_len=SEQ)
    assert best[0].step_time <= given.step_time


def test_advise_none_fits_names_smallest_peak():
    cfg = small()
    c = Cluster(gpus=2, gpu="A100-40GB", memory=64 * 2 ** 20)
    with pytest.raises(MemoryBudgetError, match="smallest peak"):
        autoshard.advise(cfg, c, global_batch=4, seq_len=SEQ)


def test_cluster_and_layout_checks():
    with pytest.raises(ValueError, match="unknown gpu"):
        Cluster(gpus=8, gpu="B300")
    assert Cluster(gpus=8, gpu="B300", peak=1e15, memory=1e11, hbm=8e12, nvlink=9e11, network=1e11, gemm=0.7).peak == 1e15
    with pytest.raises(ValueError, match="recompute"):
        Layout(recompute="some")
    with pytest.raises(ValueError, match="interleave"):
        Layout(interleave=2)


def test_cli_prints_table_for_config_json(capsys, tmp_path):
    from autoshard.cli import main
    small(layers=4, h=256, heads=4).to_json_file(tmp_path / "config.json")
    assert main(["advise", "--config", str(tmp_path / "config.json"), "--gpus", "1", "--gpu", "H100-SXM",
                 "--global-batch", "8", "--seq", "128", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\|\s+tp\s+\|", out) and "step s" in out and "memory GiB" in out
    assert "autoshard.parallelize" in out or "autoshard.pipeline" in out


@pytest.mark.slow
def test_cli_prints_table_for_builtin(capsys):
    from autoshard.cli import main
    assert main(["advise", "--config", "gpt2", "--gpus", "1", "--gpu", "A100-80GB", "--global-batch", "8",
                 "--seq", "256", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\|\s+tp\s+\|", out) and "step s" in out and "memory GiB" in out
    assert "autoshard.parallelize" in out


# Korthikanti et al. 2022: Table 5 (iteration seconds: full recomputation; SP + selective) and Figure 1
# (GiB: parameters and optimizer state; activations without recomputation; with SP + selective).
KORTHIKANTI = [
    ("gpt-22b", 8, 1, 4, 4, 1, 1.42, 1.10, 45.56, 59.25, 9.56),
    ("gpt-175b", 8, 8, 64, 1, 3, 18.13, 13.75, 45.56, 66.84, 12.35),
    ("gpt-530b", 8, 35, 280, 1, 3, 49.05, 37.83, 31.64, 114.02, 23.08),
    ("gpt-1t", 8, 64, 512, 1, 1, 94.42, 71.49, 32.96, 131.25, 26.56),
]


def korthikanti_estimates(row):
    """(full, selective, none, state GiB) of one KORTHIKANTI row: its layout estimated with full
    recompute, with selective recompute and sequence parallelism, and with neither; the state is
    the selective run's parameters, gradients and optimizer (also benchmarks/advise.py)."""
    name, tp, pp, gb, mb, v = row[:6]
    c = Cluster(gpus=tp * pp, gpu="A100-80GB")

    def run(rc, sp):
        return autoshard.estimate(name, c, Layout(tp=tp, pp=pp, microbatch=mb, interleave=v, sequence_parallel=sp,
                                                  recompute=rc), global_batch=gb, seq_len=2048)
    f, s, n = run("full", False), run("selective", True), run("none", False)
    return f, s, n, (s.parts["parameters"] + s.parts["gradients"] + s.parts["optimizer"]) / GiB


@pytest.mark.slow
def test_korthikanti_table():
    """Iteration time: mean error <= 5%, every row within 10%; memory within 10% of every bar."""
    errors = []
    for row in KORTHIKANTI:
        name, full, sel, state, act_none, act_sel = row[0], *row[6:]
        f, s, n, held = korthikanti_estimates(row)
        errors += [f.step_time / full - 1, s.step_time / sel - 1]
        assert held == pytest.approx(state, rel=0.10), (name, held)
        assert n.parts["activations"] / GiB == pytest.approx(act_none, rel=0.10), name
        assert s.parts["activations"] / GiB == pytest.approx(act_sel, rel=0.10), name
    assert max(abs(e) for e in errors) <= 0.10, errors
    assert sum(abs(e) for e in errors) / len(errors) <= 0.05, errors
