"""A tiny LLaMA trained by the Hugging Face Trainer, as a user would run it under torchrun:

    torchrun --nproc_per_node 4 hf_trainer.py --tp 2 --out DIR      # autoshard's module, tp 2 x dp 2
    python hf_trainer.py --tp 1 --batch 4 --out DIR                  # the model itself, one process

Each rank writes DIR/rank{R}.json: the Trainer's logged losses and gradient norms, the error a
mis-wiring raised (--miswire sampler|ddp), and, with --save, where `trainer.save_model` and
`gm.save_pretrained` wrote. Used by tests/test_trainers.py.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoshard  # noqa: E402 - before the process group exists
import autoshard.distributed as ad  # noqa: E402

VOCAB, SEQ, SAMPLES = 128, 8, 64


def build(seed=0):
    import transformers
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                      max_position_embeddings=32, tie_word_embeddings=False, use_cache=False,
                                      attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def parallel(model, data, tp, batch):
    """autoshard's module of `model` at degree `tp` (the model itself at 1), captured at a batch."""
    if tp == 1:
        return model
    example = {"input_ids": data[0]["input_ids"][None].repeat(batch, 1),
               "labels": data[0]["labels"][None].repeat(batch, 1)}
    return autoshard.parallelize(model, tp, example, tracer="export")


def logged(trainer) -> dict:
    """The losses and gradient norms the Trainer logged, step by step."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h.get("grad_norm") for h in logs]}


def make_trainer(module, data, out, batch, accum, steps, clip, save_steps=0):
    """A plain Trainer with plain TrainingArguments (constant lr 1e-2, clipping at `clip`, a loss
    logged every step, a checkpoint every `save_steps` steps where given)."""
    import transformers
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=steps,
        logging_steps=1, max_grad_norm=clip, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
        per_device_eval_batch_size=2, report_to=[], save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, use_cpu=True, disable_tqdm=True, seed=0, dataloader_drop_last=True,
        weight_decay=0.0)
    return transformers.Trainer(model=module, args=args, train_dataset=data)


def miswire(trainer, module, data, batch, how):
    """Wire `trainer` wrong as users do: "sampler", the data split over the whole world (the usual
    data-parallel recipe); "ddp", the module wrapped in DDP across the tensor-parallel ranks."""
    import transformers
    if how == "sampler":
        from torch.utils.data import DataLoader, DistributedSampler
        loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False),
                            collate_fn=transformers.default_data_collator)
        trainer.get_train_dataloader = lambda: loader
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(module)
        trainer._wrap_model = lambda model, training=True, dataloader=None: wrapped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="per device (per data-parallel replica)")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=0.05)
    ap.add_argument("--miswire", choices=["none", "sampler", "ddp"], default="none")
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import transformers
    transformers.logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", 0))
    model = build()
    data = dataset()
    if a.tp > 1:
        ad.init_process_group(a.tp, backend="gloo")
    module = parallel(model, data, a.tp, a.batch)
    result = {"rank": rank}
    trainer = make_trainer(module, data, os.path.join(a.out, "run"), a.batch, a.accum, a.steps, a.clip)
    miswire(trainer, module, data, a.batch, a.miswire)
    try:
        trainer.train()
    except autoshard.AutoshardError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result.update(logged(trainer))
    if a.save and "error" not in result:
        path = os.path.join(a.out, "saved")
        module.save_pretrained(path) if a.tp > 1 else trainer.save_model(path)
        result["saved"] = path
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
