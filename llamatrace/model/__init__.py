"""The model: its blueprint (``config``), the forward pass (``llama``), the KV cache, and the
prefill + decode loop (``generate``, ``sampling``) that knows token ids only."""

from llamatrace.model.llama import Llama

__all__ = ["Llama"]
