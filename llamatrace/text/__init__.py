"""Text and token ids: the GGUF's tokenizer (``tokenizer``) and its chat template (``chat``)."""
