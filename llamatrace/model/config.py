"""ModelConfig: the blueprint of a Llama model, read from GGUF ``llama.*`` metadata.

Names follow Meta's reference ``ModelArgs`` (dim, n_layers, n_heads, n_kv_heads, norm_eps...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from llamatrace.errors import ModelFormatError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-architecture model.

    Attributes:
        dim: embedding width (``llama.embedding_length``), e.g. 576 for SmolLM2-135M.
        n_layers: transformer blocks (``llama.block_count``).
        n_heads: query heads (``llama.attention.head_count``).
        n_kv_heads: key/value heads (``llama.attention.head_count_kv``); < n_heads means
            grouped-query attention with ``n_rep = n_heads // n_kv_heads``.
        head_dim: width of one head (``llama.attention.key_length`` or ``dim // n_heads``).
        hidden_dim: SwiGLU inner width (``llama.feed_forward_length``).
        vocab_size: rows of ``token_embd.weight``.
        norm_eps: RMSNorm epsilon (``llama.attention.layer_norm_rms_epsilon``).
        rope_theta: RoPE base frequency (``llama.rope.freq_base``, default 10000).
        rope_dim: rotated dimensions per head (``llama.rope.dimension_count``, default head_dim).
        max_seq_len: the model's context length (``llama.context_length``), in tokens.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim",
                     "vocab_size", "rope_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelFormatError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(
                f"model config: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ModelFormatError(
                f"model config: head_dim ({self.head_dim}) and rope_dim ({self.rope_dim}) must be even, "
                f"rope_dim <= head_dim")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ModelFormatError(
                f"model config: norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) must be positive")

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (1 = plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries, ``n_heads * head_dim`` (rows of wq)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and values, ``n_kv_heads * head_dim`` (rows of wk and wv)."""
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_gguf(cls, f) -> "ModelConfig":
        """The config of an open GGUF file (:class:`~llamatrace.gguf.reader.GGUFFile`): its metadata,
        and the vocabulary size from the rows of ``token_embd.weight``.

        Raises:
            ModelFormatError: no ``token_embd.weight``; as :meth:`from_metadata`.
            UnsupportedModelError: as :meth:`from_metadata`.
        """
        from pathlib import Path

        from llamatrace.gguf.reader import gguf_name
        vocab_size = f.matrix_shape(gguf_name("tok_embeddings"))[0]   # raises if the tensor is missing
        return cls.from_metadata(f.metadata, vocab_size=vocab_size, source=Path(f.path).name)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int, source: str = "model") -> "ModelConfig":
        """Build the config from GGUF metadata ``{key: value}``.

        Args:
            meta: decoded GGUF key/value pairs.
            vocab_size: rows of ``token_embd.weight`` (the authoritative vocabulary size).
            source: file name used in error messages.

        Raises:
            UnsupportedModelError: the architecture is not ``llama``.
            ModelFormatError: a required key is missing or a value is inconsistent.
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} is not supported; llamatrace runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF models (e.g. Llama 3.x, SmolLM2)")

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelFormatError(f"{source}: required metadata key {full!r} is missing; "
                                       f"the GGUF file is incomplete — re-convert or re-download it")
            return meta[full]

        def as_int(key: str, value: Any) -> int:
            try:
                return int(value)
            except (TypeError, ValueError):
                raise ModelFormatError(f"{source}: metadata {arch}.{key} should be an integer, got {value!r}") from None

        dim = as_int("embedding_length", need("embedding_length"))
        n_heads = as_int("attention.head_count", need("attention.head_count"))
        n_kv_heads = as_int("attention.head_count_kv", meta.get(f"{arch}.attention.head_count_kv", n_heads))
        head_dim = as_int("attention.key_length",
                          meta.get(f"{arch}.attention.key_length", dim // n_heads if n_heads else 0))
        return cls(
            dim=dim,
            n_layers=as_int("block_count", need("block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            hidden_dim=as_int("feed_forward_length", need("feed_forward_length")),
            vocab_size=int(vocab_size),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=as_int("rope.dimension_count", meta.get(f"{arch}.rope.dimension_count", head_dim)),
            max_seq_len=as_int("context_length", need("context_length")),
        )
