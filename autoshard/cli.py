"""Command line: `python -m autoshard plan MODULE:FACTORY --world-size N ...` prints a sharding plan;
`python -m autoshard demo ...` runs autoshard.demo; `python -m autoshard convert SRC DST` converts a
sharded checkpoint (a DCP directory) to one torch.save file of full tensors, or back;
`python -m autoshard verify CKPT_DIR` checks a checkpoint directory (every block against its
checksums, .metadata against the files) and prints what is wrong.

    python -m autoshard plan tests.factories:gpt --world-size 4 --input-shape 2,64 --dtype long
    python -m autoshard plan tests.models:GPT --world-size 2 --pin head=None --search exact
    python -m autoshard plan path/to/model.py:build --world-size 8 --tracer export --json
    python -m autoshard plan tests.factories:gpt --world-size 2 --input-shape 2,64 --dtype long --draw plan.svg
    python -m autoshard plan --from-pretrained path/to/hf_checkpoint -n 8
    python -m autoshard plan tests.factories:gpt -n 2 --input-shape 4,64 --dtype long --pp 2 --microbatches 2
    python -m autoshard plan path/to/model.py:build -n 4 --pp 3 --split 3,3,2 --schedule GPipe --json
    python -m autoshard convert ckpt/step100 full.pt        # DCP directory -> torch.save file
    python -m autoshard convert full.pt ckpt/step0          # torch.save file -> DCP directory
    python -m autoshard verify ckpt/step100                 # before resuming, or after a copy

--from-pretrained DIR builds the Hugging Face model of DIR/config.json on the meta device (no
weight is read). The report ends with the memory of a training step per rank (parameters,
gradients, optimizer state, activations and the peak: `plan.memory`).

FACTORY is called with no arguments and returns an nn.Module, or (module, example_inputs) where
example_inputs is a tuple of positional arguments or a dict of keyword arguments (the builders
of tests/hf_models.py return that). With --input-shape (repeat it for several positional inputs)
the inputs are zeros of those shapes and --dtype(s); with neither, a batch of --tokens positions
is synthesised. Exit status: 0 on success, 1 when planning fails (verify: when the checkpoint has a
problem), 2 on bad arguments.

--pp N (default 1: none) plans N pipeline stages of --world-size tensor-parallel ranks each
(`autoshard.plan_pipeline`, no process group) and prints the stage table (blocks, predicted times,
memory, bytes sent, bubble) after the tensor-parallel report, which is then that of one microbatch;
--json adds a "pipeline" object. The example's batch is cut into --microbatches M (default: N, or
the batch's next divisor above N, or the batch if smaller); a batch M does not divide is a bad
argument. A synthesised input holds M sequences of --tokens positions. --schedule GPipe, 1F1B
(default), Interleaved1F1B or InterleavedZeroBubble (the last two: --stages-per-rank K, default 2,
stages a rank); --split 3,3,2 pins the blocks per stage.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys

_DTYPES = {"long": "int64", "int": "int32", "int64": "int64", "int32": "int32", "float": "float32",
           "float32": "float32", "fp32": "float32", "half": "float16", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "bool": "bool"}


class CliError(Exception):
    """A bad argument: printed as `autoshard: error: ...`, exit status 2."""


def _shape(text: str) -> tuple:
    try:
        dims = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-shape wants comma-separated sizes like 2,64; got {text!r}")
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(f"--input-shape wants non-negative sizes like 2,64; got {text!r}")
    return dims


def _dtype(text: str) -> str:
    name = _DTYPES.get(text.lower().removeprefix("torch."))
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; one of {', '.join(sorted(_DTYPES))}")
    return name


def _pin(text: str) -> tuple:
    name, sep, dim = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--pin wants NAME=DIM (DIM one of None, 0, 1, -1); got {text!r}")
    d = dim.strip().lower()
    if d in ("none", "replicate", "r", ""):
        return name, None
    value = int(d) if d.lstrip("-").isdigit() else None
    if value not in (0, 1, -1):
        raise argparse.ArgumentTypeError(f"--pin {name}: DIM must be None, 0, 1 or -1; got {dim!r}")
    return name, value


def _split(text: str) -> list:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"--split wants blocks per stage like 3,3,2; got {text!r}")
    return counts


def _weight(s: str):
    """--memory-weight: seconds per byte, or 'none' (no price)."""
    return "none" if s.lower() == "none" else float(s)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m autoshard",
                                 description="autoshard: automatic tensor parallelism by torch.fx graph rewriting")
    sub = ap.add_subparsers(dest="command", metavar="{plan,demo,convert,verify,advise}")
    sub.required = True
    pp = sub.add_parser("plan", help="plan a model and print the sharding-plan report",
                        description="Build a model with MODULE:FACTORY, plan it and print the report.")
    pp.add_argument("target", metavar="MODULE:FACTORY", nargs="?",
                    help="importable module (or path to a .py file) and a zero-argument callable in it")
    pp.add_argument("--from-pretrained", metavar="DIR",
                    help="plan the Hugging Face checkpoint directory DIR from its config (on meta, no weights read)")
    pp.add_argument("--weights-dtype", type=_dtype, help="--from-pretrained: dtype of the parameters (default: the config's)")
    pp.add_argument("--world-size", "-n", type=int, required=True, help="tensor-parallel degree")
    pp.add_argument("--input-shape", type=_shape, action="append", default=[], metavar="D0,D1,...",
                    help="shape of one positional input (repeat for several); values are zeros")
    pp.add_argument("--dtype", type=_dtype, action="append", default=[],
                    help="dtype of the inputs: one for all, or one per --input-shape (default float)")
    pp.add_argument("--pin", type=_pin, action="append", default=[], metavar="NAME=DIM",
                    help="fix a module's TorchShard dim (None, 0, 1, -1); repeatable")
    pp.add_argument("--search", choices=("greedy", "exact", "optimal"), default="greedy", help="optimal: autoshard[optimal]")
    pp.add_argument("--tracer", choices=("auto", "symbolic_trace", "export"), default="auto")
    pp.add_argument("--tokens", type=int, default=512, help="positions of a synthesised input (no --input-shape)")
    pp.add_argument("--outputs", choices=("full", "sharded"), default="full",
                    help="return outputs whole (default) or leave split ones split (DTensors at run time)")
    pp.add_argument("--bandwidth", type=float, help="bytes/s a rank sends (cost model)")
    pp.add_argument("--latency", type=float, help="seconds per ring step (cost model)")
    pp.add_argument("--memory-weight", type=_weight, help="seconds per byte of training state (cost model), or 'none' "
                    "(default): no price, the fastest plan within about 1/p of the least state")
    pp.add_argument("--memory-budget", help="peak bytes of a training step per rank, e.g. 30GB (the fastest plan "
                    "that fits; an error names the smallest reachable peak)")
    pp.add_argument("--sequence-parallel", choices=("auto", "on", "off"), default="auto",
                    help="hold the stream, norms and dropouts split on tokens between row- and column-parallel "
                         "layers (Megatron's sequence parallelism): on, off, or auto (default: only where a "
                         "--memory-budget needs it)")
    pp.add_argument("--optimizer", help="optimizer whose state the memory counts: adamw (default), adam, sgd, "
                    "sgd_momentum, adagrad, rmsprop, or a number of moments per parameter")
    pp.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline stages of --world-size ranks each: "
                    "also print the pipeline plan (default 1: no pipeline)")
    pp.add_argument("--microbatches", type=int, metavar="M", help="--pp: microbatches of the batch, which M must "
                    "divide (default: N, or the next divisor of the batch above N)")
    pp.add_argument("--schedule", choices=("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"),
                    help="--pp: pipeline schedule (default 1F1B)")
    pp.add_argument("--stages-per-rank", type=int, metavar="K",
                    help="--pp: stages a pipeline rank holds, N x K in all (default 1; 2 with Interleaved*)")
    pp.add_argument("--split", type=_split, metavar="B0,B1,...",
                    help="--pp: blocks per stage, e.g. 3,3,2 (default: balance the stages' predicted time)")
    pp.add_argument("--json", action="store_true", help="print a JSON summary instead of the report")
    pp.add_argument("--export", choices=("dtensor", "hf"),
                    help="print the plan as another engine's plan instead of the report: dtensor (Python for "
                         "parallelize_module) or hf (JSON, a transformers tp_plan); what it leaves replicated "
                         "and the bytes each plan moves go to stderr")
    pp.add_argument("--base-model-prefix", metavar="NAME",
                    help="--export hf: keys relative to this base model (config.base_model_tp_plan), e.g. model")
    pp.add_argument("--loss-parallel", action="store_true",
                    help="--export dtensor: leave split logits sharded for a loss under loss_parallel()")
    pp.add_argument("--draw", metavar="PATH", help="also write a picture of the plan to PATH (.svg or .png; "
                    "needs matplotlib: pip install 'autoshard[draw]')")
    cp = sub.add_parser("convert", help="sharded checkpoint (DCP directory) <-> one torch.save file",
                        description="Convert a DCP checkpoint directory into a torch.save file of full tensors "
                                    "(SRC a directory), or a torch.save file into a DCP checkpoint that loads at any "
                                    "degree (SRC a file).")
    cp.add_argument("src", metavar="SRC", help="a DCP checkpoint directory or a torch.save file")
    cp.add_argument("dst", metavar="DST", help="the file or directory to write")
    vp = sub.add_parser("verify", help="check a sharded checkpoint (DCP directory): every block, the files",
                        description="Read every saved item of a DCP checkpoint directory once and check it against "
                                    ".checksums (every block) and .metadata (files missing, items past the end of "
                                    "a file); print every problem found. Exit status 1 when there is one.")
    vp.add_argument("checkpoint", metavar="CKPT_DIR", help="a DCP checkpoint directory")
    dp = sub.add_parser("demo", help="run autoshard.demo (arguments are passed on)", add_help=False)
    dp.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def load_factory(target: str):
    """The callable named by MODULE:FACTORY (MODULE may be a dotted name or a .py path)."""
    mod_name, sep, attr = target.rpartition(":")
    if not sep or not mod_name or not attr:
        raise CliError(f"target must look like MODULE:FACTORY (e.g. tests.factories:gpt), got {target!r}")
    if mod_name.endswith(".py") or os.sep in mod_name:
        if not os.path.isfile(mod_name):
            raise CliError(f"no such file: {mod_name}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(mod_name)))
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - reported with its cause
            raise CliError(f"importing {mod_name} failed: {type(e).__name__}: {e}") from e
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            raise CliError(f"cannot import {mod_name!r}: {e} (run from the directory that holds it, or set "
                           "PYTHONPATH)") from e
        except Exception as e:  # noqa: BLE001
            raise CliError(f"importing {mod_name!r} failed: {type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise CliError(f"{mod_name} has no {attr!r}; callables there: {', '.join(names[:20])}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"{target} is a {type(obj).__name__}, not a callable that builds a model")
    return obj


def build_model(target: str):
    """(model, example_inputs or None) from MODULE:FACTORY."""
    import torch.nn as nn
    factory = load_factory(target)
    try:
        built = factory()
    except Exception as e:  # noqa: BLE001
        raise CliError(f"{target}() failed: {type(e).__name__}: {e}") from e
    example = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, example = built
    if not isinstance(built, nn.Module):
        raise CliError(f"{target}() returned a {type(built).__name__}, not an nn.Module "
                       "(or a (module, example_inputs) pair)")
    return built, example


def make_inputs(shapes, dtypes):
    import torch
    if not shapes:
        if dtypes:
            raise CliError("--dtype needs --input-shape")
        return None
    if len(dtypes) > 1 and len(dtypes) != len(shapes):
        raise CliError(f"{len(dtypes)} --dtype for {len(shapes)} --input-shape: give one, or one per shape")
    dts = [getattr(torch, d) for d in (dtypes or ["float32"])]
    dts = dts * len(shapes) if len(dts) == 1 else dts
    return tuple(torch.zeros(s, dtype=d) for s, d in zip(shapes, dts))


def summary(plan) -> dict:
    """What --json prints: the plan's decisions and predicted costs."""
    return {
        "world_size": plan.world_size, "tracer": plan.tracer, "search": plan.search,
        "dims": dict(plan.dims), "layouts": {k: str(v) for k, v in plan.layouts.items()},
        "comm_bytes": plan.comm_bytes, "comm_by_kind": {k: list(v) for k, v in plan.comm_by_kind.items()},
        "comm_time": plan.comm_time, "compute_time": plan.compute_time, "step_time": plan.step_time,
        "params_total": plan.params_total, "params_per_rank": plan.params_per_rank,
        "unsupported": list(plan.unsupported), "notes": list(plan.notes), "search_seconds": plan.search_seconds,
        "outputs": plan.outputs, "output_placements": {k: str(v) for k, v in plan.output_placements.items()},
        "memory": dict(plan.memory, peak_at=plan.memory.peak_at), "checkpointed": list(plan.checkpointed),
        "sequence_parallel": plan.sequence_parallel,
    }


def pipeline_options(args) -> dict | None:
    """--pp and its options, checked: plan_pipeline's keywords, or None for --pp 1."""
    given = [f for f, v in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                            ("--stages-per-rank", args.stages_per_rank), ("--split", args.split)) if v is not None]
    if args.pp < 1 or args.pp == 1 and given or args.pp > 1 and args.export:
        raise CliError(f"--pp must be >= 1, got {args.pp}" if args.pp < 1 else
                       f"{', '.join(given)}: for a pipeline, with --pp 2 or more" if args.pp == 1 else
                       "--export writes a tensor-parallel plan for another engine; it does not take --pp")
    if args.pp == 1:
        return None
    if args.microbatches is not None and args.microbatches < 1:
        raise CliError(f"--microbatches must be >= 1, got {args.microbatches}")
    schedule = args.schedule or "1F1B"
    many = schedule.startswith("Interleaved")
    k = args.stages_per_rank if args.stages_per_rank is not None else 2 if many else 1
    if k < 1 or k > 1 and not many:
        raise CliError(f"--stages-per-rank must be >= 1, got {k}" if k < 1 else f"--schedule {schedule} runs one "
                       f"stage a rank; for --stages-per-rank {k} use --schedule Interleaved1F1B")
    return {"pp": args.pp, "schedule": schedule, "stages_per_rank": k, "split": args.split}


def pipeline_example(model, example, source: str | None, args) -> tuple:
    """(example, microbatches, batch) for --pp. `source` None: a synthesised example, one sequence
    a microbatch; else one whose batch (dim 0 of its first batched tensor, as autoshard.pipeline
    reads it) --microbatches must divide (by default --pp, or the next divisor of the batch above)."""
    import torch
    from torch.utils import _pytree as pytree
    if source is None:
        from .capture.trace import synthesize_inputs
        m = args.microbatches or args.pp
        one = example if example is not None else synthesize_inputs(model, args.tokens)
        return pytree.tree_map(lambda x: x.expand(m, *x.shape[1:]).contiguous() if isinstance(x, torch.Tensor)
                               and x.dim() > 0 and x.shape[0] == 1 else x, one), m, m
    batch = next((x.shape[0] for x in pytree.tree_leaves(example) if isinstance(x, torch.Tensor) and x.dim() > 0),
                 None)
    if batch is None:                       # autoshard.plan_pipeline says what is wrong
        return example, args.microbatches or args.pp, None
    m = args.microbatches or min((d for d in range(args.pp, batch + 1) if batch % d == 0), default=batch)
    if m != args.pp and not args.microbatches:
        print(f"autoshard: {m} microbatches, " + (f"the batch of {batch} ({source}) is smaller than --pp {args.pp}"
              if m < args.pp else f"the fewest from --pp {args.pp} up that divide the batch of {batch} ({source})"),
              file=sys.stderr)
    if batch % m or batch == 0:
        raise CliError(f"--microbatches {m}: the example's batch of {batch} ({source}) does not split into {m} "
                       f"equal microbatches; give a batch that is a multiple of {m}, or other --microbatches")
    return example, m, batch


def pipeline_summary(pplan) -> dict:
    """The "pipeline" object of --json: the blocks of each stage and the predicted costs."""
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(pplan).items() if k != "tensor_parallel"}
    return dict(out, stages=[list(names) for names in pplan.stages], balance=pplan.balance)


def cmd_plan(args, out) -> int:
    import autoshard
    if args.world_size < 1:
        raise CliError(f"--world-size must be >= 1, got {args.world_size}")
    piped = pipeline_options(args)
    if (args.target is None) == (args.from_pretrained is None):
        raise CliError("give either MODULE:FACTORY or --from-pretrained DIR")
    if args.from_pretrained is not None:
        from .io.loading import example_ids, meta_model
        from .errors import LoadError
        try:
            model = meta_model(args.from_pretrained, args.weights_dtype)
        except (LoadError, ImportError, OSError, ValueError) as e:
            raise CliError(f"--from-pretrained {args.from_pretrained}: {e}") from e
        example = example_ids(model, args.tokens)
        source = None                       # synthesised
        if args.tracer == "auto":
            args.tracer = "export"
    else:
        model, example = build_model(args.target)
        source = None if example is None else f"the example of {args.target}"
    inputs = make_inputs(args.input_shape, args.dtype)
    if inputs is not None:
        example = inputs
        source = "--input-shape " + " --input-shape ".join(",".join(map(str, s)) for s in args.input_shape)
    if args.draw:                           # before planning, which can take a while
        from .views.draw import FORMATS
        if os.path.splitext(args.draw)[1].lower() not in FORMATS:
            raise CliError(f"--draw {args.draw}: the extension picks the format, one of {', '.join(FORMATS)}")
    knobs = {k: getattr(args, k) for k in ("bandwidth", "latency", "memory_weight", "memory_budget", "optimizer")
             if getattr(args, k) is not None}
    if knobs.get("memory_weight") == "none":
        knobs["memory_weight"] = None
    if knobs.get("optimizer", "").isdigit():
        knobs["optimizer"] = int(knobs["optimizer"])
    pins = dict(args.pin)
    sequence = {"auto": None, "on": True, "off": False}[args.sequence_parallel]
    options = dict(pin=pins or None, search=args.search, tracer=args.tracer, tokens=args.tokens,
                   outputs=args.outputs, sequence_parallel=sequence, **knobs)
    pplan = None
    if piped:
        from torch.utils import _pytree as pytree
        example, microbatches, batch = pipeline_example(model, example, source, args)
        pplan = autoshard.plan_pipeline(model, example, tp=args.world_size, microbatches=microbatches, **piped,
                                        **options)
        example = pytree.tree_map(lambda x: x[:batch // microbatches] if getattr(x, "shape", ())[:1] == (batch,)
                                  else x, example)      # the report: one microbatch, as every stage runs it
    plan = pplan.tensor_parallel if pplan is not None else autoshard.plan(model, args.world_size, example, **options)
    if args.export:
        exported = plan.export(args.export, **({"model": model, "loss_parallel": args.loss_parallel}
                                               if args.export == "dtensor" else
                                               {"base_model_prefix": args.base_model_prefix}))
        print(exported.python(), file=out)
        print(exported, file=sys.stderr)
    elif args.json:
        found = summary(plan)
        if pplan is not None:
            found["pipeline"] = pipeline_summary(pplan)
        print(json.dumps(found, indent=1), file=out)
    else:
        if pplan is not None:
            print(f"tensor-parallel plan of one microbatch ({batch // microbatches} of the batch's {batch}):\n")
        print(plan)
        print(f"\nmemory per rank of a training step at world size {plan.world_size} (bytes, "
              f"optimizer {plan.cost_model.optimizer}{'; the whole model at one microbatch' if pplan else ''}):")
        for k, v in plan.memory.items():
            print(f"  {k:<11} {v:>16,d}  ({v / 2 ** 30:.2f} GiB)")
        if pplan is not None:
            print()
            print(pplan)
    if args.draw:
        try:
            plan.draw(args.draw)
        except ImportError as e:
            raise CliError(str(e)) from e
        print(f"wrote {args.draw}", file=sys.stderr)
    return 0


def cmd_demo(argv) -> int:
    try:
        demo = importlib.import_module("autoshard.demo")
    except ModuleNotFoundError as e:
        if e.name == "autoshard.demo":
            raise CliError("autoshard.demo is not available in this installation") from e
        raise
    rc = demo.main(list(argv))
    return int(rc or 0)


def cmd_convert(args) -> int:
    from .io.checkpoint import dcp_to_torch_save, torch_save_to_dcp
    if os.path.isdir(args.src):
        dcp_to_torch_save(args.src, args.dst)
        print(f"wrote {args.dst} (torch.save of the full tensors of {args.src})")
    else:
        torch_save_to_dcp(args.src, args.dst)
        print(f"wrote {args.dst} (DCP checkpoint of {args.src})")
    return 0


def cmd_verify(args) -> int:
    from .io.checkpoint import verify
    report = verify(args.checkpoint)
    print(report)
    return 0 if report.ok else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["advise"]:               # the layout of a whole job (autoshard.advise.main)
        from .advise import main as advise
        return advise(argv[1:])
    if argv[:1] == ["demo"]:                 # everything after `demo` belongs to the demo
        try:
            return cmd_demo(argv[1:])
        except CliError as e:
            parser.exit(2, f"autoshard: error: {e}\n")
    args = parser.parse_args(argv)
    from .errors import AutoshardError
    if args.command == "verify":
        try:
            return cmd_verify(args)
        except OSError as e:
            parser.exit(1, f"autoshard: verify {args.checkpoint} failed: {type(e).__name__}: {e}\n")
    if args.command == "convert":
        try:
            return cmd_convert(args)
        except (AutoshardError, OSError) as e:
            parser.exit(1, f"autoshard: convert {args.src} -> {args.dst} failed: {e}\n")
    try:
        out = sys.stdout      # with --export or --json, what libraries print (DeepSpeed's line) goes to stderr
        with contextlib.redirect_stdout(sys.stderr if args.export or args.json else out):
            return cmd_plan(args, out)
    except CliError as e:
        parser.exit(2, f"autoshard: error: {e}\n")
    except (AutoshardError, ValueError, TypeError) as e:
        at = f"pp {args.pp} x tp {args.world_size}" if args.pp > 1 else f"world size {args.world_size}"
        parser.exit(1, f"autoshard: planning {args.target or args.from_pretrained} at {at} failed: "
                       f"{type(e).__name__}: {e}\n")
