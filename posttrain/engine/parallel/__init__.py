"""Parallelism over a trainer group's ranks: data-parallel rows and reductions
(data_parallel.py), a full-weight session sharded with FSDP2 (fsdp.py: the shard layout and its
collectives) and vocabulary-parallel ends (vocab_parallel.py). It knows nothing of optimizers:
optim/ steps the shards (adam_shards.py, muon_shards.py) through this layout.
"""
