"""Checkpoints and live state: the file formats (PEFT adapters, training state, merged and full
models), a session's durable live state, and a session's tensors gathered from shards.
"""
