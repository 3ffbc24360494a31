"""llama.cpp's tokenizer test vectors: models/ggml-vocab-{name}.gguf with its .inp (46 strings separated
by "\\n__ggml_vocab_test__\\n") and .out (the expected ids, one line per string, without BOS), taken
from the llama-cpp-python sdist that tests/llamacpp_sdist.py downloads once into the user cache.

llama-spm is SentencePiece (Llama 1/2, Mistral…), as phi-3; llama-bpe is Llama 3's byte-level BPE;
qwen2 (Qwen2/2.5/3, their MoE) and qwen35 (Qwen3.5) are Llama 3's regex with single digits;
deepseek-llm and deepseek-coder are byte-level BPE with sequences of pre-tokenizer regexes; gpt-2,
mpt, starcoder and refact are the other names our pre-tokenizer aliases cover.
"""

from __future__ import annotations

import pytest

from llamacpp_sdist import vocab_test_file
from llamatrace.gguf.reader import open_gguf
from llamatrace.text.tokenizer import StreamDecoder, Tokenizer

VOCABS = ("llama-spm", "llama-bpe", "deepseek-llm", "deepseek-coder", "qwen2", "qwen35", "gpt-2", "mpt", "starcoder",
          "refact", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"

# the Llama 2 chat template (meta-llama/Llama-2-7b-chat-hf tokenizer_config.json) and Mistral's (v0.1)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

_loaded: dict[str, Tokenizer] = {}


@pytest.fixture(scope="session")
def vocab():
    """name → Tokenizer, each GGUF read once per test run (GGUFReader takes seconds on the larger ones)."""
    def get(name: str) -> Tokenizer:
        if name not in _loaded:
            path = vocab_test_file(name)
            _loaded[name] = Tokenizer.from_reader(open_gguf(path), str(path))
        return _loaded[name]
    return get


def cases(name: str) -> list[tuple[str, list[int]]]:
    texts = vocab_test_file(name, ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    lines = vocab_test_file(name, ".out").read_text(encoding="utf-8").split("\n")
    n = 50 if name == "qwen35" else 46                 # qwen35's .inp adds four strings of its own
    assert len(texts) == n + 1 and len(lines) == n + 1 and texts[-1] == lines[-1] == ""  # trailing ""
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts[:n], lines[:n])]


@pytest.mark.parametrize("name", VOCABS)
def test_ids_match_llama_cpp(vocab, name: str) -> None:
    tok = vocab(name)
    mismatches = [(text, tok.encode(text, bos=False), ids) for text, ids in cases(name)
                  if tok.encode(text, bos=False) != ids]
    assert not mismatches, mismatches[:3]


@pytest.mark.parametrize("name", VOCABS)
def test_decode_round_trips(vocab, name: str) -> None:
    tok = vocab(name)
    for text, ids in cases(name):
        assert tok.decode(ids) == text, (name, text)


def test_vocabulary_kinds(vocab) -> None:
    spm = vocab("llama-spm")
    assert (spm.kind, spm.n_vocab, spm.bos_id, spm.eos_id, spm.add_bos, spm.add_space_prefix) == \
        ("spm", 32000, 1, 2, True, True)
    assert spm.stop_ids == {2}
    assert "SentencePiece" in spm.describe()
    assert [vocab(n).pre for n in VOCABS[1:]] == ["llama3", "deepseek-llm", "deepseek-coder", "qwen2", "qwen35",
                                                  "gpt2", "gpt2", "smollm", "smollm", "sentencepiece"]
    assert "deepseek-coder" in vocab("deepseek-coder").describe()
    coder = vocab("deepseek-coder")  # DeepSeek Coder Instruct ends its turns with <|EOT|>, not EOS
    assert {coder.piece(i) for i in coder.stop_ids} == {"<｜end▁of▁sentence｜>", "<|EOT|>"}


def test_spm_byte_fallback_and_stream_decoding(vocab) -> None:
    tok = vocab("llama-spm")
    text = "Hi 🦙!"  # no token for the llama: four <0xNN> byte tokens
    ids = tok.encode(text, bos=False)
    pieces = [tok.piece(i) for i in ids]
    assert tok.decode(ids) == text
    assert sum(len(tok.decode_bytes([i])) == 1 and tok.decode_bytes([i])[0] >= 0x80 for i in ids) == 4
    assert pieces[0] == " Hi"  # '▁' shown as a space
    stream = StreamDecoder(tok)
    chunks = [stream.push(i) for i in ids] + [stream.flush()]
    assert "\ufffd" not in "".join(chunks)
    # generation continues a prompt: the stream keeps the leading space, decode() drops it (llama.cpp)
    assert "".join(chunks) == " " + text


def test_spm_leading_space_and_bos(vocab) -> None:
    tok = vocab("llama-spm")
    assert tok.decode(tok.encode(" Hello", bos=False)) == " Hello"
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "<s> Hello"  # BOS shown as text keeps the space
    f = open_gguf(vocab_test_file("llama-spm"))
    no_prefix = Tokenizer(f.field("tokenizer.ggml.tokens"), f.field("tokenizer.ggml.token_type"), [], "default",
                          kind="spm", scores=f.field("tokenizer.ggml.scores"), add_space_prefix=False,
                          bos_id=1, eos_id=2)
    assert no_prefix.encode(" Hello", bos=False) == tok.encode("Hello", bos=False)
    assert no_prefix.decode(no_prefix.encode("Hello", bos=False)) == "Hello"


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, MISTRAL_TEMPLATE])
def test_inst_chat_templates_render_and_raise(vocab, template: str) -> None:
    tok = vocab("llama-spm")
    tok.chat_template = template
    try:
        ids = tok.encode_chat([{"role": "user", "content": "Hi there"}])
        # llama.cpp: "<s>" is a control token, the text after it gets the space prefix
        assert ids == [tok.bos_id, *tok.encode("[INST] Hi there [/INST]", bos=False)]
        turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}]
        ids = tok.encode_chat(turns)
        assert ids.count(tok.bos_id) == 2 - (template is MISTRAL_TEMPLATE) and ids.count(tok.eos_id) == 1
        assert tok.eos_id in tok.stop_ids
        with pytest.raises(Exception, match="alternate"):
            tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    finally:
        tok.chat_template = None
