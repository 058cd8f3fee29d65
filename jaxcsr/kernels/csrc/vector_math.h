// Eight-lane float32 arithmetic for jaxcsr's CPU kernels (included by common.h): the vector
// types and the softmax's exp. Self-contained, so that the tests compile it alone to
// check exp against float64.
#ifndef JAXCSR_VECTOR_MATH_H_
#define JAXCSR_VECTOR_MATH_H_

#include <cstdint>

#ifndef JAXCSR_INLINE
#define JAXCSR_INLINE inline __attribute__((always_inline))
#endif

namespace jaxcsr {

// Eight floats at a time in GCC/Clang vector extensions: explicit, so the exp below is
// vectorised whatever the compiler's cost model decides (one AVX register, or two SSE
// ones in the baseline build). Sixteen at a time for the AVX-512 build of the softmax
// (one register there; never used without AVX-512).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

JAXCSR_INLINE f32x8 splat(float v) { return f32x8{} + v; }

template <typename F>
JAXCSR_INLINE F splat_as(float v) {
  return F{} + v;
}

// exp(x) in float32 on every lane of F (I: the int32 vector of the same lanes):
// Cephes' expf (exp(r) * 2^n, r = x - n ln 2 in [-ln2 / 2, ln2 / 2], a degree-6
// polynomial), 2^n applied as two normal factors so that results down to the smallest
// subnormal are formed. Within 0.95 ulp of exp in float64 on every float32 of
// [-110, 90] (checked exhaustively once; the tests check every 61st). exp(-inf) = 0,
// exp(inf) = inf, NaN stays NaN. Lane by lane the same operations whatever the width:
// exp8 and exp16 give the same bits.
template <typename F, typename I>
JAXCSR_INLINE F exp_lanes(F x) {
  const F lo = splat_as<F>(-104.0f), hi = splat_as<F>(88.72283935546875f);
  F c = x > lo ? x : lo;  // NaN -> lo here; the last select restores it
  c = c < hi ? c : hi;
  const F t = c * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(t, I);       // toward zero
  n += (__builtin_convertvector(n, F) > t);  // true is -1: floor(t) = round(c / ln 2)
  const F fn = __builtin_convertvector(n, F);
  const F r = (c - fn * 0.693359375f) - fn * -2.12194440e-4f;
  F p = splat_as<F>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const I half = n >> 1;  // n in [-150, 128]: both factors are normal numbers
  const F s1 = reinterpret_cast<F>((half + 127) << 23);
  const F s2 = reinterpret_cast<F>((n - half + 127) << 23);
  F e = p * s1 * s2;
  e = x < lo ? splat_as<F>(0.0f) : e;
  e = x > hi ? splat_as<F>(__builtin_inff()) : e;
  return x != x ? x : e;
}

JAXCSR_INLINE f32x8 exp8(f32x8 x) { return exp_lanes<f32x8, i32x8>(x); }
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) JAXCSR_INLINE f32x16 exp16(
    f32x16 x) {  // AVX-512 only: see run_avx512 in common.h
  return exp_lanes<f32x16, i32x16>(x);
}

}  // namespace jaxcsr

#endif  // JAXCSR_VECTOR_MATH_H_
