"""Train autoshard's module with accelerate's own loop: `Accelerator(parallelism_config=...)`,
`prepare`, `backward`, `clip_grad_norm_`.

    torchrun --nproc_per_node 4 docs/examples/train_accelerate.py --tp 2     # 2 tensor-parallel x 2 data-parallel
    python docs/examples/train_accelerate.py --tp 1 --batch 4                # the same global batch, one process

autoshard's groups (`init_process_group(tp)`: tensor-parallel groups of consecutive ranks) are
the layout of accelerate's ("dp_shard", "tp") mesh, and the module carries `tp_size`, which
`prepare` checks: accelerate then splits the data by data-parallel rank (ranks of one
tensor-parallel group read the same batch) and wraps nothing in DDP. The module averages its
gradients over the data-parallel replicas itself, and `accelerator.clip_grad_norm_` of its
parameters is the norm over every shard (the module's `clip_grad_norm_`). Each run prints its
losses; they are those of one process with the same global batch.
"""
import argparse

import torch


def build(seed=0):
    """A tiny LLaMA (random weights) and 64 sequences of 8 random tokens."""
    import transformers
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                                      max_position_embeddings=32, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (64, 8), generator=torch.Generator().manual_seed(1))
    return model, [{"input_ids": x, "labels": x.clone()} for x in ids]


def train(tp=2, batch=2, steps=4, clip=0.05, lr=1e-2):
    """The losses of `steps` steps (mean over the global batch), on every rank."""
    import autoshard
    import autoshard.distributed as ad
    from accelerate import Accelerator, ParallelismConfig
    from torch.utils.data import DataLoader
    from transformers import default_data_collator
    model, data = build()
    if tp > 1:
        ad.init_process_group(tp)                      # before the Accelerator: its mesh's groups are the same
        example = default_data_collator(data[:batch])
        model = autoshard.parallelize(model, tp, example, tracer="export")
        config = ParallelismConfig(tp_size=tp, dp_shard_size=ad.data_parallel_size())
    else:
        config = None
    accelerator = Accelerator(parallelism_config=config, cpu=not torch.cuda.is_available())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loader = DataLoader(data, batch_size=batch, collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _, inputs in zip(range(steps), loader):
        loss = model(**inputs).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())   # tensor-parallel ranks hold one loss
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="per data-parallel replica")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    print("losses", train(a.tp, a.batch, a.steps))
