"""posttrain.engine.hosts."""
