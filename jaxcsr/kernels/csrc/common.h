// Shared by jaxcsr's CPU kernel families (products.cc, attaining.cc, sddmm.cc,
// gather.cc, softmax.cc): 16-bit float types and reductions, the thread pool's chunking,
// eight-lane loads and stores, the instruction-set dispatch (run_best, run_wide), the
// push's piece count and the dtype dispatch of a handler. Everything here is inline or
// a template, in an unnamed namespace inside jaxcsr::cpu.
#pragma once

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

#define JAXCSR_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

namespace jaxcsr::cpu {
// Internal linkage in each kernel file, as the kernel bodies themselves have: every
// file compiles (and inlines) its own copy.
namespace {

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

// Whether In -> Out loops take their own vector code (whole vectors, blocks in
// registers): float32 or bfloat16 operands into their own dtype or into float32 (the
// mean's sum, carried in float32). The same operations per value as the loops the
// compiler vectorises: the same bits. (Float16 converts lane by lane; other pairs do
// not occur.)
template <typename In, typename Out>
constexpr bool vector_code() {
  return !std::is_same<In, F16>::value &&
         (std::is_same<In, Out>::value || std::is_same<Out, F32>::value);
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

// Whether row r holds no entries (``indptr`` null: a sum's push, which needs no row
// pointer; its empty rows keep the fill, 0, so none is flagged).
JAXCSR_INLINE bool empty_row(const int32_t* indptr, int64_t r) {
  return indptr != nullptr && indptr[r + 1] == indptr[r];
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

inline int64_t thread_count(ffi::ThreadPool& pool, int64_t max_threads) {
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  return max_threads > 0 ? std::min(threads, max_threads) : threads;
}

// ------------------------------------------------------------------ huge pages
// An output this large usually comes from the allocator as pages never touched: glibc
// maps blocks past its mmap threshold (at most 32 MiB) anew for every call, and Linux
// faults in and zeroes each 4 KiB page at the kernel's first store into it -- which
// cost the row gather 3.6x its time on the 2-core EPYC (a virtual machine, where a
// fault costs more; benchmarks/results/cpu-epyc/allocator/). Where transparent huge
// pages are on "madvise" (the usual default) the kernels ask for them over the whole
// 2 MiB pages inside such an output before they first write it: one fault per 2 MiB,
// as numpy asks for its own large arrays.
// Memory policy only: the bits never change. Outputs whose first whole 2 MiB page is
// already mapped (a reused block) are left as they are; JAXCSR_HUGE_PAGES=0 turns it
// off (read once per process).
inline constexpr int64_t kHugePageBytes = int64_t{1} << 21;

// Whether the page holding ``address`` is mapped to memory (Linux's mincore; false
// where it cannot tell, and elsewhere).
inline bool page_mapped(const void* address) {
#if defined(__linux__)
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (page <= 0) return false;
  unsigned char resident = 0;
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(address) / page * page);
  return mincore(start, 1, &resident) == 0 && (resident & 1);
#else
  (void)address;
  return false;
#endif
}

inline bool huge_pages_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("JAXCSR_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed;
}

// Advises huge pages for the 2 MiB pages wholly inside [p, p + bytes) when that range
// holds at least one and its first is not mapped yet (Linux; elsewhere nothing).
inline void advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < 2 * kHugePageBytes || !huge_pages_allowed()) return;
  constexpr uintptr_t huge = static_cast<uintptr_t>(kHugePageBytes);
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (start + huge - 1) & ~(huge - 1);
  const uintptr_t hi = (start + static_cast<uintptr_t>(bytes)) & ~(huge - 1);
  if (hi <= lo || page_mapped(reinterpret_cast<void*>(lo))) return;
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // refused: 4 KiB pages
#else
  (void)p, (void)bytes;
#endif
}

// Chunks for ``work`` elements: one per ``grain``, at most ``per_thread`` per thread;
// below kSerialWork, one (the calling thread alone): waking a pool thread costs tens
// of microseconds on the machines measured, about what 2^17 elements take (the
// timings: benchmarks/results/cpu-xeon-avx512/README.md).
inline constexpr int64_t kSerialWork = int64_t{1} << 17;

inline int64_t chunk_count(int64_t work, int64_t threads, int64_t per_thread, int64_t grain = 16384) {
  if (work < kSerialWork) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(threads * per_thread, work / grain + 1));
}

// Chunk c covers rows [starts[c], starts[c + 1]): about equal entries (plus rows) each.
inline std::vector<int64_t> row_chunks(const int32_t* indptr, int64_t rows, int64_t chunks) {
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

// y[0:w] = v[0:w] for w < 8 floats, from registers: a half of 4, a pair, then one. The
// lane loop it replaces compiled to a spill of v and a copy of 4 w bytes by overlapping
// 8-byte moves, whose loads straddle the spilled vector's 16-byte halves and wait for
// the spill to reach the cache: a stall at the end of every row shorter than a vector
// (the timings: benchmarks/results/cpu-xeon-avx512/README.md).
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));
JAXCSR_INLINE void store_partial8(float* y, f32x8 v, int64_t w) {
  f32x4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3);
  if (w >= 4) {
    std::memcpy(y, &half, sizeof half);
    half = __builtin_shufflevector(v, v, 4, 5, 6, 7);
    y += 4;
    w -= 4;
  }
  if (w >= 2) {
    const f32x2 pair = __builtin_shufflevector(half, half, 0, 1);
    std::memcpy(y, &pair, sizeof pair);
    half = __builtin_shufflevector(half, half, 2, 3, 2, 3);
    y += 2;
    w -= 2;
  }
  if (w >= 1) y[0] = half[0];
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
  if constexpr (std::is_same<Out, F32>::value) {
    store_partial8(y, v, w);
  } else {
    for (int l = 0; l < (w < 8 ? w : 8); ++l) y[l] = Out::store(v[l]);
  }
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

// The widest instruction set the loops may use: 0 the baseline, 1 AVX2, 2 AVX-512;
// JAXCSR_CPU_ISA=baseline or avx2 (read once) caps it below what the CPU has -- for the
// tests that compare the builds' bits on one machine.
inline int isa_cap() {
  static const int cap = [] {
    const char* isa = std::getenv("JAXCSR_CPU_ISA");
    if (isa && std::strcmp(isa, "baseline") == 0) return 0;
    if (isa && std::strcmp(isa, "avx2") == 0) return 1;
    return 2;
  }();
  return cap;
}

inline bool has_avx2() {
  static const bool yes = isa_cap() >= 1 && __builtin_cpu_supports("avx2");
  return yes;
}

// Every loop body compiled for AVX2 and for the baseline (some also for AVX-512:
// run_wide), chosen at run time: Body::run (always inlined) takes on the instruction set
// of its caller here. A build with JAXCSR_ONE_ISA compiles and runs the AVX2 build of
// each alone (the sanitizer test's: the same source loops, about a third less to
// compile).
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
#ifdef JAXCSR_ONE_ISA
  run_avx2<Body>(std::forward<Args>(args)...);
#else
  if (has_avx2()) {
    run_avx2<Body>(std::forward<Args>(args)...);
  } else {
    run_base<Body>(std::forward<Args>(args)...);
  }
#endif
}

// The AVX-512 build of a body (run_wide's, the softmax's sixteen-lane exp), where the CPU
// has it.
inline bool has_avx512() {
  static const bool yes = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

template <typename Body, typename... Args>
JAXCSR_AVX512 void run_avx512(Args&&... args) {
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
#ifdef JAXCSR_ONE_ISA
  run_avx2<Body>(std::forward<Args>(args)...);
#else
  if (has_avx512()) {
    run_avx512<Body>(std::forward<Args>(args)...);
  } else {
    run_best<Body>(std::forward<Args>(args)...);
  }
#endif
}

// The pieces of a push of ``entries`` into ``rows`` rows of f floats (row_push), their
// float32 partials within ``budget`` bytes.
inline int64_t push_pieces(int64_t rows, int64_t entries, int64_t f, int64_t budget) {
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
inline int64_t push_piece_count(int64_t rows, int64_t entries, int64_t f, int64_t row_bytes,
                         bool narrow = false) {
  const int64_t pieces = push_pieces(rows, entries, f, int64_t{8} << 20);
  if (pieces > 1) return pieces;
  const int64_t budget = int64_t{row_bytes < 512 ? 128 : 32} << 20;
  if (push_pieces(rows, entries, f, budget) >= 2) return 2;
  const bool two = narrow && entries * f >= kSerialWork && entries >= 2 * rows &&
                   2 * 4 * rows * f <= (int64_t{32} << 20);
  return two ? 2 : 1;
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
#ifdef JAXCSR_SAME_OUTPUT_DTYPE
    // a build of the kernels whose output dtype is their operand's only (the sanitizer
    // test's: a third of the instantiations to compile)
    if (out != in) return ffi::Error::InvalidArgument("jaxcsr cpu: build without mixed dtypes");
    return with_op(in_tag, in_tag);
#else
    switch (out) {
      case ffi::DataType::F32: return with_op(in_tag, F32{});
      case ffi::DataType::BF16: return with_op(in_tag, BF16{});
      case ffi::DataType::F16: return with_op(in_tag, F16{});
      default: return ffi::Error::InvalidArgument("jaxcsr cpu: unsupported output dtype");
    }
#endif
  };
  switch (in) {
    case ffi::DataType::F32: return with_out(F32{});
    case ffi::DataType::BF16: return with_out(BF16{});
    case ffi::DataType::F16: return with_out(F16{});
    default: return ffi::Error::InvalidArgument("jaxcsr cpu: unsupported operand dtype");
  }
}

// x's (entries n, features f): x (n, f), or (f, n) feature-major.
inline std::pair<int64_t, int64_t> entries_and_features(const ffi::AnyBuffer& x, bool feature_major) {
  auto xd = x.dimensions();
  return feature_major ? std::make_pair(xd[1], xd[0]) : std::make_pair(xd[0], xd[1]);
}

// x (n, f) and y (rows, f); feature-major: x (f, n) and y (f, rows).
inline ffi::Error check_2d(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y, int64_t rows,
                    bool feature_major = false) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  const int r = feature_major ? 1 : 0;
  if (xd.size() != 2 || yd.size() != 2 || yd[r] != rows || yd[1 - r] != xd[1 - r])
    return ffi::Error::InvalidArgument("jaxcsr cpu: operand/output shapes do not match");
  return ffi::Error::Success();
}

// A row pointer the kernels can trust: starts at 0, non-decreasing, ends at nnz (O(rows)).
inline bool valid_indptr(const int32_t* indptr, int64_t rows, int64_t nnz) {
  if (indptr[0] != 0 || indptr[rows] != nnz) return false;
  for (int64_t r = 0; r < rows; ++r)
    if (indptr[r + 1] < indptr[r]) return false;
  return true;
}

}  // namespace
}  // namespace jaxcsr::cpu
