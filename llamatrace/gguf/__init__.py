"""GGUF files: finding the model (``fetch``), validating the header (``validate``), and reading
metadata and memory-mapped tensors (``reader``). Nothing here computes."""
