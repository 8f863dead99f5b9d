"""Parallelism over a trainer group's ranks: data-parallel rows and reductions
(data_parallel.py), a full-weight session sharded with FSDP2 (fsdp.py) and Muon's Newton-Schulz
over its shards (muon_shards.py).
"""
