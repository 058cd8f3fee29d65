// The softmax over rows and its tangent (Softmax): one pass per row for entries sorted
// by row; pushes in input order, like RowPush, for unsorted segment ids.
#include "common.h"

namespace jaxcsr::cpu {
namespace {

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

template <typename In, typename Out, int Fixed = 0>
JAXCSR_INLINE void tangent_row(const typename In::Storage* __restrict p,
                               const typename In::Storage* __restrict g,
                               typename Out::Storage* __restrict y, int64_t len, int64_t h,
                               float* __restrict inner) {
  if constexpr (Fixed > 0) h = Fixed;  // a head count known at compile time: loops unroll
  if (Fixed == 0 && h == 1) {
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

// buffer[0:n] = exp(buffer[0:n]) in whole vectors of sixteen where the CPU has
// AVX-512 (exp16: the same bits as exp8), else eight (up to 15 floats past n are read
// and written).
JAXCSR_AVX512 void exp_in_place16(float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    f32x16 v;
    std::memcpy(&v, buffer + i, sizeof v);
    v = exp16(v);
    std::memcpy(buffer + i, &v, sizeof v);
  }
}

JAXCSR_INLINE void exp_in_place(float* buffer, int64_t n) {
  if (has_avx512()) return exp_in_place16(buffer, n);
  for (int64_t i = 0; i < n; i += 8) {
    f32x8 v;
    std::memcpy(&v, buffer + i, sizeof v);
    v = exp8(v);
    std::memcpy(buffer + i, &v, sizeof v);
  }
}

// Lane l of a vector combined with every lane that holds the same head: for H heads
// dividing 8 (lane l holds head l % H), in a fixed tree (neighbours, then pairs, then
// halves). For one head the sum is fold_lanes' tree.
template <typename Op, int H>
JAXCSR_INLINE f32x8 fold_period(f32x8 v) {
  if constexpr (H == 1) v = combine8<Op>(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  if constexpr (H <= 2) v = combine8<Op>(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  if constexpr (H <= 4) v = combine8<Op>(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  return v;
}

// Rows [lo, hi) of a sorted pattern with h <= 8 heads (Fixed: 1, 2, 4 or 8 at compile
// time; 0: 3, 5, 6 or 7, read at run time), in batches of whole rows whose values fit
// in ``buffer`` (kRowBuffer floats, 16 more to spare), three passes each: every row's
// peak per head and x - peak into the buffer; exp over the whole batch in full vectors
// (rows of a few entries of a few heads fill part of a vector); every row's sums and
// its scaled outputs. A row's values are contiguous, so for h dividing 8 a vector from
// the row's start holds head l % h in lane l: each head is summed in 8 / h interleaved
// lanes, combined by fold_period (one head: eight lanes and fold_lanes' tree, as
// softmax_row); other counts sum each head in entry order (as softmax_heads). A row
// too long for the buffer takes softmax_row.
template <typename In, typename Out, int Fixed>
JAXCSR_INLINE void softmax_rows_narrow(const int32_t* indptr, const typename In::Storage* x,
                                       typename Out::Storage* y, int64_t h, int64_t lo,
                                       int64_t hi, float* __restrict buffer, int64_t entries) {
  constexpr bool vectors = Fixed > 0;  // 1, 2, 4 or 8 heads; 0: h (3, 5, 6 or 7) at run time
  constexpr int H = vectors ? Fixed : 8;  // the heads, or the room for them
  if constexpr (vectors) h = H;
  const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t r = lo; r < hi;) {
    const int64_t j0 = indptr[r];
    if ((indptr[r + 1] - j0) * h > kRowBuffer) {
      softmax_row<In, Out>(x + j0 * h, y + j0 * h, indptr[r + 1] - j0, h, buffer, entries - j0);
      ++r;
      continue;
    }
    int64_t r1 = r + 1;
    while (r1 < hi && (indptr[r1 + 1] - j0) * h <= kRowBuffer) ++r1;
    for (int64_t q = r; q < r1; ++q) {
      const int64_t n = (indptr[q + 1] - indptr[q]) * h;
      const auto* xq = x + indptr[q] * h;
      float* bq = buffer + (indptr[q] - j0) * h;
      if constexpr (vectors) {
        const int64_t readable = (entries - indptr[q]) * h;
        f32x8 top = splat(-__builtin_inff());
        for (int64_t i = 0; i < n; i += 8)
          top = max8(top, load8_row<In>(xq, i, n, readable, -__builtin_inff()));
        top = fold_period<Max, H>(top);
        top = top - top == 0.0f ? top : splat(0.0f);  // finite_or_zero, lane by lane
        for (int64_t i = 0; i < n; i += 8) {  // a tail's extra lanes land in the next row
          const f32x8 d = load8_row<In>(xq, i, n, readable, 0.0f) - top;
          std::memcpy(bq + i, &d, sizeof d);
        }
      } else {
        float top[H];
        for (int c = 0; c < h; ++c) top[c] = -__builtin_inff();
        for (int64_t i = 0; i < n; i += h)
          for (int c = 0; c < h; ++c) top[c] = Max::combine(top[c], In::load(xq[i + c]));
        for (int c = 0; c < h; ++c) top[c] = finite_or_zero(top[c]);
        for (int64_t i = 0; i < n; i += h)
          for (int c = 0; c < h; ++c) bq[i + c] = In::load(xq[i + c]) - top[c];
      }
    }
    exp_in_place(buffer, (indptr[r1] - j0) * h);
    for (int64_t q = r; q < r1; ++q) {
      const int64_t n = (indptr[q + 1] - indptr[q]) * h;
      if (n == 0) continue;
      const float* e = buffer + (indptr[q] - j0) * h;
      auto* yq = y + indptr[q] * h;
      if constexpr (vectors) {
        f32x8 sum = splat(0.0f);
        for (int64_t i = 0; i < n; i += 8) {
          f32x8 v;
          std::memcpy(&v, e + i, sizeof v);
          sum += lane < (i32x8{} + static_cast<int32_t>(n - i)) ? v : splat(0.0f);
        }
        const f32x8 scale = splat(1.0f) / fold_period<Sum, H>(sum);
        for (int64_t i = 0; i < n; i += 8) {
          f32x8 v;
          std::memcpy(&v, e + i, sizeof v);
          store8<Out>(yq + i, v * scale, n - i);
        }
      } else {
        float scale[H] = {};
        for (int64_t i = 0; i < n; i += h)
          for (int c = 0; c < h; ++c) scale[c] += e[i + c];
        for (int c = 0; c < h; ++c) scale[c] = 1.0f / scale[c];
        for (int64_t i = 0; i < n; i += h)
          for (int c = 0; c < h; ++c) yq[i + c] = Out::store(e[i + c] * scale[c]);
      }
    }
    r = r1;
  }
}

// Rows [lo, hi) of a sorted pattern, the tangent from the output p (tangent_row; Fixed:
// the head count at compile time, 0 for h at run time).
template <typename In, typename Out, int Fixed>
JAXCSR_INLINE void tangent_rows(const int32_t* indptr, const typename In::Storage* p,
                                const typename In::Storage* g, typename Out::Storage* y,
                                int64_t h, int64_t lo, int64_t hi, float* scratch) {
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], len = indptr[r + 1] - j0;
    if (len > 0)
      tangent_row<In, Out, Fixed>(p + j0 * h, g + j0 * h, y + j0 * h, len, h, scratch);
  }
}

// Rows [lo, hi) of a sorted pattern (row r's entries are indptr[r]..indptr[r+1]).
// g == nullptr: the softmax of x; else the tangent from the output x = p.
template <typename In, typename Out>
JAXCSR_INLINE void softmax_sorted_body(const int32_t* indptr, const typename In::Storage* x,
                                       const typename In::Storage* g,
                                       typename Out::Storage* y, int64_t h, int64_t lo,
                                       int64_t hi, float* scratch, int64_t entries) {
  if (g) {  // 2, 4 and 8 heads with a compile-time count (the same operations)
    switch (h) {
      case 2: return tangent_rows<In, Out, 2>(indptr, x, g, y, h, lo, hi, scratch);
      case 4: return tangent_rows<In, Out, 4>(indptr, x, g, y, h, lo, hi, scratch);
      case 8: return tangent_rows<In, Out, 8>(indptr, x, g, y, h, lo, hi, scratch);
      default: return tangent_rows<In, Out, 0>(indptr, x, g, y, h, lo, hi, scratch);
    }
  } else {
    switch (h) {
      case 1: return softmax_rows_narrow<In, Out, 1>(indptr, x, y, h, lo, hi, scratch, entries);
      case 2: return softmax_rows_narrow<In, Out, 2>(indptr, x, y, h, lo, hi, scratch, entries);
      case 4: return softmax_rows_narrow<In, Out, 4>(indptr, x, y, h, lo, hi, scratch, entries);
      case 8: return softmax_rows_narrow<In, Out, 8>(indptr, x, y, h, lo, hi, scratch, entries);
      case 3: case 5: case 6: case 7:
        return softmax_rows_narrow<In, Out, 0>(indptr, x, y, h, lo, hi, scratch, entries);
      default: break;
    }
  }
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t j0 = indptr[r], len = indptr[r + 1] - j0;
    if (len > 0) softmax_row<In, Out>(x + j0 * h, y + j0 * h, len, h, scratch, entries - j0);
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
    // fewer than 8 heads are never split (less than a line): c0 = 0, c1 = h
    if (h < 8) return run_flat(ids, x, g, peak, y, acc, m, h, k0, k1);
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

  // h < 8 heads (all of them): eight values at a time in storage order (8 / h entries
  // per vector; one exp for eight values), added to their rows' heads in input order.
  JAXCSR_INLINE static void run_flat(const int32_t* ids, const S* x, const S* g,
                                     const float* peak, Y* y, float* acc, int64_t m, int64_t h,
                                     int64_t k0, int64_t k1) {
    const int64_t i1 = k1 * h;
    int64_t k = k0, c = 0;  // the entry and head of value i
    for (int64_t i = k0 * h; i < i1; i += 8) {
      const int64_t w = std::min<int64_t>(8, i1 - i);
      int64_t at[8];  // the lane's place in acc, -1 for an entry of no row
      f32x8 top = splat(0.0f);
      for (int64_t l = 0; l < w; ++l) {
        const uint64_t r = static_cast<uint32_t>(ids[k]);
        at[l] = r < static_cast<uint64_t>(m) ? static_cast<int64_t>(r) * h + c : -1;
        if (What == Pushed::kExp && peak) top[l] = at[l] >= 0 ? peak[at[l]] : 0.0f;
        if (++c == h) c = 0, ++k;
      }
      f32x8 v;
      if constexpr (What == Pushed::kPeak) {
        v = load8<In>(x + i, w, 0.0f);
      } else if constexpr (What == Pushed::kProduct) {
        v = load8<In>(x + i, w, 0.0f) * load8<In>(g + i, w, 0.0f);
      } else {
        v = exp8(load8<In>(x + i, w, 0.0f) - top);
        if constexpr (kKeep) store8<F32>(y + i, v, w);
      }
      for (int64_t l = 0; l < w; ++l)
        if (at[l] >= 0) acc[at[l]] = Op::combine(acc[at[l]], v[l]);
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
    if (h < 8) return run_flat(ids, x, g, peak, scale, y, m, h, k0, k1);
    const bool forward = g == nullptr;
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

  // h < 8 heads: eight values at a time in storage order (8 / h entries per vector).
  JAXCSR_INLINE static void run_flat(const int32_t* ids, const S* x, const S* g,
                                     const float* peak, const float* scale, Y* y, int64_t m,
                                     int64_t h, int64_t k0, int64_t k1) {
    const bool forward = g == nullptr;
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const int64_t i1 = k1 * h;
    int64_t k = k0, c = 0;  // the entry and head of value i
    for (int64_t i = k0 * h; i < i1; i += 8) {
      const int64_t w = std::min<int64_t>(8, i1 - i);
      f32x8 top = splat(0.0f), by = splat(0.0f);
      i32x8 in_row = lane < static_cast<int32_t>(w);
      for (int64_t l = 0; l < w; ++l, c = c + 1 == h ? 0 : c + 1, k += c == 0) {
        const uint64_t r = static_cast<uint32_t>(ids[k]);
        if (r >= static_cast<uint64_t>(m)) {
          in_row[l] = 0;  // no row: 0 forward, p * g - p * 0 in the tangent
          continue;
        }
        const int64_t at = static_cast<int64_t>(r) * h + c;
        if (!kKept && forward && peak) top[l] = peak[at];
        by[l] = scale[at];
      }
      const f32x8 v = entry(x, g, y, top, by, i, w);
      store8<Out>(y + i, forward ? (in_row ? v : splat(0.0f)) : v, w);
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
    // a row costs what about 16 values do (its peak, fold and scale: rows of a few
    // entries of one head are bound by them), so short rows split over threads sooner
    const int64_t chunks = chunk_count(indptr[m] * h + 16 * m, threads, 8);
    const std::vector<int64_t> starts = row_chunks(indptr, m, chunks);
    parallel_chunks(pool, chunks, threads, [&](int64_t c) {
      std::vector<float> scratch(std::max<int64_t>(h, kRowBuffer + 16));
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
  advise_huge_pages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
  return dispatch<SoftmaxKernel>(x.element_type(), y->element_type(), 0, pool, max_threads, ptr,
                                 unsorted ? ids.typed_data() : nullptr, x.untyped_data(),
                                 tangent ? g.untyped_data() : nullptr, y->untyped_data(), m,
                                 entries, h);
}

}  // namespace
}  // namespace jaxcsr::cpu

using namespace jaxcsr::cpu;

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
