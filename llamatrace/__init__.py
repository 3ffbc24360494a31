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
        from llamatrace.gguf.fetch import cache_root
        _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(cache_root(), "numba")


def _preload_tbb() -> None:
    # pip puts the `tbb` package's libtbb.so.12 in <venv>/lib, which the dynamic loader does not
    # search, so Numba silently falls back to OpenMP/workqueue (slow under load). Loading it
    # globally first lets Numba's TBB layer find it.
    import ctypes
    import sys
    try:
        ctypes.CDLL("libtbb.so.12", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = _os.path.join(prefix, "lib", "libtbb.so.12")
        if _os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return


def _prefer_openmp() -> None:
    # A parallel region costs ~4-5 µs with OpenMP and ~9 µs with TBB on 2 cores; decode runs
    # ~120 of them per token on small models (SmolLM2: +15-20% tok/s with OpenMP). TBB stays
    # the fallback where libgomp is missing. A user's own choice wins.
    if "NUMBA_THREADING_LAYER" not in _os.environ:
        _os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")
        # Numba reads its config once, at import: if the caller imported it before us, the
        # environment is read already; the layer is only chosen at the first parallel launch.
        import sys
        config = getattr(sys.modules.get("numba"), "config", None)
        if config is not None:
            config.THREADING_LAYER_PRIORITY = _os.environ["NUMBA_THREADING_LAYER_PRIORITY"].split()


_numba_cache_dir()
_prefer_openmp()
if _os.name == "posix":
    _preload_tbb()


def __getattr__(name: str):
    if name == "Llama":
        from llamatrace.model.llama import Llama
        return Llama
    raise AttributeError(name)
