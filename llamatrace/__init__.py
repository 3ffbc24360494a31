"""llamatrace: run a Llama-architecture GGUF model on the CPU and trace every stage of its forward pass.

Python use::

    from llamatrace import Llama
    model = Llama.load("model.gguf")
    ids = model.tokenizer.encode("The capital of France is")
    with model.trace(layers=[0], stages=["kq*"], stats=True) as rec:
        tokens = list(model.generate(ids, max_tokens=8))
    for event in rec.events:
        print(event.step, event.layer, event.stage, event.shape, event.stats["rms"])
"""

import os as _os

__version__ = "0.1.0"


def _numba_cache_dir() -> None:
    # Numba writes its kernel cache next to the sources; when the installed package is read-only,
    # send it to the user cache instead (must happen before numba is imported).
    if _os.environ.get("NUMBA_CACHE_DIR"):
        return
    if not _os.access(_os.path.dirname(__file__), _os.W_OK):
        from .fetch import cache_root
        _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(cache_root(), "numba")


_numba_cache_dir()


def __getattr__(name: str):
    if name == "Llama":
        from .model import Llama
        return Llama
    raise AttributeError(name)
