"""Draft heads (and the tiny Llama target) in plain PyTorch."""
