#!/usr/bin/env bash
# One lent-TPU call, in the repository root of a TPU machine's own python (jax with
# libtpu, scipy, pytest there; nothing installed; the repository on PYTHONPATH): the
# environment, the TPU kernel's tests compiled for the chip (tests/reference.py:
# TPU_INTERPRET is False there), then the benchmark (benchmarks/hardware/on_tpu.py).
# Everything goes to $OUT (default benchmarks/results/tpu-latest). Time limits: TEST_S
# and BENCH_S seconds (the benchmark stops starting groups at BENCH_S - 60); FEATURES,
# DTYPES for the embedded graphs; LARGE: .npz paths of large graphs (twitter_ego from
# ../shared/data, copied into an ignored folder that the call carries), run after
# them at LARGE_FEATURES (128) in float32 within LARGE_S seconds. TEST_FILES and TEST_K
# choose the compiled tests (default: the three kernel files, -k tpu).
set -u
OUT=${OUT:-benchmarks/results/tpu-latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
"$PY" -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
  2>&1 | tee "$OUT/env.txt"
# one process holds the chip: no pytest -n
# shellcheck disable=SC2086  # TEST_FILES is a list of paths
timeout "${TEST_S:-170}" "$PY" -m pytest -q -p no:cacheprovider --maxfail=20 \
  ${TEST_FILES:-tests/test_kernels_tpu.py tests/test_reductions.py tests/test_traced.py} \
  -k "${TEST_K:-tpu}" 2>&1 | tee "$OUT/tests.txt"
tests_rc=${PIPESTATUS[0]}
BENCH_S=${BENCH_S:-300}
timeout "$BENCH_S" "$PY" -m benchmarks.hardware.on_tpu --out "$OUT" \
  --graphs tolokers,musae_github --features "${FEATURES:-128,16}" \
  --dtypes "${DTYPES:-float32,bfloat16}" --deadline $((BENCH_S - 60)) 2>&1 \
  | grep -v "^WARNING" | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
if [ -n "${LARGE:-}" ]; then
  LARGE_S=${LARGE_S:-150}
  timeout "$LARGE_S" "$PY" -m benchmarks.hardware.on_tpu --out "$OUT" --append \
    --graphs "$LARGE" --features "${LARGE_FEATURES:-128}" --dtypes float32 \
    --deadline $((LARGE_S - 60)) --repeats 3 2>&1 | grep -v "^WARNING" | tee -a "$OUT/bench.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
fi
echo "tests exit $tests_rc, benchmark exit $bench_rc" | tee -a "$OUT/env.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
