// The sampled product (Sddmm): one fixed-order dot product per stored entry.
#include "common.h"

namespace jaxcsr::cpu {
namespace {

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

// Lanes [0, 8) of a and b folded in pairs: (a0 + a1, a2 + a3, b0 + b1, b2 + b3, a4 + a5,
// a6 + a7, b4 + b5, b6 + b7).
JAXCSR_INLINE f32x8 add_pairs(f32x8 a, f32x8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// out[0:heads] = the dot products of ct's and x's blocks of fh features, fh a multiple
// of 8: each head's eight lanes summed over its vectors from 0, as dot does, then up to
// eight heads' lanes folded at once, transposed -- neighbours, pairs, halves: fold_lanes'
// tree -- so the same additions give the same bits without a fold per head.
template <typename In, typename Out>
JAXCSR_INLINE void dot_heads(const typename In::Storage* __restrict ct_row,
                             const typename In::Storage* __restrict x_row,
                             typename Out::Storage* out, int64_t heads, int64_t fh) {
  for (int64_t h0 = 0; h0 < heads; h0 += 8) {
    const int64_t count = std::min<int64_t>(8, heads - h0);
    f32x8 part[8];
    if (fh == 8 && count == 8) {  // eight heads of one vector each: no loops
      for (int k = 0; k < 8; ++k)
        part[k] = splat(0.0f) + load8<In>(ct_row + (h0 + k) * 8, 8, 0.0f) *
                                    load8<In>(x_row + (h0 + k) * 8, 8, 0.0f);
    } else {
      for (int64_t k = 0; k < 8; ++k) {
        part[k] = splat(0.0f);
        if (k >= count) continue;
        const int64_t at = (h0 + k) * fh;
        for (int64_t i = 0; i < fh; i += 8)
          part[k] += load8<In>(ct_row + at + i, 8, 0.0f) * load8<In>(x_row + at + i, 8, 0.0f);
      }
    }
    const f32x8 low = add_pairs(add_pairs(part[0], part[1]), add_pairs(part[2], part[3]));
    const f32x8 high = add_pairs(add_pairs(part[4], part[5]), add_pairs(part[6], part[7]));
    const f32x8 sums = __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
                       __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
    store8<Out>(out + h0, sums, count);
  }
}

// One value per entry (One) or ``heads``: out[j * heads + h] = the dot product of ct's
// and x's h-th blocks of f / heads features; each the one-head dot, the same bits.
template <typename In, typename Out, bool One>
JAXCSR_INLINE void sddmm_body(const int32_t* indptr, const int32_t* rows, const int32_t* cols,
                              const typename In::Storage* ct, const typename In::Storage* x,
                              typename Out::Storage* out, int64_t m, int64_t n, int64_t f,
                              int64_t heads, int64_t lo, int64_t hi, bool& bad) {
  const int64_t fh = One ? f : f / heads;
  const auto put = [&](int64_t j, const typename In::Storage* ct_row, int64_t col) {
    if constexpr (One) {
      out[j] = Out::store(ct_row ? dot<In>(ct_row, x + col * f, f) : 0.0f);
    } else if (fh % 8 == 0 && ct_row) {
      dot_heads<In, Out>(ct_row, x + col * f, out + j * heads, heads, fh);
    } else {
      for (int64_t h = 0; h < heads; ++h)
        out[j * heads + h] =
            Out::store(ct_row ? dot<In>(ct_row + h * fh, x + col * f + h * fh, fh) : 0.0f);
    }
  };
  if (indptr) {  // [lo, hi) are rows
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t j = indptr[r]; j < indptr[r + 1]; ++j) {
        const int64_t col = cols ? cols[j] : j;
        if (static_cast<uint64_t>(col) >= static_cast<uint64_t>(n)) {
          bad = true;
          put(j, nullptr, 0);
          continue;
        }
        put(j, ct + r * f, col);
      }
    }
    return;
  }
  for (int64_t j = lo; j < hi; ++j) {  // [lo, hi) are entries
    const int64_t r = rows ? rows[j] : j, col = cols ? cols[j] : j;
    if (r < 0 || r >= m) {  // a dropped entry: no row, no value
      put(j, nullptr, 0);
      continue;
    }
    if (static_cast<uint64_t>(col) >= static_cast<uint64_t>(n)) {
      bad = true;
      put(j, nullptr, 0);
      continue;
    }
    put(j, ct + r * f, col);
  }
}

template <typename In, typename Out>
struct SddmmEntries {
  template <typename... Args>
  JAXCSR_INLINE static void run(int64_t heads, Args&&... args) {
    if (heads == 1) return sddmm_body<In, Out, true>(std::forward<Args>(args)...);
    sddmm_body<In, Out, false>(std::forward<Args>(args)...);
  }
};

template <typename In, typename Out, typename Unused>
struct SddmmKernel {
  static ffi::Error run(ffi::ThreadPool& pool, int64_t max_threads, const int32_t* indptr,
                        const int32_t* rows, const int32_t* cols, const void* ct,
                        const void* x, void* out, int64_t m, int64_t n, int64_t f,
                        int64_t heads, int64_t entries) {
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
          heads, indptr, rows, cols, static_cast<const typename In::Storage*>(ct),
          static_cast<const typename In::Storage*>(x), static_cast<typename Out::Storage*>(out),
          m, n, f, heads, starts[c], starts[c + 1], bad);
      if (bad) any_bad.store(true);
    });
    if (any_bad.load())
      return ffi::Error::InvalidArgument("jaxcsr cpu: a column index is out of range");
    return ffi::Error::Success();
  }
};

// indptr: (m + 1,) or empty; rows: (entries,) or empty; cols: (entries,) or empty; out:
// (entries,) or (entries, heads), each head the dot product of its block of features.
ffi::Error SddmmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indptr,
                     ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> cols, ffi::AnyBuffer ct,
                     ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t max_threads) {
  auto cd = ct.dimensions();
  auto xd = x.dimensions();
  auto od = out->dimensions();
  if (cd.size() != 2 || xd.size() != 2 || cd[1] != xd[1] || od.size() < 1 || od.size() > 2 ||
      ct.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxcsr cpu: sddmm operands do not match");
  const int64_t m = cd[0], n = xd[0], f = cd[1];
  const int64_t entries = od[0], heads = od.size() == 2 ? od[1] : 1;
  if (heads < 1 || f % heads != 0)
    return ffi::Error::InvalidArgument("jaxcsr cpu: sddmm heads do not divide the features");
  const bool by_rows = indptr.element_count() > 0;
  const bool has_rows = rows.element_count() > 0, has_cols = cols.element_count() > 0;
  if (by_rows && (static_cast<int64_t>(indptr.element_count()) != m + 1 || has_rows ||
                  !valid_indptr(indptr.typed_data(), m, entries)))
    return ffi::Error::InvalidArgument("jaxcsr cpu: invalid row pointer");
  if ((has_rows && static_cast<int64_t>(rows.element_count()) != entries) ||
      (has_cols && static_cast<int64_t>(cols.element_count()) != entries) ||
      (!by_rows && !has_rows && entries > m) || (!has_cols && entries > n))
    return ffi::Error::InvalidArgument("jaxcsr cpu: sddmm index arrays do not match");
  advise_huge_pages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  return dispatch<SddmmKernel>(x.element_type(), out->element_type(), 0, pool, max_threads,
                               by_rows ? indptr.typed_data() : nullptr,
                               has_rows ? rows.typed_data() : nullptr,
                               has_cols ? cols.typed_data() : nullptr, ct.untyped_data(),
                               x.untyped_data(), out->untyped_data(), m, n, f, heads, entries);
}

}  // namespace
}  // namespace jaxcsr::cpu

using namespace jaxcsr::cpu;

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
