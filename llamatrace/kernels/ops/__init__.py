"""The float32 arithmetic between the matmuls (ggml's "ops"): norms, rotary embeddings,
masks, softmax, activations, soft-capping and the attention products (``fp32``)."""
