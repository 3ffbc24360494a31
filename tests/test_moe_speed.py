"""Memory of a mixture of experts at load time: the experts' file pages are let go as they are packed.

At Qwen3-30B-A3B's shape a layer's experts are ~0.35 GB of the file; a load that holds them
until the layer's end peaks that much above the packed model (benchmarks/make_moe.py and
docs/performance.md measure it). The order of packing and releasing is checked here on the
tiny qwen3moe file of ``tests/moe_files.py``.
"""

from __future__ import annotations

from moe_files import SPECS, write_moe_file

from llamatrace.gguf.reader import GGUFFile, open_gguf
from llamatrace.kernels.types import packing
from llamatrace.model.llama import Llama


def test_each_expert_is_released_before_the_next_is_packed(tmp_path, monkeypatch):
    path = write_moe_file(tmp_path / "tiny-qwen3moe.gguf", "qwen3moe")
    events = []
    real_pack, real_release = packing.pack_concat, GGUFFile.release

    def pack_concat(name, parts, **kw):
        events.append(("pack", name))
        return real_pack(name, parts, **kw)

    def release(self, t, start=0, n_bytes=None):
        events.append(("release", t.name, start, t.n_bytes if n_bytes is None else n_bytes))
        return real_release(self, t, start, n_bytes)

    monkeypatch.setattr(packing, "pack_concat", pack_concat)
    monkeypatch.setattr(GGUFFile, "release", release)
    Llama.load(path, cache=False)

    n_expert = SPECS["qwen3moe"]["n_expert"]
    with open_gguf(path) as f:
        per_expert = {t.name: t.n_bytes // n_expert for t in f.tensors.values() if "_exps" in t.name}
    checked = 0
    for i, event in enumerate(events):
        if event[0] != "pack" or "_exps" not in event[1]:
            continue
        stem, e = event[1].rsplit("#", 1)
        following = events[i + 1:]
        upto = next((j for j, ev in enumerate(following) if ev[0] == "pack"), len(following))
        released = {ev[1:] for ev in following[:upto] if ev[0] == "release"}
        for tensor in stem.split("+"):         # gate|up stacked: both tensors' expert e
            per = per_expert[tensor]
            assert (tensor, int(e) * per, per) in released, (event, sorted(released))
            checked += 1
    assert checked == SPECS["qwen3moe"]["n_layers"] * n_expert * 3
