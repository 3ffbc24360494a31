"""Recognising a file that is not GGUF by its first bytes, to say what it is and how to get a GGUF.

Downloads go wrong in familiar ways: a Git LFS pointer, a Hugging Face HTML page, a safetensors or
PyTorch checkpoint, a pre-GGUF GGML model, a config JSON. :func:`llamatrace.gguf.validate.validate_gguf`
calls :func:`describe_foreign` when the magic is not ``GGUF``.
"""

from __future__ import annotations

import re
import struct

FIX_NOT_GGUF = "pass a .gguf model file (e.g. download one from Hugging Face)"


def describe_foreign(head: bytes) -> tuple[str, str]:
    """What a file whose first bytes ``head`` (up to 64) are not the GGUF magic is, and what to do.

    Returns ``(what, fix)``, the two halves of a one-line error message.
    """
    magic = show_bytes(head[:4])
    stripped = head.lstrip().lower()
    if head.startswith(b"version https://git-lfs"):
        return (
            "this is a Git LFS pointer file, not the model itself",
            "run `git lfs pull` in the repository or download the .gguf file directly",
        )
    if stripped.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml")):
        return (
            f"starts with {magic} instead of 'GGUF': this is an HTML/XML page (a failed or login-gated download?)",
            "download the raw .gguf file (on Hugging Face use the 'resolve' link, not the 'blob' page)",
        )
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack_from("<Q", head, 0)[0] < (1 << 32):
        return (
            f"starts with {magic} instead of 'GGUF': this looks like a safetensors file",
            "convert it with llama.cpp's convert_hf_to_gguf.py or download a .gguf build of the model",
        )
    if head.startswith(b"PK\x03\x04"):
        return (
            f"starts with {magic} instead of 'GGUF': this is a zip archive (a PyTorch checkpoint?)",
            "convert the model with llama.cpp's convert_hf_to_gguf.py or download a .gguf build",
        )
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return (
            f"starts with {magic} instead of 'GGUF': this is a Python pickle (a PyTorch checkpoint?)",
            "convert the model with llama.cpp's convert_hf_to_gguf.py or download a .gguf build",
        )
    if head[:4] in (b"lmgg", b"fmgg", b"tjgg", b"ggml", b"ggmf", b"ggjt"):
        return (
            f"starts with {magic}: this is a pre-GGUF GGML/GGJT model",
            "convert it with llama.cpp's convert_llama_ggml_to_gguf.py or download a .gguf build",
        )
    if head[:4] == b"FUGG":
        return (
            f"starts with {magic}: the GGUF magic is byte-swapped (a big-endian or broken writer)",
            "download the little-endian .gguf file",
        )
    if stripped.startswith(b"{") or re.match(rb"\[\s*[\[{\"\d\]-]", stripped):
        return (
            f"starts with {magic} instead of 'GGUF': this is a JSON file (a config or tokenizer?), not the model",
            FIX_NOT_GGUF,
        )
    return (f"starts with {magic} instead of the GGUF magic 'GGUF': this is not a GGUF file", FIX_NOT_GGUF)


def show_bytes(raw: bytes, limit: int = 40) -> str:
    """``raw`` as a Python bytes literal without the ``b``, cut after ``limit`` bytes (``'GGUF\\x03...'``)."""
    text = repr(raw[:limit])[1:]  # b'...' -> '...'
    return text + ("..." if len(raw) > limit else "")
