// a / b rounded as IEEE division (PyTorch's `/`): the build's -ffast-math may turn a plain `/` into a product with
// a reciprocal, one ulp away, which the fp16 rounding of a scale can carry into a different code
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

inline float ieee_div(float a, float b) {
#if defined(__x86_64__)
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  volatile float q = a / b;
  return q;
#endif
}
