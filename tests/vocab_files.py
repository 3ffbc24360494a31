"""Tiny GGUF vocabularies (tokenizer metadata only) for the tokenizer tests and
``tests/golden/make_special_tokens_golden.py``: 3 control tokens, the 256 single bytes, one token per
merge. Needs only gguf and numpy (the golden venv has no tiktoken)."""

from __future__ import annotations

from pathlib import Path

import gguf

from llamatrace.text.vocab import bytes_to_unicode

B2U = bytes_to_unicode()
CONTROLS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# merges in GPT-2 byte-level text ('Ġ' is a space); "b c" outranks "a b" on purpose
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n", "Ġan d", "Ġ Ġ", "b c", "a b", "1 2", "12 3", "4 5"]
MERGES += ["Ċ Ċ"]


def write_vocab(
    path: Path,
    *,
    merges: list[str] = MERGES,
    skip_bytes: tuple[int, ...] = (),
    reverse_merged_ids: bool = False,
    model: str = "gpt2",
    pre: str | None = "smollm",
    bos: int | None = 1,
    eos: int | None = 2,
    eot: int | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    template: str | None = CHATML,
    user_defined: tuple[str, ...] = (),
) -> Path:
    """A GGUF file with only tokenizer metadata: 3 control tokens, the single bytes, one token per merge."""
    singles = [B2U[b] for b in range(256) if b not in skip_bytes]
    merged = [m.replace(" ", "") for m in merges]
    if reverse_merged_ids:
        merged.reverse()
    tokens = [*CONTROLS, *singles, *merged, *user_defined]
    types = [3] * len(CONTROLS) + [1] * (len(singles) + len(merged)) + [4] * len(user_defined)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (eot, w.add_eot_token_id),
                       (add_bos, w.add_add_bos_token), (add_eos, w.add_add_eos_token), (template, w.add_chat_template)):
        if value is not None:                        # an absent key: the reader's default
            add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
