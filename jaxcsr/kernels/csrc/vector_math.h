// Eight-lane float32 arithmetic for jaxcsr's CPU kernels (cpu_kernels.cc): the vector
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
// ones in the baseline build).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

JAXCSR_INLINE f32x8 splat(float v) { return f32x8{} + v; }

// exp(x) in float32: Cephes' expf (exp(r) * 2^n, r = x - n ln 2 in [-ln2 / 2, ln2 / 2],
// a degree-6 polynomial), 2^n applied as two normal factors so that results down to
// the smallest subnormal are formed. Within 0.95 ulp of exp in float64 on every float32
// of [-110, 90] (checked exhaustively once; the tests check every 61st). exp(-inf) = 0,
// exp(inf) = inf, NaN stays NaN.
JAXCSR_INLINE f32x8 exp8(f32x8 x) {
  const f32x8 lo = splat(-104.0f), hi = splat(88.72283935546875f);
  f32x8 c = x > lo ? x : lo;  // NaN -> lo here; the last select restores it
  c = c < hi ? c : hi;
  const f32x8 t = c * 1.44269504088896341f + 0.5f;
  i32x8 n = __builtin_convertvector(t, i32x8);       // toward zero
  n += (__builtin_convertvector(n, f32x8) > t);      // true is -1: floor(t) = round(c / ln 2)
  const f32x8 fn = __builtin_convertvector(n, f32x8);
  const f32x8 r = (c - fn * 0.693359375f) - fn * -2.12194440e-4f;
  f32x8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const i32x8 half = n >> 1;  // n in [-150, 128]: both factors are normal numbers
  const f32x8 s1 = reinterpret_cast<f32x8>((half + 127) << 23);
  const f32x8 s2 = reinterpret_cast<f32x8>((n - half + 127) << 23);
  f32x8 e = p * s1 * s2;
  e = x < lo ? splat(0.0f) : e;
  e = x > hi ? splat(__builtin_inff()) : e;
  return x != x ? x : e;
}

}  // namespace jaxcsr

#endif  // JAXCSR_VECTOR_MATH_H_
