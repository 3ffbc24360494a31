"""Quantizing a GGUF: llama.cpp's per-tensor rules and writer, and the recipe search."""
