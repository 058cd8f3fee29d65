// Where a max or min is attained: ArgSearch (the first entry of each row and feature
// that attains the output) and PutAttaining (the max/min gradient's put at those
// entries).
#include "common.h"

namespace jaxcsr::cpu {
namespace {

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
  advise_huge_pages(result->typed_data(), static_cast<int64_t>(result->size_bytes()));
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
  advise_huge_pages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
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

}  // namespace
}  // namespace jaxcsr::cpu

using namespace jaxcsr::cpu;

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcsrPutAttaining, PutAttainingImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("max_threads"));
