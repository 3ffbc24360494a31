"""Making quantized GGUF files as llama.cpp does: ``quantize``, its importance matrix (``imatrix``), and the
recipe search that chooses a type per tensor for the least KL divergence at a byte budget (``search``)."""
