"""Training: forward passes over packed and bucketed rows, logprobs, losses, per-token loss
gradients, gradient accumulation, MoE expert routes, and the weights of a full-weight session.
"""
