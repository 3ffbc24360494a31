"""Our log-line templates against the book's own ``[DEBUG]`` lines (llama-nuts-and-bolts ch. 15-16).

``tests/book/book_debug_lines.txt`` holds the chapters' lines verbatim (made from the team's
source chapters by ``tests/book/make_book_lines.py``). Every book line that is a stage of the
forward pass must be produced by one template wording of the stage catalogue, word for word,
with the shapes the chapter prints where a template computes a shape formula. Lines that are
details of the book's Go code, not stages, are left out here, each kind with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llamatrace.views.render import _FIELD, fmt_shape
from llamatrace.tracing.stages import STAGES, eval_shape

BOOK = Path(__file__).parent / "book" / "book_debug_lines.txt"

# Go details of the book, not stages of the forward pass
NOT_STAGES = {
    re.compile(r"^\[Scheduling goroutine\] "): "the book's Go code schedules each projection on a goroutine",
    re.compile(r"^Converting \w+ tensor shape\(\[[\d ]*\]\) to (Float32|BFloat16) tensor"):
        "the book computes in BF16 and converts around softmax and logits; llamatrace is float32 throughout",
}
# the goroutine that runs a projection logs the same call as a plain one
GOROUTINE_CALL = re.compile(r"^\[Calling in goroutine\] ")

# The chapters' configs, for the shape formulas of the templates (seq_len 22 and 32 prompts).
CHAPTER_DIMS = {
    "000": dict(seq_len=22, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336,
                vocab_size=128256, rope_half=64),
    "003": dict(seq_len=32, dim=4096, n_heads=32, n_kv_heads=32, head_dim=128, hidden_dim=11008,
                vocab_size=32000, rope_half=64),
    "004": dict(seq_len=22, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336,
                vocab_size=128256, rope_half=64),
}
for _d in CHAPTER_DIMS.values():
    _d.update(kv_len=_d["seq_len"], q_dim=_d["n_heads"] * _d["head_dim"],
              kv_dim=_d["n_kv_heads"] * _d["head_dim"], n_rep=_d["n_heads"] // _d["n_kv_heads"])

# The stages whose wording the book fixes (every other stage is ours: the book has no line for it).
BOOK_STAGES = {
    "attn_norm", "Qcur", "Kcur", "Vcur", "Vcur_heads", "Kcur_rope", "kq", "kq_scaled", "kq_masked",
    "kq_soft_max", "kqv", "attn_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu",
    "ffn_out", "l_out", "result_norm", "result_output",
}


def _book_lines() -> list[tuple[str, str]]:
    rows = []
    for line in BOOK.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            seed, text = line.split("\t", 1)
            rows.append((seed, text))
    return rows


def _template_regex(template: str) -> tuple[re.Pattern, list[str]]:
    """A template as a regex: literal text exact, each ``{field}`` one lazy group."""
    parts, fields, pos = [], [], 0
    for m in _FIELD.finditer(template):
        parts.append(re.escape(template[pos:m.start()]))
        parts.append("(.+?)")
        fields.append(m.group(1))
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(parts) + "$"), fields


TEMPLATES = [(stage.id, t, *_template_regex(t)) for stage in STAGES for t in stage.lines + stage.skip_lines]


def _stage_lines():
    for seed, text in _book_lines():
        if any(p.search(text) for p in NOT_STAGES):
            continue
        yield seed, GOROUTINE_CALL.sub("Calling ", text)


def test_fixture_holds_the_three_chapters():
    seeds = {seed for seed, _ in _book_lines()}
    assert seeds == set(CHAPTER_DIMS)
    assert sum(1 for _ in _stage_lines()) >= 50


@pytest.mark.parametrize("seed, text", list(_stage_lines()), ids=lambda v: v[:60])
def test_book_line_comes_from_one_template_wording(seed, text):
    hits = [(sid, t, fields, m) for sid, t, rx, fields in TEMPLATES if (m := rx.match(text))]
    # one wording; several stages may share it ("Returning tensor output: shape(...)")
    assert len({t for _, t, _, _ in hits}) == 1, f"book line {text!r} matched {[h[:2] for h in hits]}"
    dims = CHAPTER_DIMS[seed]
    for sid, _, fields, m in hits:
        for name, value in zip(fields, m.groups()):
            if name.startswith("["):        # a shape formula: it must give the chapter's shape
                assert value == fmt_shape(eval_shape(name, dims)), (sid, name, value)


def test_every_book_stage_is_covered_and_named():
    covered = set()
    for _, text in _stage_lines():
        covered.update(sid for sid, _, rx, _ in TEMPLATES if rx.match(text))
    assert covered == BOOK_STAGES
