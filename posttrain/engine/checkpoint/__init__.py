"""posttrain.engine.checkpoint."""
