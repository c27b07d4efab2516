"""Test helpers: an independent per-sample Hugging Face reference, tiny checkpoints, torchrun."""
