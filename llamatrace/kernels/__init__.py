"""The arithmetic of the forward pass: Numba kernels, each beside its NumPy twin.

``fp32`` holds the small float32 kernels (RMSNorm, RoPE, softmax, SiLU, attention); the weight
matmuls work on GGUF's quantized blocks repacked into row tiles (``tiles``): ``quant`` packs
weights and dispatches, one module per quant family computes (``k_quants``, ``act8`` …).
"""
