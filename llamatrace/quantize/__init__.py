"""Making quantized GGUF files as llama.cpp does: ``quantize``, its importance matrix (``imatrix``)."""
