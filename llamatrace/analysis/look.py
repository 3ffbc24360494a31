"""Looking inside a run: attention matrices and the logit lens, as plain data.

Both run the ordinary forward pass with a :class:`~llamatrace.tracing.recorder.Recorder` (hooks of an
enclosing ``with model.hooks()`` block apply as usual) and return NumPy arrays and small
records; :mod:`llamatrace.views.plots` draws them and the CLI prints them.

* :func:`attention` — ``kq_soft_max`` of one layer at one step: the prefill's
  ``[n_heads, seq_len, seq_len]`` (step 0) or decode step S's one query row against the whole
  cache ``[n_heads, 1, kv_len]``. Masked cells (keys after the query) are flagged, not hidden
  in small probabilities.
* :func:`logit_lens` — ``inp_embd`` and every layer's ``l_out`` through the final RMSNorm and
  the output projection (:meth:`~llamatrace.model.Llama.logits`, the forward pass's own code:
  the last layer's last row equals the model's logits bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamatrace.errors import NumericalError, OptionError
from llamatrace.model.sampling import softmax64
from llamatrace.tracing.recorder import Recorder


@dataclass
class AttentionMaps:
    """Attention probabilities of one layer at one step.

    ``probs`` float32 ``[n_heads, n_queries, kv_len]`` (``kq_soft_max``); ``masked`` bool
    ``[n_queries, kv_len]``, True where the causal mask hid the key (its probability is 0), or the
    sliding window of a local layer (``window`` keys, 0 = a layer that sees every earlier key);
    ``query_pos`` / ``ids`` the positions of the query rows and the tokens of all ``kv_len``
    keys. Query head ``h`` reads KV head ``h // n_rep``.
    """

    layer: int
    step: int
    probs: np.ndarray
    masked: np.ndarray
    query_pos: list[int]
    ids: list[int]
    n_kv_heads: int
    n_rep: int
    window: int = 0


def attention(model, prompt_ids: list[int], layer: int, step: int = 0) -> AttentionMaps:
    """Run the prompt (and ``step`` greedy decode steps) and return ``layer``'s attention at ``step``.

    Raises:
        OptionError: ``layer`` out of range, ``step`` < 0, or the run stopped (end of text, the
            context limit) before ``step``. PromptError: the prompt does not fit the context.
        NumericalError: the logits a decode step samples from hold NaN or Inf.
    """
    from llamatrace.model.generate import check_prompt_fits, generate

    c = model.config
    if not 0 <= layer < c.n_layers:
        raise OptionError(f"--layer {layer} is out of range: this model has {c.n_layers} layers (0-{c.n_layers - 1})")
    if step < 0:
        raise OptionError(f"--step must be >= 0, got {step}")
    if len(prompt_ids) + step > model.config.max_seq_len:    # at once, not after minutes of decoding
        raise OptionError(f"--step {step} needs {len(prompt_ids) + step} cache positions ({len(prompt_ids)} prompt "
                          f"tokens + {step} decode steps) but the model's context length is "
                          f"{model.config.max_seq_len}: give a smaller --step")
    rec = Recorder(layers=[layer], stages=["kq_soft_max"], keep_arrays=True)
    if step == 0:             # the prefill alone: no token is chosen (a NaN in later layers cannot stop it)
        check_prompt_fits(model, len(prompt_ids), c.max_seq_len)
        model.forward(np.asarray(prompt_ids), 0, model.new_cache(len(prompt_ids)), recorder=rec)
        tokens = []
    else:
        tokens = list(generate(model, prompt_ids, max_tokens=step + 1, recorder=rec))
    events = [e for e in rec.events if e.step == step]
    if not events:
        raise OptionError(f"--step {step}: the run stopped at step {rec.step} (end of text or the context "
                          f"limit) after {len(tokens)} generated tokens; choose a smaller --step")
    event = events[0]
    ids = (list(prompt_ids) + tokens)[:event.start_pos + event.seq_len]
    query_pos = list(range(event.start_pos, event.start_pos + event.seq_len))
    behind = np.asarray(query_pos)[:, None] - np.arange(len(ids))[None, :]    # query pos - key pos
    window = c.sliding_window if c.is_local(layer) else 0
    masked = (behind < 0) | ((behind >= window) if window else False)
    return AttentionMaps(layer=layer, step=step, probs=event.array, masked=masked, query_pos=query_pos,
                         ids=ids, n_kv_heads=c.n_kv_heads, n_rep=c.n_rep, window=window)


@dataclass
class LensRow:
    """One cell of the lens: after ``layer`` (``"embd"`` = the embeddings) at position ``pos``."""

    layer: int | str
    pos: int
    top_id: int
    top_piece: str
    top_prob: float
    final_rank: int          # 0 = the model's final prediction is this cell's top-1
    final_prob: float

    def to_json(self) -> dict:
        return {"layer": self.layer, "pos": self.pos, "top_id": self.top_id, "top_piece": self.top_piece,
                "top_prob": self.top_prob, "final_rank": self.final_rank, "final_prob": self.final_prob}


@dataclass
class Lens:
    """The logit lens of one prompt: ``rows`` layer-major (embd, 0 … n_layers−1), positions
    ascending within a layer; ``final_id`` the model's greedy next token and ``logits`` its
    float32 ``[vocab_size]`` logits; ``lens_logits`` float32 ``[n_layers + 1, K, vocab_size]``."""

    prompt_ids: list[int]
    positions: list[int]
    final_id: int
    logits: np.ndarray
    lens_logits: np.ndarray
    rows: list[LensRow]


def logit_lens(model, prompt_ids: list[int], positions: int = 6) -> Lens:
    """Project the residual stream after the embeddings and after every layer to the vocabulary.

    ``positions``: the last K positions of the prompt (at most its length).

    Raises:
        OptionError: ``positions`` < 1, or the prompt does not fit the model's context.
        NumericalError: the final logits hold NaN or Inf.
    """
    if positions < 1:
        raise OptionError(f"--positions must be >= 1, got {positions}")
    c, tok = model.config, model.tokenizer
    n = len(prompt_ids)
    if not 0 < n <= c.max_seq_len:
        raise OptionError(f"the prompt has {n} tokens; the model's context holds 1-{c.max_seq_len}")
    rec = Recorder(stages=["inp_embd", "l_out"], keep_arrays=True)
    logits = model.forward(np.asarray(prompt_ids), 0, model.new_cache(n), recorder=rec)[-1]
    if not np.isfinite(logits.max()):          # argmax would name a token the model never predicted
        raise NumericalError(f"the logits after position {n - 1} hold NaN or Inf, so the lens has no final "
                             f"prediction to rank: the model's weights (or an --ablate) make them; "
                             f"`llamatrace trace --check-finite` names the first stage that does")
    arrays = rec.arrays()
    k = min(positions, n)
    residuals = [arrays["step0.inp_embd"]] + [arrays[f"step0.layer{i}.l_out"] for i in range(c.n_layers)]
    lens_logits = np.stack([model.logits(h[n - k:]) for h in residuals])
    final_id = int(np.argmax(logits))
    rows = []
    for li, per_layer in enumerate(lens_logits):
        for j, row in enumerate(per_layer):
            probs = softmax64(row)
            top = int(np.argmax(probs))
            rows.append(LensRow(layer="embd" if li == 0 else li - 1, pos=n - k + j, top_id=top,
                                top_piece=tok.piece(top), top_prob=float(probs[top]),
                                final_rank=int((probs > probs[final_id]).sum()), final_prob=float(probs[final_id])))
    return Lens(prompt_ids=list(prompt_ids), positions=list(range(n - k, n)), final_id=final_id,
                logits=logits, lens_logits=lens_logits, rows=rows)


@dataclass
class StateWrites:
    """What one gated DeltaNet layer wrote into its state over a prompt, per value head.

    ``write`` float64 ``[n_v_heads, seq_len]``: ‖k_t u_tᵀ‖ = ‖k_t‖·‖u_t‖ with u_t = β_t(v_t − S'ᵀk_t),
    S' the state after token t's decay — how much token t changed the state (the linear-attention
    counterpart of an attention column). ``decay`` ``[n_v_heads, seq_len]``: exp(g_t) ∈ (0, 1), the
    factor the state kept at token t (1 = nothing forgotten). ``state_norm``: ‖S‖ after token t.
    ``ids`` the prompt's tokens; value head h reads key head ``h % n_k_heads``.
    """

    layer: int
    write: np.ndarray
    decay: np.ndarray
    state_norm: np.ndarray
    ids: list[int]
    n_k_heads: int


def state_writes(model, prompt_ids: list[int], layer: int) -> StateWrites:
    """Run the prompt (one prefill) and replay ``layer``'s delta rule token by token from the
    recorded ``k/v_conv_predelta``, ``beta_sigmoid``, ``gate`` and ``state_predelta`` (float64).

    Raises:
        OptionError: ``layer`` out of range or not a gated DeltaNet layer.
    """
    c = model.config
    if not 0 <= layer < c.n_layers:
        raise OptionError(f"--layer {layer} is out of range: this model has {c.n_layers} layers (0-{c.n_layers - 1})")
    if not c.is_recurrent(layer):
        kinds = ", ".join(map(str, c.recurrent_layers)) or "none: the model has no recurrent layers"
        raise OptionError(f"--layer {layer} has no recurrent state (softmax attention); its gated DeltaNet "
                          f"layers are {kinds}")
    rec = Recorder(layers=[layer], stages=["k_conv_predelta", "v_conv_predelta", "beta_sigmoid", "gate",
                                           "state_predelta"], keep_arrays=True)
    ids = list(prompt_ids)
    model.forward(np.asarray(ids), 0, model.new_cache(len(ids)), recorder=rec)
    got = {e.stage: np.asarray(e.array, dtype=np.float64) for e in rec.events}
    k, v, beta, g = got["k_conv_predelta"], got["v_conv_predelta"], got["beta_sigmoid"], got["gate"]
    S = got["state_predelta"].copy()                        # [h, j, i]: S[h] @ k = Sᵀk
    n_v, n_k = v.shape[1], k.shape[1]
    write, norm = np.zeros((n_v, len(ids))), np.zeros((n_v, len(ids)))
    for t in range(len(ids)):
        kt = k[t, np.arange(n_v) % n_k]                     # [h, d]
        S *= np.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - np.einsum("hji,hi->hj", S, kt))
        S += u[:, :, None] * kt[:, None, :]
        write[:, t] = np.linalg.norm(u, axis=1) * np.linalg.norm(kt, axis=1)
        norm[:, t] = np.linalg.norm(S, axis=(1, 2))
    return StateWrites(layer, write, np.exp(g).T, norm, ids, n_k)
