"""Runtime: what every rank holds and runs, below every stage of the pipeline.

Takes plain tensors and process groups; hands on placements and the pieces of a shard
(`placements`, `pieces`), which collectives turn one placement into another (`transitions`), the
tensor-parallel groups (`groups`), the replicated random streams (`rng`), the autograd
collectives and their byte counters (`collectives`, `counters`; small CPU ones between the ranks
of one host through shared memory, `shm`), and TorchShard's parameter attributes with the full
<-> sharded state dicts (`state_dict`).
"""
