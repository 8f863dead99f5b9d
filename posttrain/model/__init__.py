"""Model layer: Hugging Face models, LoRA adapters. Imports nothing above it."""
