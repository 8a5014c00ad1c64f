// The KV codec (sage_infer/quantization/kv_codec.py) in one pass over the values: fp8 (e4m3fn, e5m2, e4m3fnuz),
// int8 and int4 encode and decode of [outer, group, inner] values with one fp16 scale per (outer, inner), and a
// CRC32C of the encoded bytes computed as they are written, so the wire path reads the KV once. The CRC32C and the
// one-pass copy + CRC32C of the data path fold 64-byte vectors with VPCLMULQDQ where the CPU has it (32-byte
// vectors in the avx2 build), else run the SSE4.2 `crc32` instruction in three streams (crc_method).
//
// The arithmetic is the Python codec's, operation for operation, in fp32: scale = fp16(clamp(amax / qmax,
// 2^-24, 65504)) with amax / qmax an IEEE division; codes from clamp(x * (1 / scale), -qmax, qmax); int levels
// truncate (level + qmax + 0.5); fp8 rounds to nearest even as c10's Float8 casts do; decoding multiplies the
// exact level (fp8 widened through fp16 bits, as `fp8_as_fp16`) by the scale, then rounds once to the output
// dtype. So codes, scales and decoded values equal the Python codec's bit for bit (tests/test_kv_codec_kernel.py).
// 16-lane AVX-512 in the AVX-512 builds, 8-lane AVX2 + F16C in the avx2 build (and for rows shorter than 16), scalar
// elsewhere and for tails; every width computes the same bytes. kv_decode_crc checksums a payload as it decodes it.
#include "ieee_div.h"
#include "kernel.h"
#include "widen.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// ---------------------------------------------------------------------------------------------------- CRC32C
constexpr uint32_t POLY = 0x82f63b78u;  // Castagnoli, reflected

// a * b modulo the polynomial, reflected (zlib's multmodp)
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
  }
  return p;
}

// x^n modulo the polynomial, reflected (bit 31 is x^0), from a table of x^(2^k)
uint32_t x_pow_mod(uint64_t n) {
  static const std::vector<uint32_t> x2n = [] {
    std::vector<uint32_t> t(64);
    t[0] = 1u << 30;  // x^1
    for (int k = 1; k < 64; ++k) t[k] = multmodp(t[k - 1], t[k - 1]);
    return t;
  }();
  uint32_t p = 1u << 31;  // x^0
  for (unsigned k = 0; n; n >>= 1, ++k)
    if (n & 1) p = multmodp(x2n[k & 63], p);
  return p;
}

// crc(A then B) from crc(A), crc(B) and len(B): crc(A) times x^(8 len(B)) mod the polynomial, plus crc(B)
// (zlib's crc32_combine; a few hundred cycles)
uint32_t crc_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) { return multmodp(x_pow_mod(8 * len2), crc1) ^ crc2; }

// the operator that appends `len` zero bytes to a raw CRC state, as a table (the crc32 instruction's streams are
// joined with it): shift(crc) = crc times x^(8 len)
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t len) {
    const uint32_t k = x_pow_mod(8 * len);
    for (uint32_t n = 0; n < 256; ++n)
      for (int b = 0; b < 4; ++b) t[b][n] = multmodp(k, n << (8 * b));
  }
  uint32_t shift(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

constexpr size_t LONG_BLOCK = 8192, SHORT_BLOCK = 256;

// What a CRC pass does with the bytes it reads: nothing (a checksum), store them (a copy), or store them
// non-temporally (a copy that bypasses the cache: no read-for-ownership of the destination, which a large copy's
// destination would only evict again)
enum class Store { NONE, PLAIN, STREAM };

#if defined(__SSE4_2__)
constexpr bool NATIVE_CRC = true;

template <Store S>
inline void put8(uint8_t* d, uint64_t v) {
  if constexpr (S == Store::PLAIN) std::memcpy(d, &v, 8);
  if constexpr (S == Store::STREAM) _mm_stream_si64(reinterpret_cast<long long*>(d), static_cast<long long>(v));
}

// raw (not pre/post-inverted) CRC32C of len bytes at p on the crc32 instruction, and with S != NONE a copy of them
// to d made from the same registers (each byte loaded once): three interleaved streams per block (the
// instruction's latency is 3 cycles, its throughput 1), joined by the zero-append tables above
template <Store S>
uint32_t crc_insn(uint32_t crc, const uint8_t* p, size_t len, uint8_t* d) {
  static const ShiftTable long_shift(LONG_BLOCK), short_shift(SHORT_BLOCK);
  constexpr bool copy = S != Store::NONE;
  uint64_t c0 = crc;
  // align the stores when copying (8-byte stores that never split a line), else the loads
  while (len && (reinterpret_cast<uintptr_t>(copy ? d : p) & 7)) {
    if constexpr (copy) *d++ = *p;
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
    --len;
  }
  auto three = [&](size_t block, const ShiftTable& sh) {
    while (len >= 3 * block) {
      uint64_t c1 = 0, c2 = 0;
      const uint8_t* end = p + block;
      do {  // 32 bytes of each stream per turn (block is a multiple of 32)
        uint64_t a[4], b[4], c[4];
        std::memcpy(a, p, 32);
        std::memcpy(b, p + block, 32);
        std::memcpy(c, p + 2 * block, 32);
        for (int k = 0; k < 4; ++k) {
          c0 = _mm_crc32_u64(c0, a[k]);
          c1 = _mm_crc32_u64(c1, b[k]);
          c2 = _mm_crc32_u64(c2, c[k]);
        }
        if constexpr (copy) {
          for (int k = 0; k < 4; ++k) {
            put8<S>(d + 8 * k, a[k]);
            put8<S>(d + block + 8 * k, b[k]);
            put8<S>(d + 2 * block + 8 * k, c[k]);
          }
          d += 32;
        }
        p += 32;
      } while (p < end);
      c0 = sh.shift(static_cast<uint32_t>(c0)) ^ c1;
      c0 = sh.shift(static_cast<uint32_t>(c0)) ^ c2;
      p += 2 * block;
      if constexpr (copy) d += 2 * block;
      len -= 3 * block;
    }
  };
  three(LONG_BLOCK, long_shift);
  three(SHORT_BLOCK, short_shift);
  for (; len >= 8; len -= 8, p += 8) {
    uint64_t a;
    std::memcpy(&a, p, 8);
    c0 = _mm_crc32_u64(c0, a);
    if constexpr (copy) {
      put8<S>(d, a);
      d += 8;
    }
  }
  for (; len; --len) {
    if constexpr (copy) *d++ = *p;
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
  }
  return static_cast<uint32_t>(c0);
}

// ---------------------------------------------------------------------------- CRC32C by carry-less multiplication
// The bytes are read as 16-byte lanes, each a polynomial C = H x^64 + L (H its first 8 bytes, reflected). Four
// accumulators of V::BYTES each take one vector per turn; a lane moves forward F bytes as C x^(8F) = H k_lo + L k_hi
// (two carry-less products of 64 x 32 bits) with k_lo = x^(8F + 31), k_hi = x^(8F - 33) mod P: the -33 undoes the
// product's one-bit reflection offset and the constants' 32-bit placement. The last lane's 16 bytes go through the
// crc32 instruction (its CRC from state 0 is that lane's remainder), and so do the head that aligns the stores and
// the tail under one vector. Constants come from x_pow_mod (tests/test_copy_crc.py checks every length against the
// bitwise definition). The instruction sets are enabled per function and chosen at run time (crc_method).
enum CrcMethod : int { CRC_INSN = 0, CLMUL_128 = 1, CLMUL_256 = 2, CLMUL_512 = 3 };
const char* const METHOD_NAMES[] = {"crc32", "pclmulqdq", "vpclmulqdq-256", "vpclmulqdq-512"};

struct FoldConstant {  // (k_lo, k_hi) for moving a 16-byte lane forward by `bytes`
  uint64_t lo, hi;
  explicit FoldConstant(size_t bytes) : lo(x_pow_mod(8 * bytes + 31)), hi(x_pow_mod(8 * bytes - 33)) {}
};

// lengths from which folding pays (below: the crc32 instruction's loop alone)
constexpr size_t FOLD_MIN_BYTES = 512;

#pragma GCC push_options
#pragma GCC target("pclmul")
struct V128 {
  using T = __m128i;
  static constexpr size_t BYTES = 16, ACC = 8;  // (8 accumulators cover the product's latency)
  static T load(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const T*>(p)); }
  template <Store S>
  static void store(uint8_t* d, T v) {  // (d aligned to BYTES)
    if constexpr (S == Store::PLAIN) _mm_store_si128(reinterpret_cast<T*>(d), v);
    if constexpr (S == Store::STREAM) _mm_stream_si128(reinterpret_cast<T*>(d), v);
  }
  static T add(T a, T b) { return _mm_xor_si128(a, b); }
  static T of_crc(uint32_t crc) { return _mm_cvtsi32_si128(static_cast<int>(crc)); }
  static T constant(size_t bytes) {
    const FoldConstant k(bytes);
    return _mm_set_epi64x(static_cast<long long>(k.hi), static_cast<long long>(k.lo));
  }
  static T fold(T x, T k, T data) {  // x moved forward, plus data
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
  }
  static __m128i lanes(T x) { return x; }  // (one lane: nothing to join)
};
#pragma GCC pop_options

#if defined(__AVX2__)
#pragma GCC push_options
#pragma GCC target("pclmul,vpclmulqdq")
struct V256 {
  using T = __m256i;
  static constexpr size_t BYTES = 32, ACC = 4;
  static T load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const T*>(p)); }
  template <Store S>
  static void store(uint8_t* d, T v) {
    if constexpr (S == Store::PLAIN) _mm256_store_si256(reinterpret_cast<T*>(d), v);
    if constexpr (S == Store::STREAM) _mm256_stream_si256(reinterpret_cast<T*>(d), v);
  }
  static T add(T a, T b) { return _mm256_xor_si256(a, b); }
  static T of_crc(uint32_t crc) { return _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(crc))); }
  static T constant(size_t bytes) {
    const FoldConstant k(bytes);
    return _mm256_set_epi64x(static_cast<long long>(k.hi), static_cast<long long>(k.lo),
                             static_cast<long long>(k.hi), static_cast<long long>(k.lo));
  }
  static T fold(T x, T k, T data) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                                             _mm256_clmulepi64_epi128(x, k, 0x11)), data);
  }
  static __m128i lanes(T x) {  // lane 0 moved forward 16 bytes onto lane 1
    static const __m128i k16 = V128::constant(16);  // (static: x_pow_mod costs more than a 16 KiB row's folding)
    return V128::fold(_mm256_castsi256_si128(x), k16, _mm256_extracti128_si256(x, 1));
  }
};
#pragma GCC pop_options
#endif

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("pclmul,vpclmulqdq")
struct V512 {
  using T = __m512i;
  static constexpr size_t BYTES = 64, ACC = 4;
  static T load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  template <Store S>
  static void store(uint8_t* d, T v) {
    if constexpr (S == Store::PLAIN) _mm512_store_si512(d, v);
    if constexpr (S == Store::STREAM) _mm512_stream_si512(reinterpret_cast<T*>(d), v);
  }
  static T add(T a, T b) { return _mm512_xor_si512(a, b); }
  static T of_crc(uint32_t crc) { return _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))); }
  static T constant(size_t bytes) {
    const FoldConstant k(bytes);
    return _mm512_set_epi64(static_cast<long long>(k.hi), static_cast<long long>(k.lo),
                            static_cast<long long>(k.hi), static_cast<long long>(k.lo),
                            static_cast<long long>(k.hi), static_cast<long long>(k.lo),
                            static_cast<long long>(k.hi), static_cast<long long>(k.lo));
  }
  static T fold(T x, T k, T data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     data, 0x96);  // a ^ b ^ c
  }
  static __m128i lanes(T x) {  // lanes 0, 1, 2 moved forward 48, 32, 16 bytes onto lane 3
    static const T k = [] {  // (static: x_pow_mod costs more than a 16 KiB row's folding)
      const FoldConstant k48(48), k32(32), k16(16);
      return _mm512_set_epi64(0, 0, static_cast<long long>(k16.hi), static_cast<long long>(k16.lo),
                              static_cast<long long>(k32.hi), static_cast<long long>(k32.lo),
                              static_cast<long long>(k48.hi), static_cast<long long>(k48.lo));
    }();
    const T last = _mm512_maskz_mov_epi64(0xc0, x);  // lane 3 as it is; lanes 0-2 through k (lane 3's k is 0)
    const T y = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                          _mm512_clmulepi64_epi128(x, k, 0x11), last, 0x96);
    const __m256i h = _mm256_xor_si256(_mm512_castsi512_si256(y), _mm512_extracti64x4_epi64(y, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  }
};
#pragma GCC pop_options
#endif

// raw CRC32C of len bytes at p (len >= FOLD_MIN_BYTES), and with S != NONE a copy to d from the same registers
#pragma GCC push_options
#pragma GCC target("pclmul,vpclmulqdq")
template <class V, Store S>
uint32_t crc_fold(uint32_t crc, const uint8_t* p, size_t len, uint8_t* d) {
  using T = typename V::T;
  constexpr bool copy = S != Store::NONE;
  constexpr size_t B = V::BYTES, N = V::ACC, STEP = N * B;
  static const T k_step = V::constant(STEP), k_one = V::constant(B);
  const size_t head = copy ? (0 - reinterpret_cast<uintptr_t>(d)) & (B - 1) : 0;  // aligns the vector stores
  if (len < head + 2 * STEP) return crc_insn<S>(crc, p, len, d);
  crc = crc_insn<S>(crc, p, head, d);
  p += head, len -= head;
  if constexpr (copy) d += head;
  T x[N];
  for (size_t i = 0; i < N; ++i) x[i] = V::load(p + i * B);
  if constexpr (copy)
    for (size_t i = 0; i < N; ++i) V::template store<S>(d + i * B, x[i]);
  x[0] = V::add(x[0], V::of_crc(crc));  // the state so far enters as the first bytes' remainder
  for (p += STEP, len -= STEP, d += copy ? STEP : 0; len >= STEP; p += STEP, len -= STEP, d += copy ? STEP : 0) {
    T v[N];
    for (size_t i = 0; i < N; ++i) v[i] = V::load(p + i * B);
    if constexpr (copy)
      for (size_t i = 0; i < N; ++i) V::template store<S>(d + i * B, v[i]);
    for (size_t i = 0; i < N; ++i) x[i] = V::fold(x[i], k_step, v[i]);
  }
  T acc = x[0];
  for (size_t i = 1; i < N; ++i) acc = V::fold(acc, k_one, x[i]);
  for (; len >= B; len -= B, p += B) {
    const T v = V::load(p);
    acc = V::fold(acc, k_one, v);
    if constexpr (copy) {
      V::template store<S>(d, v);
      d += B;
    }
  }
  const __m128i lane = V::lanes(acc);
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(lane)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(lane, 1)));
  return crc_insn<S>(static_cast<uint32_t>(c), p, len, d);
}
#pragma GCC pop_options

bool cpu_runs(int method) {  // whether this build and this CPU run `method` (the CPU asked at run time)
  __builtin_cpu_init();
  switch (method) {
    case CRC_INSN: return true;
    case CLMUL_128: return __builtin_cpu_supports("pclmul");
#if defined(__AVX2__)
    case CLMUL_256: return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("vpclmulqdq");
#endif
#if defined(__AVX512F__)
    case CLMUL_512: return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("vpclmulqdq");
#endif
    default: return false;
  }
}

// the method in use: the widest VPCLMULQDQ this build and CPU run, else the crc32 instruction, unless
// crc32c_set_method chose. (128-bit PCLMULQDQ folds at half the crc32 instruction's rate beyond 64 KiB on Zen 4 —
// bench/copy_crc.py — so it is never the default; a CPU with neither runs the crc32 instruction.)
std::atomic<int>& crc_method() {
  static std::atomic<int> method{cpu_runs(CLMUL_512) ? CLMUL_512 : cpu_runs(CLMUL_256) ? CLMUL_256 : CRC_INSN};
  return method;
}

// raw CRC32C of len bytes at p, and with S != NONE a copy of them to d, each byte loaded once
template <Store S>
uint32_t crc_pass(uint32_t crc, const uint8_t* p, size_t len, uint8_t* d) {
  if (len >= FOLD_MIN_BYTES) {
    switch (crc_method().load(std::memory_order_relaxed)) {
#if defined(__AVX512F__)
      case CLMUL_512: return crc_fold<V512, S>(crc, p, len, d);
#endif
#if defined(__AVX2__)
      case CLMUL_256: return crc_fold<V256, S>(crc, p, len, d);
#endif
      case CLMUL_128: return crc_fold<V128, S>(crc, p, len, d);
      default: break;
    }
  }
  return crc_insn<S>(crc, p, len, d);
}
#else
constexpr bool NATIVE_CRC = false;
enum CrcMethod : int { BITWISE = 0 };
const char* const METHOD_NAMES[] = {"bitwise"};
bool cpu_runs(int method) { return method == BITWISE; }
std::atomic<int>& crc_method() {
  static std::atomic<int> method{BITWISE};
  return method;
}
template <Store S>
uint32_t crc_pass(uint32_t crc, const uint8_t* p, size_t len, uint8_t* d) {  // bitwise: the generic build's tests
  if constexpr (S != Store::NONE) std::memcpy(d, p, len);
  for (; len; --len) {
    crc ^= *p++;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (POLY & (0u - (crc & 1)));
  }
  return crc;
}
#endif

uint32_t crc_raw(uint32_t crc, const uint8_t* p, size_t len) { return crc_pass<Store::NONE>(crc, p, len, nullptr); }

// the CRC32C of the bytes behind `crc` (a finished CRC, as the crc32c package returns) followed by len more
uint32_t crc_update(uint32_t crc, const uint8_t* p, size_t len) { return ~crc_raw(~crc, p, len); }

// ---------------------------------------------------------------------------------------------------- formats
enum Fmt : int64_t { FP8_E4M3 = 0, FP8_E5M2 = 1, FP8_E4M3FNUZ = 2, INT8 = 3, INT4 = 4 };

// c10's fp32 -> fp8 conversion constants (Float8_e4m3fn.h, Float8_e5m2.h, Float8_e4m3fnuz.h), and how the byte
// widens through fp16 bits (kv_codec.fp8_as_fp16: shift, then times `factor`)
struct Fp8 {
  uint32_t min_normal, denorm_mask, rebias;
  int mshift, f16_shift;
  bool fnuz;
  float factor;
};
constexpr Fp8 FP8_SPECS[3] = {
    {121u << 23, 141u << 23, (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu, 20, 1, false, 256.f},
    {113u << 23, 134u << 23, (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu, 21, 0, false, 1.f},
    {0x78u << 23, 0x8Cu << 23, (static_cast<uint32_t>(8 - 127) << 23) + 0x7FFFFu, 20, 1, true, 128.f},
};
constexpr float QMAX[5] = {448.f, 57344.f, 240.f, 127.f, 7.f};

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}


inline uint8_t fp8_byte(float f, const Fp8& s) {
  const uint32_t u = bits_of(f), sign = u & 0x80000000u, a = u ^ sign;
  uint32_t r;
  if (a < s.min_normal) {
    r = bits_of(float_of(a) + float_of(s.denorm_mask)) - s.denorm_mask;
    if (s.fnuz && r == 0) return 0;  // fnuz has no negative zero
  } else {
    r = (a + s.rebias + ((a >> s.mshift) & 1)) >> s.mshift;
  }
  return static_cast<uint8_t>(r | (sign >> 24));
}

inline float fp8_value(uint8_t byte, const Fp8& s) {  // exact, times s.factor (kv_codec.fp8_as_fp16)
  int16_t w = static_cast<int16_t>(static_cast<uint16_t>(byte) << 8);
  if (s.f16_shift) w = static_cast<int16_t>((w >> s.f16_shift) & ~(((1 << s.f16_shift) - 1) << (15 - s.f16_shift)));
  at::Half h;
  h.x = static_cast<uint16_t>(w);
  return static_cast<float>(h);
}

// one value's code: int levels as (level + qmax + 0.5) truncated (the byte for int8, 0..14 for int4), fp8 bytes
inline uint32_t code_of(float x, float inv, int64_t fmt) {
  const float q = QMAX[fmt];
  const float w = std::min(std::max(x * inv, -q), q);
  if (fmt <= FP8_E4M3FNUZ) return fp8_byte(w, FP8_SPECS[fmt]);
  const int32_t level = static_cast<int32_t>(w + (q + 0.5f));
  return fmt == INT8 ? static_cast<uint8_t>(level - 127) : static_cast<uint32_t>(level);
}

inline float level_of(const uint8_t* codes, int64_t i, int64_t fmt) {  // element i's level (fp8: times factor)
  if (fmt <= FP8_E4M3FNUZ) return fp8_value(codes[i], FP8_SPECS[fmt]);
  if (fmt == INT8) return static_cast<float>(static_cast<int8_t>(codes[i]));
  return static_cast<float>(static_cast<int32_t>((codes[i >> 1] >> (4 * (i & 1))) & 0xF) - 7);
}

inline at::Half scale_of(float amax, int64_t fmt) {
  return at::Half(std::min(std::max(ieee_div(amax, QMAX[fmt]), 0x1p-24f), 65504.f));
}

inline float scale_factor(int64_t fmt) { return fmt <= FP8_E4M3FNUZ ? FP8_SPECS[fmt].factor : 1.f; }

#if defined(__AVX2__) && defined(__F16C__)
constexpr int64_t W = 8;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(c10::BFloat16* p, __m256 v) {  // round to nearest even (widen.h's narrow; finite values)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// a / b in 8 lanes, IEEE: -ffast-math compiles a vector `/` (and _mm256_div_ps) as a reciprocal estimate refined
// by a Newton step, which is not the division PyTorch does
inline __m256 ieee_div8(__m256 a, __m256 b) {
  __m256 q;
  asm("vdivps %2, %1, %0" : "=x"(q) : "x"(a), "x"(b));
  return q;
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

template <int64_t FMT>
inline __m256i fp8_bytes8(__m256 f) {  // fp8_byte in 8 lanes, one byte in each lane's low 8 bits
  constexpr Fp8 s = FP8_SPECS[FMT];
  const __m256i u = _mm256_castps_si256(f);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_xor_si256(u, sign);
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(s.denorm_mask));
  const __m256i den = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(mask))), mask);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, s.mshift), _mm256_set1_epi32(1));
  const __m256i nor =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(s.rebias))), odd),
                        s.mshift);
  const __m256i is_den = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(s.min_normal)), a);
  const __m256i r = _mm256_blendv_epi8(nor, den, is_den);
  __m256i sg = _mm256_srli_epi32(sign, 24);
  if (s.fnuz) sg = _mm256_andnot_si256(_mm256_cmpeq_epi32(r, _mm256_setzero_si256()), sg);
  return _mm256_or_si256(r, sg);
}

// 8 values -> their codes in 8 int32 lanes (the byte for int8 and fp8, 0..14 for int4)
template <int64_t FMT>
inline __m256i codes8(__m256 x, __m256 inv) {
  constexpr float q = QMAX[FMT];
  const __m256 w = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, inv), _mm256_set1_ps(-q)), _mm256_set1_ps(q));
  if constexpr (FMT <= FP8_E4M3FNUZ) return fp8_bytes8<FMT>(w);
  const __m256i v = _mm256_cvttps_epi32(_mm256_add_ps(w, _mm256_set1_ps(q + 0.5f)));
  if constexpr (FMT == INT8) return _mm256_sub_epi32(v, _mm256_set1_epi32(127));  // -127..127: packs signed
  return v;
}

// 8 values -> their 8 codes (4 bytes for int4) at dst
template <int64_t FMT>
inline void encode8(__m256 x, __m256 inv, uint8_t* dst) {
  const __m256i v = codes8<FMT>(x, inv);
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  if constexpr (FMT == INT8) {
    const __m128i w16 = _mm_packs_epi32(lo, hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(w16, w16));
  } else {
    const __m128i w16 = _mm_packus_epi32(lo, hi);
    __m128i b = _mm_packus_epi16(w16, w16);
    if constexpr (FMT == INT4) {
      b = _mm_or_si128(b, _mm_srli_epi16(b, 4));  // byte 2i: e[2i] | e[2i+1] << 4
      const int packed = _mm_cvtsi128_si32(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, -1, -1, -1, -1, -1, -1, -1,
                                                                               -1, -1, -1, -1, -1)));
      std::memcpy(dst, &packed, 4);
    } else {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), b);
    }
  }
}

// 32 values (4 vectors) -> 32 codes (16 bytes for int4) at dst, packed two vectors at a time
template <int64_t FMT>
inline void encode32(const __m256* x, __m256 inv, uint8_t* dst) {
  const __m256i v0 = codes8<FMT>(x[0], inv), v1 = codes8<FMT>(x[1], inv);
  const __m256i v2 = codes8<FMT>(x[2], inv), v3 = codes8<FMT>(x[3], inv);
  __m256i b;
  if constexpr (FMT == INT8) {
    b = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
  } else {
    b = _mm256_packus_epi16(_mm256_packus_epi32(v0, v1), _mm256_packus_epi32(v2, v3));
  }
  // dwords are [v0 lo, v1 lo, v2 lo, v3 lo | v0 hi, v1 hi, v2 hi, v3 hi]: back to element order
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (FMT == INT4) {
    b = _mm256_or_si256(b, _mm256_srli_epi16(b, 4));
    const __m256i even = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, even), 0x08);  // qwords 0 and 2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(b));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b);
  }
}

// the 8 levels of elements [i, i + 8) (i a multiple of 8 for int4's bytes), fp8 times its factor
template <int64_t FMT>
inline __m256 levels8(const uint8_t* codes, int64_t i) {
  if constexpr (FMT == INT8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
  } else if constexpr (FMT == INT4) {
    int32_t four;
    std::memcpy(&four, codes + i / 2, 4);
    const __m128i b = _mm_cvtsi32_si128(four), nib = _mm_set1_epi8(0x0F);
    const __m128i e = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(e), _mm256_set1_epi32(7)));
  } else {
    constexpr Fp8 s = FP8_SPECS[FMT];
    __m128i w = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))), 8);
    if constexpr (s.f16_shift != 0) {
      w = _mm_and_si128(_mm_srai_epi16(w, s.f16_shift),
                        _mm_set1_epi16(static_cast<int16_t>(~(((1 << s.f16_shift) - 1) << (15 - s.f16_shift)))));
    }
    return _mm256_cvtph_ps(w);
  }
}
#else
constexpr int64_t W = 1;  // the generic build: scalar loops only
#endif

// ------------------------------------------------------------------------------------ 16 lanes (AVX-512 builds)
// The 8-lane arithmetic above, operation for operation, on 16 lanes, so the codes are the same bytes: the clamp is
// one VRANGEPS (the smaller magnitude of w and qmax, w's sign: min(max(w, -qmax), qmax) for every finite w), codes
// narrow to bytes with VPMOVDB (int4 pairs with VPMOVQB), and fp8's subnormal / normal choice is a mask blend.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__F16C__)
#define SAGE_KV_W16 1
constexpr int64_t W16 = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(c10::BFloat16* p, __m512 v) {  // round to nearest even, as store8
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

inline __m512 ieee_div16(__m512 a, __m512 b) {  // IEEE division (see ieee_div8)
  __m512 q;
  asm("vdivps %2, %1, %0" : "=v"(q) : "v"(a), "v"(b));
  return q;
}

template <int64_t FMT>
inline __m512i fp8_bytes16(__m512 w) {  // fp8_byte of 16 clamped values, one byte in each lane's low 8 bits
  constexpr Fp8 s = FP8_SPECS[FMT];
  const __m512i u = _mm512_castps_si512(w);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(s.denorm_mask));
  const __m512i den = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(mask))), mask);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, s.mshift), _mm512_set1_epi32(1));
  const __m512i nor =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(s.rebias))), odd),
                        s.mshift);
  const __mmask16 is_den = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(static_cast<int>(s.min_normal)));
  const __m512i r = _mm512_mask_blend_epi32(is_den, nor, den);
  __m512i sg = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  if (s.fnuz) sg = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(r, r), sg);  // no negative zero
  return _mm512_or_si512(r, sg);
}

// 16 values -> their codes in 16 int32 lanes (the byte for int8 and fp8, 0..14 for int4)
template <int64_t FMT>
inline __m512i codes16(__m512 x, __m512 inv) {
  constexpr float q = QMAX[FMT];
  const __m512 w = _mm512_range_ps(_mm512_mul_ps(x, inv), _mm512_set1_ps(q), 0x02);  // min |.|, sign of w
  if constexpr (FMT <= FP8_E4M3FNUZ) return fp8_bytes16<FMT>(w);
  const __m512i v = _mm512_cvttps_epi32(_mm512_add_ps(w, _mm512_set1_ps(q + 0.5f)));
  if constexpr (FMT == INT8) return _mm512_sub_epi32(v, _mm512_set1_epi32(127));
  return v;
}

// 16 values -> their 16 codes (8 bytes for int4) at dst
template <int64_t FMT>
inline void encode16(__m512 x, __m512 inv, uint8_t* dst) {
  const __m512i v = codes16<FMT>(x, inv);
  if constexpr (FMT == INT4) {  // the low 32 bits of 64-bit lane i: e[2i] | e[2i+1] << 4
    const __m128i b = _mm512_cvtepi64_epi8(_mm512_or_si512(v, _mm512_srli_epi64(v, 28)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), b);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(v));
  }
}

// the 16 levels of elements [i, i + 16) (i even for int4's bytes), fp8 times its factor
template <int64_t FMT>
inline __m512 levels16(const uint8_t* codes, int64_t i) {
  if constexpr (FMT == INT8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
  } else if constexpr (FMT == INT4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)), nib = _mm_set1_epi8(0x0F);
    const __m128i e = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(e), _mm512_set1_epi32(7)));
  } else {
    constexpr Fp8 s = FP8_SPECS[FMT];
    __m256i w =
        _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))), 8);
    if constexpr (s.f16_shift != 0) {
      w = _mm256_and_si256(_mm256_srai_epi16(w, s.f16_shift),
                           _mm256_set1_epi16(static_cast<int16_t>(~(((1 << s.f16_shift) - 1) << (15 - s.f16_shift)))));
    }
    return _mm512_cvtph_ps(w);
  }
}
constexpr int64_t SCALE_BATCH = 16;  // groups whose scales are computed at once
#else
constexpr int64_t W16 = 0;
constexpr int64_t SCALE_BATCH = 8;
#endif

inline void put_scale(uint8_t* scales, int64_t k, at::Half h) { std::memcpy(scales + 2 * k, &h.x, 2); }
inline float get_scale(const uint8_t* scales, int64_t k) {
  at::Half h;
  std::memcpy(&h.x, scales + 2 * k, 2);
  return static_cast<float>(h);
}

// element e of a unit (its codes start at dst; int4: pairs never straddle units, the dispatch checks)
inline void put_code(uint8_t* dst, int64_t e, uint32_t code, int64_t fmt) {
  if (fmt != INT4) {
    dst[e] = static_cast<uint8_t>(code);
  } else if (e & 1) {
    dst[e >> 1] = static_cast<uint8_t>(dst[e >> 1] | (code << 4));
  } else {
    dst[e >> 1] = static_cast<uint8_t>(code);
  }
}

// ---------------------------------------------------------------------------------------------------- encode
// max |x| of contiguous fp16 or bf16 values as the largest of their magnitudes' bits (sign cleared: finite and
// infinite magnitudes order as unsigned integers), 32 values a step (AVX-512) or 16 (AVX2) with no widening; the
// result is that value widened, the same number the float maximum gives
template <typename T>
float half_amax(const T* x, int64_t group) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(x);
  uint16_t top = 0;
  int64_t g = 0;
#if defined(SAGE_KV_W16)
  if (group >= 32) {
    const __m512i mask = _mm512_set1_epi16(0x7FFF);
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;
    for (; g + 64 <= group; g += 64) {
      m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(b + g), mask));
      m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(b + g + 32), mask));
    }
    for (; g + 32 <= group; g += 32) m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(b + g), mask));
    m0 = _mm512_max_epu16(m0, m1);
    const __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(m0), _mm512_extracti64x4_epi64(m0, 1));
    const __m128i q = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    top = static_cast<uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi16(-1)))));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if (group >= 16) {
    const __m256i mask = _mm256_set1_epi16(0x7FFF);
    __m256i m0 = _mm256_setzero_si256(), m1 = m0;
    for (; g + 32 <= group; g += 32) {
      m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + g)), mask));
      m1 = _mm256_max_epu16(m1, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + g + 16)),
                                                 mask));
    }
    for (; g + 16 <= group; g += 16)
      m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + g)), mask));
    m0 = _mm256_max_epu16(m0, m1);
    const __m128i q = _mm_max_epu16(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
    top = static_cast<uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, _mm_set1_epi16(-1)))));
  }
#endif
  for (; g < group; ++g) top = std::max<uint16_t>(top, static_cast<uint16_t>(b[g] & 0x7FFF));
  T out;
  std::memcpy(&out, &top, sizeof top);
  return widen(out);
}

template <typename T>
float group_amax(const T* x, int64_t group) {  // max |x| of contiguous values
  if constexpr (std::is_same_v<T, at::Half> || std::is_same_v<T, c10::BFloat16>) return half_amax(x, group);
  float amax = 0.f;  // (a maximum is exact: the lanes' order does not change it)
  int64_t g = 0;
#if defined(SAGE_KV_W16)
  if (group >= W16) {
    __m512 z0 = _mm512_setzero_ps(), z1 = z0;  // 2 chains of 16 lanes
    for (; g + 2 * W16 <= group; g += 2 * W16) {
      z0 = _mm512_max_ps(z0, _mm512_abs_ps(load16(x + g)));
      z1 = _mm512_max_ps(z1, _mm512_abs_ps(load16(x + g + W16)));
    }
    for (; g + W16 <= group; g += W16) z0 = _mm512_max_ps(z0, _mm512_abs_ps(load16(x + g)));
    amax = _mm512_reduce_max_ps(_mm512_max_ps(z0, z1));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;  // 4 chains: a max's latency is 4 cycles
  for (; g + 4 * W <= group; g += 4 * W) {
    m0 = _mm256_max_ps(m0, abs8(load8(x + g)));
    m1 = _mm256_max_ps(m1, abs8(load8(x + g + W)));
    m2 = _mm256_max_ps(m2, abs8(load8(x + g + 2 * W)));
    m3 = _mm256_max_ps(m3, abs8(load8(x + g + 3 * W)));
  }
  for (; g + W <= group; g += W) m0 = _mm256_max_ps(m0, abs8(load8(x + g)));
  amax = std::max(amax, hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3))));
#endif
  for (; g < group; ++g) amax = std::max(amax, std::fabs(widen(x[g])));
  return amax;
}

// the fp16 scales of up to SCALE_BATCH groups (written to scales) and their fp32 reciprocals (SCALE_BATCH of them
// written), all at once: one group's chain (division, rounding, widening, division) is ~50 cycles of latency that
// the batch shares
template <int64_t FMT>
void scales_of(const float* amax, int64_t count, uint8_t* scales, float* inv) {
#if defined(SAGE_KV_W16)
  const __m512 s = _mm512_min_ps(
      _mm512_max_ps(ieee_div16(_mm512_loadu_ps(amax), _mm512_set1_ps(QMAX[FMT])), _mm512_set1_ps(0x1p-24f)),
      _mm512_set1_ps(65504.f));
  const __m256i h = _mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  uint16_t halves[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves), h);
  std::memcpy(scales, halves, 2 * count);
  _mm512_storeu_ps(inv, ieee_div16(_mm512_set1_ps(1.f), _mm512_cvtph_ps(h)));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 s = _mm256_min_ps(
      _mm256_max_ps(ieee_div8(_mm256_loadu_ps(amax), _mm256_set1_ps(QMAX[FMT])), _mm256_set1_ps(0x1p-24f)),
      _mm256_set1_ps(65504.f));
  const __m128i h = _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  uint16_t halves[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(halves), h);
  std::memcpy(scales, halves, 2 * count);
  _mm256_storeu_ps(inv, ieee_div8(_mm256_set1_ps(1.f), _mm256_cvtph_ps(h)));
#else
  for (int64_t j = 0; j < count; ++j) {
    const at::Half h = scale_of(amax[j], FMT);
    put_scale(scales, j, h);
    inv[j] = ieee_div(1.f, static_cast<float>(h));
  }
#endif
}

template <typename T, int64_t FMT>
void encode_group(const T* x, int64_t group, float r, uint8_t* dst) {  // contiguous values, one scale (1 / r)
  int64_t g = 0;
#if defined(SAGE_KV_W16)
  const __m512 zv = _mm512_set1_ps(r);
  constexpr int64_t step = FMT == INT4 ? W16 / 2 : W16;
  for (; g + 2 * W16 <= group; g += 2 * W16) {
    const __m512 a = load16(x + g), b = load16(x + g + W16);
    encode16<FMT>(a, zv, dst + g / W16 * step);
    encode16<FMT>(b, zv, dst + g / W16 * step + step);
  }
  for (; g + W16 <= group; g += W16) encode16<FMT>(load16(x + g), zv, dst + g / W16 * step);
#endif
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 rv = _mm256_set1_ps(r);
  for (; g + 4 * W <= group; g += 4 * W) {
    const __m256 v[4] = {load8(x + g), load8(x + g + W), load8(x + g + 2 * W), load8(x + g + 3 * W)};
    encode32<FMT>(v, rv, dst + (FMT == INT4 ? g / 2 : g));
  }
  for (; g + W <= group; g += W) encode8<FMT>(load8(x + g), rv, dst + (FMT == INT4 ? g / 2 : g));
#endif
  for (; g < group; ++g) put_code(dst, g, code_of(widen(x[g]), r, FMT), FMT);
}

// KV read from memory (a transfer's layers are far larger than the caches) is fetched this far ahead of the
// encoding: the maxima, the scales' division and the codes between loads leave the hardware prefetcher behind
constexpr int64_t kPrefetchAhead = 8 << 10;

// the cache lines of [p + ahead, p + ahead + bytes), clamped to end
inline void prefetch_ahead(const char* p, int64_t bytes, const char* end) {
  const char* from = p + kPrefetchAhead;
  const char* to = std::min(from + bytes, end);
  for (; from < to; from += 64) __builtin_prefetch(from, 0, 3);
}

// units [u0, u1) of [outer, group, 1] values: SCALE_BATCH groups' maxima, their scales at once, then their codes;
// the source prefetched up to unit `limit`
template <typename T, int64_t FMT>
void encode_groups(const T* x, int64_t u0, int64_t u1, int64_t group, uint8_t* codes, uint8_t* scales,
                   int64_t limit) {
  const int64_t unit_bytes = FMT == INT4 ? group / 2 : group;
  const char* end = reinterpret_cast<const char*>(x + limit * group);
  for (int64_t u = u0; u < u1; u += SCALE_BATCH) {
    const int64_t count = std::min<int64_t>(SCALE_BATCH, u1 - u);
    prefetch_ahead(reinterpret_cast<const char*>(x + u * group), count * group * static_cast<int64_t>(sizeof(T)), end);
    float amax[SCALE_BATCH] = {}, inv[SCALE_BATCH];
    for (int64_t j = 0; j < count; ++j) amax[j] = group_amax(x + (u + j) * group, group);
    scales_of<FMT>(amax, count, scales + 2 * u, inv);
    for (int64_t j = 0; j < count; ++j)
      encode_group<T, FMT>(x + (u + j) * group, group, inv[j], codes + (u + j) * unit_bytes);
  }
}

// one unit of [group, inner > 1] values (per_channel): inner scales, each over a column of the group's rows
template <typename T, int64_t FMT>
void encode_rows(const T* x, int64_t group, int64_t inner, uint8_t* dst, uint8_t* scales, std::vector<float>& inv) {
  float* iv = inv.data();
  std::fill(iv, iv + inner, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    int64_t i = 0;
#if defined(SAGE_KV_W16)
    for (; i + W16 <= inner; i += W16)
      _mm512_storeu_ps(iv + i, _mm512_max_ps(_mm512_loadu_ps(iv + i), _mm512_abs_ps(load16(x + g * inner + i))));
#endif
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + W <= inner; i += W)
      _mm256_storeu_ps(iv + i, _mm256_max_ps(_mm256_loadu_ps(iv + i), abs8(load8(x + g * inner + i))));
#endif
    for (; i < inner; ++i) iv[i] = std::max(iv[i], std::fabs(widen(x[g * inner + i])));
  }
  for (int64_t i = 0; i < inner; i += SCALE_BATCH)
    scales_of<FMT>(iv + i, std::min<int64_t>(SCALE_BATCH, inner - i), scales + 2 * i, iv + i);
  for (int64_t g = 0; g < group; ++g) {
    const T* row = x + g * inner;
    const int64_t e0 = g * inner;
    int64_t i = 0;
#if defined(SAGE_KV_W16)
    if (FMT != INT4 || inner % 2 == 0)
      for (; i + W16 <= inner; i += W16)
        encode16<FMT>(load16(row + i), _mm512_loadu_ps(iv + i), dst + (FMT == INT4 ? (e0 + i) / 2 : e0 + i));
#endif
#if defined(__AVX2__) && defined(__F16C__)
    if (FMT != INT4 || inner % 2 == 0)
      for (; i + W <= inner; i += W)
        encode8<FMT>(load8(row + i), _mm256_loadu_ps(iv + i), dst + (FMT == INT4 ? (e0 + i) / 2 : e0 + i));
#endif
    for (; i < inner; ++i) put_code(dst, e0 + i, code_of(widen(row[i]), iv[i], FMT), FMT);
  }
}

struct Parts {  // outer split into contiguous parts, one per task (so each part's CRC can be joined in order)
  int64_t count, per;
};

Parts split(int64_t outer, int64_t unit_elems) {  // outer >= 1
  constexpr int64_t MIN_PART_ELEMS = 1 << 16;  // below this a thread costs more than it saves
  const int64_t by_size = std::max<int64_t>(1, outer * unit_elems / MIN_PART_ELEMS);
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>({outer, by_size, at::get_num_threads()}));
  const int64_t per = (outer + count - 1) / count;
  return {(outer + per - 1) / per, per};
}

template <typename T, int64_t FMT>
uint32_t encode_all(const T* x, int64_t outer, int64_t group, int64_t inner, uint8_t* codes, uint8_t* scales,
                    bool crc, uint32_t crc_init) {
  const int64_t unit_elems = group * inner;
  const int64_t unit_bytes = FMT == INT4 ? unit_elems / 2 : unit_elems;
  const Parts parts = split(outer, unit_elems);
  std::vector<uint32_t> part_crc(parts.count, 0);
  // CRC a span of finished units while it is still in L1 / L2
  const int64_t units_per_span = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, unit_bytes));
  at::parallel_for(0, parts.count, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> inv(inner + SCALE_BATCH);  // scales_of reads and writes SCALE_BATCH at a time
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t a = p * parts.per, b = std::min(outer, a + parts.per);
      uint32_t c = 0;
      for (int64_t o = a; o < b; o += units_per_span) {
        const int64_t e = std::min(b, o + units_per_span);
        if (inner == 1) {
          encode_groups<T, FMT>(x, o, e, group, codes, scales, b);
        } else {
          for (int64_t u = o; u < e; ++u)
            encode_rows<T, FMT>(x + u * unit_elems, group, inner, codes + u * unit_bytes, scales + 2 * u * inner, inv);
        }
        if (crc) c = crc_update(c, codes + o * unit_bytes, (e - o) * unit_bytes);
      }
      part_crc[p] = c;
    }
  });
  if (!crc) return 0;
  uint32_t c = crc_init;
  for (int64_t p = 0; p < parts.count; ++p) {
    const int64_t a = p * parts.per, b = std::min(outer, a + parts.per);
    c = crc_combine(c, part_crc[p], static_cast<uint64_t>((b - a) * unit_bytes));
  }
  return crc_update(c, scales, static_cast<size_t>(2 * outer * inner));
}

// ---------------------------------------------------------------------------------------------------- decode
template <typename T, int64_t FMT>
void decode_unit(const uint8_t* codes, const uint8_t* scales, int64_t group, int64_t inner, T* out) {
  const float factor = scale_factor(FMT);
  if (inner == 1) {
    const float s = get_scale(scales, 0) * factor;
    int64_t g = 0;
#if defined(SAGE_KV_W16)
    const __m512 zv = _mm512_set1_ps(s);
    for (; g + W16 <= group; g += W16) store16(out + g, _mm512_mul_ps(levels16<FMT>(codes, g), zv));
#endif
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 sv = _mm256_set1_ps(s);
    for (; g + W <= group; g += W) store8(out + g, _mm256_mul_ps(levels8<FMT>(codes, g), sv));
#endif
    for (; g < group; ++g) out[g] = narrow<T>(level_of(codes, g, FMT) * s);
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t e0 = g * inner;
    int64_t i = 0;
#if defined(SAGE_KV_W16)
    if (FMT != INT4 || inner % 2 == 0)
      for (; i + W16 <= inner; i += W16) {
        const __m512 sv = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 2 * i))),
            _mm512_set1_ps(factor));
        store16(out + e0 + i, _mm512_mul_ps(levels16<FMT>(codes, e0 + i), sv));
      }
#endif
#if defined(__AVX2__) && defined(__F16C__)
    if (FMT != INT4 || inner % 2 == 0)
      for (; i + W <= inner; i += W) {
        const __m256 sv = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 2 * i))), _mm256_set1_ps(factor));
        store8(out + e0 + i, _mm256_mul_ps(levels8<FMT>(codes, e0 + i), sv));
      }
#endif
    for (; i < inner; ++i) out[e0 + i] = narrow<T>(level_of(codes, e0 + i, FMT) * (get_scale(scales, i) * factor));
  }
}

template <typename T, int64_t FMT>
void decode_all(const uint8_t* codes, const uint8_t* scales, int64_t outer, int64_t group, int64_t inner, T* out) {
  const int64_t unit_elems = group * inner;
  const int64_t unit_bytes = FMT == INT4 ? unit_elems / 2 : unit_elems;
  const Parts parts = split(outer, unit_elems);
  at::parallel_for(0, parts.count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t u = p0 * parts.per; u < std::min(outer, p1 * parts.per); ++u)
      decode_unit<T, FMT>(codes + u * unit_bytes, scales + 2 * u * inner, group, inner, out + u * unit_elems);
  });
}

// decode_all, and the CRC32C of the codes' then the scales' bytes continuing crc_init: each span of codes is
// checksummed, then decoded while it is in L1 / L2, so the payload is read from memory once
template <typename T, int64_t FMT>
uint32_t decode_all_crc(const uint8_t* codes, const uint8_t* scales, int64_t outer, int64_t group, int64_t inner,
                        T* out, uint32_t crc_init) {
  const int64_t unit_elems = group * inner;
  const int64_t unit_bytes = FMT == INT4 ? unit_elems / 2 : unit_elems;
  const Parts parts = split(outer, unit_elems);
  std::vector<uint32_t> part_crc(parts.count, 0);
  const int64_t units_per_span = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, unit_bytes));
  at::parallel_for(0, parts.count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t a = p * parts.per, b = std::min(outer, a + parts.per);
      uint32_t c = 0;
      for (int64_t o = a; o < b; o += units_per_span) {
        const int64_t e = std::min(b, o + units_per_span);
        c = crc_update(c, codes + o * unit_bytes, (e - o) * unit_bytes);
        for (int64_t u = o; u < e; ++u)
          decode_unit<T, FMT>(codes + u * unit_bytes, scales + 2 * u * inner, group, inner, out + u * unit_elems);
      }
      part_crc[p] = c;
    }
  });
  uint32_t c = crc_init;
  for (int64_t p = 0; p < parts.count; ++p) {
    const int64_t a = p * parts.per, b = std::min(outer, a + parts.per);
    c = crc_combine(c, part_crc[p], static_cast<uint64_t>((b - a) * unit_bytes));
  }
  return crc_update(c, scales, static_cast<size_t>(2 * outer * inner));
}

template <typename F>
void dispatch_dtype(at::ScalarType t, const char* what, F&& f) {  // fp32, fp16, bf16 (no double)
  switch (t) {
    case at::kFloat: return f(static_cast<float*>(nullptr));
    case at::kHalf: return f(static_cast<at::Half*>(nullptr));
    case at::kBFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    default: TORCH_CHECK(false, what, ": values must be float32, float16 or bfloat16, got ", t);
  }
}

template <typename F>
void dispatch_fmt(int64_t fmt, F&& f) {
  switch (fmt) {
    case FP8_E4M3: return f(std::integral_constant<int64_t, FP8_E4M3>{});
    case FP8_E5M2: return f(std::integral_constant<int64_t, FP8_E5M2>{});
    case FP8_E4M3FNUZ: return f(std::integral_constant<int64_t, FP8_E4M3FNUZ>{});
    case INT8: return f(std::integral_constant<int64_t, INT8>{});
    case INT4: return f(std::integral_constant<int64_t, INT4>{});
    default: TORCH_CHECK(false, "kv codec: unknown format code ", fmt);
  }
}

void check_shape(const torch::Tensor& values, const torch::Tensor& codes, const torch::Tensor& scales, int64_t fmt,
                 int64_t group, int64_t inner, const char* what) {
  TORCH_CHECK(values.is_contiguous() && codes.is_contiguous() && scales.is_contiguous(),
              what, ": values, codes and scales must be contiguous");
  TORCH_CHECK(values.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), what, ": CPU only");
  TORCH_CHECK(codes.scalar_type() == torch::kByte, what, ": codes must be uint8");
  const int64_t n = values.numel();
  TORCH_CHECK(group > 0 && inner > 0 && n % (group * inner) == 0, what, ": ", n, " values are not [outer, ", group,
              ", ", inner, "]");
  TORCH_CHECK(fmt != INT4 || ((group * inner) % 2 == 0 && (inner == 1 || inner % 2 == 0)),
              what, ": int4 needs an even number of values per unit and per row");
  TORCH_CHECK(codes.numel() == (fmt == INT4 ? n / 2 : n), what, ": codes hold ", codes.numel(), " bytes");
  TORCH_CHECK(scales.nbytes() == static_cast<size_t>(2 * (n / group)), what, ": scales hold ", scales.nbytes(),
              " bytes, need ", 2 * (n / group));
}

}  // namespace

// values [outer, group, inner] (fp32 / fp16 / bf16) -> codes and fp16 scales (uint8 or fp16 tensors of the right
// bytes); returns the CRC32C of the codes' then the scales' bytes, continuing crc_init (0 when crc is false)
int64_t kv_encode(torch::Tensor values, int64_t fmt, int64_t group, int64_t inner, torch::Tensor codes,
                  torch::Tensor scales, bool crc, int64_t crc_init) {
  check_shape(values, codes, scales, fmt, group, inner, "kv_encode");
  const int64_t outer = values.numel() / (group * inner);
  if (outer == 0) return crc ? crc_init : 0;  // nothing to write, nor to checksum
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = static_cast<uint8_t*>(scales.data_ptr());
  uint32_t result = 0;
  dispatch_dtype(values.scalar_type(), "kv_encode", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* xp = static_cast<const scalar_t*>(values.data_ptr());
    dispatch_fmt(fmt, [&](auto f) {
      result = encode_all<scalar_t, decltype(f)::value>(xp, outer, group, inner, cp, sp, crc,
                                                        static_cast<uint32_t>(crc_init));
    });
  });
  return result;
}

// inverse of kv_encode into out (fp32 / fp16 / bf16, [outer, group, inner] contiguous)
void kv_decode(torch::Tensor codes, torch::Tensor scales, int64_t fmt, int64_t group, int64_t inner,
               torch::Tensor out) {
  check_shape(out, codes, scales, fmt, group, inner, "kv_decode");
  const int64_t outer = out.numel() / (group * inner);
  if (outer == 0) return;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = static_cast<const uint8_t*>(scales.data_ptr());
  dispatch_dtype(out.scalar_type(), "kv_decode", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    scalar_t* op = static_cast<scalar_t*>(out.data_ptr());
    dispatch_fmt(fmt, [&](auto f) { decode_all<scalar_t, decltype(f)::value>(cp, sp, outer, group, inner, op); });
  });
}

// kv_decode, and the CRC32C of the codes' then the scales' bytes (what kv_encode returns for them), continuing
// crc_init, taken in the decoding pass: a received payload is read once to check and decode it
int64_t kv_decode_crc(torch::Tensor codes, torch::Tensor scales, int64_t fmt, int64_t group, int64_t inner,
                      torch::Tensor out, int64_t crc_init) {
  check_shape(out, codes, scales, fmt, group, inner, "kv_decode_crc");
  const int64_t outer = out.numel() / (group * inner);
  if (outer == 0) return crc_init;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = static_cast<const uint8_t*>(scales.data_ptr());
  uint32_t result = 0;
  dispatch_dtype(out.scalar_type(), "kv_decode_crc", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    scalar_t* op = static_cast<scalar_t*>(out.data_ptr());
    dispatch_fmt(fmt, [&](auto f) {
      result = decode_all_crc<scalar_t, decltype(f)::value>(cp, sp, outer, group, inner, op,
                                                            static_cast<uint32_t>(crc_init));
    });
  });
  return result;
}

// CRC32C of a contiguous CPU tensor's bytes, continuing `value` (the crc32c package's crc32c(data, value))
int64_t crc32c_of(torch::Tensor data, int64_t value) {
  TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "crc32c: a contiguous CPU tensor");
  return crc_update(static_cast<uint32_t>(value), static_cast<const uint8_t*>(data.data_ptr()), data.nbytes());
}

// a copy whose bytes total at least this streams its stores (`stream` < 0): it skips reading the destination in
// first. bench/copy_crc.py on a loaded 2-vCPU VM: faster from 1 MiB into destinations not in cache (a tier's slots,
// a transport ring), slower at 256 KiB; into one buffer rewritten in cache, faster in one run, slower in another
constexpr int64_t STREAM_MIN_BYTES = 1 << 20;

bool streams(int64_t stream, int64_t bytes) { return stream < 0 ? bytes >= STREAM_MIN_BYTES : stream > 0; }

// d = s (len bytes) and the CRC32C of them continuing `crc` (a finished CRC), in one pass; a streamed copy is
// fenced by the caller
uint32_t copy_update(uint32_t crc, uint8_t* d, const uint8_t* s, size_t len, bool stream) {
  return ~(stream ? crc_pass<Store::STREAM>(~crc, s, len, d) : crc_pass<Store::PLAIN>(~crc, s, len, d));
}

void fence(bool stream) {
#if defined(__SSE4_2__)
  if (stream) _mm_sfence();  // the streamed stores are visible before the copy returns
#endif
}

// dst = src (contiguous CPU tensors of equal bytes), and the CRC32C of the bytes copied, continuing `value`, in one
// pass: each 8 bytes loaded once, stored and fed to the crc32 instruction. `stream`: 1 streaming stores, 0 plain,
// < 0 streaming from STREAM_MIN_BYTES. Runs without the GIL.
int64_t copy_crc32c(torch::Tensor dst, torch::Tensor src, int64_t value, int64_t stream) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.device().is_cpu() && src.device().is_cpu() &&
                  dst.nbytes() == src.nbytes(), "copy_crc32c: contiguous CPU tensors of equal bytes");
  const bool st = streams(stream, static_cast<int64_t>(src.nbytes()));
  const uint32_t c = copy_update(static_cast<uint32_t>(value), static_cast<uint8_t*>(dst.data_ptr()),
                                 static_cast<const uint8_t*>(src.data_ptr()), src.nbytes(), st);
  fence(st);
  return c;
}

// a row copy splits over `threads` only where each thread gets at least this much
constexpr int64_t THREAD_MIN_BYTES = 1 << 20;

// dst[d + i] = src[s + i] for each run (d, s, n) of `runs` ([k, 3] int64) and i < n, over the rows of two 2-D
// uint8 tensors of equal row bytes (each row contiguous); returns the CRC32C of every copied row, in run order
// (int64 [rows]), each taken in the same pass as its copy. Runs without the GIL. `threads` > 1 splits the rows
// into that many consecutive ranges (fewer when the move is small, at most torch's threads), one per thread of
// the caller's OpenMP team (the engine thread's own, idle while it waits): one core's loads and stores do not
// saturate a server's memory. On a 2-vCPU Xeon VM, 16 MiB of 64 KiB rows: one thread 1.19 ms, two 0.63 (a 2 MiB
// move 109 -> 45 us; starting a std::thread per range instead cost 60-70 us a move). `spawn`: threads started for
// this call instead, for a caller that is not the engine's thread: its own OpenMP team's threads spin on after the
// region, on the cores the engine's team needs next (a 4K-token load read over two threads of the loader's team:
// the load's TTFT 22 -> 31 ms on that VM).
torch::Tensor copy_rows_crc32c(torch::Tensor dst, torch::Tensor src, torch::Tensor runs, int64_t stream,
                               int64_t threads, bool spawn) {
  TORCH_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.scalar_type() == torch::kByte &&
                  src.scalar_type() == torch::kByte && dst.device().is_cpu() && src.device().is_cpu() &&
                  dst.size(1) == src.size(1) && (dst.size(1) <= 1 || (dst.stride(1) == 1 && src.stride(1) == 1)),
              "copy_rows_crc32c: 2-D uint8 CPU tensors with rows of equal bytes, each row contiguous");
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3 && runs.scalar_type() == torch::kLong && runs.is_contiguous(),
              "copy_rows_crc32c: runs must be a contiguous [k, 3] int64 tensor of (dst row, src row, rows)");
  TORCH_CHECK(threads >= 1, "copy_rows_crc32c: threads must be >= 1, got ", threads);
  const int64_t* r = runs.data_ptr<int64_t>();
  const int64_t k = runs.size(0), row = dst.size(1);
  std::vector<int64_t> start(k + 1, 0);  // start[i]: the first row of run i in the output's order
  for (int64_t i = 0; i < k; ++i) {
    const int64_t d = r[3 * i], s = r[3 * i + 1], n = r[3 * i + 2];
    TORCH_CHECK(n >= 0 && d >= 0 && s >= 0 && d + n <= dst.size(0) && s + n <= src.size(0),
                "copy_rows_crc32c: run (", d, ", ", s, ", ", n, ") outside ", dst.size(0), " / ", src.size(0), " rows");
    start[i + 1] = start[i] + n;
  }
  const int64_t rows = start[k];
  torch::Tensor out = torch::empty({rows}, torch::kLong);
  int64_t* crcs = out.data_ptr<int64_t>();
  const bool st = streams(stream, rows * row);
  uint8_t* dp = dst.data_ptr<uint8_t>();
  const uint8_t* sp = src.data_ptr<uint8_t>();
  const int64_t ds = dst.stride(0), ss = src.stride(0);
  auto copy = [&](int64_t first, int64_t last) {  // the output's rows [first, last)
    int64_t i = std::upper_bound(start.begin(), start.end(), first) - start.begin() - 1;
    for (int64_t j = first; j < last; ++j) {
      while (j >= start[i + 1]) ++i;  // (past empty runs too)
      const int64_t t = j - start[i];
      crcs[j] = copy_update(0, dp + (r[3 * i] + t) * ds, sp + (r[3 * i + 1] + t) * ss, static_cast<size_t>(row), st);
    }
    fence(st);  // (each thread fences its own streamed stores; the join orders them for the caller)
  };
  const int64_t parts = std::max<int64_t>(1, std::min({threads, rows, rows * row / THREAD_MIN_BYTES}));
  if (parts == 1) {
    copy(0, rows);
  } else if (spawn) {
    std::vector<std::thread> helpers;
    helpers.reserve(parts - 1);
    for (int64_t p = 1; p < parts; ++p) helpers.emplace_back(copy, rows * p / parts, rows * (p + 1) / parts);
    copy(0, rows / parts);
    for (auto& h : helpers) h.join();
  } else {
    at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p) copy(rows * p / parts, rows * (p + 1) / parts);
    });
  }
  return out;
}

void bind_kv_codec(pybind11::module& m) {
  m.def("kv_encode", &kv_encode, "KV codec encode of [outer, group, inner] values, with the CRC32C of its bytes");
  m.def("kv_decode", &kv_decode, "KV codec decode into [outer, group, inner] values");
  m.def("kv_decode_crc", &kv_decode_crc,
        "KV codec decode into [outer, group, inner] values, with the CRC32C of the codes and scales read");
  m.def("kv_lanes", [] { return W16 ? W16 : W; }, "values per vector in the KV codec's loops (1: scalar)");
  m.def("crc32c", &crc32c_of, "CRC32C of a tensor's bytes, continuing a CRC");
  namespace py = pybind11;
  m.def("copy_crc32c", &copy_crc32c, "copy, and the CRC32C of the bytes copied, in one pass", py::arg("dst"),
        py::arg("src"), py::arg("value") = 0, py::arg("stream") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("copy_rows_crc32c", &copy_rows_crc32c, "copy runs of rows, and the CRC32C of each row, in one pass",
        py::arg("dst"), py::arg("src"), py::arg("runs"), py::arg("stream") = -1, py::arg("threads") = 1,
        py::arg("spawn") = false, py::call_guard<py::gil_scoped_release>());
  m.def("copy_stream_min_bytes", [] { return STREAM_MIN_BYTES; }, "copies this large stream their stores");
  m.def("crc32c_native", [] { return NATIVE_CRC; }, "whether the CRC32C runs on the CPU's crc32 instruction");
  m.def("crc32c_method", [] { return std::string(METHOD_NAMES[crc_method().load()]); },
        "how the CRC32C of long inputs is computed: crc32, pclmulqdq, vpclmulqdq-256, vpclmulqdq-512 (or bitwise)");
  m.def("crc32c_methods", [] {
    std::vector<std::string> out;
    for (int m = 0; m < static_cast<int>(std::size(METHOD_NAMES)); ++m)
      if (cpu_runs(m)) out.emplace_back(METHOD_NAMES[m]);
    return out;
  }, "the CRC32C methods this build runs on this CPU, narrowest first");
  m.def("crc32c_set_method", [](const std::string& name) {
    for (int m = 0; m < static_cast<int>(std::size(METHOD_NAMES)); ++m)
      if (name == METHOD_NAMES[m]) {
        TORCH_CHECK(cpu_runs(m), "crc32c_set_method: ", name, " does not run in this build on this CPU");
        crc_method().store(m);
        return;
      }
    TORCH_CHECK(false, "crc32c_set_method: unknown method ", name);
  }, "choose the CRC32C method (benchmarks and tests)");
}
