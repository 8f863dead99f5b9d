"""posttrain: a self-hosted server for the Together RL post-training API."""

__version__ = "0.1.0"
