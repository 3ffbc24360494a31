"""The write side: llama.cpp's quantizers, float32 rows -> the GGUF blocks ``llama-quantize``
writes, byte for byte (``rows``: every type's entry point and the 32-weight blocks; ``k_rows``:
the K-quants and the scale searches). Used by :mod:`llamatrace.quantize`; the forward pass
never quantizes weights."""
