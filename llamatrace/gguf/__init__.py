"""GGUF files: finding the model (``fetch``), the value types of the header (``header``),
validating the header (``validate``, with ``foreign`` naming files that are not GGUF), and
reading metadata and memory-mapped tensors (``reader``). Nothing here computes."""
