"""Adapters to other inference engines (optional extras, imported only when asked for)."""
