// jaxcsr's CPU kernels, called through XLA FFI (jaxcsr/kernels/cpu.py).
//
// Two products, each with a sum, max or min over a row's entries (Op; empty rows 0):
//
// * CsrPull: y[r] = op_{j in row r} data[j] * x[cols[j]], rows in CSR order
//   (general matrices and their transposes, sorted segment ids), rows split over
//   threads by nnz. Each row is accumulated in float32 in CSR order (one feature:
//   in eight lanes, combined in a fixed tree), then stored once in the output dtype.
// * RowPush: the one-per-column view (unsorted segment ids): entry k brings
//   data[k] * x[k] to row ids[k], in 1, 2 or 4 pieces of consecutive entries with
//   private float32 partials, combined in piece order.
//
// Plus the sampled product (Sddmm), the one-entry-per-row gather (Gather) and the
// softmax over rows, with its backward (Softmax: one pass per row for entries sorted by
// row; pushes in input order, like RowPush, for unsorted segment ids).
//
// Every output row is reduced in one order fixed by the sizes, whatever the number of
// threads or chunks: results are bit-identical for any thread count. Ids outside
// [0, rows) belong to no row (they are dropped, as jax.ops drops them). Loops are
// compiled for AVX2 and for the baseline (some also for AVX-512: run_wide, the softmax)
// and chosen at run time, the same bits on each. Everything is checked in Python before
// the call; the checks here guard memory.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "vector_math.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jaxcsr::exp16;
using jaxcsr::exp8;
using jaxcsr::f32x8;
using jaxcsr::f32x16;
using jaxcsr::i32x8;
using jaxcsr::splat;
using jaxcsr::splat_as;

// ------------------------------------------------------------------ 16-bit floats
JAXCSR_INLINE float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

JAXCSR_INLINE uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

JAXCSR_INLINE float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: exactly man * 2^-24
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

JAXCSR_INLINE uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below 2^-14: subnormal (or zero) in half
    float a;
    std::memcpy(&a, &abs, sizeof a);
    // a * 2^24 rounded to nearest even integer: the subnormal's mantissa
    float scaled = a * 16777216.0f;
    uint32_t m = static_cast<uint32_t>(scaled);
    float rest = scaled - static_cast<float>(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

struct F32 {
  using Storage = float;
  JAXCSR_INLINE static float load(float v) { return v; }
  JAXCSR_INLINE static float store(float v) { return v; }
};
struct BF16 {
  using Storage = uint16_t;
  JAXCSR_INLINE static float load(uint16_t v) { return bf16_to_f32(v); }
  JAXCSR_INLINE static uint16_t store(float v) { return f32_to_bf16(v); }
};
struct F16 {
  using Storage = uint16_t;
  JAXCSR_INLINE static float load(uint16_t v) { return f16_to_f32(v); }
  JAXCSR_INLINE static uint16_t store(float v) { return f32_to_f16(v); }
};

// The reductions: acc = combine(acc, v) from init; max/min propagate NaN (as XLA's).
struct Sum {
  static constexpr float init = 0.0f;
  JAXCSR_INLINE static float combine(float acc, float v) { return acc + v; }
};
// (Written as two selects, which compile to maxss/minss and a conditional move: no
// branch to mispredict on data in random order.)
struct Max {
  static constexpr float init = -__builtin_inff();
  JAXCSR_INLINE static float combine(float acc, float v) {
    const float top = v > acc ? v : acc;
    return v != v ? v : top;
  }
};
struct Min {
  static constexpr float init = __builtin_inff();
  JAXCSR_INLINE static float combine(float acc, float v) {
    const float low = v < acc ? v : acc;
    return v != v ? v : low;
  }
};

// Eight lanes of partial results combined in one fixed order: a sum as a tree (the
// order of a vector register's halves), max/min left to right.
template <typename Op>
JAXCSR_INLINE float fold_lanes(const float* lane) {
  if constexpr (std::is_same<Op, Sum>::value) {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
           ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  } else {
    float total = lane[0];
    for (int l = 1; l < 8; ++l) total = Op::combine(total, lane[l]);
    return total;
  }
}

// acc[0:f] = combine(acc, w * x[0:f]) (x converted to float32): the inner loop,
// inlined into the row loops below, which are compiled twice (AVX2 and baseline).
template <typename In, typename Op>
JAXCSR_INLINE void accumulate(float* __restrict acc, const typename In::Storage* __restrict x,
                              float w, int64_t f) {
  for (int64_t i = 0; i < f; ++i) acc[i] = Op::combine(acc[i], w * In::load(x[i]));
}

// y[0:f] = acc (or 0 for an empty row of max/min, whose acc is still +-inf).
template <typename Out>
JAXCSR_INLINE void store_row(typename Out::Storage* __restrict y, const float* __restrict acc,
                             int64_t f, bool empty) {
  if (empty) {
    for (int64_t i = 0; i < f; ++i) y[i] = Out::store(0.0f);
    return;
  }
  for (int64_t i = 0; i < f; ++i) y[i] = Out::store(acc[i]);
}

// ------------------------------------------------------------------ the thread pool
// Runs body(c) for c in [0, chunks): the caller and up to threads - 1 pool tasks claim
// chunks from one counter; the caller returns once every chunk is done. A task that
// starts late finds no chunk and touches only the shared counters.
template <typename Body>
void parallel_chunks(ffi::ThreadPool& pool, int64_t chunks, int64_t threads, Body body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, chunks, &body] {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      body(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min(threads, chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    // The task holds the state, never the caller's frame: it may start after return.
    pool.Schedule([state, chunks, body_ptr = &body]() mutable {
      for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
        (*body_ptr)(c);
        state->done.fetch_add(1, std::memory_order_release);
      }
    });
  }
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

int64_t thread_count(ffi::ThreadPool& pool, int64_t max_threads) {
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  return max_threads > 0 ? std::min(threads, max_threads) : threads;
}

// Chunks for ``work`` elements: one per ``grain``, at most ``per_thread`` per thread;
// below kSerialWork, one (the calling thread alone): waking a pool thread costs tens
// of microseconds on the machines measured, about what 2^17 elements take (the
// timings: benchmarks/results/cpu-xeon-avx512/README.md).
constexpr int64_t kSerialWork = int64_t{1} << 17;

int64_t chunk_count(int64_t work, int64_t threads, int64_t per_thread, int64_t grain = 16384) {
  if (work < kSerialWork) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(threads * per_thread, work / grain + 1));
}

// Chunk c covers rows [starts[c], starts[c + 1]): about equal entries (plus rows) each.
std::vector<int64_t> row_chunks(const int32_t* indptr, int64_t rows, int64_t chunks) {
  std::vector<int64_t> starts(chunks + 1, rows);
  starts[0] = 0;
  const int64_t total = indptr[rows] + rows;
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t target = total * c / chunks;
    int64_t lo = starts[c - 1], hi = rows;  // first row r with indptr[r] + r >= target
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (indptr[mid] + mid < target) lo = mid + 1; else hi = mid;
    }
    starts[c] = lo;
  }
  return starts;
}

// Rows split into chunks of about equal work over the threads, ``body(lo, hi, bad)``
// for each: the pull loops' split (a gathered value, read at a column at random,
// counts as two streamed ones, which put PubMed's one-feature SpMM on two threads).
// Returns false if some chunk set ``bad`` (a column outside x).
template <typename Body>
bool over_row_chunks(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                     int64_t rows, int64_t f, bool gathered, Body body) {
  const int64_t threads = thread_count(pool, max_threads);
  const int64_t work = (gathered ? 2 : 1) * int64_t{indptr[rows]} * f + rows;
  const int64_t chunks = chunk_count(work, threads, 8);
  const std::vector<int64_t> starts = row_chunks(indptr, rows, chunks);
  std::atomic<bool> any_bad{false};
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    bool bad = false;
    body(starts[c], starts[c + 1], bad);
    if (bad) any_bad.store(true);
  });
  return !any_bad.load();
}

// The features [0, f) split over ``threads`` in blocks of whole 64-byte lines of an
// operand of ``Storage``, ``body(c0, c1)`` for each (one block below two lines).
template <typename Storage, typename Body>
void over_feature_blocks(ffi::ThreadPool& pool, int64_t threads, int64_t f, Body body) {
  const int64_t line = 64 / sizeof(Storage), lines = f / line;
  const int64_t blocks = std::max<int64_t>(1, std::min(threads, lines));
  parallel_chunks(pool, blocks, threads, [&](int64_t b) {
    const int64_t c0 = line * (lines * b / blocks);
    const int64_t c1 = b + 1 == blocks ? f : line * (lines * (b + 1) / blocks);
    body(c0, c1);
  });
}

// rows[r * stride : r * stride + width] = value for r in [0, m): a block of columns
// (or all of them) of a row-major array.
template <typename T>
JAXCSR_INLINE void fill_columns(T* rows, int64_t m, int64_t stride, int64_t width, T value) {
  if (stride == width) return std::fill(rows, rows + m * width, value);
  for (int64_t r = 0; r < m; ++r) std::fill(rows + r * stride, rows + r * stride + width, value);
}

// ------------------------------------------------------------------ eight lanes
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Up to eight values from x[0:w] in float32, the rest ``pad``. Whole blocks of float32
// and bfloat16 load as vectors.
template <typename In>
JAXCSR_INLINE f32x8 load8(const typename In::Storage* x, int64_t w, float pad) {
  if (w >= 8) {
    if constexpr (std::is_same<In, F32>::value) {
      f32x8 v;
      std::memcpy(&v, x, sizeof v);
      return v;
    } else if constexpr (std::is_same<In, BF16>::value) {
      u16x8 h;
      std::memcpy(&h, x, sizeof h);
      return reinterpret_cast<f32x8>(__builtin_convertvector(h, u32x8) << 16);
    }
  }
  f32x8 v = splat(pad);
  for (int l = 0; l < (w < 8 ? w : 8); ++l) v[l] = In::load(x[l]);
  return v;
}

// load8 where eight values are readable from x (a row's tail followed by more of the
// same array, which no thread writes): one vector load, the lanes past w set to ``pad``
// -- no lane-by-lane build, which stalls on store forwarding.
template <typename In>
JAXCSR_INLINE f32x8 load8_over(const typename In::Storage* x, int64_t w, float pad) {
  if constexpr (std::is_same<In, F16>::value) {
    return load8<In>(x, w, pad);
  } else {
    const f32x8 v = load8<In>(x, 8, pad);
    if (w >= 8) return v;
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    return lane < (i32x8{} + static_cast<int32_t>(w)) ? v : splat(pad);
  }
}

// Block i of a row of len values, ``readable`` values readable from its start.
// (A helper, not a lambda: a lambda is not always inlined, and a 32-byte vector
// returned across the AVX2/baseline boundary changes the calling convention.)
template <typename In>
JAXCSR_INLINE f32x8 load8_row(const typename In::Storage* x, int64_t i, int64_t len,
                              int64_t readable, float pad) {
  return i + 8 <= readable ? load8_over<In>(x + i, len - i, pad)
                           : load8<In>(x + i, len - i, pad);
}

// Whether every lane of a comparison's result is true.
JAXCSR_INLINE bool all_lanes(i32x8 mask) {
  uint64_t words[4];
  std::memcpy(words, &mask, sizeof words);
  return (words[0] & words[1] & words[2] & words[3]) == ~uint64_t{0};
}

JAXCSR_INLINE f32x8 load8f(const float* x, int64_t w) {
  if (w >= 8) {
    f32x8 v;
    std::memcpy(&v, x, sizeof v);
    return v;
  }
  f32x8 v = splat(0.0f);
  for (int l = 0; l < w; ++l) v[l] = x[l];
  return v;
}

// y[0:min(w, 8)] = v in the output dtype (bfloat16: round to nearest even, as
// f32_to_bf16, eight at a time).
template <typename Out>
JAXCSR_INLINE void store8(typename Out::Storage* y, f32x8 v, int64_t w) {
  if (w >= 8) {
    if constexpr (std::is_same<Out, F32>::value) {
      std::memcpy(y, &v, sizeof v);
      return;
    } else if constexpr (std::is_same<Out, BF16>::value) {
      const u32x8 bits = reinterpret_cast<u32x8>(v);
      const u32x8 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
      const u32x8 nan = (bits >> 16) | 0x40u;
      const u16x8 h = __builtin_convertvector(
          (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded, u16x8);
      std::memcpy(y, &h, sizeof h);
      return;
    }
  }
  for (int l = 0; l < (w < 8 ? w : 8); ++l) y[l] = Out::store(v[l]);
}

JAXCSR_INLINE f32x8 max8(f32x8 acc, f32x8 v) {  // NaN propagates, as Max::combine
  return (v > acc) | (v != v) ? v : acc;
}

JAXCSR_INLINE f32x8 min8(f32x8 acc, f32x8 v) {  // NaN propagates, as Min::combine
  return (v < acc) | (v != v) ? v : acc;
}

// Op::combine on eight lanes (the same result in each lane as the scalar one).
template <typename Op>
JAXCSR_INLINE f32x8 combine8(f32x8 acc, f32x8 v) {
  if constexpr (std::is_same<Op, Sum>::value) {
    return acc + v;
  } else if constexpr (std::is_same<Op, Max>::value) {
    return max8(acc, v);
  } else {
    return min8(acc, v);
  }
}

template <typename Op>
JAXCSR_INLINE float fold_vector(f32x8 v) {
  float lane[8];
  std::memcpy(lane, &v, sizeof lane);
  return fold_lanes<Op>(lane);
}

// ------------------------------------------------------------------ kernels
// The column of entry j of a row ending at j1 (j itself without cols), or -1 when it is
// outside [0, n) (``bad`` is then set: x is never read there); prefetches the row of x
// that entry j + 8 reads.
template <typename S>
JAXCSR_INLINE int64_t checked_column(const int32_t* cols, int64_t j, int64_t j1, const S* x,
                                     int64_t f, uint64_t n, bool& bad) {
  const int64_t col = cols ? cols[j] : j;
  if (static_cast<uint64_t>(col) >= n) {
    bad = true;
    return -1;
  }
  if (cols && j + 8 < j1) __builtin_prefetch(x + static_cast<int64_t>(cols[j + 8]) * f);
  return col;
}

// Features [c0, c0 + 8 V) of row r of the pull product (float32 or bfloat16 operands
// and output; rows of x and y ``f`` apart): the V accumulators are vector registers, no
// loop over features, and the block's lines of x are prefetched eight entries ahead.
// Same order per feature as the general loop below: the same bits.
//
// bfloat16 with V even reads sixteen features as eight 32-bit words: a word's low half
// (an even feature) is float32 once shifted up, its high half (the odd feature next to
// it) once the low half is masked off. Accumulators 2u and 2u + 1 hold the even and
// odd features of block u, interleaved once per row at the store. The widening
// conversion it replaces compiles (gcc, AVX2) to four shuffles per eight values, all
// on one port, which bound bfloat16 SpMM (the timings:
// benchmarks/results/cpu-xeon-avx512/README.md).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "bfloat16 halves of a word");

template <typename In, typename Out, typename Op, int V>
JAXCSR_INLINE void pull_row_block(const int32_t* cols, const typename In::Storage* data,
                                  const typename In::Storage* x, typename Out::Storage* y,
                                  int64_t f, int64_t c0, int64_t j0, int64_t j1, uint64_t n,
                                  bool& bad) {
  constexpr int64_t kLines = (8 * V * sizeof(typename In::Storage) + 63) / 64;
  constexpr bool kHalves = std::is_same<In, BF16>::value && V % 2 == 0;
  const typename In::Storage* xb = x + c0;
  f32x8 a[V];
  for (int v = 0; v < V; ++v) a[v] = splat(Op::init);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t col = checked_column(cols, j, j1, xb, f, n, bad);
    if (col < 0) continue;
    if constexpr (kLines > 1) {
      if (cols && j + 8 < j1) {
        const char* ahead = reinterpret_cast<const char*>(xb + int64_t{cols[j + 8]} * f);
        for (int64_t l = 1; l < kLines; ++l) __builtin_prefetch(ahead + 64 * l);
      }
    }
    const f32x8 w = splat(data ? In::load(data[j]) : 1.0f);
    if constexpr (kHalves) {
      for (int u = 0; u < V / 2; ++u) {
        u32x8 words;
        std::memcpy(&words, xb + col * f + 16 * u, sizeof words);
        a[2 * u] = combine8<Op>(a[2 * u], w * reinterpret_cast<f32x8>(words << 16));
        a[2 * u + 1] = combine8<Op>(a[2 * u + 1], w * reinterpret_cast<f32x8>(words & 0xffff0000u));
      }
    } else {
      for (int v = 0; v < V; ++v)
        a[v] = combine8<Op>(a[v], w * load8<In>(xb + col * f + 8 * v, 8, 0.0f));
    }
  }
  if constexpr (kHalves) {
    for (int u = 0; u < V / 2; ++u) {
      const f32x8 even = a[2 * u], odd = a[2 * u + 1];
      a[2 * u] = __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
      a[2 * u + 1] = __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
    }
  }
  for (int v = 0; v < V; ++v) store8<Out>(y + c0 + 8 * v, j1 == j0 ? splat(0.0f) : a[v], 8);
}

// Rows [lo, hi) of the pull product for f = 8 * V features.
template <typename In, typename Out, typename Op, int V>
JAXCSR_INLINE void pull_rows_vectors(const int32_t* indptr, const int32_t* cols,
                                     const typename In::Storage* data,
                                     const typename In::Storage* x, typename Out::Storage* y,
                                     int64_t lo, int64_t hi, uint64_t n, bool& bad) {
  constexpr int64_t f = 8 * V;
  for (int64_t r = lo; r < hi; ++r)
    pull_row_block<In, Out, Op, V>(cols, data, x, y + r * f, f, 0, indptr[r], indptr[r + 1],
                                   n, bad);
}

// Rows [lo, hi) of the pull product for f > 64 gathered features, a multiple of 8: each row in
// blocks of 64 features (then one of the rest), every block one pass over the row's
// entries with its accumulators in registers (no accumulator row in memory, loaded and
// stored at every entry). Each feature is reduced in CSR order: the same bits.
template <typename In, typename Out, typename Op>
JAXCSR_INLINE void pull_rows_blocks(const int32_t* indptr, const int32_t* cols,
                                    const typename In::Storage* data,
                                    const typename In::Storage* x, typename Out::Storage* y,
                                    int64_t f, int64_t lo, int64_t hi, uint64_t n, bool& bad) {
  const int64_t whole = f / 64 * 64;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], j1 = indptr[r + 1];
    typename Out::Storage* yr = y + r * f;
    for (int64_t c0 = 0; c0 < whole; c0 += 64)
      pull_row_block<In, Out, Op, 8>(cols, data, x, yr, f, c0, j0, j1, n, bad);
    switch ((f - whole) / 8) {
      case 1: pull_row_block<In, Out, Op, 1>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      case 2: pull_row_block<In, Out, Op, 2>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      case 3: pull_row_block<In, Out, Op, 3>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      case 4: pull_row_block<In, Out, Op, 4>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      case 5: pull_row_block<In, Out, Op, 5>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      case 6: pull_row_block<In, Out, Op, 6>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      case 7: pull_row_block<In, Out, Op, 7>(cols, data, x, yr, f, whole, j0, j1, n, bad); break;
      default: break;
    }
  }
}

// Rows [lo, hi) of the pull product. Up to 32 features a row's accumulators stay in
// registers; wider rows accumulate in ``acc`` (f floats, in L1). One pass over each
// row's entries either way.
template <typename In, typename Out, typename Op>
JAXCSR_INLINE void pull_rows_body(const int32_t* indptr, const int32_t* cols,
                                  const typename In::Storage* data,
                                  const typename In::Storage* x, typename Out::Storage* y,
                                  int64_t f, int64_t lo, int64_t hi, float* acc, uint64_t n,
                                  bool& bad) {
  if (!cols && f == 1) {  // sorted segment ids, one feature: eight lanes per row, vectorised
    // A row's last block loads a whole vector where x continues past the row (lanes
    // past it masked): no scalar tail, whose varying trip count mispredicts on short
    // rows. Lane l sums entries l, l + 8, ... of the row, as a scalar tail would.
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t j0 = indptr[r], len = indptr[r + 1] - j0;
      const int64_t readable = data ? len : static_cast<int64_t>(n) - j0;
      f32x8 acc = splat(Op::init);
      for (int64_t i = 0; i < len; i += 8) {
        f32x8 v = load8_row<In>(x + j0, i, len, readable, 0.0f);
        if (data) v *= load8<In>(data + j0 + i, len - i, 0.0f);
        acc = combine8<Op>(acc, lane < static_cast<int32_t>(len - i) ? v : splat(Op::init));
      }
      const float total = fold_vector<Op>(acc);
      store_row<Out>(y + r, &total, 1, len == 0);
    }
    return;
  }
  if (f == 1 && n > 0) {  // one feature, columns gathered: eight lanes per row
    // As the sorted path: a row's columns load eight at a time (the block past the
    // row's end read from the next rows' columns where there are any), each lane's
    // value gathered from x at a column clamped into [0, n) and masked off past the row
    // or at a column outside x (``bad``). No loop over a row's entries, whose varying
    // trip count mispredicted at every short row's end.
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const int64_t nnz = indptr[hi];
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t j0 = indptr[r], len = indptr[r + 1] - j0;
      f32x8 acc = splat(Op::init);
      for (int64_t i = 0; i < len; i += 8) {
        i32x8 col;
        if (j0 + i + 8 <= nnz) {
          std::memcpy(&col, cols + j0 + i, sizeof col);
        } else {
          col = i32x8{};
          for (int64_t l = 0; l < nnz - j0 - i; ++l) col[l] = cols[j0 + i + l];
        }
        const i32x8 in_row = lane < static_cast<int32_t>(len - i);
        const i32x8 in_x = reinterpret_cast<u32x8>(col) < static_cast<uint32_t>(n);
        if (__builtin_expect(!all_lanes(in_x | ~in_row), 0)) bad = true;
        const i32x8 take = in_row & in_x;
        const i32x8 at = take ? col : i32x8{};
        f32x8 v;
        for (int l = 0; l < 8; ++l) v[l] = In::load(x[at[l]]);
        if (data) v *= load8_row<In>(data + j0, i, len, nnz - j0, 0.0f);
        acc = combine8<Op>(acc, take ? v : splat(Op::init));
      }
      const float total = fold_vector<Op>(acc);
      store_row<Out>(y + r, &total, 1, len == 0);
    }
    return;
  }
  if constexpr (!std::is_same<In, F16>::value && std::is_same<In, Out>::value) {
    switch (f) {
      case 8: return pull_rows_vectors<In, Out, Op, 1>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 16: return pull_rows_vectors<In, Out, Op, 2>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 32: return pull_rows_vectors<In, Out, Op, 4>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 64: return pull_rows_vectors<In, Out, Op, 8>(indptr, cols, data, x, y, lo, hi, n, bad);
      default: break;
    }
    // gathered rows only: with x streamed (sorted segment ids) the blocks measured no
    // faster for sums and slower for max, so those keep the loop
    if (cols && f > 64 && f % 8 == 0)
      return pull_rows_blocks<In, Out, Op>(indptr, cols, data, x, y, f, lo, hi, n, bad);
  }
  constexpr int64_t kWidth = 32;
  float local[kWidth];
  float* a = f <= kWidth ? local : acc;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], j1 = indptr[r + 1];
    std::fill(a, a + f, Op::init);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t col = checked_column(cols, j, j1, x, f, n, bad);
      if (col < 0) continue;
      const float w = data ? In::load(data[j]) : 1.0f;
      if (f <= kWidth) {
        accumulate<In, Op>(local, x + col * f, w, f);
      } else {
        accumulate<In, Op>(acc, x + col * f, w, f);
      }
    }
    store_row<Out>(y + r * f, a, f, j1 == j0);
  }
}

// Entries [k0, k1) of the push product into ``acc`` (all m rows, from Op::init), for
// the ``width`` features starting at ``x`` and ``acc`` of rows ``stride`` apart (a
// block of columns, or all of them): each entry's row is read, no branch per entry,
// so ids in any order cost the same. Ids outside [0, m) are dropped. V > 0: width =
// 8 * V, float32 or bfloat16 operands and output.
template <typename In, typename Out, typename Op, int V>
JAXCSR_INLINE void push_rows_body(const int32_t* ids, const typename In::Storage* data,
                                  const typename In::Storage* x, float* acc, int64_t m,
                                  int64_t stride, int64_t width, int64_t k0, int64_t k1) {
  constexpr int64_t kAhead = 16;
  // One feature (every caller then has stride 1): the bare loop, no feature loop, no
  // stride, no weight of 1.0 per entry. Any other width runs the loop below.
  if (width == 1 && stride == 1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t r = ids[k];
      if (static_cast<uint64_t>(r) >= static_cast<uint64_t>(m)) continue;
      acc[r] = Op::combine(acc[r], data ? In::load(data[k]) * In::load(x[k]) : In::load(x[k]));
    }
    return;
  }
  for (int64_t k = k0; k < k1; ++k) {
    if (width > 1 && k + kAhead < k1) {
      const uint64_t ahead = static_cast<uint32_t>(ids[k + kAhead]);
      const float* row = acc + (ahead < static_cast<uint64_t>(m) ? ahead : 0) * stride;
      for (int64_t i = 0; i < width; i += 16) __builtin_prefetch(row + i, 1);  // its lines
      // x's lines too, for rows of two lines or more (rows of one line measured no
      // better)
      if (width * int64_t{sizeof(*x)} >= 128)
        for (int64_t i = 0; i < width; i += 64 / sizeof(*x))
          __builtin_prefetch(x + (k + kAhead) * stride + i);
    }
    const int64_t r = ids[k];
    if (static_cast<uint64_t>(r) >= static_cast<uint64_t>(m)) continue;
    const float w = data ? In::load(data[k]) : 1.0f;
    if (V > 0) {  // width = 8 * V: whole vectors, no loop over features
      for (int v = 0; v < V; ++v) {
        f32x8 a;
        std::memcpy(&a, acc + r * stride + 8 * v, sizeof a);
        a = combine8<Op>(a, splat(w) * load8<In>(x + k * stride + 8 * v, 8, 0.0f));
        std::memcpy(acc + r * stride + 8 * v, &a, sizeof a);
      }
    } else {
      accumulate<In, Op>(acc + r * stride, x + k * stride, w, width);
    }
  }
}

// The widest instruction set the loops may use: 0 the baseline, 1 AVX2, 2 AVX-512;
// JAXCSR_CPU_ISA=baseline or avx2 (read once) caps it below what the CPU has -- for the
// tests that compare the builds' bits on one machine.
int isa_cap() {
  static const int cap = [] {
    const char* isa = std::getenv("JAXCSR_CPU_ISA");
    if (isa && std::strcmp(isa, "baseline") == 0) return 0;
    if (isa && std::strcmp(isa, "avx2") == 0) return 1;
    return 2;
  }();
  return cap;
}

bool has_avx2() {
  static const bool yes = isa_cap() >= 1 && __builtin_cpu_supports("avx2");
  return yes;
}

// Every loop body compiled for AVX2 and for the baseline (some also for AVX-512:
// run_wide), chosen at run time: Body::run (always inlined) takes on the instruction set
// of its caller here.
template <typename Body, typename... Args>
__attribute__((target("avx2"))) void run_avx2(Args&&... args) {
  Body::run(std::forward<Args>(args)...);
}

template <typename Body, typename... Args>
void run_base(Args&&... args) {
  Body::run(std::forward<Args>(args)...);
}

template <typename Body, typename... Args>
void run_best(Args&&... args) {
  if (has_avx2()) {
    run_avx2<Body>(std::forward<Args>(args)...);
  } else {
    run_base<Body>(std::forward<Args>(args)...);
  }
}

// The AVX-512 build of a body (run_wide's, the softmax's sixteen-lane exp), where the CPU
// has it.
bool has_avx512() {
  static const bool yes = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

template <typename Body, typename... Args>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) void run_avx512(Args&&... args) {
  Body::run(std::forward<Args>(args)...);
}

// A body compiled a third time, for AVX-512, and run that way where the CPU has it:
// for the loops the compiler vectorises itself (sixteen lanes there, the same operations
// per value: the same bits), where it measured faster than AVX2 (the two builds in
// turns, same bits asserted; the timings: benchmarks/results/cpu-xeon-avx512/README.md):
// - PullRows, the loop of rows past 64 features (rows with their own eight-lane code
//   measured the same or slower, so they stay AVX2: pull_rows);
// - PutAttainingRows (the max gradient's put);
// - GatherRows (the row gather through the caches);
// - PushRows past 64 features (rows of 8-64 features stay AVX2).
// The SDDMM measured slower, the softmax and the arg searches the same: they stay
// run_best.
template <typename Body, typename... Args>
void run_wide(Args&&... args) {
  if (has_avx512()) {
    run_avx512<Body>(std::forward<Args>(args)...);
  } else {
    run_best<Body>(std::forward<Args>(args)...);
  }
}

template <typename In, typename Out, typename Op>
struct PullRows {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    pull_rows_body<In, Out, Op>(std::forward<Args>(args)...);
  }
};

// The push body over entries [k0, k1); with Fill, into partials filled first with the
// reduction's identity (without: adding to partials an earlier call left).
template <typename In, typename Out, typename Op, bool Fill = true>
struct PushRows {
  JAXCSR_INLINE static void run(const int32_t* ids, const typename In::Storage* data,
                                const typename In::Storage* x, float* acc, int64_t m,
                                int64_t stride, int64_t width, int64_t k0, int64_t k1) {
    if constexpr (Fill) fill_columns(acc, m, stride, width, Op::init);
    if constexpr (!std::is_same<In, F16>::value && std::is_same<In, Out>::value) {
      switch (width) {
        case 8: return push_rows_body<In, Out, Op, 1>(ids, data, x, acc, m, stride, 8, k0, k1);
        case 16: return push_rows_body<In, Out, Op, 2>(ids, data, x, acc, m, stride, 16, k0, k1);
        case 32: return push_rows_body<In, Out, Op, 4>(ids, data, x, acc, m, stride, 32, k0, k1);
        case 64: return push_rows_body<In, Out, Op, 8>(ids, data, x, acc, m, stride, 64, k0, k1);
        default: break;
      }
    }
    push_rows_body<In, Out, Op, 0>(ids, data, x, acc, m, stride, width, k0, k1);
  }
};

// Whether rows of f features take a body's whole-vector code (float32 or bfloat16 in and
// out, 8-64 features: the switches of PushRows::run and pull_rows_body) rather than the
// loop over features the compiler vectorises.
template <typename In, typename Out>
constexpr bool whole_vector_rows(int64_t f) {
  return !std::is_same<In, F16>::value && std::is_same<In, Out>::value &&
         (f == 8 || f == 16 || f == 32 || f == 64);
}

// PushRows over entries [k0, k1): AVX2 where its vector bodies run (rows of 8-64
// features), else the AVX-512 build where the CPU has it (run_wide).
template <typename In, typename Out, typename Op>
void push_rows(const int32_t* ids, const typename In::Storage* data,
               const typename In::Storage* x, float* acc, int64_t m, int64_t stride,
               int64_t width, int64_t k0, int64_t k1) {
  if (whole_vector_rows<In, Out>(width)) {
    run_best<PushRows<In, Out, Op>>(ids, data, x, acc, m, stride, width, k0, k1);
  } else {
    run_wide<PushRows<In, Out, Op>>(ids, data, x, acc, m, stride, width, k0, k1);
  }
}

// PullRows over rows [lo, hi): AVX2 where it runs its own vector code (one feature;
// rows of 8-64 features and gathered rows past 64 in blocks, float32 or bfloat16 in and
// out), else -- the loop the compiler vectorises -- the AVX-512 build where the CPU has
// it (run_wide).
template <typename In, typename Out, typename Op>
void pull_rows(const int32_t* indptr, const int32_t* cols, const typename In::Storage* data,
               const typename In::Storage* x, typename Out::Storage* y, int64_t f, int64_t lo,
               int64_t hi, float* acc, uint64_t n, bool& bad) {
  constexpr bool vector_bodies = !std::is_same<In, F16>::value && std::is_same<In, Out>::value;
  const bool own_code = f == 1 || whole_vector_rows<In, Out>(f) ||
                        (vector_bodies && cols && f > 64 && f % 8 == 0);  // pull_rows_blocks
  if (own_code) {
    run_best<PullRows<In, Out, Op>>(indptr, cols, data, x, y, f, lo, hi, acc, n, bad);
  } else {
    run_wide<PullRows<In, Out, Op>>(indptr, cols, data, x, y, f, lo, hi, acc, n, bad);
  }
}

// values[j] = data[perm[j]] for entries [j0, j1) (the values of a planned transpose,
// read in its CSR order); a position outside [0, nnz) sets ``bad`` and reads 0.
template <typename S>
void permute_values(const S* data, const int32_t* perm, S* values, int64_t j0, int64_t j1,
                    int64_t nnz, bool& bad) {
  for (int64_t j = j0; j < j1; ++j) {
    const uint64_t p = static_cast<uint32_t>(perm[j]);
    if (p >= static_cast<uint64_t>(nnz)) {
      bad = true;
      values[j] = S{};
      continue;
    }
    values[j] = data[p];
  }
}

// Returns false if a column index was outside [0, n) (those entries are skipped) or a
// position in ``perm`` outside the entries. With ``perm``, entry j's value is
// data[perm[j]]: each chunk of rows puts its values in CSR order first, while they
// stay in cache for its rows (no separate pass over all of them).
template <typename In, typename Out, typename Op>
bool csr_pull(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
              const int32_t* cols, const typename In::Storage* data, const int32_t* perm,
              const typename In::Storage* x, typename Out::Storage* y, int64_t rows,
              int64_t f, int64_t n) {
  using S = typename In::Storage;
  const int64_t nnz = indptr[rows];
  std::unique_ptr<S[]> permuted(perm && data ? new S[std::max<int64_t>(nnz, 1)] : nullptr);
  return over_row_chunks(pool, max_threads, indptr, rows, f, cols != nullptr,
                         [&](int64_t lo, int64_t hi, bool& bad) {
                           const S* values = data;
                           if (permuted) {
                             permute_values(data, perm, permuted.get(), indptr[lo], indptr[hi],
                                            nnz, bad);
                             values = permuted.get();
                           }
                           std::vector<float> acc(f);
                           pull_rows<In, Out, Op>(indptr, cols, values, x, y, f, lo, hi,
                                                  acc.data(), static_cast<uint64_t>(n), bad);
                         });
}

// The pieces of a push of ``entries`` into ``rows`` rows of f floats (row_push), their
// float32 partials within ``budget`` bytes.
int64_t push_pieces(int64_t rows, int64_t entries, int64_t f, int64_t budget) {
  const int64_t by_memory = budget / (4 * std::max<int64_t>(rows * f, 1));
  const int64_t most = std::min<int64_t>({4, entries / std::max<int64_t>(4 * rows, 1), by_memory});
  return most >= 4 ? 4 : most >= 2 ? 2 : 1;  // 3 would leave a thread idle
}

// The pieces of a push (row_push, softmax_push; ``row_bytes``: a row of x): as
// push_pieces within 8 MiB; where that leaves one piece, two if their partials fit in
// 32 MiB, or in 128 MiB for rows of x under 512 bytes. The alternative, one piece with
// its features split over the threads in blocks of 64-byte lines, measured slower in
// both cases and faster only past 32 MiB with rows of 512 bytes; under one line of x
// it runs on one thread (the timings: benchmarks/results/cpu-xeon-avx512/README.md).
// With 4 entries per row and piece the partials stay within a quarter of x's float32
// bytes. The count fixes
// the order each row is reduced in, so it depends on the sizes only: the same bits on
// every machine (jaxcsr.kernels.cpu.push_pieces reads it through JaxcsrPushPieces).
//
// A product push of 16-bit x (``narrow``) with fewer entries per row takes two pieces
// from 2 entries per row on (past kSerialWork, partials within 32 MiB): converting its
// values to float32 makes it compute-bound where x stays in cache, and a feature split
// then runs on one thread for rows of one line or at its speed (float32 gained nothing
// from pieces there).
int64_t push_piece_count(int64_t rows, int64_t entries, int64_t f, int64_t row_bytes,
                         bool narrow = false) {
  const int64_t pieces = push_pieces(rows, entries, f, int64_t{8} << 20);
  if (pieces > 1) return pieces;
  const int64_t budget = int64_t{row_bytes < 512 ? 128 : 32} << 20;
  if (push_pieces(rows, entries, f, budget) >= 2) return 2;
  const bool two = narrow && entries * f >= kSerialWork && entries >= 2 * rows &&
                   2 * 4 * rows * f <= (int64_t{32} << 20);
  return two ? 2 : 1;
}

// The push product in P pieces of consecutive entries, P fixed by the sizes alone
// (1, 2 or 4, at least 4 entries per row and piece, the partials within 8 MiB: their
// fill and merge must stay small next to the entries' own work; measured on 2 cores
// with tolokers and musae-github in random order, F = 1..64, 1-8 pieces): each
// piece reduces its entries into its own (m, f) float32 partial in input order, then
// the partials are combined in piece order, rows split over threads; where 8 MiB
// allows one piece, two within a larger budget (push_piece_count). One piece (an
// output too large to copy, or few entries per row) splits its features instead, in
// blocks of whole 64-byte lines of x, one per thread: every block takes every entry
// in input order, so each value is reduced in the same order as on one thread. Every
// row is reduced in one order that depends on the sizes only: bit-identical for any
// number of threads; and no thread ever skips entries, so unsorted ids cost no branch
// mispredictions.
template <typename In, typename Out, typename Op>
void row_push(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
              const int32_t* ids, const typename In::Storage* data,
              const typename In::Storage* x, typename Out::Storage* y, int64_t rows,
              int64_t entries, int64_t f) {
  const int64_t threads = entries * f < kSerialWork ? 1 : thread_count(pool, max_threads);
  const int64_t pieces =
      push_piece_count(rows, entries, f, f * int64_t{sizeof(typename In::Storage)},
                       sizeof(typename In::Storage) == 2);
  // float32 sums with one piece accumulate in the output itself
  constexpr bool f32_sum = std::is_same<Out, F32>::value && std::is_same<Op, Sum>::value;
  const bool direct = f32_sum && pieces == 1;
  // not value-initialised: every piece (or feature block) fills its own part first
  std::unique_ptr<float[]> partials(direct ? nullptr : new float[pieces * rows * f]);
  float* first = direct ? reinterpret_cast<float*>(y) : partials.get();
  if (pieces > 1) {
    parallel_chunks(pool, pieces, threads, [&](int64_t p) {
      push_rows<In, Out, Op>(ids, data, x, first + p * rows * f, rows, f, f,
                             entries * p / pieces, entries * (p + 1) / pieces);
    });
  } else {
    over_feature_blocks<typename In::Storage>(pool, threads, f, [&](int64_t c0, int64_t c1) {
      push_rows<In, Out, Op>(ids, data, x + c0, first + c0, rows, f, c1 - c0, 0, entries);
    });
  }
  if (direct) return;
  const int64_t chunks = chunk_count(rows * f * pieces, thread_count(pool, max_threads), 4);
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    const int64_t lo = rows * c / chunks, hi = rows * (c + 1) / chunks;
    for (int64_t p = 1; p < pieces; ++p) {
      const float* part = first + p * rows * f;
      for (int64_t i = lo * f; i < hi * f; ++i) first[i] = Op::combine(first[i], part[i]);
    }
    for (int64_t r = lo; r < hi; ++r)
      store_row<Out>(y + r * f, first + r * f, f, indptr[r + 1] == indptr[r]);
  });
}

// ------------------------------------------------------------------ feature-major
// Operands stored one feature per row -- x (f, n) and y (f, rows), row-major -- the
// layout of ``values @ A.T`` (values (f, n)), taken as it is rather than transposed
// into and out of a row-major product.

// The push takes a feature block's ids in tiles of kFmTile.
constexpr int64_t kFmTile = 256;

// Push (unsorted ids): features in blocks of 16 (of 8 when that gives every thread a
// block), one block per thread at a time. A block's (width, kFmTile) tile of x is
// transposed in cache into kFmTile rows of ``width`` and pushed by the row-major body
// into the block's (rows, width) float32 partial, which is stored transposed at the
// end. Each feature is reduced over every id in input order on one thread: the same
// bits for any number of threads.
template <typename In, typename Out, typename Op>
void push_feature_major(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* ids, const typename In::Storage* data,
                        const typename In::Storage* x, typename Out::Storage* y,
                        int64_t rows, int64_t entries, int64_t f) {
  using S = typename In::Storage;
  const int64_t threads = entries * f < kSerialWork ? 1 : thread_count(pool, max_threads);
  const int64_t width = f >= 16 * threads ? 16 : 8;
  const int64_t blocks = (f + width - 1) / width;
  parallel_chunks(pool, blocks, threads, [&](int64_t b) {
    const int64_t f0 = b * width, w = std::min(width, f - f0);
    std::vector<float> acc(rows * w);
    std::vector<S> tile(kFmTile * w);
    fill_columns(acc.data(), rows, w, w, Op::init);
    for (int64_t k0 = 0; k0 < entries; k0 += kFmTile) {
      const int64_t kn = std::min(kFmTile, entries - k0);
      for (int64_t i = 0; i < w; ++i) {
        const S* from = x + (f0 + i) * entries + k0;
        for (int64_t k = 0; k < kn; ++k) tile[k * w + i] = from[k];
      }
      run_best<PushRows<In, Out, Op, false>>(ids + k0, data ? data + k0 : nullptr,
                                             tile.data(), acc.data(), rows, w, w,
                                             int64_t{0}, kn);
    }
    for (int64_t i = 0; i < w; ++i) {
      typename Out::Storage* to = y + (f0 + i) * rows;
      for (int64_t r = 0; r < rows; ++r)
        to[r] = Out::store(indptr[r + 1] == indptr[r] ? 0.0f : acc[r * w + i]);
    }
  });
}

// Pull (general views, sorted ids): the one-feature pull of each row of x into the
// same row of y; features over the threads when there are at least as many as
// threads, else one after another, each over the threads. Returns false if a column
// index was outside [0, n).
template <typename In, typename Out, typename Op>
bool pull_feature_major(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* cols, const typename In::Storage* data,
                        const typename In::Storage* x, typename Out::Storage* y,
                        int64_t rows, int64_t f, int64_t n) {
  const int64_t threads = thread_count(pool, max_threads);
  std::atomic<bool> ok{true};
  auto one = [&](int64_t k, int64_t inner) {
    if (!csr_pull<In, Out, Op>(pool, inner, indptr, cols, data, nullptr, x + k * n,
                               y + k * rows, rows, 1, n))
      ok.store(false);
  };
  if (threads > 1 && f >= threads && int64_t{indptr[rows]} * f >= kSerialWork) {
    parallel_chunks(pool, f, threads, [&](int64_t k) { one(k, 1); });
  } else {
    for (int64_t k = 0; k < f; ++k) one(k, max_threads);
  }
  return ok.load();
}

// Gather (one entry per row, the backward of ``values @ A.T``): y[k, r] = data[r] *
// x[k, cols[r]] for features [f0, f1) and rows [r0, r1), through ``at``: the columns
// themselves when all are inside x, else a checked copy whose outside columns read
// column 0 and whose rows are zeroed afterwards -- the loop has no branch either way.
// Each feature's rows are one sequential stream of y. Every output is written once:
// any split, the same bits. (AVX2 gathers and non-temporal stores were tried here:
// neither changed the time measurably.)
template <typename In, typename Out>
JAXCSR_INLINE void gather_fm_body(const int32_t* at, const typename In::Storage* data,
                                  const typename In::Storage* x, typename Out::Storage* y,
                                  int64_t rows, int64_t n, int64_t f0, int64_t f1, int64_t r0,
                                  int64_t r1) {
  constexpr bool same = std::is_same<In, Out>::value;
  for (int64_t k = f0; k < f1; ++k) {
    const typename In::Storage* __restrict from = x + k * n;
    typename Out::Storage* __restrict to = y + k * rows;
    if (same && !data) {
      const auto* bits = reinterpret_cast<const typename Out::Storage*>(from);
      for (int64_t r = r0; r < r1; ++r) to[r] = bits[at[r]];
    } else {
      for (int64_t r = r0; r < r1; ++r)
        to[r] = Out::store((data ? In::load(data[r]) : 1.0f) * In::load(from[at[r]]));
    }
  }
}

template <typename In, typename Out>
struct GatherFeatureMajor {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    gather_fm_body<In, Out>(std::forward<Args>(args)...);
  }
};

// ------------------------------------------------------------------ arg search
// The entry attaining each output of a max/min (``return_arg`` and the max/min
// gradient): the first entry, in CSR order (pull) or input order (push), whose value
// equals the output, or is NaN where the output is NaN -- the XLA path's search, the
// same answer. An entry's value is data * x in float32, rounded to the operand dtype
// (the product's own values; without data, x itself). Results are the first hits,
// whatever the split: the same for any number of threads.
template <typename In>
JAXCSR_INLINE float entry_value(typename In::Storage x, float w, bool weighted) {
  return weighted ? In::load(In::store(w * In::load(x))) : In::load(x);
}

JAXCSR_INLINE bool attains(float v, float target) {
  return v == target || (v != v && target != target);
}

// Rows [lo, hi) of a general view: pos[r, i] = the first CSR position attaining
// out[r, i], ``none`` where no entry does (empty rows).
template <typename In>
struct ArgPullRows {
  JAXCSR_INLINE static void run(const int32_t* indptr, const int32_t* cols,
                                const typename In::Storage* data,
                                const typename In::Storage* x,
                                const typename In::Storage* out, int32_t* pos, int64_t f,
                                int64_t lo, int64_t hi, uint64_t n, int32_t none,
                                bool& bad) {
    for (int64_t r = lo; r < hi; ++r) {
      int32_t* p = pos + r * f;
      const typename In::Storage* t = out + r * f;
      std::fill(p, p + f, none);
      for (int64_t j = indptr[r]; j < indptr[r + 1]; ++j) {
        const int64_t col = checked_column(cols, j, indptr[r + 1], x, f, n, bad);
        if (col < 0) continue;
        const float w = data ? In::load(data[j]) : 1.0f;
        for (int64_t i = 0; i < f; ++i) {
          const bool hit = attains(entry_value<In>(x[col * f + i], w, data), In::load(t[i]));
          p[i] = p[i] == none && hit ? static_cast<int32_t>(j) : p[i];
        }
      }
    }
  }
};

// Entries [k0, k1) of a one-per-column view (column k in row ids[k]; ids outside
// [0, m) dropped), features [0, width) of rows ``stride`` apart: first[r, i] = the
// first column attaining out[r, i] (``none``: no hit yet), from ``none``.
//
// float32 and bfloat16 take eight features at a time (the same hits: a weighted value
// is rounded to bfloat16 as In::store does). The lines of x, out and first ``kAhead``
// entries on are prefetched: a row of x is not read far enough ahead otherwise, with a
// store per eight features in the loop (the eight lanes alone gained little).
template <typename In>
struct ArgPushEntries {
  using S = typename In::Storage;
  static constexpr bool kLanes = !std::is_same<In, F16>::value;

  // data * x rounded to the operand dtype, eight lanes (entry_value's): stored and
  // loaded back as store8 and load8 do it.
  JAXCSR_INLINE static f32x8 rounded8(f32x8 v) {
    S stored[8];
    store8<In>(stored, v, 8);
    return load8<In>(stored, 8, 0.0f);
  }

  JAXCSR_INLINE static void run(const int32_t* ids, const S* data, const S* x, const S* out,
                                int32_t* first, int64_t m, int64_t stride, int64_t width,
                                int64_t k0, int64_t k1, int32_t none) {
    constexpr int64_t kAhead = 16;
    fill_columns(first, m, stride, width, none);
    const int64_t lanes = kLanes ? width / 8 * 8 : 0;
    for (int64_t k = k0; k < k1; ++k) {
      if (k + kAhead < k1) {
        const uint64_t ahead = static_cast<uint32_t>(ids[k + kAhead]);
        const int64_t row = (ahead < static_cast<uint64_t>(m) ? ahead : 0) * stride;
        for (int64_t i = 0; i < width; i += 16) __builtin_prefetch(first + row + i, 1);
        for (int64_t i = 0; i < width; i += 64 / sizeof(S)) {
          __builtin_prefetch(out + row + i);
          __builtin_prefetch(x + (k + kAhead) * stride + i);
        }
      }
      const int64_t r = ids[k];
      if (static_cast<uint64_t>(r) >= static_cast<uint64_t>(m)) continue;
      const float w = data ? In::load(data[k]) : 1.0f;
      int32_t* p = first + r * stride;
      const S* t = out + r * stride;
      const i32x8 unset = i32x8{} + none, here = i32x8{} + static_cast<int32_t>(k);
      for (int64_t i = 0; i < lanes; i += 8) {
        f32x8 v = load8<In>(x + k * stride + i, 8, 0.0f);
        if (data) v = rounded8(splat(w) * v);
        const f32x8 target = load8<In>(t + i, 8, 0.0f);
        const i32x8 hit = (v == target) | ((v != v) & (target != target));
        i32x8 at;
        std::memcpy(&at, p + i, sizeof at);
        at = (at == unset) & hit ? here : at;
        std::memcpy(p + i, &at, sizeof at);
      }
      for (int64_t i = lanes; i < width; ++i) {
        const bool hit = attains(entry_value<In>(x[k * stride + i], w, data), In::load(t[i]));
        p[i] = p[i] == none && hit ? static_cast<int32_t>(k) : p[i];
      }
    }
  }
};

template <typename In>
bool arg_pull(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
              const int32_t* cols, const typename In::Storage* data,
              const typename In::Storage* x, const typename In::Storage* out, int32_t* pos,
              int64_t rows, int64_t f, int64_t n) {
  const int32_t none = indptr[rows];  // nnz
  return over_row_chunks(pool, max_threads, indptr, rows, f, cols != nullptr,
                         [&](int64_t lo, int64_t hi, bool& bad) {
                           run_best<ArgPullRows<In>>(indptr, cols, data, x, out, pos, f, lo,
                                                     hi, static_cast<uint64_t>(n), none, bad);
                         });
}

// As row_push: pieces of consecutive entries with private first hits, combined by
// their minimum (the first hit of all), or one piece with its features split over
// the threads.
template <typename In>
void arg_push(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* ids,
              const typename In::Storage* data, const typename In::Storage* x,
              const typename In::Storage* out, int32_t* first, int64_t rows,
              int64_t entries, int64_t f) {
  const int64_t threads = entries * f < kSerialWork ? 1 : thread_count(pool, max_threads);
  const int64_t by_memory = (int64_t{8} << 20) / (4 * std::max<int64_t>(rows * f, 1));
  const int64_t pieces = std::max<int64_t>(1, std::min(threads, by_memory));
  const int32_t none = static_cast<int32_t>(entries);
  if (pieces > 1) {
    std::vector<int32_t> partials((pieces - 1) * rows * f);
    parallel_chunks(pool, pieces, threads, [&](int64_t p) {
      int32_t* mine = p == 0 ? first : partials.data() + (p - 1) * rows * f;
      run_best<ArgPushEntries<In>>(ids, data, x, out, mine, rows, f, f,
                                   entries * p / pieces, entries * (p + 1) / pieces, none);
    });
    const int64_t chunks = chunk_count(rows * f * pieces, threads, 4);
    parallel_chunks(pool, chunks, threads, [&](int64_t c) {
      const int64_t lo = rows * f * c / chunks, hi = rows * f * (c + 1) / chunks;
      for (int64_t p = 1; p < pieces; ++p) {
        const int32_t* part = partials.data() + (p - 1) * rows * f;
        for (int64_t i = lo; i < hi; ++i) first[i] = std::min(first[i], part[i]);
      }
    });
    return;
  }
  over_feature_blocks<typename In::Storage>(pool, threads, f, [&](int64_t c0, int64_t c1) {
    run_best<ArgPushEntries<In>>(ids, data, x + c0, out + c0, first + c0, rows, f, c1 - c0,
                                 0, entries, none);
  });
}

// ------------------------------------------------------------------ dispatch
// Kernel<In, Out, Op>::run(args...) for the operand dtype, output dtype and reduction.
template <template <typename, typename, typename> class Kernel, typename... Args>
ffi::Error dispatch(ffi::DataType in, ffi::DataType out, int64_t reduce, Args&&... args) {
  auto with_op = [&](auto in_tag, auto out_tag) -> ffi::Error {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    switch (reduce) {
      case 0: return Kernel<In, Out, Sum>::run(args...);
      case 1: return Kernel<In, Out, Max>::run(args...);
      case 2: return Kernel<In, Out, Min>::run(args...);
      default: return ffi::Error::InvalidArgument("jaxcsr cpu: unknown reduction");
    }
  };
  auto with_out = [&](auto in_tag) -> ffi::Error {
    switch (out) {
      case ffi::DataType::F32: return with_op(in_tag, F32{});
      case ffi::DataType::BF16: return with_op(in_tag, BF16{});
      case ffi::DataType::F16: return with_op(in_tag, F16{});
      default: return ffi::Error::InvalidArgument("jaxcsr cpu: unsupported output dtype");
    }
  };
  switch (in) {
    case ffi::DataType::F32: return with_out(F32{});
    case ffi::DataType::BF16: return with_out(BF16{});
    case ffi::DataType::F16: return with_out(F16{});
    default: return ffi::Error::InvalidArgument("jaxcsr cpu: unsupported operand dtype");
  }
}

template <typename In, typename Out, typename Op>
struct PullKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* cols, const void* data, const int32_t* perm,
                        const void* x, void* y, int64_t rows, int64_t f, int64_t n,
                        bool feature_major) {
    using S = typename In::Storage;
    const S* values = static_cast<const S*>(data);
    const auto* xs = static_cast<const S*>(x);
    auto* ys = static_cast<typename Out::Storage*>(y);
    bool ok = true;
    if (!feature_major) {
      ok = csr_pull<In, Out, Op>(pool, max_threads, indptr, cols, values, perm, xs, ys, rows, f,
                                 n);
    } else {  // one pull per feature: the values put in order once, in parallel
      const int64_t nnz = indptr[rows];
      std::unique_ptr<S[]> permuted(perm && values ? new S[std::max<int64_t>(nnz, 1)] : nullptr);
      if (permuted) {
        std::atomic<bool> bad{false};
        const int64_t threads = thread_count(pool, max_threads);
        const int64_t chunks = chunk_count(nnz, threads, 4, 65536);
        parallel_chunks(pool, chunks, threads, [&](int64_t c) {
          bool mine = false;
          permute_values(values, perm, permuted.get(), nnz * c / chunks, nnz * (c + 1) / chunks,
                         nnz, mine);
          if (mine) bad.store(true);
        });
        ok = !bad.load();
        values = permuted.get();
      }
      ok = pull_feature_major<In, Out, Op>(pool, max_threads, indptr, cols, values, xs, ys, rows,
                                           f, n) && ok;
    }
    if (!ok)
      return ffi::Error::InvalidArgument(
          "jaxcsr cpu: a column index or a value position is out of range");
    return ffi::Error::Success();
  }
};

template <typename In, typename Out, typename Op>
struct PushKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* ids, const void* data, const void* x, void* y,
                        int64_t rows, int64_t entries, int64_t f, bool feature_major) {
    const auto push = feature_major ? push_feature_major<In, Out, Op> : row_push<In, Out, Op>;
    push(pool, max_threads, indptr, ids, static_cast<const typename In::Storage*>(data),
         static_cast<const typename In::Storage*>(x), static_cast<typename Out::Storage*>(y),
         rows, entries, f);
    return ffi::Error::Success();
  }
};

// x's (entries n, features f): x (n, f), or (f, n) feature-major.
std::pair<int64_t, int64_t> entries_and_features(const ffi::AnyBuffer& x, bool feature_major) {
  auto xd = x.dimensions();
  return feature_major ? std::make_pair(xd[1], xd[0]) : std::make_pair(xd[0], xd[1]);
}

// x (n, f) and y (rows, f); feature-major: x (f, n) and y (f, rows).
ffi::Error check_2d(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y, int64_t rows,
                    bool feature_major = false) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  const int r = feature_major ? 1 : 0;
  if (xd.size() != 2 || yd.size() != 2 || yd[r] != rows || yd[1 - r] != xd[1 - r])
    return ffi::Error::InvalidArgument("jaxcsr cpu: operand/output shapes do not match");
  return ffi::Error::Success();
}

// A row pointer the kernels can trust: starts at 0, non-decreasing, ends at nnz (O(rows)).
bool valid_indptr(const int32_t* indptr, int64_t rows, int64_t nnz) {
  if (indptr[0] != 0 || indptr[rows] != nnz) return false;
  for (int64_t r = 0; r < rows; ++r)
    if (indptr[r + 1] < indptr[r]) return false;
  return true;
}

ffi::Error CsrPullImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                       ffi::Buffer<ffi::S32> cols, ffi::AnyBuffer data,
                       ffi::Buffer<ffi::S32> perm, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> y, int64_t max_threads, int64_t reduce,
                       int64_t feature_major) {
  const int64_t rows = static_cast<int64_t>(indptr.element_count()) - 1;
  if (rows < 0) return ffi::Error::InvalidArgument("jaxcsr cpu: empty indptr");
  const bool fm = feature_major != 0;
  if (auto err = check_2d(x, y, rows, fm); err.failure()) return err;
  const int64_t nnz = indptr.typed_data()[rows];
  const bool has_cols = cols.element_count() > 0, has_data = data.element_count() > 0;
  const auto [n, f] = entries_and_features(x, fm);
  if (!valid_indptr(indptr.typed_data(), rows, nnz) || nnz < 0 || (!has_cols && nnz > n))
    return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  if ((has_cols && static_cast<int64_t>(cols.element_count()) != nnz) ||
      (has_data && static_cast<int64_t>(data.element_count()) != nnz) ||
      (has_data && data.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("jaxcsr cpu: cols/data do not match indptr");
  const bool has_perm = perm.element_count() > 0;
  if (has_perm && (!has_data || static_cast<int64_t>(perm.element_count()) != nnz))
    return ffi::Error::InvalidArgument("jaxcsr cpu: perm does not match the values");
  return dispatch<PullKernel>(x.element_type(), y->element_type(), reduce, pool, max_threads,
                              indptr.typed_data(), has_cols ? cols.typed_data() : nullptr,
                              has_data ? data.untyped_data() : nullptr,
                              has_perm ? perm.typed_data() : nullptr, x.untyped_data(),
                              y->untyped_data(), rows, f, n, fm);
}

ffi::Error RowPushImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                       ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer data, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> y, int64_t max_threads, int64_t reduce,
                       int64_t feature_major) {
  const int64_t rows = static_cast<int64_t>(indptr.element_count()) - 1;
  if (rows < 0) return ffi::Error::InvalidArgument("jaxcsr cpu: empty indptr");
  const bool fm = feature_major != 0;
  if (auto err = check_2d(x, y, rows, fm); err.failure()) return err;
  const int64_t entries = static_cast<int64_t>(ids.element_count());
  const bool has_data = data.element_count() > 0;
  const int64_t stored = indptr.typed_data()[rows];
  if (stored < 0 || stored > entries || !valid_indptr(indptr.typed_data(), rows, stored))
    return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  const auto [n, f] = entries_and_features(x, fm);
  if (n != entries ||
      (has_data && (static_cast<int64_t>(data.element_count()) != entries ||
                    data.element_type() != x.element_type())))
    return ffi::Error::InvalidArgument("jaxcsr cpu: ids/data/operand do not match");
  return dispatch<PushKernel>(x.element_type(), y->element_type(), reduce, pool, max_threads,
                              indptr.typed_data(), ids.typed_data(),
                              has_data ? data.untyped_data() : nullptr, x.untyped_data(),
                              y->untyped_data(), rows, entries, f, fm);
}


template <typename In>
struct ArgKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* index, const void* data, const void* x,
                        const void* out, int32_t* result, int64_t rows, int64_t entries,
                        int64_t f, int64_t n) {
    using S = typename In::Storage;
    const S* d = static_cast<const S*>(data);
    if (indptr == nullptr) {
      arg_push<In>(pool, max_threads, index, d, static_cast<const S*>(x),
                   static_cast<const S*>(out), result, rows, entries, f);
      return ffi::Error::Success();
    }
    if (!arg_pull<In>(pool, max_threads, indptr, index, d, static_cast<const S*>(x),
                      static_cast<const S*>(out), result, rows, f, n))
      return ffi::Error::InvalidArgument("jaxcsr cpu: a column index is out of range");
    return ffi::Error::Success();
  }
};

// The max/min arg search. A row pointer (rows + 1 values) searches a general view by
// rows: (rows, F) CSR positions, nnz where no entry attains. Without one (empty),
// ``index`` holds the row of each column of a one-per-column view: (rows, F) first
// columns, the number of columns where none does.
ffi::Error ArgSearchImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                         ffi::Buffer<ffi::S32> index, ffi::AnyBuffer data, ffi::AnyBuffer x,
                         ffi::AnyBuffer out, ffi::Result<ffi::Buffer<ffi::S32>> result,
                         int64_t max_threads) {
  auto xd = x.dimensions(), od = out.dimensions(), rd = result->dimensions();
  if (xd.size() != 2 || od.size() != 2 || rd.size() != 2 || od[1] != xd[1] ||
      rd[0] != od[0] || rd[1] != od[1] || out.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxcsr cpu: operand/output shapes do not match");
  const int64_t rows = od[0], f = xd[1], n = xd[0];
  const bool has_data = data.element_count() > 0;
  if (has_data && data.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxcsr cpu: data/operand dtypes do not match");
  const int64_t count = static_cast<int64_t>(index.element_count());
  const int32_t* pointer = nullptr;
  if (indptr.element_count() > 0) {
    pointer = indptr.typed_data();
    const int64_t nnz = pointer[rows];
    if (static_cast<int64_t>(indptr.element_count()) != rows + 1 || nnz < 0 ||
        !valid_indptr(pointer, rows, nnz) || (count > 0 && count != nnz) ||
        (count == 0 && nnz > n) ||
        (has_data && static_cast<int64_t>(data.element_count()) != nnz))
      return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  } else if (count != n || (has_data && static_cast<int64_t>(data.element_count()) != n)) {
    return ffi::Error::InvalidArgument("jaxcsr cpu: ids/data/operand do not match");
  }
  const int32_t* cols = pointer && count == 0 ? nullptr : index.typed_data();
  auto go = [&](auto tag) {
    return ArgKernel<decltype(tag)>::run(pool, max_threads, pointer, cols,
                                         has_data ? data.untyped_data() : nullptr,
                                         x.untyped_data(), out.untyped_data(),
                                         result->typed_data(), rows, n, f, n);
  };
  switch (x.element_type()) {
    case ffi::DataType::F32: return go(F32{});
    case ffi::DataType::BF16: return go(BF16{});
    case ffi::DataType::F16: return go(F16{});
    default: return ffi::Error::InvalidArgument("jaxcsr cpu: unsupported operand dtype");
  }
}

// ------------------------------------------------------------------ SDDMM
// out[j] = sum_f ct[row_j, f] * x[col_j, f] (float32 sums, stored in out's dtype).
// Rows come from a row pointer (row r owns entries indptr[r]..indptr[r+1], so ct[r]
// stays in L1 over its entries) or from an array (-1 or >= m: no row, out 0; empty:
// the identity); columns from an array (empty: the identity). Entries are independent:
// any split gives the same bits.
// Eight partial sums in a fixed order (a vector register's lanes), then added up:
// vectorised without reassociating anything the compiler would have to prove.
template <typename In>
JAXCSR_INLINE float dot(const typename In::Storage* __restrict a,
                        const typename In::Storage* __restrict b, int64_t f) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= f; i += 8)
    for (int64_t l = 0; l < 8; ++l) part[l] += In::load(a[i + l]) * In::load(b[i + l]);
  for (int64_t l = 0; i < f; ++i, ++l) part[l] += In::load(a[i]) * In::load(b[i]);
  return fold_lanes<Sum>(part);
}

template <typename In, typename Out>
JAXCSR_INLINE void sddmm_body(const int32_t* indptr, const int32_t* rows, const int32_t* cols,
                              const typename In::Storage* ct, const typename In::Storage* x,
                              typename Out::Storage* out, int64_t m, int64_t n, int64_t f,
                              int64_t lo, int64_t hi, bool& bad) {
  if (indptr) {  // [lo, hi) are rows
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t j = indptr[r]; j < indptr[r + 1]; ++j) {
        const int64_t col = cols ? cols[j] : j;
        if (static_cast<uint64_t>(col) >= static_cast<uint64_t>(n)) {
          bad = true;
          out[j] = Out::store(0.0f);
          continue;
        }
        out[j] = Out::store(dot<In>(ct + r * f, x + col * f, f));
      }
    }
    return;
  }
  for (int64_t j = lo; j < hi; ++j) {  // [lo, hi) are entries
    const int64_t r = rows ? rows[j] : j, col = cols ? cols[j] : j;
    if (r < 0 || r >= m) {  // a dropped entry: no row, no value
      out[j] = Out::store(0.0f);
      continue;
    }
    if (static_cast<uint64_t>(col) >= static_cast<uint64_t>(n)) {
      bad = true;
      out[j] = Out::store(0.0f);
      continue;
    }
    out[j] = Out::store(dot<In>(ct + r * f, x + col * f, f));
  }
}

template <typename In, typename Out>
struct SddmmEntries {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    sddmm_body<In, Out>(std::forward<Args>(args)...);
  }
};

template <typename In, typename Out, typename Unused>
struct SddmmKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* rows, const int32_t* cols, const void* ct,
                        const void* x, void* out, int64_t m, int64_t n, int64_t f,
                        int64_t entries) {
    const int64_t threads = thread_count(pool, max_threads);
    const int64_t chunks = chunk_count(entries * f, threads, 8);
    std::vector<int64_t> starts;
    if (indptr) {
      starts = row_chunks(indptr, m, chunks);
    } else {
      starts.resize(chunks + 1);
      for (int64_t c = 0; c <= chunks; ++c) starts[c] = entries * c / chunks;
    }
    std::atomic<bool> any_bad{false};
    parallel_chunks(pool, chunks, threads, [&](int64_t c) {
      bool bad = false;
      run_best<SddmmEntries<In, Out>>(
          indptr, rows, cols, static_cast<const typename In::Storage*>(ct),
          static_cast<const typename In::Storage*>(x), static_cast<typename Out::Storage*>(out),
          m, n, f, starts[c], starts[c + 1], bad);
      if (bad) any_bad.store(true);
    });
    if (any_bad.load())
      return ffi::Error::InvalidArgument("jaxcsr cpu: a column index is out of range");
    return ffi::Error::Success();
  }
};

// indptr: (m + 1,) or empty; rows: (entries,) or empty; cols: (entries,) or empty.
ffi::Error SddmmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                     ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> cols, ffi::AnyBuffer ct,
                     ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t max_threads) {
  auto cd = ct.dimensions();
  auto xd = x.dimensions();
  if (cd.size() != 2 || xd.size() != 2 || cd[1] != xd[1] || out->dimensions().size() != 1 ||
      ct.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxcsr cpu: sddmm operands do not match");
  const int64_t m = cd[0], n = xd[0], f = cd[1];
  const int64_t entries = out->dimensions()[0];
  const bool by_rows = indptr.element_count() > 0;
  const bool has_rows = rows.element_count() > 0, has_cols = cols.element_count() > 0;
  if (by_rows && (static_cast<int64_t>(indptr.element_count()) != m + 1 || has_rows ||
                  !valid_indptr(indptr.typed_data(), m, entries)))
    return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  if ((has_rows && static_cast<int64_t>(rows.element_count()) != entries) ||
      (has_cols && static_cast<int64_t>(cols.element_count()) != entries) ||
      (!by_rows && !has_rows && entries > m) || (!has_cols && entries > n))
    return ffi::Error::InvalidArgument("jaxcsr cpu: sddmm index arrays do not match");
  return dispatch<SddmmKernel>(x.element_type(), out->element_type(), 0, pool, max_threads,
                               by_rows ? indptr.typed_data() : nullptr,
                               has_rows ? rows.typed_data() : nullptr,
                               has_cols ? cols.typed_data() : nullptr, ct.untyped_data(),
                               x.untyped_data(), out->untyped_data(), m, n, f, entries);
}

// ------------------------------------------------------------------ row gather
// y[r] = data[r] * x[cols[r]] (one entry per row: the segment sum's backward); a
// column outside [0, n) is an empty row (0). Rows are independent: any split gives
// the same bits. One-valued rows of one dtype are copied as they are.
// Rows [lo, hi) of a plain gather of rows of ``Bytes`` bytes: one fixed-size copy
// each (whole vector loads and stores), zeros for columns outside [0, n).
template <int Bytes>
JAXCSR_INLINE void gather_rows_of(const int32_t* cols, const char* x, char* y, int64_t n,
                                  int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t c = cols[r];
    if (static_cast<uint64_t>(c) >= static_cast<uint64_t>(n)) {
      std::memset(y + r * Bytes, 0, Bytes);
    } else {
      std::memcpy(y + r * Bytes, x + c * Bytes, Bytes);
    }
  }
}

// Rows [lo, hi) of a plain gather of rows of ``bytes`` bytes (a multiple of 16; the
// same at compile time as ``Bytes``, or any with Bytes = 0) into a 16-byte aligned y,
// stored past the caches (non-temporal): a large output is then written once, not
// read into the cache first and written back later.
template <int Bytes>
JAXCSR_INLINE void gather_rows_streamed(const int32_t* cols, const char* x, char* y,
                                        int64_t n, int64_t bytes, int64_t lo, int64_t hi) {
#if defined(__SSE2__)
  const int64_t units = (Bytes ? Bytes : bytes) / 16;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t c = cols[r];
    auto* to = reinterpret_cast<__m128i*>(y + r * units * 16);
    if (static_cast<uint64_t>(c) >= static_cast<uint64_t>(n)) {
      for (int64_t i = 0; i < units; ++i) _mm_stream_si128(to + i, _mm_setzero_si128());
      continue;
    }
    const auto* from = reinterpret_cast<const __m128i*>(x + c * units * 16);
    for (int64_t i = 0; i < units; ++i) _mm_stream_si128(to + i, _mm_loadu_si128(from + i));
  }
  _mm_sfence();  // the streamed stores are ordered before the pool sees the chunk done
#else
  (void)cols, (void)x, (void)y, (void)n, (void)bytes, (void)lo, (void)hi;
#endif
}

template <typename In, typename Out>
JAXCSR_INLINE void gather_streamed_body(const int32_t* cols, const typename In::Storage* x,
                                        typename Out::Storage* y, int64_t n, int64_t f,
                                        int64_t lo, int64_t hi) {
  const char* from = reinterpret_cast<const char*>(x);
  char* to = reinterpret_cast<char*>(y);
  const int64_t bytes = f * static_cast<int64_t>(sizeof(typename Out::Storage));
  switch (bytes) {
    case 32: return gather_rows_streamed<32>(cols, from, to, n, bytes, lo, hi);
    case 64: return gather_rows_streamed<64>(cols, from, to, n, bytes, lo, hi);
    case 128: return gather_rows_streamed<128>(cols, from, to, n, bytes, lo, hi);
    case 256: return gather_rows_streamed<256>(cols, from, to, n, bytes, lo, hi);
    default: return gather_rows_streamed<0>(cols, from, to, n, bytes, lo, hi);
  }
}

template <typename In, typename Out>
struct GatherRowsStreamed {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    gather_streamed_body<In, Out>(std::forward<Args>(args)...);
  }
};

// Rows [r0, r1) of feature k of the feature-major gather, for 2- or 4-byte values
// copied as they are (no values, one dtype): to[r] = from[at[r]], the aligned middle
// of the row stored past the caches 16 bytes at a time, its ends through them.
template <typename T>
JAXCSR_INLINE void gather_fm_streamed(const int32_t* at, const T* from, T* to, int64_t r0,
                                      int64_t r1) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, uint16_t>::value,
                "float32 or 16-bit storage");
  int64_t r = r0;
#if defined(__SSE2__)
  for (; r < r1 && reinterpret_cast<uintptr_t>(to + r) % 16 != 0; ++r) to[r] = from[at[r]];
  for (; r + 16 / int64_t{sizeof(T)} <= r1; r += 16 / sizeof(T)) {
    const int32_t* a = at + r;
    if constexpr (std::is_same<T, float>::value) {
      _mm_stream_ps(to + r, _mm_setr_ps(from[a[0]], from[a[1]], from[a[2]], from[a[3]]));
    } else {
      const __m128i v = _mm_setr_epi16(from[a[0]], from[a[1]], from[a[2]], from[a[3]],
                                       from[a[4]], from[a[5]], from[a[6]], from[a[7]]);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + r), v);
    }
  }
  _mm_sfence();  // ordered before the pool sees the chunk done
#endif
  for (; r < r1; ++r) to[r] = from[at[r]];
}

template <typename T>
struct GatherFeatureMajorStreamed {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    gather_fm_streamed<T>(std::forward<Args>(args)...);
  }
};

// Whether the pages of [p, p + bytes) are already mapped to memory, sampled at up to
// 16 pages (Linux; elsewhere false). A fresh output (glibc serves blocks past its mmap
// threshold, at most 32 MiB by default, with new pages) is zeroed by the kernel at
// first touch, through the caches; stores past the caches into such pages measured
// slower than plain ones, and faster into pages already mapped (a reused heap block;
// the timings: benchmarks/results/cpu-xeon-avx512/README.md).
bool pages_resident(const void* p, int64_t bytes) {
#if defined(__linux__)
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (page <= 0 || bytes <= 0) return false;
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) / page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + bytes - 1) / page;
  const uintptr_t span = last - first;
  for (int s = 0; s < 16; ++s) {
    unsigned char resident = 0;
    void* at = reinterpret_cast<void*>((first + span * s / 15) * page);
    if (mincore(at, page, &resident) != 0 || !(resident & 1)) return false;
  }
  return true;
#else
  (void)p, (void)bytes;
  return false;
#endif
}

#if defined(__SSE2__)
constexpr bool kStreams = true;
#else
constexpr bool kStreams = false;
#endif

// How a large output is stored: kAuto streams outputs of ``stream_bytes`` or more (the
// machine's, chosen in Python: jaxcsr.machine) into resident pages; the others force
// one way (tests: both give the same bits).
enum class Stores : int64_t { kAuto = 0, kCached = 1, kStreamed = 2 };

// Whether an output of ``bytes`` at y, whose layout allows it, is stored past the
// caches: where the instructions exist, as ``stores`` forces, or (kAuto) from
// ``stream_bytes`` on into resident pages.
bool streams_output(Stores stores, int64_t stream_bytes, const void* y, int64_t bytes) {
  return kStreams && (stores == Stores::kStreamed ||
                      (stores == Stores::kAuto && bytes >= stream_bytes &&
                       pages_resident(y, bytes)));
}

template <typename In, typename Out>
JAXCSR_INLINE void gather_body(const int32_t* cols, const typename In::Storage* data,
                               const typename In::Storage* x, typename Out::Storage* y,
                               int64_t n, int64_t f, int64_t lo, int64_t hi) {
  constexpr bool same = std::is_same<In, Out>::value;
  if (same && !data) {  // rows of 32 to 256 bytes: fixed-size copies, no loop per row
    const char* from = reinterpret_cast<const char*>(x);
    char* to = reinterpret_cast<char*>(y);
    switch (f * static_cast<int64_t>(sizeof(typename Out::Storage))) {
      case 32: return gather_rows_of<32>(cols, from, to, n, lo, hi);
      case 64: return gather_rows_of<64>(cols, from, to, n, lo, hi);
      case 128: return gather_rows_of<128>(cols, from, to, n, lo, hi);
      case 256: return gather_rows_of<256>(cols, from, to, n, lo, hi);
      default: break;
    }
  }
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t c = cols[r];
    typename Out::Storage* yr = y + r * f;
    if (c < 0 || c >= n) {
      for (int64_t i = 0; i < f; ++i) yr[i] = Out::store(0.0f);
      continue;
    }
    const typename In::Storage* xr = x + c * f;
    if (same && !data) {  // a plain copy (a loop, not memcpy: rows are short)
      const auto* from = reinterpret_cast<const typename Out::Storage*>(xr);
      for (int64_t i = 0; i < f; ++i) yr[i] = from[i];
      continue;
    }
    const float w = data ? In::load(data[r]) : 1.0f;
    for (int64_t i = 0; i < f; ++i) yr[i] = Out::store(w * In::load(xr[i]));
  }
}

template <typename In, typename Out>
struct GatherRows {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    gather_body<In, Out>(std::forward<Args>(args)...);
  }
};

template <typename In, typename Out, typename Unused>
struct GatherKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* cols,
                        const void* data, const void* x, void* y, int64_t rows, int64_t n,
                        int64_t f, bool feature_major, Stores stores,
                        int64_t stream_bytes) {
    const int64_t threads = thread_count(pool, max_threads);
    if (feature_major) {  // features one at a time, by parts of the rows
      // the columns as they are when all are inside x (one branch-free pass), else
      // a checked copy and the rows to zero
      uint32_t largest = 0;
      for (int64_t r = 0; r < rows; ++r)
        largest = std::max(largest, static_cast<uint32_t>(cols[r]));
      std::vector<int32_t> checked;
      std::vector<int64_t> outside;
      if (rows > 0 && static_cast<int64_t>(largest) >= n) {
        checked.resize(rows);
        for (int64_t r = 0; r < rows; ++r) {
          const bool inside = static_cast<uint64_t>(cols[r]) < static_cast<uint64_t>(n);
          checked[r] = inside ? cols[r] : 0;
          if (!inside) outside.push_back(r);
        }
      }
      const int32_t* at = checked.empty() ? cols : checked.data();
      const int64_t use = rows * f < kSerialWork ? 1 : threads;
      const int64_t parts = std::max<int64_t>(1, (2 * use + f - 1) / f);
      using S = typename Out::Storage;
      auto* out = static_cast<S*>(y);
      const bool stream = std::is_same<In, Out>::value && !data &&
                          streams_output(stores, stream_bytes, y, rows * f * int64_t{sizeof(S)});
      parallel_chunks(pool, f * parts, use, [&](int64_t c) {
        const int64_t k = c / parts, p = c % parts;
        if (stream) {
          run_best<GatherFeatureMajorStreamed<S>>(at, static_cast<const S*>(x) + k * n,
                                                  out + k * rows, rows * p / parts,
                                                  rows * (p + 1) / parts);
          return;
        }
        run_best<GatherFeatureMajor<In, Out>>(
            at, static_cast<const typename In::Storage*>(data),
            static_cast<const typename In::Storage*>(x), out, rows, n, k, k + 1,
            rows * p / parts, rows * (p + 1) / parts);
      });
      for (int64_t k = 0; k < f; ++k)
        for (const int64_t r : outside) out[k * rows + r] = Out::store(0.0f);
      return ffi::Error::Success();
    }
    const int64_t chunks = chunk_count(rows * f, threads, 4, 65536);
    const int64_t row_bytes = f * static_cast<int64_t>(sizeof(typename Out::Storage));
    const bool stream = std::is_same<In, Out>::value && !data && row_bytes >= 32 &&
                        row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                        streams_output(stores, stream_bytes, y, rows * row_bytes);
    if (stream) {
      parallel_chunks(pool, chunks, threads, [&](int64_t c) {
        run_best<GatherRowsStreamed<In, Out>>(
            cols, static_cast<const typename In::Storage*>(x),
            static_cast<typename Out::Storage*>(y), n, f, rows * c / chunks,
            rows * (c + 1) / chunks);
      });
      return ffi::Error::Success();
    }
    parallel_chunks(pool, chunks, threads, [&](int64_t c) {
      run_wide<GatherRows<In, Out>>(
          cols, static_cast<const typename In::Storage*>(data),
          static_cast<const typename In::Storage*>(x), static_cast<typename Out::Storage*>(y),
          n, f, rows * c / chunks, rows * (c + 1) / chunks);
    });
    return ffi::Error::Success();
  }
};

ffi::Error GatherImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> cols, ffi::AnyBuffer data,
                      ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t max_threads,
                      int64_t feature_major, int64_t stores, int64_t stream_bytes) {
  const int64_t rows = static_cast<int64_t>(cols.element_count());
  if (stores < 0 || stores > 2) return ffi::Error::InvalidArgument("jaxcsr cpu: bad stores");
  if (stream_bytes < 0) return ffi::Error::InvalidArgument("jaxcsr cpu: bad stream_bytes");
  const bool fm = feature_major != 0;
  if (auto err = check_2d(x, y, rows, fm); err.failure()) return err;
  const auto [n, f] = entries_and_features(x, fm);
  const bool has_data = data.element_count() > 0;
  if (has_data && (static_cast<int64_t>(data.element_count()) != rows ||
                   data.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("jaxcsr cpu: gather values do not match");
  return dispatch<GatherKernel>(x.element_type(), y->element_type(), 0, pool, max_threads,
                                cols.typed_data(), has_data ? data.untyped_data() : nullptr,
                                x.untyped_data(), y->untyped_data(), rows, n, f, fm,
                                static_cast<Stores>(stores), stream_bytes);
}

// ------------------------------------------------------------------ put at the attaining
// The transpose of taking x (n, f) at the (m, f) columns attaining a max/min of a
// one-per-column view (jaxcsr.take_attaining.take_attaining): y[k, i] = ct[rows[k], i] where
// columns[rows[k], i] == k, else 0 (rows[k] outside [0, m): a column in no row, 0).
// One pass writing y, rows of entries split over the threads; copies of the values'
// bits, so any dtype of their size.
template <typename S>
struct PutAttainingRows {
  JAXCSR_INLINE static void run(const int32_t* rows, const int32_t* columns, const S* ct, S* y,
                                int64_t m, int64_t f, int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const uint64_t r = static_cast<uint32_t>(rows[k]);
      S* out = y + k * f;
      if (r >= static_cast<uint64_t>(m)) {
        std::fill(out, out + f, S{});
        continue;
      }
      const int32_t* at = columns + r * f;
      const S* from = ct + r * f;
      const int32_t mine = static_cast<int32_t>(k);
      for (int64_t i = 0; i < f; ++i) out[i] = at[i] == mine ? from[i] : S{};
    }
  }
};

template <typename S>
void put_attaining(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* rows,
                   const int32_t* columns, const S* ct, S* y, int64_t m, int64_t n, int64_t f) {
  const int64_t threads = n * f < kSerialWork ? 1 : thread_count(pool, max_threads);
  const int64_t chunks = chunk_count(n * f, threads, 4);
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    run_wide<PutAttainingRows<S>>(rows, columns, ct, y, m, f, n * c / chunks,
                                  n * (c + 1) / chunks);
  });
}

// rows: (n,) the row of each column; columns: (m, f) int32 attaining columns; ct: (m, f);
// y: (n, f) in ct's dtype (2 or 4 bytes).
ffi::Error PutAttainingImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> rows,
                            ffi::Buffer<ffi::S32> columns, ffi::AnyBuffer ct,
                            ffi::Result<ffi::AnyBuffer> y, int64_t max_threads) {
  auto cd = columns.dimensions(), td = ct.dimensions(), yd = y->dimensions();
  const int64_t n = static_cast<int64_t>(rows.element_count());
  if (cd.size() != 2 || td.size() != 2 || yd.size() != 2 || cd[0] != td[0] ||
      cd[1] != td[1] || yd[0] != n || yd[1] != td[1] || ct.element_type() != y->element_type())
    return ffi::Error::InvalidArgument("jaxcsr cpu: put_attaining shapes do not match");
  const int64_t m = td[0], f = td[1];
  switch (ffi::ByteWidth(ct.element_type())) {
    case 4:
      put_attaining(pool, max_threads, rows.typed_data(), columns.typed_data(),
                    static_cast<const uint32_t*>(ct.untyped_data()),
                    static_cast<uint32_t*>(y->untyped_data()), m, n, f);
      return ffi::Error::Success();
    case 2:
      put_attaining(pool, max_threads, rows.typed_data(), columns.typed_data(),
                    static_cast<const uint16_t*>(ct.untyped_data()),
                    static_cast<uint16_t*>(y->untyped_data()), m, n, f);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("jaxcsr cpu: put_attaining takes 2- or 4-byte values");
  }
}

// ------------------------------------------------------------------ softmax
constexpr int64_t kRowBuffer = 8192;  // floats of exp(x - peak) kept per row (32 KiB)

// The shift of a row's softmax: its max where finite, else 0 (rows of -inf give
// 0 / 0 = NaN, a row with +inf gives NaN there and 0 elsewhere, NaN gives NaN: the
// XLA path's results).
JAXCSR_INLINE float finite_or_zero(float peak) { return peak - peak == 0.0f ? peak : 0.0f; }

// Heads [c, c + 8 V) of a row's softmax (the last vector may be partial: heads past h
// are neither read nor written). exp(x - peak) is kept between the sum and the
// scaling in ``buffer`` when the block fits (kRowBuffer floats), else in y for
// float32 outputs, else computed again.
template <typename In, typename Out, int V>
JAXCSR_INLINE void softmax_heads(const typename In::Storage* __restrict x,
                                 typename Out::Storage* __restrict y, int64_t len, int64_t h,
                                 int64_t c, float* __restrict buffer) {
  const bool in_buffer = len * 8 * V <= kRowBuffer;
  constexpr bool in_y = std::is_same<Out, F32>::value;
  f32x8 top[V], sum[V];
  for (int v = 0; v < V; ++v) top[v] = splat(-__builtin_inff()), sum[v] = splat(0.0f);
  for (int64_t j = 0; j < len; ++j)
    for (int v = 0; v < V; ++v)
      top[v] = max8(top[v], load8<In>(x + j * h + c + 8 * v, h - c - 8 * v, -__builtin_inff()));
  for (int v = 0; v < V; ++v) top[v] = top[v] - top[v] == 0.0f ? top[v] : splat(0.0f);
  for (int64_t j = 0; j < len; ++j)
    for (int v = 0; v < V; ++v) {
      const int64_t w = h - c - 8 * v;
      const f32x8 e = exp8(load8<In>(x + j * h + c + 8 * v, w, 0.0f) - top[v]);
      sum[v] += e;
      if (in_buffer) {
        std::memcpy(buffer + (j * V + v) * 8, &e, sizeof e);
      } else if (in_y) {
        store8<Out>(y + j * h + c + 8 * v, e, w);
      }
    }
  for (int v = 0; v < V; ++v) sum[v] = splat(1.0f) / sum[v];
  for (int64_t j = 0; j < len; ++j)
    for (int v = 0; v < V; ++v) {
      const int64_t w = h - c - 8 * v;
      f32x8 e;
      if (in_buffer) {
        std::memcpy(&e, buffer + (j * V + v) * 8, sizeof e);
      } else if (in_y) {
        e = load8<F32>(reinterpret_cast<float*>(y) + j * h + c + 8 * v, w, 0.0f);
      } else {
        e = exp8(load8<In>(x + j * h + c + 8 * v, w, 0.0f) - top[v]);
      }
      store8<Out>(y + j * h + c + 8 * v, e * sum[v], w);
    }
}

// Over a row stored contiguously (``len`` entries of h heads): the softmax of each
// head, out = exp(x - peak) * (1 / sum exp(x - peak)). One head reduces the row in eight
// lanes (fixed order: vectorised, and the same bits for any thread count); several
// heads run in blocks of eight heads.
template <typename In, typename Out>
JAXCSR_INLINE void softmax_row(const typename In::Storage* __restrict x,
                               typename Out::Storage* __restrict y, int64_t len, int64_t h,
                               float* __restrict buffer, int64_t readable) {
  // exp(x - peak) is kept between the sum and the scaling (one exp per value, read
  // back from cache): in y itself for float32 outputs, else in ``buffer`` when the row
  // fits (kRowBuffer floats); longer rows of 16-bit outputs compute it again
  // (rows that fit keep it in the private buffer, which is 8 floats longer: its reads
  // may run past the row; longer rows of float32 keep it in y)
  const bool in_buffer = len * h <= kRowBuffer;
  const bool keep = in_buffer || std::is_same<Out, F32>::value;
  float* kept = in_buffer ? buffer : reinterpret_cast<float*>(y);
  if (h == 1) {  // ``readable``: values of x from the row's start (>= len)
    f32x8 top = splat(-__builtin_inff());
    for (int64_t i = 0; i < len; i += 8)
      top = max8(top, load8_row<In>(x, i, len, readable, -__builtin_inff()));
    const f32x8 shift = splat(finite_or_zero(fold_vector<Max>(top)));
    f32x8 sum = splat(0.0f);
    for (int64_t i = 0; i < len; i += 8) {
      const f32x8 e = exp8(load8_row<In>(x, i, len, readable, -__builtin_inff()) - shift);
      sum += e;
      if (in_buffer) {
        std::memcpy(kept + i, &e, sizeof e);  // whole vectors: the buffer has room
      } else if (keep) {
        store8<F32>(kept + i, e, len - i);
      }
    }
    const f32x8 scale = splat(1.0f / fold_vector<Sum>(sum));
    for (int64_t i = 0; i < len; i += 8) {
      f32x8 e;
      if (in_buffer) {
        std::memcpy(&e, kept + i, sizeof e);
      } else {
        e = keep ? load8f(kept + i, len - i)
                 : exp8(load8_row<In>(x, i, len, readable, 0.0f) - shift);
      }
      store8<Out>(y + i, e * scale, len - i);
    }
    return;
  }
  // Several heads: blocks of up to 32 heads (whole cache lines of float32), each
  // block's max, sum and scaling over the whole row before the next block, the
  // statistics in registers.
  for (int64_t c = 0; c < h; c += 32) {
    switch ((std::min<int64_t>(h - c, 32) + 7) / 8) {
      case 1: softmax_heads<In, Out, 1>(x, y, len, h, c, buffer); break;
      case 2: softmax_heads<In, Out, 2>(x, y, len, h, c, buffer); break;
      case 3: softmax_heads<In, Out, 3>(x, y, len, h, c, buffer); break;
      default: softmax_heads<In, Out, 4>(x, y, len, h, c, buffer); break;
    }
  }
}

// Sixteen lanes (the AVX-512 build; float32 and bfloat16 only). Every helper carries
// the target itself: compiled for the baseline and inlined later, gcc 12 splits its
// 512-bit compares into scalar ones.
#define JAXCSR_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <typename In>
JAXCSR_INLINE JAXCSR_AVX512 f32x16 load16(const typename In::Storage* x) {
  if constexpr (std::is_same<In, F32>::value) {
    f32x16 v;
    std::memcpy(&v, x, sizeof v);
    return v;
  } else {
    static_assert(std::is_same<In, BF16>::value, "float32 or bfloat16");
    u16x16 h;
    std::memcpy(&h, x, sizeof h);
    return reinterpret_cast<f32x16>(__builtin_convertvector(h, u32x16) << 16);
  }
}

template <typename Out>
JAXCSR_INLINE JAXCSR_AVX512 void store16(typename Out::Storage* y, f32x16 v) {
  if constexpr (std::is_same<Out, F32>::value) {
    std::memcpy(y, &v, sizeof v);
  } else {
    static_assert(std::is_same<Out, BF16>::value, "float32 or bfloat16");
    const u32x16 bits = reinterpret_cast<u32x16>(v);  // as store8
    const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const u32x16 nan = (bits >> 16) | 0x40u;
    const u16x16 h = __builtin_convertvector(
        (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded, u16x16);
    std::memcpy(y, &h, sizeof h);
  }
}

// softmax_heads for heads [c, c + 16 V), all present (h a multiple of 16), sixteen
// lanes at a time: the same operations lane by lane, so the same bits as the
// eight-lane build; exp costs about half as much (one 512-bit register per exp).
template <typename In, typename Out, int V>
JAXCSR_INLINE JAXCSR_AVX512 void softmax_heads16(const typename In::Storage* __restrict x,
                                   typename Out::Storage* __restrict y, int64_t len, int64_t h,
                                   int64_t c, float* __restrict buffer) {
  const bool in_buffer = len * 16 * V <= kRowBuffer;
  constexpr bool in_y = std::is_same<Out, F32>::value;
  f32x16 top[V], sum[V];
  for (int v = 0; v < V; ++v) {
    top[v] = splat_as<f32x16>(-__builtin_inff());
    sum[v] = splat_as<f32x16>(0.0f);
  }
  for (int64_t j = 0; j < len; ++j)
    for (int v = 0; v < V; ++v) {
      const f32x16 e = load16<In>(x + j * h + c + 16 * v);
      top[v] = e > top[v] ? e : top[v];  // as max8 (two selects: a 512-bit "|" of
      top[v] = e != e ? e : top[v];      // comparisons is scalarised by gcc 12)
    }
  for (int v = 0; v < V; ++v) top[v] = top[v] - top[v] == 0.0f ? top[v] : splat_as<f32x16>(0.0f);
  for (int64_t j = 0; j < len; ++j)
    for (int v = 0; v < V; ++v) {
      const f32x16 e = exp16(load16<In>(x + j * h + c + 16 * v) - top[v]);
      sum[v] += e;
      if (in_buffer) {
        std::memcpy(buffer + (j * V + v) * 16, &e, sizeof e);
      } else if constexpr (in_y) {
        store16<Out>(y + j * h + c + 16 * v, e);
      }
    }
  for (int v = 0; v < V; ++v) sum[v] = splat_as<f32x16>(1.0f) / sum[v];
  for (int64_t j = 0; j < len; ++j)
    for (int v = 0; v < V; ++v) {
      f32x16 e;
      if (in_buffer) {
        std::memcpy(&e, buffer + (j * V + v) * 16, sizeof e);
      } else if constexpr (in_y) {
        e = load16<F32>(y + j * h + c + 16 * v);
      } else {
        e = exp16(load16<In>(x + j * h + c + 16 * v) - top[v]);
      }
      store16<Out>(y + j * h + c + 16 * v, e * sum[v]);
    }
}

// Rows [lo, hi) of a sorted pattern, the softmax with h a multiple of 16 (blocks of
// up to 64 heads).
template <typename In, typename Out>
struct SoftmaxSorted16 {
  JAXCSR_INLINE JAXCSR_AVX512 static void run(const int32_t* indptr,
                                               const typename In::Storage* x,
                                               typename Out::Storage* y, int64_t h,
                                               int64_t lo, int64_t hi, float* buffer) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t j0 = indptr[r], len = indptr[r + 1] - j0;
      const auto* xr = x + j0 * h;
      auto* yr = y + j0 * h;
      for (int64_t c = 0; len > 0 && c < h; c += 64) {
        switch (std::min<int64_t>(h - c, 64) / 16) {
          case 1: softmax_heads16<In, Out, 1>(xr, yr, len, h, c, buffer); break;
          case 2: softmax_heads16<In, Out, 2>(xr, yr, len, h, c, buffer); break;
          case 3: softmax_heads16<In, Out, 3>(xr, yr, len, h, c, buffer); break;
          default: softmax_heads16<In, Out, 4>(xr, yr, len, h, c, buffer); break;
        }
      }
    }
  }
};

template <typename In, typename Out>
JAXCSR_INLINE void tangent_row(const typename In::Storage* __restrict p,
                               const typename In::Storage* __restrict g,
                               typename Out::Storage* __restrict y, int64_t len, int64_t h,
                               float* __restrict inner) {
  if (h == 1) {
    float lane[8] = {};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      for (int l = 0; l < 8; ++l) lane[l] += In::load(p[i + l]) * In::load(g[i + l]);
    for (int l = 0; i < len; ++i, ++l) lane[l] += In::load(p[i]) * In::load(g[i]);
    const float dot = fold_lanes<Sum>(lane);
    for (i = 0; i < len; ++i) {
      const float pi = In::load(p[i]);
      y[i] = Out::store(pi * In::load(g[i]) - pi * dot);
    }
    return;
  }
  for (int64_t c = 0; c < h; ++c) inner[c] = 0.0f;
  for (int64_t j = 0; j < len; ++j)
    for (int64_t c = 0; c < h; ++c) inner[c] += In::load(p[j * h + c]) * In::load(g[j * h + c]);
  for (int64_t j = 0; j < len; ++j)
    for (int64_t c = 0; c < h; ++c) {
      const float pi = In::load(p[j * h + c]);
      y[j * h + c] = Out::store(pi * In::load(g[j * h + c]) - pi * inner[c]);
    }
}

// Rows [lo, hi) of a sorted pattern (row r's entries are indptr[r]..indptr[r+1]).
// g == nullptr: the softmax of x; else the tangent from the output x = p.
template <typename In, typename Out>
JAXCSR_INLINE void softmax_sorted_body(const int32_t* indptr, const typename In::Storage* x,
                                       const typename In::Storage* g,
                                       typename Out::Storage* y, int64_t h, int64_t lo,
                                       int64_t hi, float* scratch, int64_t entries) {
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], len = indptr[r + 1] - j0;
    if (len == 0) continue;
    if (g) {
      tangent_row<In, Out>(x + j0 * h, g + j0 * h, y + j0 * h, len, h, scratch);
    } else {
      softmax_row<In, Out>(x + j0 * h, y + j0 * h, len, h, scratch, entries - j0);
    }
  }
}

template <typename In, typename Out>
struct SoftmaxSorted {
  template <typename... Args>
  JAXCSR_INLINE static void run(Args&&... args) {
    softmax_sorted_body<In, Out>(std::forward<Args>(args)...);
  }
};

// ------------------------------------------------------------------ softmax, unsorted ids
// The softmax over the rows of a one-per-column pattern whose ids come in any order
// (segment_softmax on unsorted ids) and its tangent, as pushes that stream x in input
// order (a pull through the sort permutation reads rows of x at random, and row
// owners that scan every id mispredict a branch per id). Forward: each row's sum of
// exp(x) (a sum push; the exps kept in y for float32 outputs) -- shifted by the row's
// max (a max push first) only where the unshifted sums are unsafe --, then
// y = exp(x - shift) * (1 / sum) entry by entry. Tangent: each row's sum of p * g,
// then y = p * g - p * sum. The pushes split as the product's
// push does (row_push: 1, 2 or 4 pieces of consecutive entries into private (m, h)
// partials combined in piece order, or one piece with its heads split over the
// threads), and the last pass is elementwise: every row is reduced in one order fixed
// by the sizes, bit-identical for any thread count. An id outside [0, m) belongs to
// no row: its entry is 0 forward and p * g in the tangent (the XLA path's values).

// What a push sums (or maxes) per row: x (max), exp(x - peak[row]), or x * g.
enum class Pushed { kPeak, kExp, kProduct };

// A softmax push prefetches kPushAhead entries ahead: for entry k, heads [c0, c1), the
// lines of its scores and of its row's partial (and peak, where there is one). The
// scores' prefetch matters most.
constexpr int64_t kPushAhead = 16;

template <typename S>
JAXCSR_INLINE void prefetch_push_entry(const int32_t* ids, const S* x, const float* peak,
                                       const float* acc, int64_t m, int64_t h, int64_t c0,
                                       int64_t c1, int64_t k) {
  const uint64_t id = static_cast<uint32_t>(ids[k]);
  const int64_t row = (id < static_cast<uint64_t>(m) ? id : 0) * h;
  for (int64_t c = c0; c < c1; c += 16) {
    __builtin_prefetch(acc + row + c, 1);
    __builtin_prefetch(x + k * h + c);
    if (peak) __builtin_prefetch(peak + row + c);
  }
}

template <typename In, typename Out, Pushed What>
struct SoftmaxPushRows {
  using S = typename In::Storage;
  using Y = typename Out::Storage;
  using Op = typename std::conditional<What == Pushed::kPeak, Max, Sum>::type;
  static constexpr bool kKeep = What == Pushed::kExp && std::is_same<Out, F32>::value;

  // Heads [c, c + w) of one entry (x + at, g + at) whose row's statistics start at
  // peak + top (w >= 8: a whole vector); exps are kept in y + at.
  JAXCSR_INLINE static f32x8 value(const S* x, const S* g, const float* peak, Y* y, int64_t at,
                                   int64_t top, int64_t w) {
    if constexpr (What == Pushed::kPeak) {
      return load8<In>(x + at, w, -__builtin_inff());
    } else if constexpr (What == Pushed::kProduct) {
      return load8<In>(x + at, w, 0.0f) * load8<In>(g + at, w, 0.0f);
    } else {
      const f32x8 shift = peak ? load8f(peak + top, w) : splat(0.0f);
      const f32x8 e = exp8(load8<In>(x + at, w, 0.0f) - shift);
      if constexpr (kKeep) store8<F32>(y + at, e, w);
      return e;
    }
  }

  // Entries [k0, k1), heads [c0, c1) of h, into acc (m rows of h floats).
  JAXCSR_INLINE static void run(const int32_t* ids, const S* x, const S* g, const float* peak,
                                Y* y, float* acc, int64_t m, int64_t h, int64_t c0, int64_t c1,
                                int64_t k0, int64_t k1) {
    if (h == 1) return run_one_head(ids, x, g, peak, y, acc, m, k0, k1);
    for (int64_t k = k0; k < k1; ++k) {
      if (k + kPushAhead < k1) prefetch_push_entry(ids, x, peak, acc, m, h, c0, c1, k + kPushAhead);
      const uint64_t r = static_cast<uint32_t>(ids[k]);
      if (r >= static_cast<uint64_t>(m)) continue;
      for (int64_t c = c0; c < c1; c += 8) {
        const int64_t w = c1 - c;
        float* a = acc + r * h + c;
        const f32x8 v = value(x, g, peak, y, k * h + c, r * h + c, w);
        store8<F32>(a, combine8<Op>(load8f(a, w), v), w);
      }
    }
  }

  // One head: eight entries at a time (one exp for eight), added to their rows in
  // input order.
  JAXCSR_INLINE static void run_one_head(const int32_t* ids, const S* x, const S* g,
                                         const float* peak, Y* y, float* acc, int64_t m,
                                         int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; k += 8) {
      const int64_t w = std::min<int64_t>(8, k1 - k);
      uint32_t rows[8];
      f32x8 top = splat(0.0f);
      for (int64_t l = 0; l < w; ++l) {
        rows[l] = static_cast<uint32_t>(ids[k + l]);
        if (What == Pushed::kExp && peak)
          top[l] = rows[l] < static_cast<uint64_t>(m) ? peak[rows[l]] : 0.0f;
      }
      f32x8 v;
      if constexpr (What == Pushed::kPeak) {
        v = load8<In>(x + k, w, 0.0f);
      } else if constexpr (What == Pushed::kProduct) {
        v = load8<In>(x + k, w, 0.0f) * load8<In>(g + k, w, 0.0f);
      } else {
        v = exp8(load8<In>(x + k, w, 0.0f) - top);
        if constexpr (kKeep) store8<F32>(y + k, v, w);
      }
      for (int64_t l = 0; l < w; ++l)
        if (rows[l] < static_cast<uint64_t>(m)) acc[rows[l]] = Op::combine(acc[rows[l]], v[l]);
    }
  }
};

// SoftmaxPushRows for h a multiple of 16 (float32 and bfloat16, where the CPU has
// AVX-512): sixteen lanes at a time, the same operations lane by lane (the same bits);
// exp costs about half as much.
template <typename In, typename Out, Pushed What>
struct SoftmaxPushRows16 {
  using S = typename In::Storage;
  using Y = typename Out::Storage;
  using Op = typename SoftmaxPushRows<In, Out, What>::Op;

  JAXCSR_INLINE JAXCSR_AVX512 static void run(const int32_t* ids, const S* x, const S* g,
                                               const float* peak, Y* y, float* acc, int64_t m,
                                               int64_t h, int64_t c0, int64_t c1, int64_t k0,
                                               int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      if (k + kPushAhead < k1) prefetch_push_entry(ids, x, peak, acc, m, h, c0, c1, k + kPushAhead);
      const uint64_t r = static_cast<uint32_t>(ids[k]);
      if (r >= static_cast<uint64_t>(m)) continue;
      for (int64_t c = c0; c < c1; c += 16) {
        const int64_t at = k * h + c;
        f32x16 v;
        if constexpr (What == Pushed::kPeak) {
          v = load16<In>(x + at);
        } else if constexpr (What == Pushed::kProduct) {
          v = load16<In>(x + at) * load16<In>(g + at);
        } else {
          const f32x16 shift = peak ? load16<F32>(peak + r * h + c) : splat_as<f32x16>(0.0f);
          v = exp16(load16<In>(x + at) - shift);
          if constexpr (SoftmaxPushRows<In, Out, What>::kKeep) store16<F32>(y + at, v);
        }
        float* a = acc + r * h + c;
        f32x16 total = load16<F32>(a);
        if constexpr (std::is_same<Op, Max>::value) {
          total = v > total ? v : total;  // as max8, in two selects (see softmax_heads16)
          total = v != v ? v : total;
        } else {
          total += v;
        }
        store16<F32>(a, total);
      }
    }
  }
};

// Runs Body, or its sixteen-lane twin Body16 where it applies (h a multiple of 16,
// float32/bfloat16 operands and output, AVX-512).
template <typename Body, typename Body16, typename In, typename Out, typename... Args>
void run_softmax_body(int64_t h, Args&&... args) {
  constexpr bool wide = !std::is_same<In, F16>::value && !std::is_same<Out, F16>::value;
  if constexpr (wide) {
    if (h % 16 == 0 && has_avx512()) return run_avx512<Body16>(std::forward<Args>(args)...);
  }
  run_best<Body>(std::forward<Args>(args)...);
}

// acc (m, h) = what every entry brings to its row (SoftmaxPushRows), reduced with its
// Op (Op::init in rows no entry reaches), in pieces fixed by the sizes.
template <typename In, typename Out, Pushed What>
void softmax_push(ffi::ThreadPool& pool, int64_t threads, const int32_t* ids,
                  const typename In::Storage* x, const typename In::Storage* g,
                  const float* peak, typename Out::Storage* y, float* acc, int64_t m,
                  int64_t n, int64_t h) {
  using Body = SoftmaxPushRows<In, Out, What>;
  using Body16 = SoftmaxPushRows16<In, Out, What>;
  using Op = typename Body::Op;
  const int64_t pieces = push_piece_count(m, n, h, h * int64_t{sizeof(typename In::Storage)});
  if (pieces == 1) {
    fill_columns(acc, m, h, h, Op::init);
    over_feature_blocks<typename In::Storage>(pool, threads, h, [&](int64_t c0, int64_t c1) {
      run_softmax_body<Body, Body16, In, Out>(h, ids, x, g, peak, y, acc, m, h, c0, c1,
                                              int64_t{0}, n);
    });
    return;
  }
  // not value-initialised: every piece fills its own part first
  std::unique_ptr<float[]> partials(new float[(pieces - 1) * m * h]);
  const auto part = [&](int64_t p) { return p == 0 ? acc : partials.get() + (p - 1) * m * h; };
  parallel_chunks(pool, pieces, threads, [&](int64_t p) {
    fill_columns(part(p), m, h, h, Op::init);
    run_softmax_body<Body, Body16, In, Out>(h, ids, x, g, peak, y, part(p), m, h, int64_t{0},
                                            h, n * p / pieces, n * (p + 1) / pieces);
  });
  const int64_t chunks = chunk_count(m * h * pieces, threads, 4);
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    const int64_t lo = m * h * c / chunks, hi = m * h * (c + 1) / chunks;
    for (int64_t p = 1; p < pieces; ++p)
      for (int64_t i = lo; i < hi; ++i) acc[i] = Op::combine(acc[i], part(p)[i]);
  });
}

// stats[i] = fn(stats[i]) for the (m, h) per-row statistics, over the threads.
template <typename Fn>
void over_statistics(ffi::ThreadPool& pool, int64_t threads, float* stats, int64_t size, Fn fn) {
  const int64_t chunks = chunk_count(size, threads, 4);
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    for (int64_t i = size * c / chunks; i < size * (c + 1) / chunks; ++i) stats[i] = fn(stats[i]);
  });
}

// The last pass, entries [k0, k1): forward (g null) y = exp(x - peak[row]) * scale[row]
// (peak null: unshifted; the exp read back from y for float32 outputs), tangent
// y = p * g - p * scale[row] (x = p, scale = the rows' sums of p * g); entries of no
// row: 0 forward, p * g.
template <typename In, typename Out>
struct SoftmaxScaleEntries {
  using S = typename In::Storage;
  using Y = typename Out::Storage;
  static constexpr bool kKept = std::is_same<Out, F32>::value;

  JAXCSR_INLINE static f32x8 entry(const S* x, const S* g, const Y* y, f32x8 top, f32x8 scale,
                                   int64_t at, int64_t w) {
    if (g) {
      const f32x8 p = load8<In>(x + at, w, 0.0f);
      return p * load8<In>(g + at, w, 0.0f) - p * scale;
    }
    const f32x8 e = kKept ? load8f(reinterpret_cast<const float*>(y) + at, w)
                          : exp8(load8<In>(x + at, w, 0.0f) - top);
    return e * scale;
  }

  JAXCSR_INLINE static void run(const int32_t* ids, const S* x, const S* g, const float* peak,
                                const float* scale, Y* y, int64_t m, int64_t h, int64_t k0,
                                int64_t k1) {
    const bool forward = g == nullptr;
    if (h == 1) {  // eight entries at a time
      const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
      for (int64_t k = k0; k < k1; k += 8) {
        const int64_t w = std::min<int64_t>(8, k1 - k);
        f32x8 top = splat(0.0f), by = splat(0.0f);
        i32x8 in_row = lane < static_cast<int32_t>(w);
        for (int64_t l = 0; l < w; ++l) {
          const uint64_t r = static_cast<uint32_t>(ids[k + l]);
          if (r >= static_cast<uint64_t>(m)) {
            in_row[l] = 0;  // no row: 0 forward, p * g - p * 0 in the tangent
            continue;
          }
          if (!kKept && forward && peak) top[l] = peak[r];
          by[l] = scale[r];
        }
        const f32x8 v = entry(x, g, y, top, by, k, w);
        store8<Out>(y + k, forward ? (in_row ? v : splat(0.0f)) : v, w);
      }
      return;
    }
    for (int64_t k = k0; k < k1; ++k) {
      const uint64_t r = static_cast<uint32_t>(ids[k]);
      const bool in_row = r < static_cast<uint64_t>(m);
      for (int64_t c = 0; c < h; c += 8) {
        const int64_t w = h - c;
        if (forward && !in_row) {
          store8<Out>(y + k * h + c, splat(0.0f), w);
          continue;
        }
        const f32x8 top = !kKept && forward && peak ? load8f(peak + r * h + c, w) : splat(0.0f);
        const f32x8 by = in_row ? load8f(scale + r * h + c, w) : splat(0.0f);
        store8<Out>(y + k * h + c, entry(x, g, y, top, by, k * h + c, w), w);
      }
    }
  }
};

// SoftmaxScaleEntries for h a multiple of 16, sixteen lanes at a time (the same bits).
template <typename In, typename Out>
struct SoftmaxScaleEntries16 {
  using S = typename In::Storage;
  using Y = typename Out::Storage;
  JAXCSR_INLINE JAXCSR_AVX512 static void run(const int32_t* ids, const S* x, const S* g,
                                               const float* peak, const float* scale, Y* y,
                                               int64_t m, int64_t h, int64_t k0, int64_t k1) {
    constexpr bool kKept = SoftmaxScaleEntries<In, Out>::kKept;
    const f32x16 zero = splat_as<f32x16>(0.0f);
    for (int64_t k = k0; k < k1; ++k) {
      const uint64_t r = static_cast<uint32_t>(ids[k]);
      const bool in_row = r < static_cast<uint64_t>(m);
      for (int64_t c = 0; c < h; c += 16) {
        const int64_t at = k * h + c;
        const f32x16 by = in_row ? load16<F32>(scale + r * h + c) : zero;
        if (g) {
          const f32x16 p = load16<In>(x + at);
          store16<Out>(y + at, p * load16<In>(g + at) - p * by);
        } else if (!in_row) {
          store16<Out>(y + at, zero);
        } else {
          f32x16 e;
          if constexpr (kKept) {
            e = load16<F32>(reinterpret_cast<const float*>(y) + at);
          } else {
            e = exp16(load16<In>(x + at) - (peak ? load16<F32>(peak + r * h + c) : zero));
          }
          store16<Out>(y + at, e * by);
        }
      }
    }
  }
};

// Whether the unshifted sums are safe: every non-empty row's sum of exp(x) lies in
// [2^-40, 2^126] (NaN passes): the XLA path's fast path (jaxcsr/softmax.py,
// fast_path_safe). The shift only guards exp against overflow and the sum against
// underflow; within these bounds every probability above 2^-126 * 2^40 is the shifted
// formula's to float32 rounding. An empty row's sum is 0: which rows are empty is
// found (one pass over the ids) only when some sum is out of range.
bool unshifted_sums_safe(const int32_t* ids, int64_t n, const float* total, int64_t m,
                         int64_t h) {
  const auto out_of_range = [&](int64_t r) {
    for (int64_t c = 0; c < h; ++c) {
      const float t = total[r * h + c];
      if (t < 0x1p-40f || t > 0x1p126f) return true;
    }
    return false;
  };
  std::vector<char> suspect(m);
  bool any = false;
  for (int64_t r = 0; r < m; ++r) any |= (suspect[r] = out_of_range(r));
  if (!any) return true;
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t r = static_cast<uint32_t>(ids[k]);
    if (r < static_cast<uint64_t>(m) && suspect[r]) return false;  // a non-empty row
  }
  return true;
}

// The forward (g null) or the tangent (from the output x) over unsorted ids. The
// forward sums exp(x) unshifted first and keeps that when unshifted_sums_safe; else
// (a row's max above ~87, or all its scores below ~-27) it pushes each row's max and
// sums exp(x - max) again.
template <typename In, typename Out>
void softmax_unsorted(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* ids,
                      const typename In::Storage* x, const typename In::Storage* g,
                      typename Out::Storage* y, int64_t m, int64_t n, int64_t h) {
  const int64_t threads = n * h < kSerialWork ? 1 : thread_count(pool, max_threads);
  std::vector<float> peak, scale(m * h);
  if (g) {
    softmax_push<In, Out, Pushed::kProduct>(pool, threads, ids, x, g, nullptr, y, scale.data(),
                                            m, n, h);
  } else {
    softmax_push<In, Out, Pushed::kExp>(pool, threads, ids, x, nullptr, nullptr, y,
                                        scale.data(), m, n, h);
    if (!unshifted_sums_safe(ids, n, scale.data(), m, h)) {
      peak.resize(m * h);
      softmax_push<In, Out, Pushed::kPeak>(pool, threads, ids, x, nullptr, nullptr, y,
                                           peak.data(), m, n, h);
      over_statistics(pool, threads, peak.data(), m * h,
                      [](float top) { return finite_or_zero(top); });
      softmax_push<In, Out, Pushed::kExp>(pool, threads, ids, x, nullptr, peak.data(), y,
                                          scale.data(), m, n, h);
    }
    over_statistics(pool, threads, scale.data(), m * h, [](float total) { return 1.0f / total; });
  }
  const float* shift = peak.empty() ? nullptr : peak.data();
  const int64_t chunks = chunk_count(n * h, threads, 4);
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    const int64_t k0 = n * c / chunks, k1 = n * (c + 1) / chunks;
    run_softmax_body<SoftmaxScaleEntries<In, Out>, SoftmaxScaleEntries16<In, Out>, In, Out>(
        h, ids, x, g, shift, scale.data(), y, m, h, k0, k1);
  });
}

template <typename In, typename Out, typename Unused>
struct SoftmaxKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* ids, const void* x_any, const void* g_any, void* y_any,
                        int64_t m, int64_t entries, int64_t h) {
    const auto* x = static_cast<const typename In::Storage*>(x_any);
    const auto* g = static_cast<const typename In::Storage*>(g_any);
    auto* y = static_cast<typename Out::Storage*>(y_any);
    if (ids) {
      softmax_unsorted<In, Out>(pool, max_threads, ids, x, g, y, m, entries, h);
      return ffi::Error::Success();
    }
    const int64_t threads = thread_count(pool, max_threads);
    // the entries after the last row (dropped ids, padded layouts) belong to none
    for (int64_t i = indptr[m] * h; i < entries * h; ++i) y[i] = Out::store(0.0f);
    const int64_t chunks = chunk_count(indptr[m] * h + m, threads, 8);
    const std::vector<int64_t> starts = row_chunks(indptr, m, chunks);
    parallel_chunks(pool, chunks, threads, [&](int64_t c) {
      std::vector<float> scratch(std::max<int64_t>(h, kRowBuffer + 8));
      constexpr bool wide = !std::is_same<In, F16>::value && !std::is_same<Out, F16>::value;
      if constexpr (wide) {
        if (!g && h % 16 == 0 && has_avx512()) {
          run_avx512<SoftmaxSorted16<In, Out>>(indptr, x, y, h, starts[c], starts[c + 1],
                                               scratch.data());
          return;
        }
      }
      run_best<SoftmaxSorted<In, Out>>(indptr, x, g, y, h, starts[c], starts[c + 1],
                                       scratch.data(), entries);
    });
    return ffi::Error::Success();
  }
};

// rows: m; indptr: the pattern's (m + 1,) row pointer when its entries are sorted by
// row (row r owns entries indptr[r]..indptr[r+1]), else empty and ids: (n,) the row of
// every entry, in any order (outside [0, m): none); x: (n, h); g: empty (the softmax of
// x) or (n, h) (the tangent from the output x).
ffi::Error SoftmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                       ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer x, ffi::AnyBuffer g,
                       ffi::Result<ffi::AnyBuffer> y, int64_t max_threads, int64_t rows) {
  const int64_t m = rows;
  auto xd = x.dimensions();
  if (xd.size() != 2 || y->dimensions().size() != 2 || y->dimensions()[0] != xd[0] ||
      y->dimensions()[1] != xd[1])
    return ffi::Error::InvalidArgument("jaxcsr cpu: softmax operand/output shapes do not match");
  const int64_t entries = xd[0], h = xd[1];
  const bool tangent = g.element_count() > 0;
  if (tangent && (g.element_type() != x.element_type() ||
                  static_cast<int64_t>(g.element_count()) != entries * h))
    return ffi::Error::InvalidArgument("jaxcsr cpu: softmax operands do not match");
  if (entries * h == 0) return ffi::Error::Success();  // nothing to read or write
  const bool unsorted = ids.element_count() > 0 || indptr.element_count() == 0;
  if (m < 0 || (unsorted && (static_cast<int64_t>(ids.element_count()) != entries ||
                             indptr.element_count() != 0)))
    return ffi::Error::InvalidArgument("jaxcsr cpu: softmax ids do not match the scores");
  const int32_t* ptr = indptr.typed_data();
  if (!unsorted && (static_cast<int64_t>(indptr.element_count()) != m + 1 || ptr[m] < 0 ||
                    ptr[m] > entries || !valid_indptr(ptr, m, ptr[m])))
    return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  return dispatch<SoftmaxKernel>(x.element_type(), y->element_type(), 0, pool, max_threads, ptr,
                                 unsorted ? ids.typed_data() : nullptr, x.untyped_data(),
                                 tangent ? g.untyped_data() : nullptr, y->untyped_data(), m,
                                 entries, h);
}

// The push: (indptr, ids, values or empty, x) -> y, with attributes.
auto push_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("max_threads")
      .Attr<int64_t>("reduce")
      .Attr<int64_t>("feature_major");
}

// The pull: (indptr, columns or empty, values or empty, value positions or empty, x) -> y;
// with positions, entry j's value is values[positions[j]] (a planned transpose's).
auto pull_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("max_threads")
      .Attr<int64_t>("reduce")
      .Attr<int64_t>("feature_major");
}

}  // namespace

// The instruction set the loops run with: 0 the baseline, 1 AVX2, 2 AVX-512 (for tests).
extern "C" int JaxcsrCpuIsa() { return has_avx512() ? 2 : has_avx2() ? 1 : 0; }

// The pieces a row-major product push of ``entries`` ids into ``rows`` rows of ``f``
// features takes (push_piece_count): the order every row is reduced in. The Python
// side reads it to choose the push or the pull, which reduce in the same order where
// it is 1, and to say which runs (plan_info).
extern "C" int64_t JaxcsrPushPieces(int64_t rows, int64_t entries, int64_t f,
                                    int64_t itemsize) {
  return push_piece_count(rows, entries, f, f * itemsize, itemsize == 2);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrCsrPull, CsrPullImpl, pull_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrRowPush, RowPushImpl, push_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrArgSearch, ArgSearchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrSddmm, SddmmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrSoftmax, SoftmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrPutAttaining, PutAttainingImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrGather, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("feature_major")
                                  .Attr<int64_t>("stores")
                                  .Attr<int64_t>("stream_bytes"));
