// jaxcsr's CPU kernels, called through XLA FFI (jaxcsr/kernels/cpu.py): the plain C
// exports the Python side reads. The FFI handlers are defined beside their kernels:
// products.cc (JaxcsrCsrPull, JaxcsrRowPush), attaining.cc (JaxcsrArgSearch,
// JaxcsrPutAttaining), sddmm.cc (JaxcsrSddmm), gather.cc (JaxcsrGather) and softmax.cc
// (JaxcsrSoftmax); common.h holds what they share.
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
#include "common.h"

using namespace jaxcsr::cpu;

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
