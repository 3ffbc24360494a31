"""Quant types: the registry, one declaration module a family (its block format, NumPy
dequantizer and f32-mode kernels) and packing (GGUF blocks -> row tiles, either mode).
Importing :mod:`llamatrace.kernels` declares every type."""
