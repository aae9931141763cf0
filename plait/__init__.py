"""plait: train Llama-style language models on one CPU or many GPUs."""

__version__ = "0.1.0"
