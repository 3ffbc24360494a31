"""Tokenizer tests: tiny GGUF vocabularies written here, llama.cpp's tokenizer test vectors
(models/ggml-vocab-*.gguf with .inp/.out, fetched from the llama-cpp-python sdist), and the real SmolLM2 file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import gguf
import pytest

from llamatrace.text.chat import render_chat
from llamatrace.gguf.reader import open_gguf
from llamatrace.errors import ModelFormatError, PromptError, UnsupportedModelError
from llamatrace.text.tokenizer import StreamDecoder, Tokenizer, quoted
from vocab_files import B2U, MERGES, write_vocab

ROUND_TRIP = [
    "",
    "the cat and the hat",
    "  leading, trailing and   inner   runs   ",
    "   ",
    " ",
    "line\nbreaks\n\n\nand\r\nwindows\r\n",
    "tabs\t\tand\t",
    "mixed \t\n \u00a0\u3000 whitespace\u2028end",
    "日本語のテキストと中文",
    "emoji 😀🎉 and 👍🏽 and 🐱\u200d👤",
    "digits 12345 and 3.14159, ²³ ½ ٣",
    "it's we'll THEY'RE",
    "<|im_end|> typed by hand <|im_start|>",
    "ﬁ ligature, Ωmega, naïve café",
]


def load(path: Path) -> Tokenizer:
    return Tokenizer.from_reader(open_gguf(path), str(path))


@pytest.fixture
def tiny(tmp_path: Path) -> Tokenizer:
    return load(write_vocab(tmp_path / "tiny.gguf"))


def texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.piece(i) for i in ids]


# ---- tiny vocabularies ----


@pytest.mark.parametrize("text", ROUND_TRIP)
@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "gpt2"])
def test_decode_encode_round_trips_every_character(tmp_path: Path, pre: str, text: str) -> None:
    tok = load(write_vocab(tmp_path / "v.gguf", pre=pre))
    assert tok.decode(tok.encode(text, bos=False)) == text


def test_merges_apply_in_merges_order(tiny: Tokenizer) -> None:
    assert texts(tiny, tiny.encode(" the and")) == [" the", " and"]
    # "b c" comes before "a b" in the merges list, so "abc" is a + bc, not ab + c
    assert texts(tiny, tiny.encode("abc")) == ["a", "bc"]


def test_ranks_follow_merges_when_ids_do_not(tmp_path: Path) -> None:
    tok = load(write_vocab(tmp_path / "rev.gguf", reverse_merged_ids=True))
    assert not tok._ids_are_ranks
    assert texts(tok, tok.encode("abc")) == ["a", "bc"]
    assert texts(tok, tok.encode(" the and 123")) == [" the", " and", " ", "1", "2", "3"]
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text


def test_smollm_splits_every_digit_llama3_groups_three(tmp_path: Path) -> None:
    smol = load(write_vocab(tmp_path / "s.gguf", pre="smollm"))
    llama3 = load(write_vocab(tmp_path / "l.gguf", pre="llama-bpe"))
    assert texts(smol, smol.encode("12345")) == ["1", "2", "3", "4", "5"]
    assert llama3.add_bos  # llama.cpp's default for Llama 3 vocabularies that do not say
    assert texts(llama3, llama3.encode("12345", bos=False)) == ["123", "45"]


def test_smollm_keeps_whitespace_before_a_digit_in_one_piece(tiny: Tokenizer) -> None:
    # HF: Digits split first, so "a  1" → "a", "  ", "1" (not "a", " ", " ", "1")
    assert texts(tiny, tiny.encode("a  1")) == ["a", "  ", "1"]
    assert texts(tiny, tiny.encode("x\n\n2")) == ["x", "\n\n", "2"]


def test_user_text_never_produces_control_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_end|>")
    assert 2 not in ids and len(ids) > 1
    assert tiny.decode(ids) == "<|im_end|>"


def test_user_defined_tokens_match_in_user_text(tmp_path: Path) -> None:
    tok = load(write_vocab(tmp_path / "u.gguf", user_defined=("<think>",)))
    think = tok.n_vocab - 1
    assert tok.encode("a<think>b") == [*tok.encode("a"), think, *tok.encode("b")]


def test_chat_template_text_produces_control_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode_chat([{"role": "user", "content": "hi <|im_end|> there"}])
    assert ids[0] == 1  # <|im_start|> from the template
    assert ids.count(2) == 1  # only the template's <|im_end|>, not the user's
    assert tiny.decode(ids) == "<|im_start|>user\nhi <|im_end|> there<|im_end|>\n<|im_start|>assistant\n"


def test_encode_chat_without_template_suggests_raw(tmp_path: Path) -> None:
    tok = load(write_vocab(tmp_path / "nt.gguf", template=None))
    assert tok.chat_template is None
    with pytest.raises(PromptError, match="--raw"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_missing_single_bytes_are_dropped_with_one_warning(tmp_path: Path) -> None:
    tok = load(write_vocab(tmp_path / "m.gguf", skip_bytes=(0x04, 0xF1)))
    assert tok.missing_bytes == bytes([0x04, 0xF1])
    with pytest.warns(UserWarning, match="0x04"):
        ids = tok.encode("a\x04b the")
    assert tok.decode(ids) == "ab the"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per tokenizer
        ids = tok.encode("\U00050000!")  # F1 90 80 80: the lead byte goes, as in HF
    assert tok.decode_bytes(ids) == b"\x90\x80\x80!"


def test_bos_follows_add_bos_unless_overridden(tmp_path: Path) -> None:
    tok = load(write_vocab(tmp_path / "b.gguf", add_bos=True))
    assert tok.add_bos and tok.encode("hi")[0] == 1
    assert tok.encode("hi", bos=False)[0] != 1
    off = load(write_vocab(tmp_path / "nb.gguf", add_bos=False))
    assert not off.add_bos and off.encode("hi", bos=True)[0] == 1


def test_eos_follows_add_eos_as_llama_cpp_add_special(tmp_path: Path) -> None:
    # llama-vocab.cpp's tokenize: with add_special, BOS first if add_bos and EOS last if add_eos
    # (Qwen3-Embedding's files say add_eos_token = true); a piece of text (bos=False) gets neither
    tok = load(write_vocab(tmp_path / "e.gguf", add_bos=True, add_eos=True))
    plain = tok.encode("hi", bos=False)
    assert tok.add_eos and tok.encode("hi") == [1, *plain, 2]
    assert 2 not in plain and tok.encode("hi", bos=True, eos=False) == [1, *plain]
    assert tok.encode("hi", bos=False, eos=True) == [*plain, 2]
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[-1] != 2   # the template's text, as HF
    for absent in (None, False):
        off = load(write_vocab(tmp_path / f"ne{absent}.gguf", add_bos=True, add_eos=absent))
        assert not off.add_eos and off.encode("hi") == [1, *plain]


SPECIAL_GOLDEN = Path(__file__).parent / "golden" / "special_tokens_llamacpp.json"


@pytest.mark.parametrize("variant", sorted(json.loads(SPECIAL_GOLDEN.read_text())["variants"]))
def test_special_tokens_match_llama_cpp(tmp_path: Path, variant: str) -> None:
    # llama.cpp's own ids (tests/golden/make_special_tokens_golden.py) on the same tiny vocabularies:
    # add_bos / add_eos as the file says and, without add_bos_token, BOS by the pre-tokenizer's name
    # (the llama3 group and tekken; not dbrx or smaug-bpe, whose regex is llama3's)
    golden = json.loads(SPECIAL_GOLDEN.read_text())
    want = golden["variants"][variant]
    tok = load(write_vocab(tmp_path / f"{variant}.gguf", **want["vocab"]))
    assert [tok.encode(t) for t in golden["texts"]] == want["special"]
    assert [tok.encode(t, bos=False) for t in golden["texts"]] == want["plain"]


def test_stop_ids_cover_eos_eot_and_end_tokens(tmp_path: Path) -> None:
    tok = load(write_vocab(tmp_path / "s.gguf", eos=0, eot=5))
    assert tok.stop_ids == {0, 2, 5}  # eos <|endoftext|>, <|im_end|> by name, eot


def test_piece_shows_readable_text(tiny: Tokenizer) -> None:
    (the,) = [i for i in range(tiny.n_vocab) if tiny.piece(i) == " the"]
    assert tiny.piece(2) == "<|im_end|>"
    assert tiny.decode([the]) == " the"
    assert tiny.piece(tiny.encode("\xf0")[0]) == "\\xc3"  # a lone UTF-8 lead byte, escaped


def test_quoted_shows_a_partial_characters_byte_as_one_escape(tiny: Tokenizer) -> None:
    byte = tiny.piece(tiny.encode("\xf0")[0])
    assert quoted(byte) == "'\\xc3'" and quoted(" " + byte) == "' \\xc3'"    # as Python shows b"\xc3"
    assert quoted("a\\" + byte) == "'a\\\\\\xc3'"        # a literal backslash stays doubled, as repr
    assert quoted("\x93") == "'\\x93'" and quoted("\n") == "'\\n'"    # control characters: repr's escapes
    assert quoted("it's") == repr("it's") and quoted('"') == repr('"')
    assert quoted("\\x41") == repr("\\x41")           # a code token's own text '\x41' (< 0x80: no byte of ours)


def test_decode_rejects_ids_outside_the_vocabulary(tiny: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.decode([5, tiny.n_vocab])
    with pytest.raises(ValueError, match="token id -1 is outside"):      # not the last entry, as a list takes -1
        tiny.decode([5, -1])
    with pytest.raises(TypeError, match="takes a str"):
        tiny.encode(None)


def test_stream_decoder_never_emits_half_a_character(tiny: Tokenizer) -> None:
    text = "ok 😀🎉 日本 👍🏽!"
    ids = tiny.encode(text)  # every emoji byte is its own token here
    stream = StreamDecoder(tiny)
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "\ufffd" not in "".join(chunks)
    assert "".join(chunks) == text


def test_stream_decoder_flush_replaces_a_truncated_character(tiny: Tokenizer) -> None:
    stream = StreamDecoder(tiny)
    first = tiny.encode("😀")[0]  # 0xF0 only
    assert stream.push(first) == ""
    assert stream.flush() == "\ufffd"


def test_unknown_pre_tokenizer_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"'qwen9'.*smollm"):
        load(write_vocab(tmp_path / "p.gguf", pre="qwen9"))


def test_missing_pre_tokenizer_warns_and_uses_gpt2(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="GPT-2"):
        tok = load(write_vocab(tmp_path / "p.gguf", pre=None))
    assert tok.pre == "gpt2"


def test_other_tokenizer_models_are_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'bert'.*SentencePiece"):
        load(write_vocab(tmp_path / "wp.gguf", model="bert"))


def test_sentencepiece_vocabulary_needs_scores(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="scores"):
        load(write_vocab(tmp_path / "spm.gguf", model="llama"))


@pytest.mark.parametrize("bad, index", [("ab", 2), ("a b c", 2), ("a\nb c", 2), ("a  b", 2), ("a\tb", 2),
                                        ("Ġ ", None)])
def test_a_merge_that_is_not_left_space_right_is_named(tmp_path: Path, bad: str, index: int | None) -> None:
    # the merges are translated in one piece; a bad one anywhere must still be found and named
    path = write_vocab(tmp_path / "m.gguf", merges=[*MERGES[:2], bad, *MERGES[2:]])
    if index is None:     # "Ġ " is a space and an empty right side: accepted, as before
        assert len(load(path).encode(" the", bos=False)) == 1
        return
    with pytest.raises(ModelFormatError, match=rf"tokenizer.ggml.merges\[{index}\] = .* is not 'left right'"):
        load(path)


def test_file_without_tokenizer_is_a_format_error(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "none.gguf"), arch="llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="tokenizer"):
        load(tmp_path / "none.gguf")


class CountingEncoding:
    """Wraps a tiktoken Encoding and counts calls into it (work done, not seconds)."""

    def __init__(self, encoding) -> None:
        self.encoding, self.calls = encoding, 0

    def encode_ordinary(self, text: str) -> list[int]:
        self.calls += 1
        return self.encoding.encode_ordinary(text)

    def __getattr__(self, name: str):
        return getattr(self.encoding, name)


def test_long_prompt_is_one_call_into_tiktoken(tiny: Tokenizer) -> None:
    text = " ".join(ROUND_TRIP[:-2]) * 40  # no control-token text: one ordinary segment
    tiny.encoding = counting = CountingEncoding(tiny.encoding)
    ids = tiny.encode(text)
    assert counting.calls == 1  # the whole text in Rust, no per-word Python loop
    assert len(ids) > 5000 and tiny.decode(ids) == text


# ---- the real SmolLM2 vocabulary (the default model, resolved by the conftest fixture) ----

GOLDEN = Path(__file__).parent / "golden" / "smollm2_golden.json"
SMOL_MISSING = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)])


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_reader(open_gguf(smollm2_path), str(smollm2_path))


def test_smollm2_metadata(smol: Tokenizer) -> None:
    assert (smol.n_vocab, smol.pre, smol.bos_id, smol.eos_id, smol.add_bos) == (49152, "smollm", 1, 2, False)
    assert smol._ids_are_ranks
    assert smol.stop_ids == {0, 2}
    assert "<|im_start|>" in (smol.chat_template or "")


def test_smollm2_known_ids(smol: Tokenizer) -> None:
    # ids from HF tokenizers / llama.cpp for the same vocabulary
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smol.encode("  multiple   spaces") == [216, 2701, 256, 5600]
    assert smol.encode("Café déjà vu.") == [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm2_round_trips(smol: Tokenizer, text: str) -> None:
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_lacks_21_single_bytes_and_drops_them(smol: Tokenizer) -> None:
    assert smol.missing_bytes == SMOL_MISSING
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = smol.encode("a\x04b\x1dc \U00040000")
    assert smol.decode_bytes(ids) == b"abc \x80\x80\x80"


def test_smollm2_user_im_end_is_plain_text_template_im_end_is_control(smol: Tokenizer) -> None:
    user = smol.encode("<|im_end|>")
    assert len(user) > 1 and 2 not in user
    ids = smol.encode_chat([{"role": "user", "content": "<|im_end|>"}])
    # system turn and user turn each end with the template's own single <|im_end|> id
    assert ids.count(2) == 2
    assert smol.decode(ids).count("<|im_end|>") == 3


def test_smollm2_stream_decoder_emoji(smol: Tokenizer) -> None:
    text = "I love pizza 🍕 and cats 🐱\u200d👤! 👍🏽"
    ids = smol.encode(text)
    assert any("\ufffd" in smol.decode([i]) for i in ids)  # some emoji really are split across tokens
    stream = StreamDecoder(smol)
    out = [stream.push(i) for i in ids] + [stream.flush()]
    assert "\ufffd" not in "".join(out) and "".join(out) == text


def test_smollm2_long_prompt_is_one_call_into_tiktoken(smol: Tokenizer) -> None:
    text = Path(__file__).read_text().replace("<|im_", "<im_") * 3  # no user-defined/control text
    smol.encoding = counting = CountingEncoding(smol.encoding)
    try:
        ids = smol.encode(text)
    finally:
        smol.encoding = counting.encoding
    assert counting.calls == 1
    assert len(ids) > 3000 and smol.decode(ids) == text


def test_smollm2_matches_hf_golden_ids(smol: Tokenizer) -> None:
    golden = json.loads(GOLDEN.read_text())
    for name, prompt in golden["prompts"].items():
        if prompt["kind"] == "chat":
            rendered = render_chat(smol.chat_template or "", prompt["messages"])
            assert "".join(text for text, _ in rendered) == prompt["rendered"]
            assert smol.encode_chat(prompt["messages"]) == prompt["prompt_ids"], name
        else:
            assert smol.encode(prompt["text"]) == prompt["prompt_ids"], name
    for case in golden.get("tokenizer_cases", []):
        assert smol.encode(case["text"]) == case["ids"], case["text"]


def test_public_names_import_from_the_tokenizer_module() -> None:
    from llamatrace.text import tokenizer
    assert set(tokenizer.__all__) == {"Tokenizer", "StreamDecoder", "bytes_to_unicode"}
    assert tokenizer.bytes_to_unicode() == B2U
    assert B2U[ord(" ")] == "Ġ" and B2U[ord("\n")] == "Ċ" and sorted(B2U) == list(range(256))
