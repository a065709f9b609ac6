#!/usr/bin/env python
"""autoshard's plans against a hand-written Megatron-LM plan, on published Hugging Face configurations.

    python benchmarks/real_configs.py                          # every dense configuration, degrees 2, 4, 8
    python benchmarks/real_configs.py --only llama3-8b,gpt2    # a few (names: --list)
    python benchmarks/real_configs.py --degrees 4 --no-layers --no-depth  # one degree, 2-layer plans only
    python benchmarks/real_configs.py --moe                    # the mixtures of experts (--only names any)
    python benchmarks/real_configs.py --moe-memory             # Mixtral-8x7B's activations against its dense twin

What is measured. Each configuration below is typed in from the published config.json of its
Hugging Face checkpoint (vocabulary, widths, heads, key/value heads, head_dim, tied embeddings,
the architecture switches), built with 2 layers instead of the published depth, on the meta
device (`with torch.device("meta"): Auto*.from_config(cfg)`: nothing is downloaded or allocated).
For every degree p and every outputs mode ("full", "sharded"), `autoshard.plan(model, p,
{"input_ids": ids, "labels": ids}, outputs=mode)` is called with ids of shape (2, 512) on meta, i.e.
T = 1024 tokens, and timed (wall seconds of the call, capture included; models built once per
configuration). From the Plan: `comm_bytes` (ring bytes one rank sends per training step, forward +
backward, fp32) and `params_per_rank`. The model's total is its unique parameters (tied ones once).

The reference is Megatron-LM's plan of the same step, per rank, in ring bytes
(`autoshard.runtime.collectives.ring_bytes`; an all-reduce of n bytes sends 2(p-1)/p n), 4 bytes an element,
h the hidden size, V the vocabulary, L = 2 layers:

- layers: (4L + 2) all-reduces of T x h. Per layer 4: in forward the row-parallel outputs of attention
  and of the MLP, in backward the input gradients of the column-parallel projections that read the
  replicated activations (Megatron's "f" and "g"); + 2 for the vocabulary-parallel embedding's forward
  all-reduce and its backward counterpart at the head. Parallel-attention layers (Falcon with
  parallel_attn, GPT-NeoX/Pythia with use_parallel_residual, Phi-1/Phi-2: attention and MLP read the
  same input and their outputs are summed while still partial) count 1 forward all-reduce a layer
  and one backward all-reduce per norm that feeds the two branches: 2 a layer for Falcon-7B,
  Phi-2, GPT-J and CodeGen (one shared norm), 3 for GPT-NeoX / Pythia (a norm per branch: two column-parallel inputs,
  whose gradients GPT-NeoX's own Megatron also all-reduces separately).
- loss: 3 all-reduces of T elements (vocabulary-parallel cross-entropy: max, sum of exp, target logit).
- logits: with outputs="full" one all-gather of the T x V logits; with outputs="sharded" none.

Reported per (configuration, p, outputs): comm / Megatron, the ratio of the two; the layers' share,
(comm(L=4) - comm(L=2)) / Megatron bytes of 2 layers (8 all-reduces of T x h, or 4 for parallel
layers), the same call planned on a 4-layer build of the configuration: what two more layers cost,
free of the embedding, head, loss and logits; comm / Megatron at the published depth, the same call
planned on a build with the published number of layers (the embedding, head, loss and logits then
weigh what they weigh in a real step; `--no-depth` skips it); params per rank / (total / p). Configurations whose
head counts do not divide by p have no head-parallel Megatron plan at that degree (Megatron refuses
them); a vocabulary that does not divide by p Megatron pads (to a multiple of 128 p, a negligible
change in bytes). The formula (unpadded V) is still the bar for them, and the note names the
quantities that do not divide. For every row the plan's collectives (redistributions and collectives ops run themselves,
with the node that reads them and its module, largest first) are kept in the JSON; for each
configuration with a row above --flag (default 1.25) the largest of its worst row are printed under
the table.

Mixtures of experts (`Spec.moe`: Mixtral-8x7B, Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B,
OLMoE-1B-7B, DeepSeek-V2-Lite). Capture writes each transformers experts module (3-D `gate_up_proj`
[E, 2I, h] and `down_proj` [E, h, I]) as one op, `autoshard::experts`, placed "expert_parallel" (E/p
whole experts a rank) or "expert_tensor" (each expert's FFN split); either way its output is
Partial. The hand plan of an MoE layer moves the layer's output exactly as a dense MLP's: the
router replicated, the experts split (Megatron's expert tensor parallelism, or expert parallelism
over the tensor-parallel group with the tokens already replicated there), one all-reduce of T x h
forward (the experts' summands, with a shared expert's row-parallel output added before it) and one
backward (the input gradient of the experts and the router). So `megatron()` applies unchanged,
4 all-reduces of T x h a layer. What an exact step adds to it and the formula leaves out, all of
T floats or T x k: the router's gradient (the routing weights' gradient, T x k, comes back Partial
from the ranks' experts and is all-reduced), Qwen2-MoE's shared-expert gate (its sigmoid's
gradient, T floats), OLMoE's RMSNorm of q and k over all heads (its statistics, T floats, each way).
DeepSeek-V2-Lite's multi-head latent attention (a compressed K/V of kv_lora_rank + rope dims read by
every head) has no place in the dense formula: its row has `bar=False`, no `ratio`, and the formula's
ratio is kept apart as `dense_formula_ratio`, never flagged nor counted as a target.
For each MoE row also: the strategy of each experts op (`plan.nodes[n].strategy`), the collectives
that move an expert weight (a redistribution of a 3-D expert parameter or of what an experts op
reads as one; an all-gather of one is what must not happen; the experts ops' own outputs gathered
are counted too), the router's gradient bytes, and `plan.memory` (activations, peak). On a model
built on meta `plan.memory` was the stand-in upper bound before commit 398c5da (the fake run of
the saved tensors failed on meta), so the memory of each 2-layer MoE row comes from the same call
on a copy of the model with fake tensors (`autoshard.capture.trace.recipe_copy`), whose plan moves
the same bytes (checked: `memory_plan_comm_bytes`); the meta model's is kept as `memory_meta`.

`--moe-memory`: Mixtral-8x7B at 8 ranks, input ids of shape (1, 4096), 32 layers, fake tensors,
activations per rank (`plan.memory.activations`) against its dense twin (MistralConfig with the same
attention, hidden size, FFN size 14336, vocabulary and depth) planned alike; written to
benchmarks/results/real_configs_moe_memory.json.

Results: a markdown table on stdout, benchmarks/results/real_configs.json (every row, the
hyperparameters, torch / transformers versions). Shapes only: one process, CPU, no GPU needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

import autoshard  # noqa: E402
from autoshard.io.configs import CONFIGS, Spec  # noqa: E402  (typed in from each published config.json)
from autoshard.capture.trace import recipe_copy  # noqa: E402
from autoshard.nn.experts import DOWN, DOWN_BIAS, EXPERTS_OPS, UP, UP_BIAS, WEIGHTS  # noqa: E402
from autoshard.runtime.collectives import ring_bytes  # noqa: E402
from common import env_info  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BATCH, SEQ = 2, 512
TOKENS = BATCH * SEQ
BYTES = 4                       # fp32
LAYERS = 2
MODES = ("full", "sharded")
TOP = 6                         # largest collectives printed per flagged configuration
MOE_MEMORY = {"p": 8, "shape": (1, 4096), "layers": 32, "outputs": "sharded", "target": 2.2}   # --moe-memory


# ----------------------------------------------------------------------------- models and formula

def build(spec: Spec, layers: int):
    """The configuration and its model with `layers` layers, on meta."""
    # a list with an entry per layer (GPT-Neo's attention types) follows the depth built
    scaled = {k: [[v, layers // n]] for k, (v, n) in spec.per_layer.items()}
    cfg = getattr(transformers, spec.config)(**{**spec.kwargs, **scaled, spec.layers_key: layers, "use_cache": False})
    auto = getattr(transformers, spec.auto)
    with torch.device("meta"):
        model = auto.from_config(cfg, attn_implementation=spec.attn)
    return cfg, model


def heads(cfg) -> tuple[int, int]:
    n = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv is None and getattr(cfg, "new_decoder_architecture", False):
        kv = cfg.num_kv_heads                     # Falcon-40B's groups
    elif kv is None and getattr(cfg, "multi_query", False):
        kv = 1
    return n, kv if kv is not None else n


def megatron(h: int, vocab: int, layers: int, p: int, outputs: str, parallel: bool, norms: int = 1) -> dict:
    """Megatron-LM's ring bytes per rank per step (the module docstring's formula), by part."""
    per_layer = 1 + norms if parallel else 4
    act = TOKENS * h * BYTES
    part = {"layers": (per_layer * layers + 2) * ring_bytes("all_reduce", act, p),
            "loss": 3 * ring_bytes("all_reduce", TOKENS * BYTES, p),
            "logits": ring_bytes("all_gather", TOKENS * vocab * BYTES, p) if outputs == "full" else 0.0}
    part["total"] = sum(part.values())
    part["two_layers"] = 2 * per_layer * ring_bytes("all_reduce", act, p)
    return part


def carriers(plan) -> list[dict]:
    """The plan's collectives, largest first: each redistribution (a tensor changing placement, with
    the node that reads it and the module of that node) and each collective an op runs itself."""
    p = plan.world_size
    out = []
    for r in plan.redistributions:
        b = r.ring_bytes(p)
        if not b:
            continue
        reader = r.consumers[0] if r.consumers else ""
        d = plan.nodes.get(reader)
        out.append({"node": r.node, "reader": str(reader), "module": d.module if d is not None else "",
                    "what": f"{r.src}->{r.dst}", "forward": list(r.forward), "backward": list(r.backward),
                    "tensor_bytes": r.nbytes, "ring_bytes": b})
    for name, d in plan.nodes.items():
        for kind, nb in d.comm:
            out.append({"node": name, "reader": name, "module": d.module, "what": f"{d.strategy} ({d.op})",
                        "forward": [kind], "backward": [], "tensor_bytes": nb, "ring_bytes": ring_bytes(kind, nb, p)})
    out.sort(key=lambda c: -c["ring_bytes"])
    return out


def experts_nodes(plan) -> list:
    """The graph's `autoshard::experts` nodes, in order."""
    return [n for n in plan.graph_module.graph.nodes if n.op == "call_function" and n.target in EXPERTS_OPS]


def moe_of(plan, model) -> dict:
    """What `plan` does with a mixture of experts' experts: each experts op's module and strategy, the
    placements its weights are read in and laid out in, every collective that moves an expert weight
    (a redistribution of a 3-D parameter, or of what an experts op reads as its weights or biases,
    back to the parameter), the experts ops' outputs gathered, and the router's gradient bytes (the
    routing weights' gradient, Partial from each rank's experts)."""
    p = plan.world_size
    params = dict(model.named_parameters(remove_duplicate=False))
    weights = {n.name for n in plan.graph_module.graph.nodes
               if n.op == "get_attr" and n.target in params and params[n.target].dim() == 3}
    ops = experts_nodes(plan)
    router, inputs = {}, set()
    for n in ops:
        d = plan.nodes[n.name]
        for i in (UP, DOWN, UP_BIAS, DOWN_BIAS):
            a = n.args[i]
            if isinstance(a, torch.fx.Node):
                inputs.add(str(d.inputs[i]) if i < len(d.inputs) else "?")
            while isinstance(a, torch.fx.Node):          # back through casts and views to the parameter
                weights.add(a.name)
                ins = a.all_input_nodes
                a = ins[0] if a.op == "call_function" and len(ins) == 1 else None
        router[n.args[WEIGHTS].name] = n.name
    names = {n.name for n in ops}
    moved, gathered_out, router_bytes = [], [], 0.0
    for r in plan.redistributions:
        what = {"node": r.node, "what": f"{r.src}->{r.dst}", "forward": list(r.forward), "backward": list(r.backward),
                "tensor_bytes": r.nbytes, "ring_bytes": r.ring_bytes(p)}
        if r.node in weights and (r.forward or r.backward):
            moved.append(what)
        if r.node in names and "all_gather" in r.forward:
            gathered_out.append(what)
        if r.node in router:
            router_bytes += r.ring_bytes(p)
    strategies = {plan.nodes[n.name].module or n.name: plan.nodes[n.name].strategy for n in ops}
    counts = {}
    for v in strategies.values():
        counts[v] = counts.get(v, 0) + 1
    layouts = {str(plan.layouts[k]) for k, t in params.items() if t.dim() == 3 and k in plan.layouts}
    return {"experts_ops": len(ops), "strategies": strategies, "strategy_counts": counts,
            "expert_weight_inputs": sorted(inputs), "expert_layouts": sorted(layouts),
            "expert_weight_collectives": moved,
            "expert_weight_gathers": sum("all_gather" in m["forward"] for m in moved),
            "experts_output_gathers": gathered_out, "router_grad_ring_bytes": router_bytes}


def memory_of(plan) -> dict | None:
    """`plan.memory` as a dictionary (bytes per rank)."""
    m = plan.memory
    if m is None:
        return None
    return {**{k: m[k] for k in m.KEYS}, "buffers": m.buffers, "peak_at": m.peak_at, "exact": m.exact}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


COST = {}          # cost-model knobs of every plan (--memory-weight W: {"memory_weight": W})


def timed_plan(model, p: int, mode: str, shape=(BATCH, SEQ), device="meta"):
    """`autoshard.plan` of `model` on input ids (and labels) of `shape`, timed; on meta for a model on
    meta, on `device="cpu"` for a copy with fake tensors (`recipe_copy`: its inputs become fake too)."""
    ids = torch.zeros(*shape, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autoshard.plan(model, p, {"input_ids": ids, "labels": ids}, outputs=mode, **COST)
        return plan, time.perf_counter() - t0, None
    except Exception as exc:                                     # noqa: BLE001 - recorded, never fatal
        return None, time.perf_counter() - t0, exc


# ----------------------------------------------------------------------------- running

def run_config(name: str, spec: Spec, degrees, with_layers: bool, log, with_depth: bool = True) -> tuple[dict, list[dict]]:
    info = {"hf_id": spec.hf_id, "config_class": spec.config, "model_class": None, "published": spec.kwargs,
            "layers_built": LAYERS, "attn_implementation": spec.attn, "parallel_layers": spec.parallel,
            "remark": spec.remark, "moe": spec.moe, "dense_formula_is_bar": spec.bar}
    rows = []
    try:
        cfg, model = build(spec, LAYERS)
        cfg4, model4 = build(spec, 2 * LAYERS) if with_layers else (None, None)
        depth = spec.kwargs[spec.layers_key]
        cfgD, modelD = build(spec, depth) if with_depth else (None, None)
        fake = recipe_copy(model, {}, fake=True) if spec.moe else None     # plan.memory exact (docstring)
    except Exception as exc:                                     # noqa: BLE001
        info["build_error"] = first_line(exc)
        log(f"{name}: build failed: {info['build_error']}")
        for p in degrees:
            for mode in MODES:
                rows.append({"config": name, "p": p, "outputs": mode, "note": "build: " + info["build_error"]})
        return info, rows
    info["model_class"] = type(model).__name__
    total = sum(t.numel() for t in model.parameters())           # unique: a tied weight once
    n_heads, n_kv = heads(cfg)
    h, vocab = cfg.hidden_size, cfg.vocab_size
    info.update(hidden=h, vocab=vocab, heads=n_heads, kv_heads=n_kv, params_total=total,
                params_total_4_layers=sum(t.numel() for t in model4.parameters()) if model4 is not None else None)
    for p in degrees:
        for mode in MODES:
            ref = megatron(h, vocab, LAYERS, p, mode, spec.parallel, spec.norms)
            row = {"config": name, "p": p, "outputs": mode, "megatron": ref, "params_total": total}
            notes = []
            odd = [f"{k} {v}" for k, v in (("heads", n_heads), ("kv heads", n_kv), ("vocab", vocab)) if v % p]
            if odd:
                notes.append(f"not divisible by {p}: " + ", ".join(odd))
            plan, secs, err = timed_plan(model, p, mode)
            row["plan_seconds"] = secs
            if err is not None:
                notes.insert(0, "plan failed: " + first_line(err))
                row["error_traceback"] = traceback.format_exception(err)[-3:]
            else:
                row.update(comm_bytes=plan.comm_bytes, comm_by_kind={k: list(v) for k, v in plan.comm_by_kind.items()},
                           params_per_rank=plan.params_per_rank, plan_params_total=plan.params_total,
                           tracer=plan.tracer, params_ratio=plan.params_per_rank / (total / p),
                           collectives=carriers(plan), unsupported=len(plan.unsupported))
                row["ratio" if spec.bar else "dense_formula_ratio"] = plan.comm_bytes / ref["total"]
                if not spec.bar:
                    notes.append(f"no dense bar ({spec.remark.split(';')[0]}): dense formula "
                                 f"x{row['dense_formula_ratio']:.3f}")
            if spec.moe and plan is not None:
                row["moe"] = moe_of(plan, model)
                row["memory_meta"] = memory_of(plan)
                planF, secsF, errF = timed_plan(fake, p, mode, device="cpu")
                row["plan_seconds_memory"] = secsF
                if errF is not None:
                    notes.append("fake-tensor plan (memory) failed: " + first_line(errF))
                else:
                    row.update(memory=memory_of(planF), memory_plan_comm_bytes=planF.comm_bytes)
                    if planF.comm_bytes != plan.comm_bytes:
                        notes.append(f"the fake-tensor plan moves {planF.comm_bytes / plan.comm_bytes:.4f} of the bytes")
                del planF
            if model4 is not None:
                plan4, secs4, err4 = timed_plan(model4, p, mode)
                row["plan_seconds_4_layers"] = secs4
                if err4 is not None:
                    notes.append("4-layer plan failed: " + first_line(err4))
                elif plan is not None:
                    row["comm_bytes_4_layers"] = plan4.comm_bytes
                    row["layers_share" if spec.bar else "dense_formula_layers_share"] = \
                        (plan4.comm_bytes - plan.comm_bytes) / ref["two_layers"]
                del plan4
            if modelD is not None:                       # the published depth: what a user's step moves
                planD, secsD, errD = timed_plan(modelD, p, mode)
                row["plan_seconds_depth"] = secsD
                if errD is not None:
                    notes.append(f"{depth}-layer plan failed: " + first_line(errD))
                else:
                    refD = megatron(h, vocab, depth, p, mode, spec.parallel, spec.norms)
                    row.update(depth=depth, comm_bytes_depth=planD.comm_bytes, megatron_depth=refD["total"])
                    row["ratio_depth" if spec.bar else "dense_formula_ratio_depth"] = planD.comm_bytes / refD["total"]
                    if spec.moe:
                        row["moe_depth"] = {k: v for k, v in moe_of(planD, modelD).items() if k != "strategies"}
                del planD
            row["note"] = "; ".join(notes)
            rows.append(row)
            log(f"{name:13s} p={p} {mode:7s} " + (
                f"comm {row['comm_bytes'] / 2**20:9.1f} MiB  Megatron {ref['total'] / 2**20:9.1f} MiB  "
                f"ratio {fmt(row.get('ratio'), 3)}  layers {fmt(row.get('layers_share'))}  "
                f"params {row['params_ratio']:.3f}  at L={row.get('depth', '-')} {fmt(row.get('ratio_depth'), 3)}"
                if "comm_bytes" in row else "") + (
                f"  experts {row['moe']['strategy_counts']} expert-weight gathers "
                f"{row['moe']['expert_weight_gathers']} (at L={row.get('depth', '-')}: "
                f"{row.get('moe_depth', {}).get('expert_weight_gathers', '-')})  activations "
                f"{row['memory']['activations'] / 2**20:.0f} MiB peak {row['memory']['peak'] / 2**30:.2f} GiB"
                if row.get("memory") else "") + f"  {secs:.1f} s  {row['note']}")
            del plan
    return info, rows


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows, configs) -> str:
    head = ["configuration", "p", "outputs", "comm MiB", "Megatron MiB", "comm/Megatron", "layers' share",
            "published depth: L, comm/Megatron", "params/(1/p)", "plan s", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        par = " ‡" if configs.get(r["config"], {}).get("parallel_layers") else ""
        cells = [r["config"] + par, str(r["p"]), r["outputs"],
                 fmt(r["comm_bytes"] / 2**20, 1) if "comm_bytes" in r else "-",
                 fmt(r["megatron"]["total"] / 2**20, 1) if "megatron" in r else "-",
                 fmt(r.get("ratio"), 3), fmt(r.get("layers_share"), 3),
                 f"{r['depth']}: {r['ratio_depth']:.3f}" if "ratio_depth" in r else "-", fmt(r.get("params_ratio"), 3),
                 fmt(r.get("plan_seconds"), 1), (r.get("note") or "").replace("|", "\\|")]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"T = {BATCH} x {SEQ} tokens, fp32, {LAYERS} layers; bytes are ring bytes per rank per step "
               "(forward + backward). Megatron = (4L+2) all-reduces of T x h + 3 all-reduces of T (loss) "
               "+ with outputs=full one all-gather of T x V. ‡ parallel attention + MLP (Falcon parallel_attn, "
               "Phi-2): (2L+2) all-reduces of T x h instead, GPT-NeoX (a norm per branch) (3L+2). layers' share = "
               "(comm(4 layers) - comm(2 layers)) / Megatron bytes of 2 layers. params/(1/p) = params per rank "
               "/ (unique parameters / p). published depth: the same plan and formula at the published number of "
               "layers (the embedding, head and loss then weigh what they do in a real step). "
               "\"not divisible by p\": heads / kv heads (Megatron has no head-parallel plan) "
               "or vocab (Megatron pads it).")
    return "\n".join(out)


def moe_table(rows) -> str:
    """The mixtures of experts' rows: bytes against the bar, parameters, what the experts ops run, the
    expert weights moved, the router's gradient and the memory per rank (2 layers)."""
    head = ["configuration", "p", "outputs", "comm/Megatron", "params/(1/p)", "experts' strategies",
            "expert-weight collectives (all-gathers)", "at published depth", "router grad KiB",
            "activations MiB", "peak GiB (at)", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r.get("moe")
        if m is None:
            continue
        mem, md = r.get("memory") or {}, r.get("moe_depth")
        ratio = fmt(r.get("ratio"), 3) if "ratio" in r else (
            f"({r['dense_formula_ratio']:.3f}: no bar)" if "dense_formula_ratio" in r else "-")
        cells = [r["config"], str(r["p"]), r["outputs"], ratio, fmt(r.get("params_ratio"), 3),
                 ", ".join(f"{k} x{v}" for k, v in sorted(m["strategy_counts"].items())),
                 f"{len(m['expert_weight_collectives'])} ({m['expert_weight_gathers']})",
                 f"L={r['depth']}: {len(md['expert_weight_collectives'])} ({md['expert_weight_gathers']}), "
                 f"{md['experts_ops']} experts ops" if md else "-",
                 fmt(m["router_grad_ring_bytes"] / 2**10, 1),
                 fmt(mem["activations"] / 2**20, 0) if mem else "-",
                 f"{mem['peak'] / 2**30:.2f} ({mem['peak_at']})" if mem else "-",
                 (r.get("note") or "").replace("|", "\\|")]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append("experts' strategies: `plan.nodes[n].strategy` of each `autoshard::experts` node (2 layers). "
               "expert-weight collectives: redistributions of a 3-D expert parameter or of what an experts op "
               "reads as its weights (all-gathers among them in brackets). router grad: ring bytes of the "
               "routing weights' gradient all-reduce (T x k floats a layer). activations, peak: `plan.memory` "
               "of the same call on a fake-tensor copy of the 2-layer model (the meta model's, kept in the JSON "
               "as memory_meta, is the same since commit 398c5da).")
    return "\n".join(out)


def dense_twin(spec: Spec) -> Spec:
    """Mixtral's dense twin: MistralConfig with Mixtral's numbers (attention, hidden size, FFN size
    14336, vocabulary, depth), no experts."""
    kw = {k: v for k, v in spec.kwargs.items()
          if k not in ("num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef")}
    return Spec(spec.hf_id + " (dense twin: MistralConfig, the same numbers)", "MistralConfig", kw,
                remark="Mixtral-8x7B without experts")


def moe_memory(log, layers: int = MOE_MEMORY["layers"], p: int = MOE_MEMORY["p"], shape=MOE_MEMORY["shape"],
               outputs: str = MOE_MEMORY["outputs"]) -> dict:
    """Mixtral-8x7B's activations per rank (`plan.memory`, a fake-tensor copy: exact) against its dense
    twin's, both planned alike at `p` ranks on input ids of `shape` with `layers` layers."""
    mix = CONFIGS["mixtral-8x7b"]
    res = {"p": p, "input_shape": list(shape), "tokens": shape[0] * shape[1], "layers": layers, "outputs": outputs,
           "target": MOE_MEMORY["target"], "models": {}}
    for name, spec in (("mixtral-8x7b", mix), ("dense twin", dense_twin(mix))):
        rec = {"hf_id": spec.hf_id, "config_class": spec.config}
        try:
            cfg, model = build(spec, layers)
            fake = recipe_copy(model, {}, fake=True)
        except Exception as exc:                                 # noqa: BLE001
            rec["build_error"] = first_line(exc)
            res["models"][name] = rec
            log(f"{name}: build failed: {rec['build_error']}")
            continue
        rec.update(model_class=type(model).__name__, params_total=sum(t.numel() for t in model.parameters()))
        plan, secs, err = timed_plan(fake, p, outputs, shape=shape, device="cpu")
        rec["plan_seconds"] = secs
        if err is not None:
            rec.update(error=first_line(err), error_traceback=traceback.format_exception(err)[-3:])
            log(f"{name}: plan failed: {rec['error']}")
        else:
            t0 = time.perf_counter()
            rec["memory"] = memory_of(plan)
            rec.update(memory_seconds=time.perf_counter() - t0, comm_bytes=plan.comm_bytes,
                       params_per_rank=plan.params_per_rank, largest=[list(x) for x in plan.memory.largest])
            if spec.moe:
                m = moe_of(plan, fake)
                rec["moe"] = {k: v for k, v in m.items() if k != "strategies"}
            mem = rec["memory"]
            log(f"{name:13s} L={layers} p={p} {tuple(shape)} {outputs}: activations {mem['activations'] / 2**30:.3f} GiB"
                f"  peak {mem['peak'] / 2**30:.2f} GiB ({mem['peak_at']})  exact {mem['exact']}  "
                f"comm {plan.comm_bytes / 2**20:.1f} MiB  plan {secs:.1f} s"
                + (f"  experts {rec['moe']['strategy_counts']} gathers {rec['moe']['expert_weight_gathers']}"
                   if "moe" in rec else ""))
            del plan
        planM, secsM, errM = timed_plan(model, p, outputs, shape=shape)     # on meta, for the record
        if errM is None:
            rec.update(memory_meta=memory_of(planM), comm_bytes_meta=planM.comm_bytes,
                       plan_seconds_meta=secsM)
        del planM
        res["models"][name] = rec
    a, b = (res["models"].get(k, {}).get("memory") for k in ("mixtral-8x7b", "dense twin"))
    if a and b:
        res["activations_ratio"] = a["activations"] / b["activations"]
        res["peak_ratio"] = a["peak"] / b["peak"]
        log(f"activations per rank, Mixtral-8x7B / dense twin: {res['activations_ratio']:.3f} "
            f"(target at most {MOE_MEMORY['target']}); peak {res['peak_ratio']:.3f}")
    a, b = (res["models"].get(k, {}).get("memory_meta") for k in ("mixtral-8x7b", "dense twin"))
    if a and b:
        res["activations_ratio_meta"] = a["activations"] / b["activations"]
    return res


def flagged(rows, threshold: float) -> str:
    """Per configuration with a row above `threshold` (comm/Megatron or layers' share): the rows above
    it, then the largest collectives of the worst of them."""
    lines, by_config = [], {}
    for r in rows:
        if r.get("ratio") is not None and max(r["ratio"], r.get("layers_share") or 0) > threshold:
            by_config.setdefault(r["config"], []).append(r)
    for name, rs in by_config.items():
        r = max(rs, key=lambda x: (x["ratio"], x["p"]))
        lines.append(f"{name}: above {threshold} at " + ", ".join(
            f"p={x['p']} {x['outputs']} ({x['ratio']:.2f}, layers {fmt(x.get('layers_share'))})" for x in rs))
        lines.append(f"  worst, p={r['p']} outputs={r['outputs']}: collectives by kind " + ", ".join(
            f"{k} x{int(c)} {b / 2**20:.1f} MiB" for k, (c, b) in sorted(r["comm_by_kind"].items())))
        for c in r["collectives"][:TOP]:
            lines.append(f"    {c['ring_bytes'] / 2**20:9.1f} MiB  {c['node']} {c['what']} "
                         f"fwd {'+'.join(c['forward']) or '-'} bwd {'+'.join(c['backward']) or '-'}"
                         f"  read by {c['reader']} ({c['module'] or '-'})")
    return "\n".join(lines)


def env() -> dict:
    """common.env_info() and what this script adds: transformers' version, threads, the load."""
    info = env_info()
    info.update(transformers=transformers.__version__, threads=torch.get_num_threads(), load_avg=os.getloadavg())
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated configuration names (see --list)")
    ap.add_argument("--degrees", default="2,4,8", help="comma-separated tensor-parallel degrees")
    ap.add_argument("--json", default=None, help=f"output JSON (default {RESULTS / 'real_configs.json'})")
    ap.add_argument("--no-layers", action="store_true", help="skip the 4-layer plans (no layers' share)")
    ap.add_argument("--no-depth", action="store_true", help="skip the plans at the published depth")
    ap.add_argument("--flag", type=float, default=1.25,
                    help="print the largest collectives of rows whose comm/Megatron or layers' share exceeds this")
    ap.add_argument("--list", action="store_true", help="list the configurations and exit")
    ap.add_argument("--moe", action="store_true",
                    help="the mixtures of experts only (default JSON benchmarks/results/real_configs_moe.json)")
    ap.add_argument("--moe-memory", action="store_true",
                    help=f"only Mixtral-8x7B's activations per rank against its dense twin's ({MOE_MEMORY['p']} "
                         f"ranks, ids {MOE_MEMORY['shape']}, {MOE_MEMORY['layers']} layers unless --moe-memory-layers)")
    ap.add_argument("--moe-memory-layers", type=int, default=MOE_MEMORY["layers"], help="depth for --moe-memory")
    ap.add_argument("--memory-weight", type=float, default=None,
                    help="plan at this fixed price of training state, seconds a byte (e.g. 1e-9); default: the "
                         "planner's objective without a price (the fastest plan within about 1/p of the least state)")
    args = ap.parse_args(argv)
    if args.memory_weight is not None:
        COST["memory_weight"] = args.memory_weight
    if args.list:
        for k, s in CONFIGS.items():
            print(f"{k:17s} {s.hf_id:36s} {s.remark}")
        return 0
    if args.moe_memory:
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        res = moe_memory(lambda s: print(s, flush=True), layers=args.moe_memory_layers)
        res.update(env=env(), total_seconds=time.perf_counter() - t0)
        path = Path(args.json) if args.json else RESULTS / "real_configs_moe_memory.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"wrote {path}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else \
        [n for n, s in CONFIGS.items() if s.moe == args.moe]          # by default the dense ones, --moe the others
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    degrees = [int(d) for d in args.degrees.split(",") if d.strip()]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    configs, rows = {}, []
    for name in names:
        info, rs = run_config(name, CONFIGS[name], degrees, not args.no_layers, lambda s: print(s, flush=True),
                              not args.no_depth)
        configs[name] = info
        rows.extend(rs)
    total = time.perf_counter() - t0
    print()
    print(table(rows, configs))
    if any("moe" in r for r in rows):
        print("\nmixtures of experts:\n")
        print(moe_table(rows))
    bad = flagged(rows, args.flag)
    if bad:
        print(f"\nlargest collectives of rows above {args.flag} (comm/Megatron or layers' share):")
        print(bad)
    failed = [r for r in rows if "comm_bytes" not in r]
    print(f"\n{len(rows)} rows, {len(failed)} failed to plan; total {total:.0f} s")
    path = Path(args.json) if args.json else RESULTS / ("real_configs_moe.json" if args.moe else "real_configs.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    res = {"env": env(), "settings": {"batch": BATCH, "seq": SEQ, "tokens": TOKENS, "bytes_per_element": BYTES,
                                      "layers": LAYERS, "degrees": degrees, "modes": list(MODES),
                                      "layers_share": not args.no_layers, "published_depth": not args.no_depth},
           "formula": "Megatron ring bytes per rank per step: (4L+2) [parallel layers: (2L+2)] all_reduce of "
                      "T*h*4 + 3 all_reduce of T*4 + (outputs=full) all_gather of T*V*4",
           "configs": configs, "rows": rows, "total_seconds": total}
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
