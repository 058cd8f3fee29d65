#!/usr/bin/env bash
# One lent-GPU call, in the repository root of a CUDA machine's own python (jax, torch,
# scipy, pytest there; nothing installed): the environment, the GPU kernel's tests
# compiled for the device (tests/reference.py: GPU_INTERPRET is False there), then the
# benchmark (benchmarks/hardware/on_gpu.py). Everything goes to $OUT (default
# benchmarks/results/gpu-latest). Time limits: TEST_S and BENCH_S seconds (the
# benchmark stops starting cell groups at BENCH_S - 60); GRAPHS: extra .npz paths;
# FEATURES, DTYPES, SEGMENTS (few-segment counts, "" for none), SKIP (peers left out).
set -u
OUT=${OUT:-benchmarks/results/gpu-latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$PY" -c "import jax, torch, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_S:-150}" "$PY" -m pytest -q -p no:cacheprovider --maxfail=20 \
  tests/test_kernels_gpu.py tests/test_reductions.py tests/test_traced.py -k gpu 2>&1 \
  | tee "$OUT/tests.txt"
tests_rc=${PIPESTATUS[0]}
BENCH_S=${BENCH_S:-330}
graphs="tolokers,musae_github,planetoid_pubmed${GRAPHS:+,$GRAPHS}"
timeout "$BENCH_S" "$PY" -m benchmarks.hardware.on_gpu --out "$OUT" --graphs "$graphs" \
  --features "${FEATURES:-64,256,16}" --dtypes "${DTYPES:-float32,bfloat16}" \
  --segments "${SEGMENTS-1,24}" --skip "${SKIP:-}" --deadline $((BENCH_S - 60)) 2>&1 \
  | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "tests exit $tests_rc, benchmark exit $bench_rc" | tee -a "$OUT/env.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
