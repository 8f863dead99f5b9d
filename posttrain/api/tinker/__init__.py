"""The Tinker 0.38 wire protocol (/api/v1), beside the Together API (/v1/rl)."""
