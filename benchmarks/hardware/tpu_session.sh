#!/usr/bin/env bash
# The TPU kernel's tests compiled for the chip, then the benchmark, in two lent-TPU calls
# of under 10 minutes each, in the repository root of a TPU machine's own python (jax
# with libtpu, scipy, pytest there; nothing installed; the repository on PYTHONPATH):
#
#   PART=1 bash benchmarks/hardware/tpu_session.sh   # env, compiled tests, tolokers at
#                                                    # N = 1..128 and the model steps
#   PART=2 LARGE=.tpudata/twitter_ego.npz bash benchmarks/hardware/tpu_session.sh
#                                                    # musae_github, then twitter_ego
#
# tests/reference.py: TPU_INTERPRET is False there, so the tests run compiled. Everything
# goes to $OUT (default benchmarks/results/tpu-latest); PART=2 appends to PART=1's
# tpu.json when both write to one folder. Knobs: TEST_S and BENCH_S (seconds; the
# benchmark stops starting groups at BENCH_S - 60), TEST_FILES and TEST_K (the compiled
# tests), GRAPHS, FEATURES, DTYPES and WORKLOADS (the per-width workloads), LARGE (.npz
# paths of large graphs, e.g. twitter_ego copied from ../shared/data into an ignored
# folder that the call carries) run at LARGE_FEATURES within LARGE_S seconds.
set -u
PART=${PART:-1}
OUT=${OUT:-benchmarks/results/tpu-latest}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
NARROW=copy,segment,segment\ pre-sorted,max,traced\ sorted,spmm,softmax
tests_rc=0
bench_rc=0
if [ "$PART" = 1 ]; then
  "$PY" -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
    2>&1 | tee "$OUT/env.txt"
  # one process holds the chip: no pytest -n
  # shellcheck disable=SC2086  # TEST_FILES is a list of paths
  timeout "${TEST_S:-200}" "$PY" -m pytest -q -p no:cacheprovider --maxfail=20 \
    ${TEST_FILES:-tests/test_kernels_tpu.py tests/test_reductions.py} \
    -k "${TEST_K:-tpu}" 2>&1 | tee "$OUT/tests.txt"
  tests_rc=${PIPESTATUS[0]}
  BENCH_S=${BENCH_S:-330}
  timeout "$BENCH_S" "$PY" -m benchmarks.hardware.on_tpu --out "$OUT" \
    --graphs "${GRAPHS:-tolokers}" --features "${FEATURES:-1,8,16,64,128}" \
    --dtypes "${DTYPES:-float32}" --workloads "${WORKLOADS:-$NARROW}" \
    --deadline $((BENCH_S - 60)) 2>&1 | grep -v "^WARNING" | tee "$OUT/bench.txt"
  bench_rc=${PIPESTATUS[0]}
else
  BENCH_S=${BENCH_S:-300}
  timeout "$BENCH_S" "$PY" -m benchmarks.hardware.on_tpu --out "$OUT" --append \
    --graphs "${GRAPHS:-musae_github}" --features "${FEATURES:-16,128}" \
    --dtypes "${DTYPES:-float32}" --workloads "${WORKLOADS:-$NARROW}" --no-models \
    --deadline $((BENCH_S - 60)) 2>&1 | grep -v "^WARNING" | tee -a "$OUT/bench.txt"
  bench_rc=${PIPESTATUS[0]}
  if [ -n "${LARGE:-}" ]; then
    LARGE_S=${LARGE_S:-200}
    timeout "$LARGE_S" "$PY" -m benchmarks.hardware.on_tpu --out "$OUT" --append \
      --graphs "$LARGE" --features "${LARGE_FEATURES:-128}" --dtypes float32 \
      --workloads "copy,segment,segment pre-sorted" --no-models \
      --deadline $((LARGE_S - 60)) --repeats 3 2>&1 | grep -v "^WARNING" | tee -a "$OUT/bench.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
  fi
fi
echo "part $PART: tests exit $tests_rc, benchmark exit $bench_rc" | tee -a "$OUT/env.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
