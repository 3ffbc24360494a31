"""llamatrace: run a Llama-architecture GGUF model on the CPU and trace every stage of its forward pass."""

__version__ = "0.1.0"
