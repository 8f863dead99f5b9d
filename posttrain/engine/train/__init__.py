"""posttrain.engine.train."""
