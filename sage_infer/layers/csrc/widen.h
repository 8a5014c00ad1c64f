// bf16 <-> fp32 for the CPU kernels, by bit shifts: they vectorize, where c10::BFloat16's conversion
// operators do not here. Rounding to bf16 is to nearest even, as c10::BFloat16's constructor does.
#pragma once
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>

template <typename T>
inline float widen(T x) { return static_cast<float>(x); }
template <>
inline float widen<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T narrow(float f) { return static_cast<T>(f); }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  c10::BFloat16 out;
  out.x = std::isnan(f) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return out;
}
