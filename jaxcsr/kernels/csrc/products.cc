// The products: CsrPull (rows in CSR order: general matrices, their transposes, sorted
// segment ids) and RowPush (the one-per-column view: unsorted segment ids), each with a
// sum, max or min over a row's entries, row-major or feature-major.
#include "common.h"

namespace jaxcsr::cpu {
namespace {

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

// The widths the pull and the push run in loops of a width fixed when compiled: below 32
// features, all but the multiples of 8 (whole vectors, which have vector bodies). A loop
// over a width known only at run time is the bound at these widths.
using FixedWidths = std::integer_sequence<int, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15,
                                          17, 18, 19, 20, 21, 22, 23, 25, 26, 27, 28, 29, 30, 31>;

// Calls fn(std::integral_constant<int, W>{}) for the W of ``Widths`` that equals f, if
// one does; returns whether one did.
template <typename Fn, int... W>
JAXCSR_INLINE bool at_fixed_width(int64_t f, Fn&& fn, std::integer_sequence<int, W...>) {
  return ((f == W && (fn(std::integral_constant<int, W>{}), true)) || ...);
}

// Rows [lo, hi) of the pull product for F features of FixedWidths: the loop of the
// general case below with the width fixed at compile time, so the feature loop unrolls.
// Same operations in the same order: the same bits.
template <typename In, typename Out, typename Op, int F>
JAXCSR_INLINE void pull_rows_narrow(const int32_t* indptr, const int32_t* cols,
                                    const typename In::Storage* data,
                                    const typename In::Storage* x, typename Out::Storage* y,
                                    int64_t lo, int64_t hi, uint64_t n, bool& bad) {
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], j1 = indptr[r + 1];
    float a[F];
    for (int i = 0; i < F; ++i) a[i] = Op::init;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t col = checked_column(cols, j, j1, x, F, n, bad);
      if (col < 0) continue;
      const float w = data ? In::load(data[j]) : 1.0f;
      const typename In::Storage* row = x + col * F;
      for (int i = 0; i < F; ++i) a[i] = Op::combine(a[i], w * In::load(row[i]));
    }
    store_row<Out>(y + r * F, a, F, j1 == j0);
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
  if constexpr (vector_code<In, Out>()) {
    switch (f) {
      case 8: return pull_rows_vectors<In, Out, Op, 1>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 16: return pull_rows_vectors<In, Out, Op, 2>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 24: return pull_rows_vectors<In, Out, Op, 3>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 32: return pull_rows_vectors<In, Out, Op, 4>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 40: return pull_rows_vectors<In, Out, Op, 5>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 48: return pull_rows_vectors<In, Out, Op, 6>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 56: return pull_rows_vectors<In, Out, Op, 7>(indptr, cols, data, x, y, lo, hi, n, bad);
      case 64: return pull_rows_vectors<In, Out, Op, 8>(indptr, cols, data, x, y, lo, hi, n, bad);
      default: break;
    }
    // gathered rows only: with x streamed (sorted segment ids) the blocks measured no
    // faster for sums and slower for max, so those keep the loop
    if (cols && f > 64 && f % 8 == 0)
      return pull_rows_blocks<In, Out, Op>(indptr, cols, data, x, y, f, lo, hi, n, bad);
  }
  const auto narrow = [&](auto w) {
    pull_rows_narrow<In, Out, Op, decltype(w)::value>(indptr, cols, data, x, y, lo, hi, n, bad);
  };
  if (at_fixed_width(f, narrow, FixedWidths{})) return;
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

// Rows [lo, hi) of the pull product with ``heads`` values per entry (attention heads):
// entry j's value for head h is data[j * heads + h] and weighs features [h * fh, (h + 1)
// * fh) of x's and y's rows of f = heads * fh. Each output value is reduced in CSR
// order with the operations of the one-value pull of its block of features (the loop
// below, or pull_row_block's for blocks of 8 features): a product per head gives the
// same bits, except at one feature per head, where the one-value pull sums a row in
// eight lanes. V heads of 8 features (float32 or bfloat16 in and out): the heads'
// accumulators are vector registers, no loop over features.
template <typename In, typename Out, typename Op, int V>
JAXCSR_INLINE void pull_rows_heads_vectors(const int32_t* indptr, const int32_t* cols,
                                           const typename In::Storage* data,
                                           const typename In::Storage* x,
                                           typename Out::Storage* y, int64_t lo, int64_t hi,
                                           uint64_t n, bool& bad) {
  constexpr int64_t f = 8 * V;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], j1 = indptr[r + 1];
    f32x8 a[V];
    for (int v = 0; v < V; ++v) a[v] = splat(Op::init);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t col = checked_column(cols, j, j1, x, f, n, bad);
      if (col < 0) continue;
      const typename In::Storage* w = data + j * V;
      for (int v = 0; v < V; ++v)
        a[v] = combine8<Op>(a[v], splat(In::load(w[v])) * load8<In>(x + col * f + 8 * v, 8, 0.0f));
    }
    for (int v = 0; v < V; ++v) store8<Out>(y + r * f + 8 * v, j1 == j0 ? splat(0.0f) : a[v], 8);
  }
}

template <typename In, typename Out, typename Op>
JAXCSR_INLINE void pull_rows_heads_loop(const int32_t* indptr, const int32_t* cols,
                                        const typename In::Storage* data,
                                        const typename In::Storage* x, typename Out::Storage* y,
                                        int64_t f, int64_t heads, int64_t lo, int64_t hi,
                                        float* acc, uint64_t n, bool& bad) {
  const int64_t fh = f / heads;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], j1 = indptr[r + 1];
    std::fill(acc, acc + f, Op::init);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t col = checked_column(cols, j, j1, x, f, n, bad);
      if (col < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const float w = In::load(data[j * heads + h]);
        const typename In::Storage* row = x + col * f + h * fh;
        float* a = acc + h * fh;
        for (int64_t i = 0; i < fh; ++i) a[i] = Op::combine(a[i], w * In::load(row[i]));
      }
    }
    store_row<Out>(y + r * f, acc, f, j1 == j0);
  }
}

template <typename In, typename Out, typename Op>
struct PullHeads {
  JAXCSR_INLINE static void run(const int32_t* indptr, const int32_t* cols,
                                const typename In::Storage* data, const typename In::Storage* x,
                                typename Out::Storage* y, int64_t f, int64_t heads, int64_t lo,
                                int64_t hi, float* acc, uint64_t n, bool& bad) {
    if constexpr (vector_code<In, Out>()) {
      if (f == 8 * heads) {
        switch (heads) {
          case 2: return pull_rows_heads_vectors<In, Out, Op, 2>(indptr, cols, data, x, y, lo, hi, n, bad);
          case 3: return pull_rows_heads_vectors<In, Out, Op, 3>(indptr, cols, data, x, y, lo, hi, n, bad);
          case 4: return pull_rows_heads_vectors<In, Out, Op, 4>(indptr, cols, data, x, y, lo, hi, n, bad);
          case 5: return pull_rows_heads_vectors<In, Out, Op, 5>(indptr, cols, data, x, y, lo, hi, n, bad);
          case 6: return pull_rows_heads_vectors<In, Out, Op, 6>(indptr, cols, data, x, y, lo, hi, n, bad);
          case 7: return pull_rows_heads_vectors<In, Out, Op, 7>(indptr, cols, data, x, y, lo, hi, n, bad);
          case 8: return pull_rows_heads_vectors<In, Out, Op, 8>(indptr, cols, data, x, y, lo, hi, n, bad);
          default: break;
        }
      }
    }
    pull_rows_heads_loop<In, Out, Op>(indptr, cols, data, x, y, f, heads, lo, hi, acc, n, bad);
  }
};

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

// The push body for rows of W features of FixedWidths stored back to back (stride W):
// the row's W values combined one by one, W known when compiled (a loop over a width
// known only at run time cost rows this narrow about what 16 features cost). The same
// operations per value as push_rows_body.
template <typename In, typename Op, int W>
JAXCSR_INLINE void push_rows_narrow(const int32_t* ids, const typename In::Storage* data,
                                    const typename In::Storage* x, float* acc, int64_t m,
                                    int64_t k0, int64_t k1) {
  constexpr int64_t kAhead = 16;
  for (int64_t k = k0; k < k1; ++k) {
    if (k + kAhead < k1) {
      const uint64_t ahead = static_cast<uint32_t>(ids[k + kAhead]);
      const float* row = acc + (ahead < static_cast<uint64_t>(m) ? ahead : 0) * W;
      // every line of the row, as push_rows_body does (one line per row measured
      // slower into large scattered partials at 17 features)
      for (int i = 0; i < W; i += 16) __builtin_prefetch(row + i, 1);
    }
    const int64_t r = ids[k];
    if (static_cast<uint64_t>(r) >= static_cast<uint64_t>(m)) continue;
    const float w = data ? In::load(data[k]) : 1.0f;
    float* a = acc + r * W;
    const typename In::Storage* v = x + k * W;
    // the row's W products first, then the W updates: loads of x interleaved with
    // stores to acc (which the compiler must assume may alias them) ran slower
    // (benchmarks/results/cpu-epyc/narrow_push/)
    float add[W];
    for (int i = 0; i < W; ++i) add[i] = w * In::load(v[i]);
    if constexpr (std::is_same<Op, Sum>::value && W == 4) {
      // one 4-lane add, the same additions and bits: GCC left four scalar
      // read-modify-writes, slower (benchmarks/results/cpu-epyc/narrow_push/)
      f32x4 sum, more;
      std::memcpy(&sum, a, sizeof sum);
      std::memcpy(&more, add, sizeof more);
      sum = sum + more;
      std::memcpy(a, &sum, sizeof sum);
    } else {
      for (int i = 0; i < W; ++i) a[i] = Op::combine(a[i], add[i]);
    }
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
    const auto narrow = [&](auto w) {
      push_rows_narrow<In, Op, decltype(w)::value>(ids, data, x, acc, m, k0, k1);
    };
    if (stride == width && at_fixed_width(width, narrow, FixedWidths{})) return;
    if constexpr (vector_code<In, Out>()) {
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
  return vector_code<In, Out>() &&
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
  constexpr bool vector_bodies = vector_code<In, Out>();
  const bool own_code = f == 1 || whole_vector_rows<In, Out>(f) ||
                        (vector_bodies && cols && f > 64 && f % 8 == 0);  // pull_rows_blocks
  if (own_code) {
    run_best<PullRows<In, Out, Op>>(indptr, cols, data, x, y, f, lo, hi, acc, n, bad);
  } else {
    run_wide<PullRows<In, Out, Op>>(indptr, cols, data, x, y, f, lo, hi, acc, n, bad);
  }
}

// Row means are summed in blocks of at most this many float32 values (16 KiB, in L1).
constexpr int64_t kMeanBlockValues = 4096;

// Rows [r0, r1) of a mean from their float32 sums (``sums``, rows f apart from r0's):
// each times the float32 reciprocal of its row's entry count (1 for an empty row),
// rounded once into y, eight at a time (store8: bfloat16 rounded as f32_to_bf16).
template <typename Out>
struct MeanRows {
  JAXCSR_INLINE static void run(const int32_t* indptr, const float* sums,
                                typename Out::Storage* y, int64_t f, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float count = static_cast<float>(std::max<int64_t>(indptr[r + 1] - indptr[r], 1));
      const f32x8 scale = splat(1.0f / count);
      const float* sum = sums + (r - r0) * f;
      typename Out::Storage* to = y + r * f;
      int64_t c = 0;
      for (; c + 8 <= f; c += 8) {
        f32x8 v;
        std::memcpy(&v, sum + c, sizeof v);
        store8<Out>(to + c, v * scale, 8);
      }
      for (; c < f; ++c) to[c] = Out::store(sum[c] * scale[0]);
    }
  }
};

// Rows [lo, hi) of the mean: each block of rows is summed in float32 into ``sums`` (the
// sum's own loops, on the block's slice of the row pointer), then MeanRows: the
// operations of a float32 sum followed by the primitive's division by the counts
// (times their reciprocals, as XLA computes a division by a broadcast), so the same
// bits, without the float32 (m, f) intermediate and the second pass over it.
template <typename In, typename Out>
void pull_means(const int32_t* indptr, const int32_t* cols, const typename In::Storage* data,
                const typename In::Storage* x, typename Out::Storage* y, int64_t f, int64_t lo,
                int64_t hi, float* acc, uint64_t n, bool& bad) {
  const int64_t block = std::max<int64_t>(1, kMeanBlockValues / f);
  std::vector<float> sums(std::min(block, hi - lo) * f);
  for (int64_t r0 = lo; r0 < hi; r0 += block) {
    const int64_t r1 = std::min(hi, r0 + block);
    pull_rows<In, F32, Sum>(indptr + r0, cols, data, x, sums.data(), f, 0, r1 - r0, acc, n,
                            bad);
    run_best<MeanRows<Out>>(indptr, static_cast<const float*>(sums.data()), y, f, r0, r1);
  }
}

// values[j] = data[perm[j]] for entries [j0, j1) (the values of a planned transpose,
// read in its CSR order), ``heads`` values per entry; a position outside [0, nnz) sets
// ``bad`` and reads 0.
template <typename S>
void permute_values(const S* data, const int32_t* perm, S* values, int64_t j0, int64_t j1,
                    int64_t nnz, int64_t heads, bool& bad) {
  if (heads == 1) {  // one value an entry: no copy loop per entry
    for (int64_t j = j0; j < j1; ++j) {
      const uint64_t p = static_cast<uint32_t>(perm[j]);
      if (p >= static_cast<uint64_t>(nnz)) {
        bad = true;
        values[j] = S{};
        continue;
      }
      values[j] = data[p];
    }
    return;
  }
  for (int64_t j = j0; j < j1; ++j) {
    const uint64_t p = static_cast<uint32_t>(perm[j]);
    if (p >= static_cast<uint64_t>(nnz)) {
      bad = true;
      std::fill(values + j * heads, values + (j + 1) * heads, S{});
      continue;
    }
    std::copy(data + p * heads, data + (p + 1) * heads, values + j * heads);
  }
}

// Returns false if a column index was outside [0, n) (those entries are skipped) or a
// position in ``perm`` outside the entries. With ``perm``, entry j's value is
// data[perm[j]]: each chunk of rows puts its values in CSR order first, while they
// stay in cache for its rows (no separate pass over all of them). With ``heads`` > 1,
// each entry has that many values, one per block of f / heads features (PullHeads).
// With ``mean`` (a sum, one value per entry), each row's sum is divided by its entry
// count (pull_means).
template <typename In, typename Out, typename Op>
bool csr_pull(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
              const int32_t* cols, const typename In::Storage* data, const int32_t* perm,
              const typename In::Storage* x, typename Out::Storage* y, int64_t rows,
              int64_t f, int64_t n, int64_t heads = 1, bool mean = false) {
  using S = typename In::Storage;
  const int64_t nnz = indptr[rows];
  std::unique_ptr<S[]> permuted(perm && data ? new S[std::max<int64_t>(nnz * heads, 1)]
                                             : nullptr);
  return over_row_chunks(pool, max_threads, indptr, rows, f, cols != nullptr,
                         [&](int64_t lo, int64_t hi, bool& bad) {
                           const S* values = data;
                           if (permuted) {
                             permute_values(data, perm, permuted.get(), indptr[lo], indptr[hi],
                                            nnz, heads, bad);
                             values = permuted.get();
                           }
                           std::vector<float> acc(f);
                           if constexpr (std::is_same<Op, Sum>::value) {
                             if (mean) {
                               pull_means<In, Out>(indptr, cols, values, x, y, f, lo, hi,
                                                   acc.data(), static_cast<uint64_t>(n), bad);
                               return;
                             }
                           }
                           if (heads > 1) {
                             run_best<PullHeads<In, Out, Op>>(
                                 indptr, cols, values, x, y, f, heads, lo, hi, acc.data(),
                                 static_cast<uint64_t>(n), bad);
                             return;
                           }
                           pull_rows<In, Out, Op>(indptr, cols, values, x, y, f, lo, hi,
                                                  acc.data(), static_cast<uint64_t>(n), bad);
                         });
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
// mispredictions. With ``mean`` (a sum; ``indptr`` given), each row's float32 sum is
// multiplied by the reciprocal of its entry count as it is stored (MeanRows).
template <typename In, typename Out, typename Op>
void row_push(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
              const int32_t* ids, const typename In::Storage* data,
              const typename In::Storage* x, typename Out::Storage* y, int64_t rows,
              int64_t entries, int64_t f, bool mean = false) {
  const int64_t threads = entries * f < kSerialWork ? 1 : thread_count(pool, max_threads);
  const int64_t pieces =
      push_piece_count(rows, entries, f, f * int64_t{sizeof(typename In::Storage)},
                       sizeof(typename In::Storage) == 2);
  // A float32 sum's first piece accumulates in the output itself (its float32 partial
  // is what the output holds), the later pieces' partials then added into it: no
  // partial to fill and copy out for it, the same additions in the same order.
  constexpr bool f32_sum = std::is_same<Out, F32>::value && std::is_same<Op, Sum>::value;
  const int64_t own = f32_sum ? pieces - 1 : pieces;  // partials of their own
  // not value-initialised: every piece (or feature block) fills its own part first
  std::unique_ptr<float[]> partials(own > 0 ? new float[own * rows * f] : nullptr);
  advise_huge_pages(partials.get(), own * rows * f * int64_t{sizeof(float)});
  // piece p's partial
  const auto part = [&](int64_t p) {
    return f32_sum ? (p == 0 ? reinterpret_cast<float*>(y) : partials.get() + (p - 1) * rows * f)
                   : partials.get() + p * rows * f;
  };
  float* first = part(0);
  if (pieces > 1) {
    parallel_chunks(pool, pieces, threads, [&](int64_t p) {
      push_rows<In, Out, Op>(ids, data, x, part(p), rows, f, f, entries * p / pieces,
                             entries * (p + 1) / pieces);
    });
  } else {
    over_feature_blocks<typename In::Storage>(pool, threads, f, [&](int64_t c0, int64_t c1) {
      push_rows<In, Out, Op>(ids, data, x + c0, first + c0, rows, f, c1 - c0, 0, entries);
    });
  }
  if (f32_sum && pieces == 1 && !mean) return;
  const int64_t chunks = chunk_count(rows * f * pieces, thread_count(pool, max_threads), 4);
  parallel_chunks(pool, chunks, threads, [&](int64_t c) {
    const int64_t lo = rows * c / chunks, hi = rows * (c + 1) / chunks;
    for (int64_t p = 1; p < pieces; ++p) {
      const float* later = part(p);
      for (int64_t i = lo * f; i < hi * f; ++i) first[i] = Op::combine(first[i], later[i]);
    }
    if constexpr (std::is_same<Op, Sum>::value) {
      if (mean) {  // the sums (in the output itself for float32) stored as means
        run_best<MeanRows<Out>>(indptr, static_cast<const float*>(first + lo * f), y, f, lo,
                                hi);
        return;
      }
    }
    if (f32_sum) return;  // the sums are in the output
    for (int64_t r = lo; r < hi; ++r)
      store_row<Out>(y + r * f, first + r * f, f, empty_row(indptr, r));
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
        to[r] = Out::store(empty_row(indptr, r) ? 0.0f : acc[r * w + i]);
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

template <typename In, typename Out, typename Op>
struct PullKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* cols, const void* data, const int32_t* perm,
                        const void* x, void* y, int64_t rows, int64_t f, int64_t n,
                        bool feature_major, int64_t heads, bool mean) {
    using S = typename In::Storage;
    const S* values = static_cast<const S*>(data);
    const auto* xs = static_cast<const S*>(x);
    auto* ys = static_cast<typename Out::Storage*>(y);
    bool ok = true;
    if (!feature_major) {
      ok = csr_pull<In, Out, Op>(pool, max_threads, indptr, cols, values, perm, xs, ys, rows, f,
                                 n, heads, mean);
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
                         nnz, int64_t{1}, mine);
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
                        int64_t rows, int64_t entries, int64_t f, bool feature_major,
                        bool mean) {
    const auto* values = static_cast<const typename In::Storage*>(data);
    const auto* xs = static_cast<const typename In::Storage*>(x);
    auto* ys = static_cast<typename Out::Storage*>(y);
    if (feature_major) {
      push_feature_major<In, Out, Op>(pool, max_threads, indptr, ids, values, xs, ys, rows,
                                      entries, f);
    } else {
      row_push<In, Out, Op>(pool, max_threads, indptr, ids, values, xs, ys, rows, entries, f,
                            mean);
    }
    return ffi::Error::Success();
  }
};

ffi::Error CsrPullImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                       ffi::Buffer<ffi::S32> cols, ffi::AnyBuffer data,
                       ffi::Buffer<ffi::S32> perm, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> y, int64_t max_threads, int64_t reduce,
                       int64_t feature_major, int64_t heads, int64_t mean) {
  const int64_t rows = static_cast<int64_t>(indptr.element_count()) - 1;
  if (rows < 0) return ffi::Error::InvalidArgument("jaxcsr cpu: empty indptr");
  const bool fm = feature_major != 0;
  if (auto err = check_2d(x, y, rows, fm); err.failure()) return err;
  const int64_t nnz = indptr.typed_data()[rows];
  const bool has_cols = cols.element_count() > 0, has_data = data.element_count() > 0;
  const auto [n, f] = entries_and_features(x, fm);
  if (!valid_indptr(indptr.typed_data(), rows, nnz) || nnz < 0 || (!has_cols && nnz > n))
    return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  if (heads < 1 || (heads > 1 && (fm || !has_data || f % heads != 0)))
    return ffi::Error::InvalidArgument("jaxcsr cpu: heads need values and row-major x");
  if (mean != 0 && (reduce != 0 || fm || heads != 1))
    return ffi::Error::InvalidArgument("jaxcsr cpu: a mean is a row-major sum, one value per entry");
  if ((has_cols && static_cast<int64_t>(cols.element_count()) != nnz) ||
      (has_data && static_cast<int64_t>(data.element_count()) != nnz * heads) ||
      (has_data && data.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("jaxcsr cpu: cols/data do not match indptr");
  const bool has_perm = perm.element_count() > 0;
  if (has_perm && (!has_data || static_cast<int64_t>(perm.element_count()) != nnz))
    return ffi::Error::InvalidArgument("jaxcsr cpu: perm does not match the values");
  advise_huge_pages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
  return dispatch<PullKernel>(x.element_type(), y->element_type(), reduce, pool, max_threads,
                              indptr.typed_data(), has_cols ? cols.typed_data() : nullptr,
                              has_data ? data.untyped_data() : nullptr,
                              has_perm ? perm.typed_data() : nullptr, x.untyped_data(),
                              y->untyped_data(), rows, f, n, fm, heads, mean != 0);
}

ffi::Error RowPushImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                       ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer data, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> y, int64_t max_threads, int64_t reduce,
                       int64_t feature_major, int64_t mean) {
  // A sum needs no row pointer (an empty row's sum is the fill, 0): given empty, the
  // rows are y's
  const bool has_indptr = indptr.element_count() > 0;
  if (!has_indptr && (reduce != 0 || mean != 0))
    return ffi::Error::InvalidArgument("jaxcsr cpu: a max/min or mean push needs the row pointer");
  const bool fm = feature_major != 0;
  if (mean != 0 && (reduce != 0 || fm))
    return ffi::Error::InvalidArgument("jaxcsr cpu: a mean is a row-major sum");
  if (y->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxcsr cpu: operand/output shapes do not match");
  const int64_t rows = has_indptr ? static_cast<int64_t>(indptr.element_count()) - 1
                                  : y->dimensions()[fm ? 1 : 0];
  if (auto err = check_2d(x, y, rows, fm); err.failure()) return err;
  const int64_t entries = static_cast<int64_t>(ids.element_count());
  const bool has_data = data.element_count() > 0;
  if (has_indptr) {
    const int64_t stored = indptr.typed_data()[rows];
    if (stored < 0 || stored > entries || !valid_indptr(indptr.typed_data(), rows, stored))
      return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  }
  const auto [n, f] = entries_and_features(x, fm);
  if (n != entries ||
      (has_data && (static_cast<int64_t>(data.element_count()) != entries ||
                    data.element_type() != x.element_type())))
    return ffi::Error::InvalidArgument("jaxcsr cpu: ids/data/operand do not match");
  advise_huge_pages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
  return dispatch<PushKernel>(x.element_type(), y->element_type(), reduce, pool, max_threads,
                              has_indptr ? indptr.typed_data() : nullptr, ids.typed_data(),
                              has_data ? data.untyped_data() : nullptr, x.untyped_data(),
                              y->untyped_data(), rows, entries, f, fm, mean != 0);
}

// The push: (indptr or empty for a sum, ids, values or empty, x) -> y, with attributes;
// with mean = 1 (a row-major sum; indptr given), each row's sum times the reciprocal of
// its entry count.
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
      .Attr<int64_t>("feature_major")
      .Attr<int64_t>("mean");
}

// The pull: (indptr, columns or empty, values or empty, value positions or empty, x) -> y;
// with positions, entry j's value is values[positions[j]] (a planned transpose's); with
// heads > 1, each entry has that many values (row-major, one per block of features);
// with mean = 1 (a row-major sum, one value per entry), each row's sum is divided by its
// entry count.
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
      .Attr<int64_t>("feature_major")
      .Attr<int64_t>("heads")
      .Attr<int64_t>("mean");
}

}  // namespace
}  // namespace jaxcsr::cpu

using namespace jaxcsr::cpu;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrCsrPull, CsrPullImpl, pull_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrRowPush, RowPushImpl, push_binding());
