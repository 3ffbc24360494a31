"""Where the ``f32`` decode kernels read Q4_K / Q6_K quants as float32 subnormals, and where they
convert them (:data:`llamatrace.kernels.tiles.SUBNORMAL_BIAS`): Intel documents microcode assists
on subnormal operands, so only AMD's Zen cores (LLVM's ``znver*``) take the subnormal path. The
other path is what every non-Zen machine runs, so it is compiled here for another CPU name (in a
subprocess: the choice is a constant of the compiled kernels, keyed as Numba's cache is) and held
to the float64 reference: for ``haswell`` (ymm), and on an AVX-512 host for ``icelake-server`` too
(the zmm kernels an Intel AVX-512 CPU runs)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from llvmlite import binding as llvm_binding
from test_daz_guard import _runs

from llamatrace.kernels import mul_mat_id as mmid
from llamatrace.kernels import tiles
from llamatrace.kernels.types import mul_mat_id_f32
from llamatrace.machine.jit import subnormal_fma_full_speed

ROOT = Path(__file__).resolve().parents[1]


def _env(cpu: str, avx512: bool = False) -> dict[str, str]:
    """The environment of a child that compiles for ``cpu`` with the host's features less the
    ones that CPU lacks and the kernels would pick (AVX-512 unless ``avx512``, AMX, VNNI)."""
    dropped = ("amx", "avxvnni") if avx512 else ("avx512", "amx", "avxvnni")
    features = sorted(f for f, on in llvm_binding.get_host_cpu_features().items() if on and not f.startswith(dropped))
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=",".join("+" + f for f in features))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def pytest_in_child(cpu: str, precondition: str, args: list[str]) -> None:
    """Run pytest on ``args`` in a child compiled for ``cpu`` (:func:`_env`), after the Python
    statement ``precondition`` (an assert that the child runs the kernels meant); every test must
    pass, none be skipped."""
    code = (f"import sys, pytest; {precondition}; "
            f"sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', *{list(args)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], env=_env(cpu), cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary


def _child(cpu: str, code: str, avx512: bool = False) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=_env(cpu, avx512), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_gate_follows_the_cpu_name():
    assert tiles.SUBNORMAL_BIAS == (149 if subnormal_fma_full_speed() else 0)
    code = "from llamatrace.kernels import tiles; print(tiles.SUBNORMAL_BIAS)"
    assert _child("znver3", code) == "149"
    assert _child("haswell", code) == "0"
    assert _child("sapphirerapids", code) == "0"


CONVERTED = """
import json, gguf, numpy as np
from llamatrace.kernels import tiles
from test_daz_guard import _runs
from test_subnormal_gate import mxfp4_one_slot_error
assert tiles.SUBNORMAL_BIAS == 0
out = {"MXFP4 one slot": mxfp4_one_slot_error()}
for qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
    for name, (call, ref) in _runs(qtype).items():
        got = call().astype(np.float64)
        out[f"{qtype.name} {name}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
print(json.dumps(out))
"""


def test_the_converted_path_a_non_zen_cpu_runs():
    """Also MXFP4's ymm one-slot kernel, which every AVX2 host runs (no subnormals: the same on Intel)."""
    errors = json.loads(_child("haswell", CONVERTED))
    assert set(errors) == {"Q4_K gemv", "Q4_K one slot", "Q6_K gemv", "Q6_K one slot", "MXFP4 one slot"}
    for name, err in errors.items():
        assert err < (1e-6 if name.startswith("MXFP4") else 1e-5), (name, err)


@pytest.mark.skipif(not mul_mat_id_f32.WIDE, reason="compiling zmm kernels for an Intel CPU needs AVX-512 here")
def test_the_zmm_kernels_an_intel_avx512_cpu_runs():
    """The zmm kernels as an Intel AVX-512 CPU (``icelake-server``) compiles them: the converted
    path (no subnormals) on 16 lanes, which a Zen 4 host never runs by itself; held to the same
    float64 references as the other paths."""
    code = CONVERTED.replace("assert tiles.SUBNORMAL_BIAS == 0",
                             "from llamatrace.kernels.types import mul_mat_id_f32\n"
                             "assert tiles.SUBNORMAL_BIAS == 0 and mul_mat_id_f32.WIDE")
    errors = json.loads(_child("icelake-server", code, avx512=True))
    assert set(errors) == {"Q4_K gemv", "Q4_K one slot", "Q6_K gemv", "Q6_K one slot", "MXFP4 one slot"}
    for name, err in errors.items():
        assert err < (1e-6 if name.startswith("MXFP4") else 1e-5), (name, err)


def mxfp4_one_slot_error() -> float:
    """MXFP4's one-slot kernel (zmm with AVX-512, else ymm), one slot an expert, against float64
    sums over gguf-py's weights (rows whose every block has E8M0 scale 0 or 1, weights down to
    float32 subnormals, and a block of scale 200 among them): the largest error of an
    output over its ``sum |x| |w|``."""
    mx = gguf.GGMLQuantizationType.MXFP4
    rng = np.random.default_rng(9)
    raw = gguf.quants.quantize((rng.standard_normal((4 * 37, 2880)) * 0.02).astype(np.float32), mx)
    blocks = raw.reshape(4 * 37, -1, 17)
    blocks[0, :, 0], blocks[1, :, 0], blocks[2, 5, 0] = 0, 1, 200     # expert 0's rows 0-2 (slot 1)
    experts = raw.reshape(4, 37, -1)
    experts.flags.writeable = False
    w = gguf.quants.dequantize(raw, mx).astype(np.float64).reshape(4, 37, 2880)
    x = rng.standard_normal((3, 2880)).astype(np.float32)
    ids, rows = np.array([2, 0, 3], np.int64), np.arange(3, dtype=np.int64)
    order, starts, ex = mmid.groups(ids)
    got = mul_mat_id_f32.matmul_id(x, rows, order, starts, ex, [experts], mx)
    ref = np.einsum("si,soi->so", x.astype(np.float64), w[ids])
    bound = np.einsum("si,soi->so", np.abs(x).astype(np.float64), np.abs(w[ids]))
    return float((np.abs(got.astype(np.float64) - ref) / bound).max())


YMM = """
import hashlib, json, gguf, numpy as np
from llamatrace.kernels import tiles
from llamatrace.kernels.types import mul_mat_id_f32
from test_daz_guard import _runs
from test_subnormal_gate import mxfp4_one_slot_error
assert tiles.SUBNORMAL_BIAS == 149 and not mul_mat_id_f32.WIDE
q6k = _runs(gguf.GGMLQuantizationType.Q6_K)["one slot"][0]()
call, ref = _runs(gguf.GGMLQuantizationType.Q4_K)["one slot"]
err = float(np.abs(call().astype(np.float64) - ref).max() / np.abs(ref).max())
print(json.dumps({"Q6_K": hashlib.sha256(q6k.tobytes()).hexdigest(), "Q4_K": err, "MXFP4": mxfp4_one_slot_error()}))
"""


@pytest.mark.skipif(not (mul_mat_id_f32.WIDE and tiles.SUBNORMAL_BIAS), reason="a Zen host with AVX-512")
def test_the_ymm_one_slot_kernels_an_avx2_zen_runs():
    """The one-slot kernels an AVX2 Zen (``znver3``) compiles, beside this host's zmm ones: Q6_K's
    bit for bit (the same sums), Q4_K's and MXFP4's against the reference (their zmm kernels group
    them otherwise)."""
    got = json.loads(_child("znver3", YMM))
    assert got["Q6_K"] == hashlib.sha256(_runs(gguf.GGMLQuantizationType.Q6_K)["one slot"][0]().tobytes()).hexdigest()
    assert got["Q4_K"] < 1e-5
    assert got["MXFP4"] < 1e-6 and mxfp4_one_slot_error() < 1e-6
