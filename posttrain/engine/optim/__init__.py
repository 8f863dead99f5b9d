"""The optimizer of a session: step settings, global-norm clipping, AdamW and Muon."""
