"""The Triton kernel's Hopper machine code, compiled on CPU (see tests/gpu_sass.py).

Needs the ``[gpu-check]`` extra (pip ``triton``); ``.ci/run`` installs it and sets
``JAXCSR_REQUIRE_GPU_CHECK=1`` so that a missing compiler fails CI instead of
skipping.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

if os.environ.get("JAXCSR_REQUIRE_GPU_CHECK") == "1":
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="the [gpu-check] extra (pip triton) is not installed")

import gpu_sass


@pytest.fixture(scope="module")
def kernels():
    return gpu_sass.inspect()


def test_every_kernel_meets_the_machine_code_requirements(kernels):
    # F in {16, 64, 128, 256} x {f32, bf16} x {sum, max}, the three passes each.
    assert len(kernels) == 4 * 2 * 2 * 3
    assert {k.name for k in kernels} == {
        "jaxcsr_spmm_chunks",
        "jaxcsr_spmm_groups",
        "jaxcsr_spmm_rows",
    }
    assert gpu_sass.shortfalls(kernels) == []
    for k in kernels:  # what shortfalls() checks, spelled out
        assert k.spill_bytes == 0 and k.fences == 0 and k.atomics == 0
        assert k.registers <= gpu_sass.REGISTER_TARGET
        if k.n_features >= 64 and (k.dtype == "float32" or k.n_features >= 128):
            assert k.loads_128 > 0


def test_the_check_catches_fenced_atomics(tmp_path):
    """A Pallas atomic add (what the previous kernel used once per work item) shows
    up as fences and atomics: the check can fail."""
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, _, o_ref):
        pltriton.atomic_add(o_ref, (pl.ds(0, 16),), x_ref[pl.ds(0, 16)])

    def fn(x, o):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
            input_output_aliases={1: 0},
            compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
            name="atomic_probe",
        )(x, o)

    spec = jax.ShapeDtypeStruct((16,), jnp.float32)
    ((name, ttir, warps, stages),) = gpu_sass.triton_modules(fn, spec, spec)
    sass, usage = gpu_sass.compile_sass(ttir, warps, stages, str(tmp_path))
    code = gpu_sass.read_sass(name, 16, "float32", "sum", warps, sass, usage)
    assert code.atomics > 0 and code.fences > 0
    assert any("fences" in line for line in gpu_sass.shortfalls([code]))
