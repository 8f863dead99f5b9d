"""The optimizer of a session: step settings, global-norm clipping, AdamW and Muon, and their
steps over FSDP2 shards (parallel/fsdp.py's layout)."""
