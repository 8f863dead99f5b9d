"""posttrain.store."""
