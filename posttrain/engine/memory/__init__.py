"""posttrain.engine.memory."""
