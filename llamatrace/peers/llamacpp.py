"""llama.cpp through llama-cpp-python's low-level API: one adapter, two modes.

* last-token mode (``capture=False``, ``llamatrace bench``): each :meth:`LlamaCpp.eval` asks
  for the logits of the last token only, as llama-cpp-python's ``logits_all=False`` does.
* capture mode (``capture=True``, ``llamatrace compare``): every token outputs logits (so the
  last layer keeps every row instead of pruning to ``inp_out_ids``), flash attention is off (or
  ``kq``/``kq_soft_max`` would not exist), the KV cache is f32 (its default f16 adds drift),
  and the graph's evaluation callback (``cb_eval``) copies every named f32 tensor out of the
  graph as it is computed (llama.cpp's ``eval-callback`` example does the same).

llama-cpp-python (the extra ``llamatrace[llamacpp]``) is imported only when an adapter is made.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_GGML_MAX_DIMS = 4
_GGML_TYPE_F32 = 0
# views and writes into the KV cache share a name with the tensor they come from: not stages of their own
_VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "CPY", "SET_ROWS"})


class _TensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h): stable since ggml's 2023 layout."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * _GGML_MAX_DIMS), ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10)]


@dataclass
class Captured:
    """One tensor read in the graph callback.

    ``name`` is llama.cpp's (``Qcur-0``, ``result_norm``), ``op`` ggml's op name (``MUL_MAT``,
    ``ROPE``...), ``array`` float32 with ggml's four dims in NumPy order (``ne`` reversed:
    ``[ne3, ne2, ne1, ne0]``).
    """

    name: str
    op: str
    array: np.ndarray


# one token through llama.cpp on the file, in a child process (see check_runs_here)
_PROBE = ("import sys\n"
          "from llamatrace.peers.llamacpp import LlamaCpp\n"
          "LlamaCpp(sys.argv[1], 8, int(sys.argv[2])).eval([0])\n")


def check_runs_here(path: str, threads: int) -> None:
    """Evaluate one token with llama.cpp on ``path`` in a child process first: a build for CPU
    instructions this machine lacks dies there of SIGILL instead of killing our process.

    Raises:
        PeerError: the child was killed by a signal (the message names it; on SIGILL, says to
            rebuild). Other failures are left to the in-process run, which reports them.
    """
    from llamatrace.errors import PeerError
    from llamatrace.peers import exit_reason
    child = subprocess.run([sys.executable, "-c", _PROBE, path, str(threads)],
                           capture_output=True, text=True)
    if child.returncode < 0:
        raise PeerError(exit_reason("llama.cpp", child.returncode))


def _ggml_base():
    import llama_cpp
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
    lib = ctypes.CDLL(str(candidates[0]))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_op_desc.restype = ctypes.c_char_p
    lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_nelements.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


# names worth reading: per-layer tensors "<name>-<layer>" and the model-level ones
_WANTED = re.compile(r"^(?:[A-Za-z_][A-Za-z_0-9]*-\d+|inp_embd|inp_scaled|embd|result_norm|result_output)$")
# the causal mask is a graph input (never evaluated, so never called back): read as kq_soft_max's src[1]
_MASK_NAME = "attn_inp_kq_mask"


_QUIET_LOG = []      # the ctypes log callback must outlive every context (llama.cpp keeps the pointer)


def _silence_logs(L) -> None:
    if not _QUIET_LOG:
        _QUIET_LOG.append(L.llama_log_callback(lambda level, text, user: None))
        L.llama_log_set(_QUIET_LOG[0], None)


class LlamaCpp:
    """A GGUF loaded in llama.cpp, fed token ids.

    Args:
        path: the GGUF file.
        n_ctx: context size (also the batch size: a prefill is one batch).
        threads: CPU threads for llama.cpp.
        capture: read every named tensor of each :meth:`eval` (see the module docstring).

    Raises:
        ImportError: llama-cpp-python is not installed.
        RuntimeError: llama.cpp cannot load the model or make a context.
    """

    def __init__(self, path: str, n_ctx: int, threads: int, *, capture: bool = False) -> None:
        import llama_cpp as L
        self._L = L
        self.capture = capture
        self.version = f"llama-cpp-python {L.__version__}"
        _silence_logs(L)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_threads = cparams.n_threads_batch = threads
        self.settings = {"n_ctx": n_ctx, "threads": threads, "outputs": "all tokens" if capture else "last token"}
        self.captured: list[Captured] = []
        if capture:
            self._ggml = _ggml_base()
            self._cb = L.ggml_backend_sched_eval_callback(self._on_tensor)
            cparams.cb_eval = self._cb
            cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            cparams.type_k = cparams.type_v = _GGML_TYPE_F32
            self.settings.update(flash_attn=False, type_k="f32", type_v="f32")
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RuntimeError("llama.cpp cannot create a context")
        self.n_ctx = n_ctx
        self.n_past = 0

    # ggml calls this twice per node: ask=True ("do you want it?"), then ask=False with the data
    def _on_tensor(self, t, ask, user_data) -> bool:
        g = self._ggml
        name = (g.ggml_get_name(t) or b"").decode(errors="replace")
        if ask:
            return bool(_WANTED.match(name))
        head = _TensorHead.from_address(t)
        op = (g.ggml_op_desc(t) or b"").decode()
        if head.type != _GGML_TYPE_F32 or op in _VIEW_OPS or not g.ggml_is_contiguous(t):
            return True
        if op == "SOFT_MAX" and head.src[1] and not any(c.name == _MASK_NAME for c in self.captured):
            mask = _TensorHead.from_address(head.src[1])
            if mask.type == _GGML_TYPE_F32 and g.ggml_is_contiguous(head.src[1]):
                self.captured.append(Captured(_MASK_NAME, "NONE", self._read(head.src[1], mask)))
        self.captured.append(Captured(name, op, self._read(t, head)))
        return True

    def _read(self, t, head: _TensorHead) -> np.ndarray:
        n = self._ggml.ggml_nelements(t)
        buf = np.empty(n, dtype=np.float32)
        self._ggml.ggml_backend_tensor_get(t, buf.ctypes.data, 0, n * 4)
        return buf.reshape([int(x) for x in head.ne][::-1])

    def reset(self) -> None:
        """Forget the KV cache (a new sequence starts at position 0)."""
        L = self._L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def eval(self, ids: list[int]) -> np.ndarray:
        """Run ``ids`` at the next positions; return the logits, float32 ``[vocab_size]`` of the
        last token (last-token mode) or ``[len(ids), vocab_size]`` (capture mode).

        In capture mode :attr:`captured` holds this call's tensors, in graph order.

        Raises:
            RuntimeError: llama_decode failed (context full...).
        """
        L = self._L
        n = len(ids)
        if self.n_past + n > self.n_ctx:
            raise RuntimeError(f"llama.cpp context of {self.n_ctx} tokens is full")
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, tok in enumerate(ids):
                batch.token[i] = int(tok)
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = self.capture or i == n - 1
            batch.n_tokens = n
            self.captured = []
            rc = L.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            L.llama_batch_free(batch)
        self.n_past += n
        rows = range(n) if self.capture else [n - 1]
        out = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,)).copy()
                        for i in rows])
        return out if self.capture else out[0]

    def close(self) -> None:
        L = self._L
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None
