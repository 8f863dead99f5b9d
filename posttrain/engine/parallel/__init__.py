"""Parallelism over a trainer group's ranks: data-parallel reductions, ZeRO-2 (optimizer state
and gradients sharded, zero2.py) and ZeRO-3 (parameters sharded too, zero3.py).
"""
