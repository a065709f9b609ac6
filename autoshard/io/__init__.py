"""State in and out of files: fill a rank's module, save and load checkpoints.

Takes a rewritten module and a source of weights (a model, a torch.save / safetensors file, a
Hugging Face directory, a DCP checkpoint); hands on the module filled with only this rank's shards
(`loading`), the Hugging Face face (`hf`) and sharded DCP checkpoints with checksums (`checkpoint/`).
"""
