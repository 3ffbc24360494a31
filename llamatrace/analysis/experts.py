"""Expert routing of a mixture-of-experts model: which experts each token chose, and over a corpus,
how the load spreads.

Both read what the forward pass emits (a :class:`~llamatrace.tracing.recorder.Recorder` on the MoE
stages, llama.cpp's names): ``ffn_moe_topk`` (int32 ``[seq_len, n_expert_used]``, the chosen
experts, best first) and the weights the experts' outputs are summed with (the last of
``ffn_moe_weights`` / ``ffn_moe_weights_softmax`` / ``ffn_moe_weights_norm`` the architecture
computes, float32 ``[seq_len, n_expert_used]``). Nothing here changes the arithmetic.

* :func:`routes` — one prompt: per layer, the ids and weights of every token's route.
* :class:`ExpertLoad` — a corpus: per layer and expert, how many tokens chose it (its load, and
  the entropy of the load), which experts fire together, and the tokens that choose each most.
  :func:`corpus_chunk` is the corpus runner's work function (one chunk → one ``ExpertLoad``),
  :meth:`ExpertLoad.add` merges them in chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llamatrace.errors import OptionError
from llamatrace.tracing.recorder import Recorder
from llamatrace.tracing.stages import STAGE_BY_ID

ROUTE_STAGES = ("ffn_moe_topk", "ffn_moe_weights", "ffn_moe_weights_softmax", "ffn_moe_weights_norm")
"""The stages a route is read from; of the weights, the last one a layer emits is the one applied."""


def _route_stages() -> list[str]:
    """:data:`ROUTE_STAGES` the catalogue has (a recorder refuses a stage id it does not know)."""
    return [s for s in ROUTE_STAGES if s in STAGE_BY_ID]


def check_moe(config) -> None:
    """Raises OptionError when the model has no experts (the routing views have nothing to show)."""
    if not getattr(config, "n_expert", 0):
        raise OptionError(f"this is a dense model ({config.arch}): it has no experts to route to; the routing "
                          f"views need a mixture-of-experts file (qwen3moe, gpt-oss, Mixtral, OLMoE)")


@dataclass
class Route:
    """One layer's routing of a sequence: ``ids`` int32 ``[n_tokens, n_expert_used]`` (best
    first), ``weights`` float32 ``[n_tokens, n_expert_used]`` (what each expert's output is
    multiplied by), ``n_expert`` the experts there were to choose from."""

    layer: int
    ids: np.ndarray
    weights: np.ndarray
    n_expert: int

    def dense(self) -> np.ndarray:
        """float32 ``[n_tokens, n_expert]``: each token's weight on each expert, 0 where not chosen
        (summed where an expert is chosen twice, as an ``--ablate ffn_moe_topk`` route can be)."""
        grid = np.zeros((len(self.ids), self.n_expert), np.float32)
        rows = np.broadcast_to(np.arange(len(self.ids))[:, None], self.ids.shape)
        np.add.at(grid, (rows, self.ids.astype(np.int64)), self.weights)
        return grid


def _routes_from(events, n_expert: int) -> dict[int, Route]:
    """Routes by layer from a recorder's kept MoE events (one forward call or several in order:
    a generation's steps are stacked along the tokens)."""
    ids: dict[int, list[np.ndarray]] = {}
    weights: dict[tuple[int, int], np.ndarray] = {}
    for e in events:
        if e.stage == "ffn_moe_topk":
            ids.setdefault(e.layer, []).append(np.asarray(e.array, np.int32).reshape(e.seq_len, -1))
        elif e.stage in ROUTE_STAGES:
            weights[(e.layer, e.step)] = np.asarray(e.array, np.float32).reshape(e.seq_len, -1)  # the last wins
    out = {}
    for layer, parts in ids.items():
        w = [v for (l, _), v in sorted(weights.items()) if l == layer]
        out[layer] = Route(layer, np.concatenate(parts), np.concatenate(w), n_expert)
    return out


def routes(model, prompt_ids: list[int], layers: list[int] | None = None) -> dict[int, Route]:
    """Run the prompt (one prefill) and return each layer's route (all MoE layers when ``layers``
    is None).

    Raises:
        OptionError: a dense model; a layer out of range.
    """
    c = model.config
    check_moe(c)
    if layers is not None:
        for layer in layers:
            if not 0 <= layer < c.n_layers:
                raise OptionError(f"--layer {layer} is out of range: this model has {c.n_layers} layers "
                                  f"(0-{c.n_layers - 1})")
    rec = Recorder(layers=layers, stages=_route_stages(), keep_arrays=True)
    cache = model.new_cache(len(prompt_ids))
    model.forward(np.asarray(prompt_ids, np.int32), 0, cache, recorder=rec)
    return _routes_from(rec.events, c.n_expert)


def entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy in bits of count vectors along the last axis (0 for all-zero rows):
    log2(n_expert) is a perfectly even load, 0 one expert taking every token."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    p = np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log2(p), 0.0)
    return terms.sum(axis=-1)


@dataclass
class ExpertLoad:
    """Routing statistics over a corpus.

    Attributes:
        counts: int64 ``[n_layers, n_expert]``: tokens that chose the expert (any rank).
        weight_sums: float64 ``[n_layers, n_expert]``: the sum of the weights it was given.
        together: int64 ``[n_layers, n_expert, n_expert]``: tokens that chose both experts (the
            diagonal equals ``counts``).
        token_counts: per layer, ``{(expert, token id): tokens}`` for the tokens routed there.
        n_tokens: tokens routed (each counted once a layer).
    """

    n_layers: int
    n_expert: int
    counts: np.ndarray = field(default=None)
    weight_sums: np.ndarray = field(default=None)
    together: np.ndarray = field(default=None)
    token_counts: list[dict[tuple[int, int], int]] = field(default=None)
    n_tokens: int = 0

    def __post_init__(self) -> None:
        if self.counts is None:
            self.counts = np.zeros((self.n_layers, self.n_expert), np.int64)
            self.weight_sums = np.zeros((self.n_layers, self.n_expert), np.float64)
            self.together = np.zeros((self.n_layers, self.n_expert, self.n_expert), np.int64)
            self.token_counts = [{} for _ in range(self.n_layers)]

    def record(self, layer: int, ids: np.ndarray, weights: np.ndarray, tokens: np.ndarray) -> None:
        """Add one layer's route of ``tokens`` (int ``[n_tokens]``): ``ids``/``weights``
        ``[n_tokens, n_expert_used]``."""
        ids = np.asarray(ids, np.int64)
        chosen = np.zeros((len(ids), self.n_expert), np.int64)
        np.put_along_axis(chosen, ids, 1, axis=1)
        self.counts[layer] += chosen.sum(axis=0)
        np.add.at(self.weight_sums[layer], ids.ravel(), np.asarray(weights, np.float64).ravel())
        self.together[layer] += chosen.T @ chosen
        keys, n = np.unique(ids * (1 << 32) + np.asarray(tokens, np.int64)[:, None], return_counts=True)
        table = self.token_counts[layer]
        for key, count in zip(keys.tolist(), n.tolist()):
            pair = (key >> 32, key & 0xFFFFFFFF)
            table[pair] = table.get(pair, 0) + count

    def add(self, other: "ExpertLoad") -> None:
        """Merge another chunk's statistics into these."""
        self.counts += other.counts
        self.weight_sums += other.weight_sums
        self.together += other.together
        for mine, theirs in zip(self.token_counts, other.token_counts):
            for pair, count in theirs.items():
                mine[pair] = mine.get(pair, 0) + count
        self.n_tokens += other.n_tokens

    def entropy(self) -> np.ndarray:
        """float64 ``[n_layers]``: the entropy of each layer's load, in bits (:func:`entropy_bits`)."""
        return entropy_bits(self.counts)

    def top_pairs(self, layer: int, k: int = 10) -> list[tuple[int, int, int, float]]:
        """The ``k`` expert pairs of ``layer`` that fire together most: ``(a, b, tokens, lift)``,
        lift = observed / expected if choices were independent (> 1: they go together)."""
        both = np.triu(self.together[layer], 1)
        order = np.argsort(both, axis=None, kind="stable")[::-1][:k]
        n = max(self.n_tokens, 1)
        out = []
        for flat in order:
            a, b = divmod(int(flat), self.n_expert)
            if both[a, b] == 0:
                break
            expected = self.counts[layer, a] * self.counts[layer, b] / n
            out.append((a, b, int(both[a, b]), float(both[a, b] / expected)))
        return out

    def top_tokens(self, layer: int, expert: int, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` token ids routed to ``expert`` in ``layer`` most often: ``(token id, tokens)``."""
        rows = [(tok, n) for (e, tok), n in self.token_counts[layer].items() if e == expert]
        return sorted(rows, key=lambda r: (-r[1], r[0]))[:k]

    def to_json(self, piece=None, k: int = 5) -> dict:
        """Counts, weights, entropy, the pairs that fire together and each expert's top tokens
        (``piece(id)`` names them when given)."""
        def tokens(layer: int, e: int) -> list:
            return [{"id": t, "piece": piece(t) if piece else None, "count": n} for t, n in self.top_tokens(layer, e, k)]
        return {
            "n_tokens": self.n_tokens, "n_layers": self.n_layers, "n_expert": self.n_expert,
            "entropy_max_bits": float(np.log2(self.n_expert)),
            "layers": [{
                "layer": layer, "counts": self.counts[layer].tolist(),
                "weight_sums": [round(float(v), 6) for v in self.weight_sums[layer]],
                "entropy_bits": float(self.entropy()[layer]),
                "together": [{"experts": [a, b], "tokens": n, "lift": round(lift, 4)}
                             for a, b, n, lift in self.top_pairs(layer, k)],
                "top_tokens": {str(e): tokens(layer, e) for e in range(self.n_expert) if self.counts[layer, e]},
            } for layer in range(self.n_layers)],
        }


def corpus_chunk(model, tokens: np.ndarray) -> ExpertLoad:
    """The corpus runner's work: one chunk of token ids (int32 ``[n_ctx]``) through the model from
    an empty cache, its routes counted (:class:`ExpertLoad`)."""
    c = model.config
    tokens = np.asarray(tokens, np.int32)
    load = ExpertLoad(c.n_layers, c.n_expert, n_tokens=len(tokens))
    rec = Recorder(stages=_route_stages(), keep_arrays=True)
    model.forward(tokens, 0, model.new_cache(len(tokens)), recorder=rec)
    for layer, route in _routes_from(rec.events, c.n_expert).items():
        load.record(layer, route.ids, route.weights, tokens)
    return load
