"""posttrain.engine.generate."""
