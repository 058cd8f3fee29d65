// The one-entry-per-row gather (Gather): y[r] = x[cols[r]], row-major or feature-major.
#include "common.h"

namespace jaxcsr::cpu {
namespace {

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
  for (int s = 0; s < 16; ++s)
    if (!page_mapped(reinterpret_cast<void*>((first + span * s / 15) * page))) return false;
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
  advise_huge_pages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
  return dispatch<GatherKernel>(x.element_type(), y->element_type(), 0, pool, max_threads,
                                cols.typed_data(), has_data ? data.untyped_data() : nullptr,
                                x.untyped_data(), y->untyped_data(), rows, n, f, fm,
                                static_cast<Stores>(stores), stream_bytes);
}

}  // namespace
}  // namespace jaxcsr::cpu

using namespace jaxcsr::cpu;

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
