"""The book's STAGE diagrams (*llama-nuts-and-bolts* ch. 20): which stages a ``--highlight``
draws as "you are here", why a stage is not drawn (:func:`not_run_reason`), and the pseudo nodes a
diagram has besides stages."""

from __future__ import annotations

from dataclasses import dataclass, replace

from llamatrace.errors import OptionError
from llamatrace.tracing.stages import (SOFTMAX_ATTENTION_IDS, STAGE_BY_ID, STAGES, Stage, absent_reason,
                                      layer_list, stage_applies, unknown_hint)


# The book's STAGE diagrams (ch. 20), by number. Catalogue stages carry their number in
# ``Stage.book_stage``; 1-3, 7 and 12 draw something other than one stage (see resolve_highlight).
BOOK_STAGES = {
    1: "Tokenization",
    2: "Creating tokens tensor",
    3: "Looping through sequence length",
    4: "Creating inputTensor",
    5: "Forward Pass Through Each Transformer Block",
    6: "Forward Pass Through Attention Pre-normalization",
    7: "Forward Pass Through Attention Module",
    8: "Attention Module: Calculating xq, xk, and xv",
    9: "Attention Module: Do reshapings",
    10: "Attention Module: Apply Rotary Embeddings",
    11: "Attention Module: Update KV cache",
    12: "Attention Module: Do transposes",
    13: "Attention Module: Calculate scores",
    14: "Attention Module: Calculate output",
    15: "Add attention module output and current tensor",
    16: "Forward Pass Through Feed-Forward Pre-normalization",
    17: "Forward Pass Through Feed-Forward Module",
    18: "Add Feed-Forward module output and current tensor",
    19: "Forward Pass Through Output of The Transformer",
}

# Pseudo nodes (not stages): the block input, tokens, the KV cache, the sampled token, the legend.
BLOCK_IN, TOKENS, KV_CACHE, SAMPLED, LEGEND = "block_input", "tokens", "kv_cache", "sampled", "legend"


@dataclass(frozen=True)
class Highlight:
    """A book STAGE view: the stages drawn as "you are here" and what else to emphasise."""

    label: str                                   # "STAGE 8: Attention Module: Calculating xq, xk, and xv"
    stage_ids: frozenset[str] = frozenset()
    pseudo: frozenset[str] = frozenset()         # TOKENS / SAMPLED
    cluster: str | None = None                   # "attention" (STAGE 7) / "block" (STAGE 5)
    transposes: bool = False                     # STAGE 12: the edges that are transposed views
    model_only: bool = False                     # drawn only in --view model

    def nodes(self) -> frozenset[str]:
        return self.stage_ids | self.pseudo


def resolve_highlight(value: str) -> Highlight:
    """``--highlight``: a book STAGE number (1-19) or a stage id.

    Raises:
        OptionError: neither (the message lists what is valid).
    """
    text = value.strip()
    if text.isdecimal():
        number = int(text)
        if number not in BOOK_STAGES:
            raise OptionError(f"--highlight {value}: the book's STAGE numbers run 1-19; or give a stage id "
                              f"(`llamatrace stages -m MODEL` lists those of a model)")
        label = f"STAGE {number}: {BOOK_STAGES[number]}"
        ids = frozenset(s.id for s in STAGES if s.book_stage == number)
        if number in (1, 2):
            return Highlight(label, pseudo=frozenset({TOKENS}), model_only=True)
        if number == 3:
            return Highlight(label, pseudo=frozenset({TOKENS, SAMPLED}), model_only=True)
        if number == 5:
            return Highlight(label, stage_ids=ids, cluster="block")
        if number == 7:      # the whole LlamaAttention.Forward call: chapter section 15.3
            module = frozenset(s.id for s in STAGES if s.section.startswith("15.3"))
            return Highlight(label, stage_ids=module, cluster="attention")
        if number == 12:     # pure views: no stage, the transposed inputs of kq and kqv
            return Highlight(label, transposes=True)
        model_only = all(STAGE_BY_ID[i].level == "model" and i not in BLOCK_INPUT_STAGES for i in ids)
        return Highlight(label, stage_ids=ids, model_only=model_only)
    if text in STAGE_BY_ID:
        stage = STAGE_BY_ID[text]
        return Highlight(f"{stage.id} ({stage.op}, STAGE {stage.book_stage})", stage_ids=frozenset({text}),
                         model_only=stage.level == "model" and text not in BLOCK_INPUT_STAGES)
    raise OptionError(f"--highlight {value!r}: give a book STAGE number 1-19 or a stage id"
                      + unknown_hint(text, list(STAGE_BY_ID)))


def _block_input_stages() -> frozenset[str]:
    """Model-level stages a block consumes besides x (drawn as its inputs in --view block)."""
    layer_inputs = {name for s in STAGES if s.level == "layer" for name, _ in s.inputs}
    return frozenset(s.id for s in STAGES if s.level == "model" and s.group == "input"
                     and s.chapter in layer_inputs)


BLOCK_INPUT_STAGES = _block_input_stages()      # freqs_cis, kq_mask


def not_run_reason(stage: Stage, config, layer: int, seq_len: int) -> str | None:
    """Why ``stage`` does not run at ``layer`` of a model with ``config`` (a
    :class:`~llamatrace.model.config.ModelConfig`) for ``seq_len`` query rows: the first term of its
    ``when`` that rules it out (:func:`~llamatrace.tracing.stages.stage_applies`), in words, with
    what runs instead or what to change; ``None`` when it runs."""
    features, local, recurrent = config.features, config.is_local(layer), config.is_recurrent(layer)
    if stage.level == "layer" and recurrent and stage.id in SOFTMAX_ATTENTION_IDS:
        return (f"layer {layer} is a gated DeltaNet layer, without softmax attention; give --layer one of "
                f"the attention layers ({layer_list(config.attn_layers)})")
    if stage.level == "layer" and not recurrent and stage.when == "deltanet" and "deltanet" in features:
        return (f"layer {layer} is a softmax-attention layer; give --layer one of the gated DeltaNet layers "
                f"({layer_list(config.recurrent_layers)})")
    for term in stage.when.split("&"):
        if stage_applies(replace(stage, when=term), seq_len, config.n_rep, features, local, recurrent):
            continue
        if term == "masked":
            return ("a single query row (this step feeds one token) needs no causal mask; draw the prefill of a "
                    "prompt of several tokens (--step 0)")
        if term == "gqa":
            return (f"the model has n_rep = 1: as many KV heads as query heads ({config.n_kv_heads}, no GQA), "
                    f"so none is repeated")
        return absent_reason(stage.id, config)        # a feature the model has not, or one that replaces it
    return None


