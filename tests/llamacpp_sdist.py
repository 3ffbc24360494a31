"""llama.cpp's test data from the llama-cpp-python 0.3.36 source distribution (PyPI).

The sdist carries llama.cpp's tokenizer test vectors (``models/ggml-vocab-*.gguf`` with their
``.inp`` / ``.out`` files) and ggml's reference quantizers (``tests/kquant_files.py`` compiles
them). It is downloaded once with ``pip download`` into the user cache (``LLAMATRACE_CACHE_DIR``
moves it) and every file is sha256-checked. Used by the tests and ``benchmarks/make_*.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from llamatrace.gguf.fetch import cache_root, sha256_file

LLAMA_CPP_SDIST = ("llama-cpp-python", "0.3.36", "llama_cpp_python-0.3.36.tar.gz",
                   "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
VOCAB_TEST_SHA256 = {
    "ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "ggml-vocab-llama-spm.gguf.out": "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
    "ggml-vocab-llama-bpe.gguf": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "ggml-vocab-llama-bpe.gguf.out": "118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b",
    "ggml-vocab-deepseek-llm.gguf": "867f77537b54565f0d81d508c04edc41aa1d4ffc1a92745f225b4c1b02755f76",
    "ggml-vocab-deepseek-llm.gguf.out": "87cfc1a8a9a7ef25d04d28c26a67b6a620af7be938c9bd0feeb4d319b9302832",
    "ggml-vocab-deepseek-coder.gguf": "91cb1379f2e33af1c4866b194622b7a0e12e8f0c9dba7ba2f10d55978730bec1",
    "ggml-vocab-deepseek-coder.gguf.out": "c2cea4584b0487e67fbd81f491bb44f89238722062126120d2c412edb3dbd853",
    "ggml-vocab-qwen2.gguf": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
    "ggml-vocab-qwen2.gguf.out": "de785bb305cc6fa9d43908ed5da337f853c0b79e971348fcfb9f0915a39c5363",
    "ggml-vocab-qwen35.gguf": "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c",
    "ggml-vocab-qwen35.gguf.inp": "0fc6547e7876cd5b2ef64a9d319c6e39040eb53986660bd4227ed7ddef017a94",  # its own
    "ggml-vocab-qwen35.gguf.out": "5efe225820325303857d0a087a8d59216f0d1e9a9e31133e7a5b44c3c4e1e9ca",
    "ggml-vocab-gpt-2.gguf": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "ggml-vocab-gpt-2.gguf.out": "48e8c4cb3ad5c37915b225f872222567c1c4dd4d66951aa53460c8d152ff6d60",
    "ggml-vocab-mpt.gguf": "59dc382612866d1fc6c11ea531318d327598f3412d9c8f8600607cdf3030898f",
    "ggml-vocab-mpt.gguf.out": "9d0982a7e7950b81bc2e325fb61bb7e295d2238934ab889737494de2dc4d906b",
    "ggml-vocab-starcoder.gguf": "fedb892b4e1bd3c1f2fcdae356440b14fb458f4264d586e5c987ed93df4e174d",
    "ggml-vocab-starcoder.gguf.out": "3ef12183c57ad076f9defd8e5eb454f509f5f0865cad35646abb4c4b2d2c5764",
    "ggml-vocab-refact.gguf": "ac3ceda902fed91ccf74312b305d9b86c37e4f8e35fa9cc6ef3ce34fca7d4678",
    "ggml-vocab-refact.gguf.out": "c7e5c1c5dc1dfd3e0d56576bf699d2aca0b760b80779523ea9d323aad6cd1b88",
    "ggml-vocab-phi-3.gguf": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    "ggml-vocab-phi-3.gguf.out": "ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29",
}
for _name in ("llama-spm", "llama-bpe", "deepseek-llm", "deepseek-coder", "qwen2", "gpt-2", "mpt", "starcoder",
              "refact", "phi-3"):  # one .inp, shared by all but qwen35's
    VOCAB_TEST_SHA256[f"ggml-vocab-{_name}.gguf.inp"] = "be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0"


def sdist_path() -> Path:
    """The llama-cpp-python sdist in ``cache_root() / "sdist"``, downloaded once with
    ``pip download --no-deps --no-binary :all:`` and sha256-checked.

    Raises:
        RuntimeError: pip failed (no network?) or the checksum does not match.
    """
    return pip_download(*LLAMA_CPP_SDIST, cache_root() / "sdist", ("--no-binary", ":all:"))


def pip_download(package: str, version: str, filename: str, sha256: str, folder: Path,
                 kind: tuple[str, str]) -> Path:
    """``folder / filename``, fetched once with ``pip download --no-deps`` (``kind``: pip's
    ``("--no-binary", ":all:")`` for an sdist, ``("--only-binary", ":all:")`` for a wheel) and
    sha256-checked.

    Raises:
        RuntimeError: pip failed (no network?) or the checksum does not match.
    """
    path = folder / filename
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind,
               "--disable-pip-version-check", "-d", str(folder), f"{package}=={version}"]
        result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        if result.returncode != 0 or not path.is_file():
            raise RuntimeError(f"pip could not download {filename} ({package}=={version}, "
                               f"exit {result.returncode}); check the network")
    if sha256_file(path) != sha256:
        raise RuntimeError(f"checksum mismatch for {path}; delete it and run again")
    return path


def vocab_test_file(name: str, suffix: str = "") -> Path:
    """``ggml-vocab-{name}.gguf{suffix}`` (suffix ``""``, ``".inp"`` or ``".out"``) from llama.cpp's
    models/ folder in the llama-cpp-python sdist, extracted once into ``cache_root() / "vocab-0.3.36"``
    (all three files of ``name`` at once) and sha256-checked.

    Raises:
        ValueError: ``name`` is not one of the vocabularies listed in ``VOCAB_TEST_SHA256``.
        RuntimeError: the sdist cannot be fetched, or a checksum does not match.
    """
    wanted = {f"ggml-vocab-{name}.gguf{s}" for s in ("", ".inp", ".out")}
    if not wanted <= VOCAB_TEST_SHA256.keys():
        raise ValueError(f"no test vocabulary {name!r}; known: "
                         f"{sorted({k[11:].split('.gguf')[0] for k in VOCAB_TEST_SHA256})}")
    folder = cache_root() / f"vocab-{LLAMA_CPP_SDIST[1]}"
    if not all((folder / f).is_file() for f in wanted):
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist_path()) as tar:
            for member in tar.getmembers():
                base = member.name.rsplit("/", 1)[-1]
                if base in wanted and "/vendor/llama.cpp/models/" in member.name and member.isfile():
                    src = tar.extractfile(member)
                    assert src is not None
                    part = folder / (base + ".part")
                    part.write_bytes(src.read())
                    if sha256_file(part) != VOCAB_TEST_SHA256[base]:
                        part.unlink()
                        raise RuntimeError(f"checksum mismatch for {base} in {tar.name}")
                    os.replace(part, folder / base)
    return folder / f"ggml-vocab-{name}.gguf{suffix}"
