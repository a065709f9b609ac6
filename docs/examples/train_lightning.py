"""Train autoshard's module with Lightning's `ModelParallelStrategy`: the `configure_model` hook
parallelizes on the strategy's device mesh.

    torchrun --nproc_per_node 4 docs/examples/train_lightning.py --tp 2     # 2 tensor-parallel x 2 data-parallel
    python docs/examples/train_lightning.py --tp 1 --batch 4                # the same global batch, one process

`configure_model` calls `autoshard.parallelize(..., group=self.device_mesh["tensor_parallel"])`;
the module finds its data-parallel group in the same mesh and averages its gradients over it.
Lightning splits the data by the mesh's data-parallel rank (its DistributedSampler), so the ranks
of a tensor-parallel group read the same batch. `configure_gradient_clipping` clips by the norm
over every shard (the module's `clip_grad_norm_`; Lightning's own clips each rank's tensors by
their local norm). Each rank prints the losses of its data-parallel replica's batch.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_accelerate import build  # noqa: E402 - the same tiny LLaMA and data


def train(tp=2, batch=2, steps=4, clip=0.05, lr=1e-2, world=None):
    """This rank's losses of `steps` steps (mean over its data-parallel replica's batch)."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader
    from transformers import default_data_collator
    import autoshard

    model, data = build()

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = model, []

        def configure_model(self):
            if tp > 1:
                mesh = self.device_mesh["tensor_parallel"]
                example = default_data_collator(data[:batch])
                self.model = autoshard.parallelize(self.model, mesh.size(), example, tracer="export", group=mesh)

        def training_step(self, inputs, index):
            loss = self.model(**inputs).loss
            self.losses.append(loss.item())
            return loss

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            if tp > 1:
                self.model.clip_grad_norm_(clip)       # the norm over every shard
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    world = world or int(os.environ.get("WORLD_SIZE", 1))
    strategy = ModelParallelStrategy(data_parallel_size=world // tp, tensor_parallel_size=tp) if tp > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu" if not torch.cuda.is_available() else "gpu", devices=world,
                        strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if tp > 1:     # Lightning puts a DistributedSampler over the mesh's data-parallel ranks (shuffled, seed 0)
        loader = DataLoader(data, batch_size=batch, shuffle=True, collate_fn=default_data_collator)
    else:          # one process: the same permutation, so that the runs compare
        from torch.utils.data import DistributedSampler
        loader = DataLoader(data, batch_size=batch, collate_fn=default_data_collator,
                            sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    lm = LM()
    trainer.fit(lm, loader)
    return lm.losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="per data-parallel replica")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    print("losses", train(a.tp, a.batch, a.steps))
