"""Attention kinds beyond transformers' plain ones, through posttrain's caches: multi-head
latent attention (latent_attention.py, DeepSeek-V3 and its kin) and Gated DeltaNet linear attention
(linear_attention.py, Qwen3-Next and Qwen3.5)."""
