"""Runs that answer a question about the model: looking inside (``look``: attention, logit lens),
agreement with another engine (``compare``) and speed (``bench``)."""
