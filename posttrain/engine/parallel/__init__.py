"""posttrain.engine.parallel."""
