"""Hopper machine code of the Pallas Triton kernel, without a GPU.

``python tests/gpu_sass.py [--out DIR]`` exports ``jaxcsr.matmul(...,
impl="pallas_gpu")`` for CUDA on this (CPU) machine, takes the Triton IR out of every
``__gpu$xla.gpu.triton`` custom call, compiles it for ``sm_90`` with the pip ``triton``
package (``pip install -e ".[gpu-check]"``; it bundles ptxas and cuobjdump) and reads
the SASS: registers, spill bytes, fences, atomics and global load widths per kernel.
It prints a markdown table (the one in ``docs/gpu.md``) and exits non-zero if a
kernel misses a requirement (:func:`shortfalls`). ``tests/test_gpu_sass.py`` runs it.

pip triton is not the Triton inside jaxlib: register counts are indicative; fences,
atomics and load widths follow from what the IR asks for.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

TRITON_CALL = "__gpu$xla.gpu.triton"
REGISTER_TARGET = 128
"""Most registers per thread allowed: 4 warps x 128 registers leaves room for 4
programs (16 warps) per SM on Hopper's 64k-register file."""
FEATURES = (16, 64, 128, 256)
DTYPES = ("float32", "bfloat16")
REDUCES = ("sum", "max")


@dataclasses.dataclass(frozen=True)
class KernelCode:
    """What the SASS of one compiled Triton kernel holds."""

    name: str
    n_features: int
    dtype: str
    reduce: str
    num_warps: int
    registers: int
    spill_bytes: int
    fences: int
    atomics: int
    loads_128: int
    loads_64: int
    loads_32: int


def export_for_cuda(fn, *args) -> export.Exported:
    """``jax.export`` of ``jax.jit(fn)`` for CUDA on a machine without a GPU.

    jax 0.10 lowers Pallas Triton for CUDA as is; jax 0.11 asks which GPU to lower
    for: then an abstract ``NVIDIA H200`` (sm_90) device is named through an abstract
    mesh (``AbstractDevice`` took different arguments before 0.11: only reached there).
    """
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]

    def run():
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)

    try:
        return run()
    except Exception as err:
        if "device" not in str(err).lower():
            raise
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        return run()


def triton_modules(fn, *args) -> list[tuple[str, str, int, int]]:
    """``(name, ttir, num_warps, num_stages)`` of each Triton call in ``fn``'s CUDA export."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect as triton_dialect

    exported = export_for_cuda(fn, *args)
    context = jax_mlir.make_ir_context()
    triton_dialect.register_dialect(context)
    found = []
    with context:
        module = ir.Module.parse(exported.mlir_module())

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        child = child.operation
                        if child.name == "stablehlo.custom_call" and TRITON_CALL in str(
                            child.attributes["call_target_name"]
                        ):
                            found.append(child)
                        walk(child)

        walk(module.operation)
        out = []
        for call in found:
            config = ir.DictAttr(call.attributes["mhlo.backend_config"])
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            name = ir.StringAttr(config["name"]).value
            out.append(
                (
                    name,
                    ttir.operation.get_asm(),
                    ir.IntegerAttr(config["num_warps"]).value,
                    ir.IntegerAttr(config["num_stages"]).value,
                )
            )
    return out


def compile_sass(ttir: str, num_warps: int, num_stages: int, workdir: str) -> tuple[str, str]:
    """``(sass, resource usage)`` of Triton IR compiled for sm_90 by pip triton."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "cache"))
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    path = os.path.join(workdir, f"k{abs(hash(ttir))}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    kernel = triton.compile(
        path,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    cubin = path[:-5] + ".cubin"
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True)
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True)
    return sass.stdout, res.stdout


def read_sass(name, n_features, dtype, reduce, num_warps, sass, usage) -> KernelCode:
    """Counts what :func:`shortfalls` checks in one kernel's SASS."""
    return KernelCode(
        name=name,
        n_features=n_features,
        dtype=dtype,
        reduce=reduce,
        num_warps=num_warps,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        spill_bytes=int(re.search(r"LOCAL:(\d+)", usage).group(1)),
        fences=len(re.findall(r"\bMEMBAR\b|CCTL\.IVALL", sass)),
        atomics=len(re.findall(r"\bATOMG?\.|\bRED\.", sass)),
        loads_128=len(re.findall(r"\bLDG\.E\.(?:[A-Z.]*\.)?128\b", sass)),
        loads_64=len(re.findall(r"\bLDG\.E\.(?:[A-Z.]*\.)?64\b", sass)),
        loads_32=len(re.findall(r"\bLDG\.E(?:\.(?:EL|LU|EF|CONSTANT|STRONG\.GPU))*\s", sass)),
    )


def sample_matrix():
    """A hub row (about 30 % of nnz, so both passes run) plus short rows."""
    import jaxcsr

    rng = np.random.default_rng(0)
    idx = np.where(rng.random(4000) < 0.3, 3, rng.integers(0, 300, 4000))
    return idx, jaxcsr.CSRMatrix.from_indices(idx, num_rows=300, backends=("pallas_gpu",))


def inspect(features=FEATURES, dtypes=DTYPES, reduces=REDUCES) -> list[KernelCode]:
    """Exports, compiles and reads every kernel of the configurations asked for."""
    import jaxcsr

    idx, A = sample_matrix()
    jobs = []
    for n_features in features:
        for dtype in dtypes:
            for reduce in reduces:

                def fn(v, reduce=reduce):
                    return jaxcsr.matmul(A, v, impl="pallas_gpu", reduce=reduce)

                spec = jax.ShapeDtypeStruct((idx.size, n_features), jnp.dtype(dtype))
                for name, ttir, warps, stages in triton_modules(fn, spec):
                    jobs.append((name, n_features, dtype, reduce, ttir, warps, stages))
    # Compiles in worker processes, one per core (triton and ptxas are the cost).
    context = multiprocessing.get_context("spawn")  # no fork of a process running jax
    with (
        tempfile.TemporaryDirectory() as workdir,
        concurrent.futures.ProcessPoolExecutor(
            max_workers=max(1, min(len(jobs), os.cpu_count() or 1)), mp_context=context
        ) as pool,
    ):
        futures = [
            pool.submit(compile_sass, ttir, warps, stages, workdir)
            for _, _, _, _, ttir, warps, stages in jobs
        ]
        rows = []
        for (name, n_features, dtype, reduce, _, warps, _), future in zip(
            jobs, futures, strict=True
        ):
            sass, usage = future.result()
            rows.append(read_sass(name, n_features, dtype, reduce, warps, sass, usage))
    return rows


def shortfalls(rows: list[KernelCode]) -> list[str]:
    """Requirements from the GPU kernel issue, one line per miss."""
    out = []
    for r in rows:
        tag = f"{r.name} F={r.n_features} {r.dtype} {r.reduce}"
        if r.spill_bytes:
            out.append(f"{tag}: {r.spill_bytes} spill bytes")
        if r.fences:
            out.append(f"{tag}: {r.fences} MEMBAR/CCTL.IVALL fences")
        if r.atomics:
            out.append(f"{tag}: {r.atomics} atomics")
        if r.registers > REGISTER_TARGET:
            out.append(f"{tag}: {r.registers} registers > {REGISTER_TARGET}")
        wide = (r.dtype == "float32" and r.n_features >= 64) or r.n_features >= 128
        if wide and r.loads_128 == 0:
            out.append(f"{tag}: no 128-bit global loads")
    return out


def markdown(rows: list[KernelCode]) -> str:
    lines = [
        "| kernel | F | dtype | reduce | warps | registers | spill B | fences | atomics "
        "| LDG.128 | LDG.64 | LDG.32 |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.n_features} | {r.dtype} | {r.reduce} | {r.num_warps} "
            f"| {r.registers} | {r.spill_bytes} | {r.fences} | {r.atomics} | {r.loads_128} "
            f"| {r.loads_64} | {r.loads_32} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, nargs="+", default=list(FEATURES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument(
        "--reduces", nargs="+", default=list(REDUCES), choices=("sum", "max", "min")
    )
    args = parser.parse_args(argv)
    rows = inspect(args.features, args.dtypes, args.reduces)
    print(markdown(rows))
    misses = shortfalls(rows)
    for line in misses:
        print("SHORTFALL", line)
    print(f"{len(rows)} kernels compiled for sm_90; {len(misses)} shortfalls")
    return 1 if misses or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
