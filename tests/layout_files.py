"""A GGUF file's attention tensors in another layout llama.cpp 0.3.36 loads (``create_tensor_qkv``):

- q|k|v fused as one ``blk.N.attn_qkv.weight`` (and the biases as one ``attn_qkv.bias``), the rows of
  ``attn_q``, ``attn_k``, ``attn_v`` one after the other, as ``convert_hf_to_gguf.py --fuse-qkv``
  writes them (``torch.cat([q, k, v], dim=0)`` in ``conversion/base.py``);
- a fused ``attn_qkv`` split back into ``attn_q`` / ``attn_k`` / ``attn_v`` (phi3, whose loader takes
  either);
- biases added (``attn_q/k/v.bias``, ``attn_output.bias``), which llama.cpp's graph adds wherever a
  file has them.

``relayout`` copies every other tensor and every key byte for byte; :func:`write_layout_file` writes
the variants the tests hold against llama.cpp's logits (``tests/golden/layout_llamacpp.npz``, made by
``tests/golden/make_layout_golden.py``). Deterministic: the same name writes the same bytes.

``python tests/layout_files.py DIR`` writes them into DIR.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from arch_files import write_arch_file  # noqa: E402
from gguf_factory import rewrite_metadata, write_tiny_llama  # noqa: E402
from gptoss_files import write_gptoss_file  # noqa: E402
from moe_files import write_moe_file  # noqa: E402

QKV = ("attn_q", "attn_k", "attn_v")


def relayout(src: str | Path, dst: str | Path, *, fuse: bool = False, split: tuple[int, int, int] | None = None,
             fuse_bias: bool = True, layers: tuple[int, ...] | None = None, drop: tuple[str, ...] = (),
             biases: dict[str, np.ndarray] | None = None) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with its attention tensors in another layout.

    ``fuse``: each layer's ``attn_q|k|v.weight`` → ``attn_qkv.weight`` (and their biases →
    ``attn_qkv.bias`` if ``fuse_bias``); ``layers`` limits it to those layers. ``split``: the rows
    (q, k, v) of each ``attn_qkv.weight``, written as three tensors. ``drop``: leave out the tensors
    whose names end so. ``biases``: tensors (name → float32 array) added at the end, such as
    ``blk.0.attn_q.bias``.
    """
    def tensors(r: gguf.GGUFReader):
        by_name = {t.name: t for t in r.tensors}
        groups = {}                                   # an attn_q tensor → its q, k, v names
        for name in by_name:
            parts = name.split(".")
            if (fuse and len(parts) == 4 and parts[2] == "attn_q" and (layers is None or int(parts[1]) in layers)
                    and (parts[3] == "weight" or fuse_bias)):
                names = [f"blk.{parts[1]}.{n}.{parts[3]}" for n in QKV]
                if all(n in by_name for n in names):
                    assert len({by_name[n].tensor_type for n in names}) == 1, f"q, k, v of another type each: {names}"
                    groups[name] = names
        fused = {n for names in groups.values() for n in names}
        for t in r.tensors:
            parts = t.name.split(".")
            if t.name in groups:
                yield (f"blk.{parts[1]}.attn_qkv.{parts[3]}",
                       np.concatenate([np.asarray(by_name[n].data) for n in groups[t.name]]), t.tensor_type)
            elif split and len(parts) == 4 and parts[2:] == ["attn_qkv", "weight"]:
                at = 0
                for n, k in zip(QKV, split):
                    yield f"blk.{parts[1]}.{n}.weight", np.asarray(t.data)[at:at + k], t.tensor_type
                    at += k
            elif t.name not in fused and not t.name.endswith(drop):
                yield t.name, np.asarray(t.data), t.tensor_type
    return rewrite_metadata(src, dst, {}, extra_tensors=biases, tensors=tensors)


LAYOUTS = ("llama_biases", "qwen2_fused", "qwen2_no_biases", "phi3_split", "qwen3moe_fused", "gptoss_fused")
"""The variants :func:`write_layout_file` writes: a llama file with q/k/v and output biases (some llama
finetunes carry them; llama.cpp adds them), qwen2 with q|k|v and its biases fused, qwen2 without its
(optional) biases, phi3 with q, k, v apart, and the two MoE families with q|k|v fused."""


def write_layout_file(path: str | Path, name: str) -> Path:
    """Write the variant ``name`` (one of :data:`LAYOUTS`) at ``path``, from the plain random files of
    ``tests/arch_files.py``, ``tests/moe_files.py``, ``tests/gptoss_files.py`` and ``write_tiny_llama``
    (float32 matrices), and return the path."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain.gguf"
        if name == "llama_biases":
            write_tiny_llama(plain, qtype=gguf.GGMLQuantizationType.F32, n_layers=2, seed=3)
            rng = np.random.default_rng(47)
            biases = {f"blk.{i}.{n}.bias": rng.normal(0, 0.5, size).astype(np.float32)
                      for i in range(2) for n, size in (("attn_q", 64), ("attn_k", 32), ("attn_v", 32), ("attn_output", 64))}
            return relayout(plain, path, biases=biases)
        if name.startswith("qwen2"):
            write_arch_file(plain, "qwen2")
            if name == "qwen2_fused":
                return relayout(plain, path, fuse=True)
            return relayout(plain, path, drop=(".attn_q.bias", ".attn_k.bias", ".attn_v.bias"))
        if name == "phi3_split":
            write_arch_file(plain, "phi3")
            r = gguf.GGUFReader(str(plain))
            hd = int(r.fields["phi3.attention.key_length"].contents())
            q, kv = int(r.fields["phi3.attention.head_count"].contents()) * hd, int(r.fields["phi3.attention.head_count_kv"].contents()) * hd
            return relayout(plain, path, split=(q, kv, kv))
        if name == "qwen3moe_fused":
            write_moe_file(plain, "qwen3moe")
        elif name == "gptoss_fused":
            write_gptoss_file(plain)
        else:
            raise ValueError(f"no layout file {name!r}; one of {LAYOUTS}")
        return relayout(plain, path, fuse=True)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for name in LAYOUTS:
        print(write_layout_file(out / f"{name}.gguf", name))
