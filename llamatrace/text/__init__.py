"""Text and token ids: the GGUF vocabulary as tiktoken ranks (``vocab``), the tokenizer built on
them (``tokenizer``) and the model's chat template (``chat``)."""
