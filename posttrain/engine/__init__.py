"""posttrain.engine."""
