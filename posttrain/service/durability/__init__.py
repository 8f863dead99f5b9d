"""What outlives the process: durable sessions (durable_sessions.py, full_weight.py),
checkpoints (checkpoints.py) and the routed-experts store (routed_experts.py,
routed_experts_files.py)."""
