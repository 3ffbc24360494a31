"""The ``tekken`` pre-tokenizer (Mistral Nemo, Small 3, Ministral, Devstral) against Mistral's own
tokenizer: Mistral's published vocabulary (mistral-common's ``tekken_240718.json``) encoded with
tiktoken and the file's pattern, as ``Tekkenizer.encode`` does, and the same vocabulary as a GGUF
holds it, read by our tokenizer (``tests/tekken_vocab.py``). The texts are llama.cpp's tokenizer test
strings (the sdist's ``.inp`` files) and cases of Tekken's own rules: letter runs split at a
lower-to-upper case change (Unicode case classes, combining marks inside words), single digits, and
``/`` kept after a newline.
"""

from __future__ import annotations

import tarfile

import pytest
import tiktoken

from llamacpp_sdist import sdist_path, vocab_test_file
from tekken_vocab import reference_encoding, write_tekken_vocab
from llamatrace.gguf.reader import open_gguf
from llamatrace.text.tokenizer import PRE_PATTERNS, StreamDecoder, Tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"
OWN_CASES = (
    "HelloWorld camelCaseName XMLHttpRequest iPhone ÀÉcole éÉ ΣίσυφοςΜύθος",
    "cafe\u0301 na\u0308ive Ångström ﬁne ǅemal",            # combining marks, a ligature, a titlecase letter
    "12345 3.14159 1,000,000 ٣٤٥ ½",                          # digits one by one, other scripts' digits
    "path/to/file\r\n/next;\n//comment\r\r\n  /x {\n/",        # `[\r\n/]*` after punctuation
    "c'est l'homme qu'il faut, isn't it? print(x);\n// done",
    "Mistral says: [INST] not a control token [/INST] </s> <s>",
    "def f(x):\n    return x**2  # ok\n\n\n\tdone",
    "Привет мир! 你好，世界。 مرحبا بالعالم 🦙🦙 ​ zero-width",
)


@pytest.fixture(scope="module")
def tekken(tmp_path_factory):
    path = write_tekken_vocab(tmp_path_factory.mktemp("tekken") / "tekken.gguf")
    tok = Tokenizer.from_reader(open_gguf(path), str(path), cache=False)
    encoding, offset = reference_encoding()
    return tok, encoding, offset


def texts() -> list[str]:
    shared = vocab_test_file("llama-bpe", ".inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]
    qwen35 = vocab_test_file("qwen35", ".inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]
    return [*dict.fromkeys([*shared, *qwen35, *OWN_CASES])]


def test_ids_match_mistrals_tokenizer(tekken) -> None:
    tok, encoding, offset = tekken
    cases = texts()
    assert len(cases) > 50
    mismatches = [(text, ids, [offset + i for i in encoding.encode_ordinary(text)])
                  for text in cases if (ids := tok.encode(text, bos=False)) != [offset + i for i in encoding.encode_ordinary(text)]]
    assert not mismatches, mismatches[:3]


def test_the_texts_tell_tekken_from_the_other_patterns(tekken) -> None:
    """A vocabulary read with another pre-tokenizer's regex gives other ids on these texts, so the
    test above would see a wrong pattern: `/` after punctuation and a newline, apostrophes. Not
    o200k's: its pieces only join what Tekken splits (contractions, runs of digits), and no Tekken
    token crosses those joins, so the two give the same ids on any text with this vocabulary."""
    _, encoding, offset = tekken
    ranks = encoding._mergeable_ranks
    for name, pattern in PRE_PATTERNS.items():
        if name in ("tekken", "o200k"):
            continue
        other = tiktoken.Encoding(f"tekken-as-{name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        assert any(other.encode_ordinary(t) != encoding.encode_ordinary(t) for t in OWN_CASES), name


def test_decode_round_trips_and_streams(tekken) -> None:
    tok, _, _ = tekken
    for text in texts():
        ids = tok.encode(text, bos=False)
        assert tok.decode(ids) == text, text
    ids = tok.encode(OWN_CASES[-1], bos=False)
    stream = StreamDecoder(tok)
    assert "".join([stream.push(i) for i in ids] + [stream.flush()]) == OWN_CASES[-1]


def test_bos_specials_and_user_text(tekken) -> None:
    """llama.cpp adds BOS for ``tekken`` when the file does not say; the 1000 special tokens are
    control tokens: typed by a user they stay text, as in Mistral's encoder."""
    tok, encoding, offset = tekken
    assert (tok.pre, tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos) == ("tekken", 131072, 1, 2, True)
    assert tok.encode("Hi")[0] == 1 and tok.encode("Hi")[1:] == [offset + i for i in encoding.encode_ordinary("Hi")]
    assert 2 in tok.stop_ids
    ids = tok.encode("[INST] hi [/INST]", bos=False)
    assert 3 not in ids and 4 not in ids and min(ids) >= offset
    assert "tekken" in tok.describe()


def test_mistral_nemos_chat_template_gives_its_control_tokens(tekken) -> None:
    """Mistral Nemo's published template (llama.cpp's copy in the sdist) around a question: BOS,
    the [INST] and [/INST] control tokens (ids 3 and 4, as Mistral numbers them) and the question
    as Mistral's encoder splits it."""
    tok, encoding, offset = tekken
    with tarfile.open(sdist_path()) as tar:
        member = next(m for m in tar.getmembers()
                      if m.name.endswith("/vendor/llama.cpp/models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja"))
        tok.chat_template = tar.extractfile(member).read().decode("utf-8")
    try:
        ids = tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    finally:
        tok.chat_template = None
    assert ids == [1, 3, *(offset + i for i in encoding.encode_ordinary("What is 2+2?")), 4]


def test_pixtral_files_split_as_llama_3_as_llama_cpp_splits_them(tekken, tmp_path) -> None:
    """``pixtral`` (a file converted from the Hugging Face copy of Pixtral or Mistral Small 3.1):
    llama.cpp runs Llama 3's regex (its tokenizer.json's) with Mistral's vocabulary, and BOS; so does
    llamatrace. It differs from Tekken's own split after punctuation and a newline."""
    _, encoding, offset = tekken
    path = write_tekken_vocab(tmp_path / "pixtral.gguf", pre="pixtral")
    tok = Tokenizer.from_reader(open_gguf(path), str(path), cache=False)
    llama3 = tiktoken.Encoding("tekken-as-llama3", pat_str=PRE_PATTERNS["llama3"],
                               mergeable_ranks=encoding._mergeable_ranks, special_tokens={})
    for text in texts():
        assert tok.encode(text, bos=False) == [offset + i for i in llama3.encode_ordinary(text)], text
    assert tok.add_bos and tok.encode("x;\n/")[0] == 1
    assert tok.encode("x;\n/", bos=False) != [offset + i for i in encoding.encode_ordinary("x;\n/")]
