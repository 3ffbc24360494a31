"""The ``f32`` mode's kernels as an AVX2 machine compiles them: 8 float32 lanes a ymm register
(:func:`llamatrace.kernels.tiles.prefill_lanes`), which an AVX-512 host never runs by itself. The
dense prefill's microkernel and dequantizers, the packed decode kernels and every ``mul_mat_id``
path (one slot, several slots) are held to their references again, in a child compiled for
``znver3`` (the host's features less AVX-512, AMX and VNNI; a Zen core, so the decode kernels read
Q4_K / Q6_K quants as subnormals: the converted path is test_subnormal_gate's)."""

from __future__ import annotations

import pytest
from test_subnormal_gate import ROOT, pytest_in_child

from llamatrace.kernels.tiles import prefill_lanes

FILES = ("test_mul_mat_id_f32.py", "test_tile_gemm.py", "test_f32_decode.py", "test_quant.py")


@pytest.mark.skipif(prefill_lanes() == 8, reason="this host runs the ymm kernels itself (no AVX-512)")
def test_the_f32_kernels_an_avx2_cpu_compiles():
    pytest_in_child("znver3", "from llamatrace.kernels.tiles import prefill_lanes; assert prefill_lanes() == 8",
                    [str(ROOT / "tests" / f) for f in FILES])
