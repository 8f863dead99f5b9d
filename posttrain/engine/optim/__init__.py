"""posttrain.engine.optim.optimizer."""
