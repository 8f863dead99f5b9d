"""posttrain.api."""
