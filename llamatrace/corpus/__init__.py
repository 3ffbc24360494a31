"""Corpus-scale measurements: a text cut into chunks, every chunk through the model, merged.

``chunks`` cuts a tokenized text as llama.cpp's ``llama-perplexity`` does; ``metrics`` holds the
per-token arithmetic (negative log-likelihood, the base model's compressed log-probabilities,
KL divergence) and the statistics of the whole run; ``basefile`` reads and writes llama.cpp's
``--kl-divergence-base`` file; ``runner`` hands chunks to local worker processes; ``perplexity``
ties them into one run.
"""
