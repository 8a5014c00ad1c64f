// The experts of a mixture-of-experts layer for a step's rows, all active experts at once: every gate/up
// product of the step in one parallel region, the activation, then every down product in one more region
// (sage_infer/layers/moe.py, `FusedExperts`; gpt-oss's `ClampedSwigluExperts`). Per-expert products (two kernel
// calls each, a parallel region each) open ~34 regions per token in a Qwen3-30B-A3B layer pair; on a shared machine
// each region waits for its slowest thread. Here the work items are (expert, block of 64 output rows), handed out
// to the threads one at a time, so a descheduled thread holds up one item, not a fixed share of the step. An
// expert with many rows (a prefill chunk) multiplies them as a small GEMM: each row group of a block reuses the
// block from the cache, so its weights are read from memory once per step.
//
// The weights are read where they are, through one address per expert (the caller keeps them alive):
// - packed: bf16 in oneDNN's blocked layout that `small_linear` reads ([ceil(N/R)][ceil(K/32)*16][R][2], zero
//   padded, R = 64 or, where oneDNN packs for AMX tiles, 32; kernel.h, csrc/small_linear.cpp), on AVX512-BF16
//   with `vdpbf16ps` exactly as small_linear sums, at AVX-512 and AVX2 each bf16 pair widened to two fp32 (a shift
//   and a mask) and summed with FMA (AVX2: 4 rows of 16 columns at a time where an expert has more than 16 rows,
//   the same sums as one row at a time);
// - plain: [N, K] row-major bf16 or fp32 (transformers' stacked experts, or the bf16 weight a `PackedLinear`
//   keeps where oneDNN cannot pack bf16), with FMA (AVX-512: 16 lanes, 8 rows a pass; AVX2: 8 lanes, 4 rows),
//   bf16 widened as it is read.
// Sums are fp32; each product is rounded once to the rows' dtype (with a bias: rounded, the bias added, rounded
// again, as `x @ w + b` computes it); SiLU(gate) * up is computed as csrc/fused_ops.cpp's silu_mul computes it,
// gpt-oss's clamped SwiGLU (gate and up interleaved) as PyTorch's ops round it step by step, so only the fp32
// summation order can differ from the per-expert path. The routing weights and the sum of a token's K outputs
// stay with the caller (`run_grouped`), or are done here too (`moe_experts_routed`, `moe_block`); in
// `moe_experts_linears` the experts with more pairs than the kernel should take run on their own oneDNN weights
// (packed bf16, where oneDNN's AMX products beat the kernel) from the same call.
#include "kernel.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "widen.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 64;      // output rows per block (and per work item)
constexpr int64_t kPairStep = 16;  // packed layout: column pairs padded to a multiple of 16 (32 columns)
constexpr int64_t kSerialSilu = 1 << 16;  // SiLU * up of fewer elements than this runs on the calling thread

inline int64_t padded_pairs(int64_t k) { return (k + 2 * kPairStep - 1) / (2 * kPairStep) * kPairStep; }
inline int64_t num_blocks(int64_t n) { return (n + kRows - 1) / kRows; }

template <typename T>
inline float round_to(float f) { return widen(narrow<T>(f)); }
template <>
inline float round_to<float>(float f) { return f; }

// f(i) for i in [0, items) over the thread pool, each thread taking the next free item
template <typename F>
void run_items(int64_t items, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < items; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  });
}

// ---- packed bf16 layout: acc[g][lane] = x row g (bf16 pairs, `xs` pairs apart) . row `lane` of one block
#if defined(__AVX2__) && defined(__FMA__)
// the weights' lines this many column pairs ahead are prefetched (2 KiB a stream): without it the grouped layers of
// Qwen3-30B-A3B read their experts at 0.76x the rate (64-row steps) and 0.88x (batch 1) on the 2-vCPU Xeon with
// AMX at AVX512-BF16, 0.90-0.93x at the AVX-512 and AVX2 levels forced there: its cores keep too few misses in
// flight for the hardware prefetchers alone (docs/models.md; the many-row AVX2 strips do not prefetch)
constexpr int64_t kPrefetchPairs = 16;
// a 64-row item's four 64-byte pieces of the column pair `kPrefetchPairs` after `line` (in the 32-row layout an
// item of up to 32 rows has half 0: two pieces, each asked for twice)
inline void prefetch_ahead(const uint16_t* line, PackedLines lines) {
  const uint16_t* ahead = line + kPrefetchPairs * lines.stride;
  for (const uint16_t* piece : {ahead, ahead + 32, ahead + lines.half, ahead + lines.half + 32})
    _mm_prefetch(reinterpret_cast<const char*>(piece), _MM_HINT_T0);
}
#endif

#if defined(__AVX512BF16__)
constexpr int kPackedGroup = 6;
template <int G>
void packed_block(const uint16_t* w, PackedLines lines, const uint32_t* x, int64_t xs, int64_t pairs,
                  float (*acc)[kRows]) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* line = w + p * lines.stride;
    prefetch_ahead(line, lines);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line), w1 = (__m512bh)_mm512_loadu_si512(line + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(line + lines.half),
                   w3 = (__m512bh)_mm512_loadu_si512(line + lines.half + 32);
    for (int g = 0; g < G; ++g) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[g * xs + p]));
      a[g][0] = _mm512_dpbf16_ps(a[g][0], w0, xb);
      a[g][1] = _mm512_dpbf16_ps(a[g][1], w1, xb);
      a[g][2] = _mm512_dpbf16_ps(a[g][2], w2, xb);
      a[g][3] = _mm512_dpbf16_ps(a[g][3], w3, xb);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc[g] + 16 * j, a[g][j]);
}
#elif defined(__AVX512F__)
constexpr int kPackedGroup = 4;
template <int G>
void packed_block(const uint16_t* w, PackedLines lines, const uint32_t* x, int64_t xs, int64_t pairs,
                  float (*acc)[kRows]) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* line = w + p * lines.stride;
    prefetch_ahead(line, lines);
    __m512 even[4], odd[4];  // a pair's first column (low half of each 32-bit word) and its second
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(line + (j < 2 ? 32 * j : lines.half + 32 * (j - 2)));
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int g = 0; g < G; ++g) {
      const uint32_t xp = x[g * xs + p];
      const __m512 x0 = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp << 16)));
      const __m512 x1 = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp & 0xFFFF0000u)));
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(odd[j], x1, _mm512_fmadd_ps(even[j], x0, a[g][j]));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc[g] + 16 * j, a[g][j]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kPackedGroup = 1;  // 8 accumulators a row: one row per pass (the block is in cache after the first)
template <int G>
void packed_block(const uint16_t* w, PackedLines lines, const uint32_t* x, int64_t xs, int64_t pairs,
                  float (*acc)[kRows]) {
  static_assert(G == 1, "AVX2: one row per pass");
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* line = w + p * lines.stride;
    prefetch_ahead(line, lines);
    const uint32_t xp = x[p];
    const __m256 x0 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(xp << 16)));
    const __m256 x1 = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(xp & 0xFFFF0000u)));
    for (int j = 0; j < 8; ++j) {
      const __m256i raw =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + (j < 4 ? 16 * j : lines.half + 16 * (j - 4))));
      a[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), x0, a[j]);
      a[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(raw, high)), x1, a[j]);
    }
  }
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc[0] + 8 * j, a[j]);
  (void)xs;
}
#else
constexpr int kPackedGroup = 1;
template <int G>
void packed_block(const uint16_t* w, PackedLines lines, const uint32_t* x, int64_t xs, int64_t pairs,
                  float (*acc)[kRows]) {
  for (int g = 0; g < G; ++g)
    for (int64_t lane = 0; lane < kRows; ++lane) acc[g][lane] = 0.f;
  for (int64_t p = 0; p < pairs; ++p)
    for (int g = 0; g < G; ++g) {
      const uint32_t xp = x[g * xs + p];
      uint32_t b0 = xp << 16, b1 = xp & 0xFFFF0000u;
      float x0, x1;
      std::memcpy(&x0, &b0, 4);
      std::memcpy(&x1, &b1, 4);
      for (int64_t lane = 0; lane < kRows; ++lane) {
        uint32_t word;
        std::memcpy(&word, w + p * lines.stride + (lane < 32 ? lane * 2 : lines.half + (lane - 32) * 2), 4);
        uint32_t e = word << 16, o = word & 0xFFFF0000u;
        float we, wo;
        std::memcpy(&we, &e, 4);
        std::memcpy(&wo, &o, 4);
        acc[g][lane] += we * x0 + wo * x1;
      }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// up to kRowPassRows rows a block goes one row at a time through packed_block<1>, the block re-read from cache
// for each row: faster than the strips below at 1-64 rows on a 2-vCPU Zen 5 (a decode step of 64 tokens over
// Qwen3-30B-A3B's experts, about 4 rows each: 47 against 82 ms a layer); the engine hands this level at most
// `GROUPED_KERNEL_ROWS` (16) rows an expert, so the strips only run for more, on CPUs whose L2 may not hold a block
constexpr int64_t kRowPassRows = 16;
constexpr int64_t kStripRows = 4;  // rows per pass of the many-row kernel: 8 accumulators, 4 weights, 2 x
// acc[g][lane] = x row g (fp32, `xs` apart, the columns' pairs as two floats) . row `lane` of one block, 16
// lanes at a time: the same FMAs in the same order as packed_block<1> (the same bits whatever the rows)
template <int G>
void packed_strips(const uint16_t* w, PackedLines lines, const float* x, int64_t xs, int64_t pairs,
                   float (*acc)[kRows]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int s = 0; s < 4; ++s) {
    __m256 a[G][2];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
    const uint16_t* line = w + (s < 2 ? 32 * s : lines.half + 32 * (s - 2));
    for (int64_t p = 0; p < pairs; ++p, line += lines.stride) {
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(r0, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(r0, high));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(r1, high));
      for (int g = 0; g < G; ++g) {
        const __m256 x0 = _mm256_broadcast_ss(x + g * xs + 2 * p), x1 = _mm256_broadcast_ss(x + g * xs + 2 * p + 1);
        a[g][0] = _mm256_fmadd_ps(o0, x1, _mm256_fmadd_ps(e0, x0, a[g][0]));
        a[g][1] = _mm256_fmadd_ps(o1, x1, _mm256_fmadd_ps(e1, x0, a[g][1]));
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(acc[g] + 16 * s, a[g][0]);
      _mm256_storeu_ps(acc[g] + 16 * s + 8, a[g][1]);
    }
  }
}

// rows [0, m) of x (bf16 pairs, `pairs` apart) widened to fp32, kStripRows at a time, times one block; the last
// m % kStripRows rows one at a time through packed_block<1> (its 8 accumulators hide the FMA latency that a strip
// of fewer rows waits on; the same sums in the same order, so the same bits)
template <typename Store>
void packed_strip_rows(const uint16_t* wb, PackedLines lines, int64_t pairs, const uint32_t* x, int64_t m,
                       const Store& store) {
  std::vector<float> xf(static_cast<size_t>(kStripRows * 2 * pairs));
  alignas(64) float acc[kStripRows][kRows];
  for (int64_t r = 0; r < m; r += kStripRows) {
    const int64_t g = std::min<int64_t>(kStripRows, m - r);
    if (g < kStripRows) {
      for (int64_t j = r; j < m; ++j) {
        packed_block<1>(wb, lines, x + j * pairs, pairs, pairs, acc);
        store(j, acc[0]);
      }
      return;
    }
    for (int64_t j = 0; j < g; ++j)
      for (int64_t p = 0; p < pairs; ++p) {
        const uint32_t xp = x[(r + j) * pairs + p], lo = xp << 16, hi = xp & 0xFFFF0000u;
        std::memcpy(&xf[j * 2 * pairs + 2 * p], &lo, 4);
        std::memcpy(&xf[j * 2 * pairs + 2 * p + 1], &hi, 4);
      }
    packed_strips<kStripRows>(wb, lines, xf.data(), 2 * pairs, pairs, acc);
    for (int64_t j = 0; j < g; ++j) store(r + j, acc[j]);
  }
}
#endif

// each product rounded to T, with a bias (nullptr: none) rounded, the bias added, rounded again (x @ w + b)
template <typename T>
inline T finish(float sum, const T* bias, int64_t i) {
  return bias ? narrow<T>(round_to<T>(sum) + widen(bias[i])) : narrow<T>(sum);
}

// item `blk` (64 rows) of a packed [n, k] weight in blocks of `block_rows` rows times rows [0, m) of x (bf16 pairs,
// `pairs` apart) -> out[r * os + i], plus bias[i] where there is one
void packed_product(const uint16_t* weight, int64_t block_rows, int64_t blk, int64_t n, int64_t pairs,
                    const uint32_t* x, int64_t m, c10::BFloat16* out, int64_t os, const c10::BFloat16* bias) {
  const uint16_t* wb = weight + blk * pairs * kRows * 2;  // the same offset in either layout: two 32-row blocks
  const int64_t valid = std::min(kRows, n - blk * kRows), base = blk * kRows;
  const PackedLines lines = packed_lines(block_rows, pairs, valid);
  const c10::BFloat16* b = bias ? bias + base : nullptr;
  auto store = [&](int64_t r, const float* sums) {
    c10::BFloat16* o = out + r * os + base;
    for (int64_t i = 0; i < valid; ++i) o[i] = finish(sums[i], b, i);
  };
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (m > kRowPassRows) return packed_strip_rows(wb, lines, pairs, x, m, store);
#endif
  alignas(64) float acc[kPackedGroup][kRows];
  for (int64_t r = 0; r < m; r += kPackedGroup) {
    const int64_t g = std::min<int64_t>(kPackedGroup, m - r);
    const uint32_t* xr = x + r * pairs;
    switch (g) {
#if defined(__AVX512BF16__)
      case 6: packed_block<6>(wb, lines, xr, pairs, pairs, acc); break;
      case 5: packed_block<5>(wb, lines, xr, pairs, pairs, acc); break;
#endif
#if defined(__AVX512F__)
      case 4: packed_block<4>(wb, lines, xr, pairs, pairs, acc); break;
      case 3: packed_block<3>(wb, lines, xr, pairs, pairs, acc); break;
      case 2: packed_block<2>(wb, lines, xr, pairs, pairs, acc); break;
#endif
      default: packed_block<1>(wb, lines, xr, pairs, pairs, acc);
    }
    for (int64_t j = 0; j < g; ++j) store(r + j, acc[j]);
  }
}

// ---- MXFP4 rows (gpt-oss's checkpoints): each 32 values of a row one E8M0 exponent byte and 16 bytes of FP4 E2M1
// codes, the low nibble first. A value is FP4_VALUES[code] * 2^(exponent - 127), exact in fp32, so a row's sums
// take the same FMAs in the same order as plain_dots over the same row dequantized to bf16 or fp32 (the same bits):
// plain_dots reads either through the loaders below
struct Mxfp4Row {
  const uint8_t* codes;   // k / 2 bytes
  const uint8_t* scales;  // k / 32 exponents
};

// 2^(e - 127) for each exponent byte, as torch.ldexp gives it in fp32: the exponent field itself (e = 0: the
// denormal 2^-127; e = 255: infinity). Filled at load with memcpy, not std::bit_cast: torch before 2.12 builds
// extensions as C++17
const std::array<float, 256> kE8m0 = [] {
  std::array<float, 256> t{};
  for (uint32_t e = 0; e < 256; ++e) {
    const uint32_t bits = e == 0 ? 0x00400000u : e << 23;
    std::memcpy(&t[e], &bits, sizeof bits);
  }
  return t;
}();

constexpr float kFp4Values[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

#if defined(__AVX512F__)
// the 16 values of 8 code bytes, times scale
inline __m512 fp4x16(const uint8_t* c, __m512 scale) {
  const __m128i dup = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)),
                                       _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
  const __m512i codes = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup),  // the index is a lane's low 4 bits
                                          _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
  return _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_loadu_ps(kFp4Values)), scale);
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
// the 8 values of 4 code bytes, times scale
inline __m256 fp4x8(const uint8_t* c, __m256 scale) {
  int32_t word;
  std::memcpy(&word, c, sizeof word);
  const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(word),
                                       _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i codes = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kFp4Values), codes);  // the low 3 bits
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_mul_ps(_mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign)), scale);
}
#endif

// ---- plain layout: out[g] = x row g (fp32, `k` apart) . weight row w ([k] bf16 or fp32, or an MXFP4 row)
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const Mxfp4Row& w, int64_t k) {  // k a multiple of 8
  return fp4x8(w.codes + k / 2, _mm256_set1_ps(kE8m0[w.scales[k / 32]]));
}
template <typename T>
inline __m256 load8(const T* w, int64_t k) { return load8(w + k); }
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

#if defined(__AVX512F__)
constexpr int kPlainGroup = 8;  // rows per pass: 2 accumulators each, with the weight's 2: 18 of 32 zmm
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16_masked(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(__mmask16 m, const c10::BFloat16* p) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const Mxfp4Row& w, int64_t k) {  // k a multiple of 16
  return fp4x16(w.codes + k / 2, _mm512_set1_ps(kE8m0[w.scales[k / 32]]));
}
inline __m512 load16_masked(__mmask16 m, const Mxfp4Row& w, int64_t k) { return _mm512_maskz_mov_ps(m, load16(w, k)); }
template <typename T>
inline __m512 load16(const T* w, int64_t k) { return load16(w + k); }
template <typename T>
inline __m512 load16_masked(__mmask16 m, const T* w, int64_t k) { return load16_masked(m, w + k); }
#else
constexpr int kPlainGroup = 4;  // rows per pass: 2 accumulators each, with the weight's 2: 10 of 16 ymm
#endif

template <typename T>
inline float weight_at(const T* w, int64_t k) { return widen(w[k]); }
inline float weight_at(const Mxfp4Row& w, int64_t k) {
  const uint8_t byte = w.codes[k / 2];
  return kFp4Values[k % 2 ? byte >> 4 : byte & 15] * kE8m0[w.scales[k / 32]];
}

// each row's sums in one order whatever G (the same bits whatever the step's other rows): AVX-512 32 columns a
// step in two accumulators, then 16, then one at a time; AVX2 16 a step, then one at a time
template <int G, typename W>
inline void plain_dots(const float* x, const W& w, int64_t k_len, float* out) {
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 acc0[G], acc1[G];
  for (int g = 0; g < G; ++g) acc0[g] = acc1[g] = _mm512_setzero_ps();
  for (; k + 32 <= k_len; k += 32) {
    const __m512 w0 = load16(w, k), w1 = load16(w, k + 16);
    for (int g = 0; g < G; ++g) {
      acc0[g] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + g * k_len + k), acc0[g]);
      acc1[g] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + g * k_len + k + 16), acc1[g]);
    }
  }
  if (k + 16 <= k_len) {
    const __m512 w0 = load16(w, k);
    for (int g = 0; g < G; ++g) acc0[g] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + g * k_len + k), acc0[g]);
    k += 16;
  }
  if (k < k_len) {  // the last columns as one more step, masked (a scalar tail would vectorize differently per G)
    const __mmask16 m = static_cast<__mmask16>((1u << (k_len - k)) - 1u);
    const __m512 w0 = load16_masked(m, w, k);
    for (int g = 0; g < G; ++g) acc0[g] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, x + g * k_len + k), acc0[g]);
    k = k_len;
  }
  for (int g = 0; g < G; ++g) out[g] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[g], acc1[g]));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc0[G], acc1[G];
  for (int g = 0; g < G; ++g) acc0[g] = acc1[g] = _mm256_setzero_ps();
  for (; k + 16 <= k_len; k += 16) {
    const __m256 w0 = load8(w, k), w1 = load8(w, k + 8);
    for (int g = 0; g < G; ++g) {
      acc0[g] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + g * k_len + k), acc0[g]);
      acc1[g] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + g * k_len + k + 8), acc1[g]);
    }
  }
  if (k < k_len) {  // the last columns as one more step, zero padded (a scalar tail would vectorize differently per G)
    alignas(32) float wt[16] = {}, xt[16] = {};
    const int64_t n = k_len - k;
    for (int64_t i = 0; i < n; ++i) wt[i] = weight_at(w, k + i);
    const __m256 w0 = _mm256_load_ps(wt), w1 = _mm256_load_ps(wt + 8);
    for (int g = 0; g < G; ++g) {
      std::memcpy(xt, x + g * k_len + k, n * sizeof(float));
      acc0[g] = _mm256_fmadd_ps(w0, _mm256_load_ps(xt), acc0[g]);
      acc1[g] = _mm256_fmadd_ps(w1, _mm256_load_ps(xt + 8), acc1[g]);
    }
    k = k_len;
  }
  for (int g = 0; g < G; ++g) out[g] = hsum(_mm256_add_ps(acc0[g], acc1[g]));
#else
  for (int g = 0; g < G; ++g) out[g] = 0.f;
#endif
  for (; k < k_len; ++k) {
    const float wk = weight_at(w, k);
    for (int g = 0; g < G; ++g) out[g] += wk * x[g * k_len + k];
  }
}

// an expert's weight rows: plain [n, k] T, or MXFP4 codes [n, k / 2] and exponents [n, k / 32]
template <typename T>
struct PlainRows {
  const T* weight;
  const T* row(int64_t i, int64_t k) const { return weight + i * k; }
};
struct Mxfp4Rows {
  const uint8_t* codes;
  const uint8_t* scales;
  Mxfp4Row row(int64_t i, int64_t k) const { return {codes + i * k / 2, scales + i * k / 32}; }
};

// plain_dots of g (1..kPlainGroup) rows
template <typename W>
inline void plain_dots_of(int64_t g, const float* x, const W& w, int64_t k, float* sums) {
  switch (g) {
#if defined(__AVX512F__)
    case 8: plain_dots<8>(x, w, k, sums); break;
    case 7: plain_dots<7>(x, w, k, sums); break;
    case 6: plain_dots<6>(x, w, k, sums); break;
    case 5: plain_dots<5>(x, w, k, sums); break;
#endif
    case 4: plain_dots<4>(x, w, k, sums); break;
    case 3: plain_dots<3>(x, w, k, sums); break;
    case 2: plain_dots<2>(x, w, k, sums); break;
    default: plain_dots<1>(x, w, k, sums);
  }
}

// rows [r0, r1) of a plain [n, k] weight times rows [0, m) of x (fp32 [m, k]) -> out[r * os + i], rounded to T
// (plus bias[i] where there is one); each weight row is read once, x once per weight row
template <typename T, typename Rows>
void plain_product(const Rows& weight, int64_t r0, int64_t r1, int64_t k, const float* x, int64_t m, T* out,
                   int64_t os, const T* bias) {
  float sums[kPlainGroup];
  for (int64_t i = r0; i < r1; ++i) {
    const auto w = weight.row(i, k);
    for (int64_t r = 0; r < m; r += kPlainGroup) {
      const int64_t g = std::min<int64_t>(kPlainGroup, m - r);
      plain_dots_of(g, x + r * k, w, k, sums);
      for (int64_t j = 0; j < g; ++j) out[(r + j) * os + i] = finish(sums[j], bias, i);
    }
  }
}

struct Span {
  int64_t expert, start, end;
};

// what runs between the products: SiLU(gate) * up (gate the first I columns, up the last I), or gpt-oss's clamped
// SwiGLU (gate and up interleaved: gate the even columns); biases [E, 2I] and [E, H] (nullptr: none)
struct Experts {
  const int64_t* gate_up;
  const int64_t* down;
  int64_t inter;
  const void* gate_up_bias;
  const void* down_bias;
  bool clamped;
  float alpha, limit;
  const int64_t* gate_up_scales;  // MXFP4 experts: each expert's exponents (gate_up / down then its codes); else null
  const int64_t* down_scales;
  int64_t packed_rows;  // packed weights: their rows per block (64, 32); 0: plain
};

// exp(-x) overflows below x = -88.72, where PyTorch's 1 / (1 + inf) is 0 (and x / inf is -0); these builds assume
// finite math (-ffast-math), so those values are taken before any infinity is made
constexpr float kExpOverflow = -88.72f;

template <typename T>
inline float silu_mul(float g, float u) {
  return (g < kExpOverflow ? -0.f : round_to<T>(g / (1.f + std::exp(-g)))) * u;
}

// (up + 1) * (gate * sigmoid(gate * alpha)), gate <= limit, |up| <= limit, each step rounded to T as PyTorch's
// ops on T tensors round it
template <typename T>
inline float clamped_swiglu(float g, float u, float alpha, float limit) {
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  const float z = round_to<T>(g * alpha);
  const float s = z < kExpOverflow ? 0.f : round_to<T>(1.f / (1.f + std::exp(-z)));
  return round_to<T>(u + 1.f) * round_to<T>(g * s);
}

// the activation of [m, 2I] rows -> act [m, lda]
template <typename T>
void activation_rows(const T* gate_up, int64_t m, const Experts& ex, T* act, int64_t lda) {
  const int64_t inter = ex.inter;
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      T* o = act + r * lda;
      if (ex.clamped) {
        for (int64_t i = 0; i < inter; ++i)
          o[i] = narrow<T>(clamped_swiglu<T>(widen(g[2 * i]), widen(g[2 * i + 1]), ex.alpha, ex.limit));
      } else {
        const T* u = g + inter;
        _Pragma("omp simd")
        for (int64_t i = 0; i < inter; ++i) o[i] = narrow<T>(silu_mul<T>(widen(g[i]), widen(u[i])));
      }
    }
  };
  if (m * inter < kSerialSilu) rows(0, m);
  else at::parallel_for(0, m, std::max<int64_t>(1, kSerialSilu / inter), rows);
}

template <typename T>
inline const T* bias_of(const void* bias, int64_t expert, int64_t n) {
  return bias ? static_cast<const T*>(bias) + expert * n : nullptr;
}

// the packed layout: gate_up, down: bf16 [P, H] rows, sorted by expert
torch::Tensor experts_packed(const torch::Tensor& rows, const std::vector<Span>& spans, const Experts& ex) {
  using B = c10::BFloat16;
  const int64_t m = rows.size(0), h = rows.size(1), inter = ex.inter, n1 = 2 * inter;
  const int64_t pairs_h = padded_pairs(h), pairs_i = padded_pairs(inter);
  const int64_t blocks1 = num_blocks(n1), blocks2 = num_blocks(h), active = static_cast<int64_t>(spans.size());
  // the rows as column pairs, zero padded like the weights
  std::vector<uint32_t> xp(static_cast<size_t>(m * pairs_h), 0u);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r) std::memcpy(xp.data() + r * pairs_h, src + r * h, h * sizeof(uint16_t));
  auto gu = torch::empty({m, n1}, rows.options());
  B* gup = gu.data_ptr<B>();
  run_items(active * blocks1, [&](int64_t item) {
    const Span& s = spans[item / blocks1];
    packed_product(reinterpret_cast<const uint16_t*>(ex.gate_up[s.expert]), ex.packed_rows, item % blocks1, n1, pairs_h,
                   xp.data() + s.start * pairs_h, s.end - s.start, gup + s.start * n1, n1,
                   bias_of<B>(ex.gate_up_bias, s.expert, n1));
  });
  std::vector<uint32_t> act(static_cast<size_t>(m * pairs_i), 0u);  // bf16 pairs, zero padded
  activation_rows(gup, m, ex, reinterpret_cast<B*>(act.data()), 2 * pairs_i);
  auto out = torch::empty({m, h}, rows.options());
  B* op = out.data_ptr<B>();
  run_items(active * blocks2, [&](int64_t item) {
    const Span& s = spans[item / blocks2];
    packed_product(reinterpret_cast<const uint16_t*>(ex.down[s.expert]), ex.packed_rows, item % blocks2, h, pairs_i,
                   act.data() + s.start * pairs_i, s.end - s.start, op + s.start * h, h,
                   bias_of<B>(ex.down_bias, s.expert, h));
  });
  return out;
}

// the plain layout: gate_up [2I, H] and down [H, I] row-major T per expert, or MXFP4 rows; rows T [P, H]
template <typename T>
torch::Tensor experts_plain(const torch::Tensor& rows, const std::vector<Span>& spans, const Experts& ex) {
  const int64_t m = rows.size(0), h = rows.size(1), inter = ex.inter, n1 = 2 * inter;
  const int64_t blocks1 = num_blocks(n1), blocks2 = num_blocks(h), active = static_cast<int64_t>(spans.size());
  const auto xf = rows.to(at::kFloat).contiguous();
  const float* x = xf.data_ptr<float>();
  auto gu = torch::empty({m, n1}, rows.options());
  T* gup = gu.data_ptr<T>();
  // expert e's rows [r0, r1) of weight `w` (gate_up or down, with its exponents if MXFP4) times k-wide rows
  auto product = [&](const int64_t* w, const int64_t* scales, const Span& s, int64_t r0, int64_t r1, int64_t k,
                     const float* in, T* o, int64_t os, const void* bias, int64_t n) {
    const T* b = bias_of<T>(bias, s.expert, n);
    if (scales) {
      const Mxfp4Rows rows_of{reinterpret_cast<const uint8_t*>(w[s.expert]),
                              reinterpret_cast<const uint8_t*>(scales[s.expert])};
      plain_product(rows_of, r0, r1, k, in + s.start * k, s.end - s.start, o + s.start * os, os, b);
    } else {
      plain_product(PlainRows<T>{reinterpret_cast<const T*>(w[s.expert])}, r0, r1, k, in + s.start * k,
                    s.end - s.start, o + s.start * os, os, b);
    }
  };
  run_items(active * blocks1, [&](int64_t item) {
    const int64_t r0 = item % blocks1 * kRows;
    product(ex.gate_up, ex.gate_up_scales, spans[item / blocks1], r0, std::min(n1, r0 + kRows), h, x, gup, n1,
            ex.gate_up_bias, n1);
  });
  auto act = torch::empty({m, inter}, rows.options());
  activation_rows(gup, m, ex, act.data_ptr<T>(), inter);
  const auto actf = act.to(at::kFloat).contiguous();
  const float* a = actf.data_ptr<float>();
  auto out = torch::empty({m, h}, rows.options());
  T* op = out.data_ptr<T>();
  run_items(active * blocks2, [&](int64_t item) {
    const int64_t r0 = item % blocks2 * kRows;
    product(ex.down, ex.down_scales, spans[item / blocks2], r0, std::min(h, r0 + kRows), inter, a, op, h,
            ex.down_bias, h);
  });
  return out;
}

std::vector<Span> checked_spans(const torch::Tensor& spans, int64_t experts, int64_t m) {
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == at::kLong && spans.is_contiguous(),
              "moe_experts: spans must be contiguous [A, 3] int64");
  const int64_t* sp = spans.data_ptr<int64_t>();
  std::vector<Span> list;
  for (int64_t a = 0; a < spans.size(0); ++a) {
    const Span s{sp[3 * a], sp[3 * a + 1], sp[3 * a + 2]};
    TORCH_CHECK(s.expert >= 0 && s.expert < experts && 0 <= s.start && s.start < s.end && s.end <= m,
                "moe_experts: span ", a, " (", s.expert, ", ", s.start, ", ", s.end, ") is outside the ", experts,
                " experts or the ", m, " rows");
    list.push_back(s);
  }
  return list;
}

// a bias: empty (none) or contiguous [E, n] in the rows' dtype -> its address or nullptr
const void* checked_bias(const torch::Tensor& bias, const torch::Tensor& rows, int64_t experts, int64_t n,
                         const char* name) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.dim() == 2 && bias.size(0) == experts && bias.size(1) == n && bias.is_contiguous() &&
                  bias.scalar_type() == rows.scalar_type() && bias.device().is_cpu(),
              "moe_experts: ", name, " must be empty or contiguous [", experts, ", ", n, "] in the rows' dtype");
  return bias.data_ptr();
}

// a step's (token, slot) pairs sorted by expert, stable (as argsort of the flattened ids is): sorted row i is pair
// order[i], pair p sits at sorted row position[p]; spans as `moe_experts` takes them; counts[e] (where given) grows
// by each expert's pairs
struct Routing {
  std::vector<int64_t> order, position;
  std::vector<Span> spans;
};

Routing sort_by_expert(const int64_t* ids, int64_t pairs, int64_t experts, int64_t* counts) {
  std::vector<int64_t> next(static_cast<size_t>(experts), 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "moe_experts_routed: expert id ", ids[p], " is outside the ",
                experts, " experts");
    ++next[ids[p]];
  }
  Routing r{std::vector<int64_t>(static_cast<size_t>(pairs)), std::vector<int64_t>(static_cast<size_t>(pairs)), {}};
  int64_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = next[e];
    if (counts) counts[e] += n;
    if (n) r.spans.push_back({e, at, at + n});
    next[e] = at;
    at += n;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = next[ids[p]]++;
    r.order[row] = p;
    r.position[p] = row;
  }
  return r;
}

// each token's K expert outputs (out: [P, H] sorted by expert) times their weights (w: [T, K], fp32 or the rows'
// dtype), each product rounded to T, then added one by one in expert order, each sum rounded to T: the bits of
// `run_grouped`'s ``(out * w).to(T)`` and ``total += per_token[:, k]`` (products and sums in separate passes, so
// no multiply-add fuses them)
template <typename T, typename W>
void combine(const T* out, const W* w, const int64_t* ids, const std::vector<int64_t>& position, int64_t tokens,
             int64_t k, int64_t h, T* total) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 14) / (k * h)), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> slots(static_cast<size_t>(k));
    std::vector<float> scaled(static_cast<size_t>(h));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* tid = ids + t * k;
      for (int64_t j = 0; j < k; ++j) slots[j] = j;
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return tid[a] < tid[b]; });
      T* dst = total + t * h;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pair = t * k + slots[j];
        const float wf = widen(w[pair]);
        const T* src = out + position[pair] * h;
        for (int64_t c = 0; c < h; ++c) scaled[c] = round_to<T>(widen(src[c]) * wf);
        if (j == 0) {
          for (int64_t c = 0; c < h; ++c) dst[c] = narrow<T>(scaled[c]);
        } else {
          for (int64_t c = 0; c < h; ++c) dst[c] = narrow<T>(widen(dst[c]) + scaled[c]);
        }
      }
    }
  });
}

template <typename T>
torch::Tensor gather_rows(const torch::Tensor& x, const std::vector<int64_t>& order, int64_t k) {
  const int64_t pairs = static_cast<int64_t>(order.size()), h = x.size(1);
  auto rows = torch::empty({pairs, h}, x.options());
  const T* src = x.data_ptr<T>();
  T* dst = rows.data_ptr<T>();
  at::parallel_for(0, pairs, std::max<int64_t>(1, (1 << 15) / h), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::memcpy(dst + p * h, src + order[p] / k * h, h * sizeof(T));
  });
  return rows;
}

template <typename T>
torch::Tensor combine_for(const torch::Tensor& out, const torch::Tensor& weights, const torch::Tensor& ids,
                          const Routing& r) {
  const int64_t tokens = ids.size(0), k = ids.size(1), h = out.size(1);
  auto total = torch::empty({tokens, h}, out.options());
  if (weights.scalar_type() == at::kFloat) {
    combine<T, float>(out.data_ptr<T>(), weights.data_ptr<float>(), ids.data_ptr<int64_t>(), r.position, tokens,
                      k, h, total.data_ptr<T>());
  } else {
    combine<T, T>(out.data_ptr<T>(), weights.data_ptr<T>(), ids.data_ptr<int64_t>(), r.position, tokens, k, h,
                  total.data_ptr<T>());
  }
  return total;
}

// the experts' arguments checked against the rows [P, H] -> what the passes read
Experts checked_experts(const torch::Tensor& rows, const torch::Tensor& gate_up, const torch::Tensor& down,
                        int64_t inter, int64_t packed, const torch::Tensor& gate_up_bias,
                        const torch::Tensor& down_bias,
                        bool clamped, double alpha, double limit, const torch::Tensor& gate_up_scales,
                        const torch::Tensor& down_scales) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.device().is_cpu(),
              "moe_experts: rows must be contiguous [P, H] on the CPU");
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 || (!packed && rows.scalar_type() == at::kFloat),
              "moe_experts: rows must be bf16 (or fp32 with plain weights)");
  TORCH_CHECK(gate_up.dim() == 1 && gate_up.scalar_type() == at::kLong && gate_up.is_contiguous() &&
                  down.sizes() == gate_up.sizes() && down.scalar_type() == at::kLong && down.is_contiguous(),
              "moe_experts: gate_up and down must be [E] int64 addresses");
  TORCH_CHECK(inter > 0, "moe_experts: inter must be positive");
  TORCH_CHECK(packed == 0 || packed == 64 || packed == 32, "moe_experts: packed is 0 (plain weights) or the packed "
              "layout's rows per block (64, 32)");
  const int64_t experts = gate_up.size(0);
  const bool mxfp4 = gate_up_scales.numel() > 0;
  TORCH_CHECK(!mxfp4 || (!packed && gate_up_scales.sizes() == gate_up.sizes() && down_scales.sizes() == gate_up.sizes() &&
                         gate_up_scales.scalar_type() == at::kLong && down_scales.scalar_type() == at::kLong &&
                         gate_up_scales.is_contiguous() && down_scales.is_contiguous()),
              "moe_experts: gate_up_scales and down_scales must be empty or [E] int64 addresses (plain weights)");
  TORCH_CHECK(!mxfp4 || (rows.size(1) % 32 == 0 && inter % 32 == 0),
              "moe_experts: MXFP4 experts need the hidden size and the expert width in multiples of 32");
  const Experts ex{gate_up.data_ptr<int64_t>(), down.data_ptr<int64_t>(), inter,
                   checked_bias(gate_up_bias, rows, experts, 2 * inter, "gate_up_bias"),
                   checked_bias(down_bias, rows, experts, rows.size(1), "down_bias"), clamped,
                   static_cast<float>(alpha), static_cast<float>(limit),
                   mxfp4 ? gate_up_scales.data_ptr<int64_t>() : nullptr,
                   mxfp4 ? down_scales.data_ptr<int64_t>() : nullptr, packed};
  return ex;
}

// the experts over rows sorted by expert, each active expert's rows a span
torch::Tensor run_experts(const torch::Tensor& rows, const std::vector<Span>& list, const Experts& ex) {
  if (rows.size(0) == 0 || list.empty()) return torch::zeros_like(rows);
  if (ex.packed_rows) return experts_packed(rows, list, ex);
  if (rows.scalar_type() == at::kFloat) return experts_plain<float>(rows, list, ex);
  return experts_plain<c10::BFloat16>(rows, list, ex);
}

}  // namespace

// rows: [P, H] bf16 or fp32, contiguous, a step's (token, expert) rows sorted by expert; spans: [A, 3] int64
// (expert, start, end) of each active expert's rows; gate_up, down: [E] int64, each expert's weight address
// ([2I, H] and [H, I], packed in blocks of `packed` rows (64, 32) or plain (0)); inter: I; gate_up_bias, down_bias:
// empty or [E, 2I] and [E, H] in the rows' dtype; clamped: gpt-oss's clamped SwiGLU with gate/up interleaved (alpha,
// limit) in place of SiLU(gate) * up; gate_up_scales, down_scales: empty, or for MXFP4 experts [E] int64, each expert's
// exponent bytes ([2I, H / 32] and [H, I / 32]; gate_up and down then address its codes, [2I, H / 2] and [H, I / 2]
// bytes)
// -> [P, H], each row's expert output down(act(gate_up)) in the rows' dtype
torch::Tensor moe_experts(torch::Tensor rows, torch::Tensor spans, torch::Tensor gate_up, torch::Tensor down,
                          int64_t inter, int64_t packed, torch::Tensor gate_up_bias, torch::Tensor down_bias,
                          bool clamped, double alpha, double limit, torch::Tensor gate_up_scales,
                          torch::Tensor down_scales) {
  const Experts ex = checked_experts(rows, gate_up, down, inter, packed, gate_up_bias, down_bias, clamped, alpha,
                                     limit, gate_up_scales, down_scales);
  return run_experts(rows, checked_spans(spans, gate_up.size(0), rows.size(0)), ex);
}

namespace {

// ---- routing: the router's logits, each token's top k and their weights
enum RouteMode : int64_t {
  kSoftmaxTopK = 0,  // softmax over all experts in fp32, its top k (Qwen-MoE, OLMoE, Mixtral)
  kTopKSoftmax = 1,  // the top k logits, softmaxed among themselves in the logits' dtype (gpt-oss)
};
constexpr int64_t kRouteTokens = 32, kRouteExperts = 16;  // a work item: this many tokens by this many experts

// the k largest of v[0, n), largest first; of equal values the lower index first (NaNs never taken)
inline void top_k(const float* v, int64_t n, int64_t k, float* top, int64_t* ids) {
  int64_t have = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (!(v[j] == v[j])) continue;
    if (have == k && !(v[j] > top[k - 1])) continue;
    int64_t at = have < k ? have++ : k - 1;
    for (; at > 0 && v[j] > top[at - 1]; --at) {
      top[at] = top[at - 1];
      ids[at] = ids[at - 1];
    }
    top[at] = v[j];
    ids[at] = j;
  }
  for (; have < k; ++have) top[have] = 0.f, ids[have] = 0;  // only where every logit was NaN
}

// logits [T, E] (the product plus the bias in fp32, rounded once to T as the router's linear rounds it), then each
// token's routing
template <typename T, typename W>
void route_tokens(const torch::Tensor& x, const T* router, const T* bias, int64_t experts, int64_t k, int64_t mode,
                  bool renormalize, W* weights, int64_t* ids) {
  const int64_t tokens = x.size(0), h = x.size(1);
  const auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<float> logits(static_cast<size_t>(tokens * experts));
  const int64_t token_blocks = (tokens + kRouteTokens - 1) / kRouteTokens;
  const int64_t expert_blocks = (experts + kRouteExperts - 1) / kRouteExperts;
  run_items(token_blocks * expert_blocks, [&](int64_t item) {  // each logit summed in one order whatever the step
    const int64_t t0 = item / expert_blocks * kRouteTokens, e0 = item % expert_blocks * kRouteExperts;
    const int64_t t1 = std::min(tokens, t0 + kRouteTokens), e1 = std::min(experts, e0 + kRouteExperts);
    float* l = logits.data() + t0 * experts;
    float sums[kPlainGroup];
    for (int64_t r = 0; r < t1 - t0; r += kPlainGroup) {  // each pass of x rows against every router row of the item
      const int64_t g = std::min<int64_t>(kPlainGroup, t1 - t0 - r);
      for (int64_t e = e0; e < e1; ++e) {
        plain_dots_of(g, xp + (t0 + r) * h, router + e * h, h, sums);
        for (int64_t j = 0; j < g; ++j)  // the bias added to the fp32 sum, then rounded once (F.linear's addmm)
          l[(r + j) * experts + e] = round_to<T>(bias ? sums[j] + widen(bias[e]) : sums[j]);
      }
    }
  });
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / experts), [&](int64_t begin, int64_t end) {
    std::vector<float> v(static_cast<size_t>(experts)), top(static_cast<size_t>(k));
    for (int64_t t = begin; t < end; ++t) {
      const float* l = logits.data() + t * experts;
      float* w = top.data();
      if (mode == kSoftmaxTopK) {
        float m = l[0], sum = 0.f;
        for (int64_t e = 1; e < experts; ++e) m = std::max(m, l[e]);
        for (int64_t e = 0; e < experts; ++e) sum += v[e] = std::exp(l[e] - m);
        for (int64_t e = 0; e < experts; ++e) v[e] /= sum;
        top_k(v.data(), experts, k, w, ids + t * k);
        if (renormalize) {
          float s = 0.f;
          for (int64_t j = 0; j < k; ++j) s += w[j];
          for (int64_t j = 0; j < k; ++j) w[j] /= s;
        }
      } else {
        top_k(l, experts, k, w, ids + t * k);
        float sum = 0.f;
        const float m = w[0];
        for (int64_t j = 0; j < k; ++j) sum += w[j] = std::exp(w[j] - m);
        for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      }
      for (int64_t j = 0; j < k; ++j) weights[t * k + j] = narrow<W>(w[j]);
    }
  });
}

}  // namespace

namespace {

// a routed step's arguments checked (`op` names the caller): x [T, H] contiguous on the CPU, ids [T, K] int64,
// weights [T, K] in fp32 or x's dtype, counts empty or [E] int64
void check_routing(const char* op, const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& ids,
                   const torch::Tensor& counts, int64_t experts) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be contiguous [T, H] on the CPU");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(), op,
              ": ids must be contiguous [T, K] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous() &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == x.scalar_type()),
              op, ": weights must be contiguous [T, K] in fp32 or x's dtype");
  TORCH_CHECK(counts.numel() == 0 || (counts.dim() == 1 && counts.size(0) == experts &&
                                      counts.scalar_type() == at::kLong && counts.is_contiguous()),
              op, ": counts must be empty or contiguous [E] int64");
}

// a checked routed step: the pairs sorted by expert (counts grown), x's rows gathered in that order,
// `run(rows, spans)` for each row's expert output, then each token's outputs weighted and added (`combine`)
template <typename Run>
torch::Tensor routed_rows(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& ids,
                          const torch::Tensor& counts, int64_t experts, const Run& run) {
  const int64_t k = ids.size(1);
  const Routing r = sort_by_expert(ids.data_ptr<int64_t>(), ids.numel(), experts,
                                   counts.numel() ? counts.data_ptr<int64_t>() : nullptr);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto rows = bf16 ? gather_rows<c10::BFloat16>(x, r.order, k) : gather_rows<float>(x, r.order, k);
  const auto out = run(rows, r.spans);
  return bf16 ? combine_for<c10::BFloat16>(out, weights, ids, r) : combine_for<float>(out, weights, ids, r);
}

}  // namespace

// A step from its routing, grouped here: x [T, H] (bf16 or fp32), the routing weights [T, K] (fp32 or x's dtype) and
// expert ids [T, K] int64; counts: empty or [E] int64, grown in place by each expert's pairs; the weights as
// `moe_experts` takes them -> [T, H], each token's expert outputs times their weights, added in expert order: the
// bits `sage_infer.layers.moe.run_grouped` gives for the same experts, without its Python grouping
torch::Tensor moe_experts_routed(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor counts,
                                 torch::Tensor gate_up, torch::Tensor down, int64_t inter, int64_t packed,
                                 torch::Tensor gate_up_bias, torch::Tensor down_bias, bool clamped, double alpha,
                                 double limit, torch::Tensor gate_up_scales, torch::Tensor down_scales) {
  check_routing("moe_experts_routed", x, weights, ids, counts, gate_up.size(0));
  const Experts ex = checked_experts(x, gate_up, down, inter, packed, gate_up_bias, down_bias, clamped, alpha, limit,
                                     gate_up_scales, down_scales);
  return routed_rows(x, weights, ids, counts, gate_up.size(0),
                     [&](const torch::Tensor& rows, const std::vector<Span>& spans) {
                       return run_experts(rows, spans, ex);
                     });
}

// oneDNN's product of rows by a weight it packed (`PackedLinear.packed`), as `PackedLinear.forward` calls it
// (decode_step.cpp)
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias);

namespace {

// oneDNN's products of an expert's rows run on a multiple of this many rows: oneDNN makes (JIT-compiles) and caches a
// kernel for each row count it meets, and experts' row counts vary from step to step; a row count met for the first
// time cost 2-4x the product itself (Qwen3-30B-A3B's gate_up, 96-166 rows, 2-vCPU Xeon with AMX), a multiple of
// 32 is met again within a few steps. oneDNN's bits for a row depend on the row count of the product (its blocking),
// not on the other rows' values
constexpr int64_t kLinearRows = 32;

// `run_experts` where the experts with more than `limit` pairs run alone, each a pair of oneDNN products on its own
// packed linears (gate_up, the activation, down; in passes of `pass_rows` rows, as `FusedOps.gated_mlp` runs an
// `ExpertMLP`, each pass's rows rounded up to `kLinearRows`), and the others in one `run_experts` call over their
// rows gathered (spans renumbered)
torch::Tensor experts_with_linears(const torch::Tensor& rows, const std::vector<Span>& spans, const Experts& ex,
                                   const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
                                   int64_t limit, int64_t pass_rows) {
  using B = c10::BFloat16;
  std::vector<Span> fewer, alone;
  for (const Span& s : spans) (s.end - s.start <= limit ? fewer : alone).push_back(s);
  if (alone.empty()) return run_experts(rows, spans, ex);
  const int64_t h = rows.size(1), bytes = h * static_cast<int64_t>(sizeof(B));
  auto out = torch::empty_like(rows);
  if (!fewer.empty()) {
    std::vector<Span> renumbered;
    int64_t n = 0;
    for (const Span& s : fewer) renumbered.push_back({s.expert, n, n + s.end - s.start}), n += s.end - s.start;
    auto sub = torch::empty({n, h}, rows.options());
    auto copy_spans = [&](const char* from, char* to, bool gather) {
      for (size_t i = 0; i < fewer.size(); ++i) {
        const int64_t at = fewer[i].start * bytes, here = renumbered[i].start * bytes;
        const int64_t len = (fewer[i].end - fewer[i].start) * bytes;
        std::memcpy(to + (gather ? here : at), from + (gather ? at : here), len);
      }
    };
    copy_spans(static_cast<const char*>(rows.data_ptr()), static_cast<char*>(sub.data_ptr()), true);
    const auto got = run_experts(sub, renumbered, ex);
    copy_spans(static_cast<const char*>(got.data_ptr()), static_cast<char*>(out.data_ptr()), false);
  }
  const int64_t m = rows.size(0);
  for (const Span& s : alone) {
    for (int64_t start = s.start; start < s.end; start += pass_rows) {
      const int64_t n = std::min(pass_rows, s.end - start), padded = (n + kLinearRows - 1) / kLinearRows * kLinearRows;
      // the product of `padded` rows: the rows after the pass's (the next experts', or zeros past the last row) are
      // multiplied too and dropped
      torch::Tensor in;
      if (start + padded <= m) {
        in = rows.narrow(0, start, padded);
      } else {
        in = torch::zeros({padded, h}, rows.options());
        in.narrow(0, 0, m - start).copy_(rows.narrow(0, start, m - start));
      }
      const auto gu = onednn_linear(in, gate_up[s.expert], c10::nullopt).contiguous();
      auto act = torch::empty({padded, ex.inter}, rows.options());
      activation_rows(gu.data_ptr<B>(), n, ex, act.data_ptr<B>(), ex.inter);
      act.narrow(0, n, padded - n).zero_();
      out.narrow(0, start, n).copy_(onednn_linear(act, down[s.expert], c10::nullopt).narrow(0, 0, n));
    }
  }
  return out;
}

}  // namespace

// `moe_experts_routed` of packed bf16 experts without biases (the arguments as it takes them) whose own oneDNN
// products win past `limit` pairs an expert: gate_up_linears, down_linears [E], each expert's packed weights
// (`PackedLinear.packed`); an expert of more than `limit` pairs runs on those (in passes of `pass_rows` rows), the
// others on the kernel in one call -> [T, H], the bits of `run_grouped` with each expert's `ExpertMLP` past the
// limit run on its rows padded to a multiple of `kLinearRows`, without its Python grouping
torch::Tensor moe_experts_linears(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor counts,
                                  std::vector<at::Tensor> gate_up_linears, std::vector<at::Tensor> down_linears,
                                  int64_t limit, int64_t pass_rows, torch::Tensor gate_up, torch::Tensor down,
                                  int64_t inter, int64_t packed, torch::Tensor gate_up_bias, torch::Tensor down_bias,
                                  bool clamped, double alpha, double limit_swiglu, torch::Tensor gate_up_scales,
                                  torch::Tensor down_scales) {
  const int64_t experts = gate_up.size(0);
  check_routing("moe_experts_linears", x, weights, ids, counts, experts);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed != 0 && gate_up_bias.numel() == 0 &&
                  down_bias.numel() == 0 && gate_up_scales.numel() == 0,
              "moe_experts_linears: bf16 x and packed experts without biases");
  TORCH_CHECK(static_cast<int64_t>(gate_up_linears.size()) == experts &&
                  static_cast<int64_t>(down_linears.size()) == experts,
              "moe_experts_linears: one gate_up and one down packed weight per expert");
  TORCH_CHECK(limit >= 0 && pass_rows > 0, "moe_experts_linears: limit >= 0, pass_rows > 0");
  const Experts ex = checked_experts(x, gate_up, down, inter, packed, gate_up_bias, down_bias, clamped, alpha,
                                     limit_swiglu, gate_up_scales, down_scales);
  return routed_rows(x, weights, ids, counts, experts, [&](const torch::Tensor& rows, const std::vector<Span>& spans) {
    return experts_with_linears(rows, spans, ex, gate_up_linears, down_linears, limit, pass_rows);
  });
}

// A step's routing: x [T, H] (bf16 or fp32), the router's weight [E, H] and bias (empty or [E]) in x's dtype ->
// (weights [T, K] in fp32, or x's dtype where `weights_in_dtype`; expert ids [T, K] int64). The logits are the
// router's product plus its bias in fp32, rounded once to x's dtype (as F.linear rounds them), each summed in one
// order whatever the step's other rows; mode 0: softmax over every expert in fp32, its top k, divided by their sum
// where `renormalize`; mode 1: the top k logits softmaxed among themselves. Of equal values the lower expert id ranks
// first. The exponentials are not PyTorch's, so weights can differ from its softmax in the last bits.
std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor x, torch::Tensor router, torch::Tensor bias,
                                                   int64_t top_k, int64_t mode, bool renormalize,
                                                   bool weights_in_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_route: x must be contiguous [T, H] bf16 or fp32 on the CPU");
  TORCH_CHECK(router.dim() == 2 && router.size(1) == x.size(1) && router.is_contiguous() &&
                  router.scalar_type() == x.scalar_type() && router.device().is_cpu(),
              "moe_route: router must be contiguous [E, H] in x's dtype");
  const int64_t experts = router.size(0);
  TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == experts && bias.is_contiguous() &&
                                    bias.scalar_type() == x.scalar_type()),
              "moe_route: bias must be empty or contiguous [E] in x's dtype");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k must be in [1, ", experts, "]");
  TORCH_CHECK(mode == kSoftmaxTopK || mode == kTopKSoftmax, "moe_route: mode must be 0 or 1");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto ids = torch::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  auto weights = torch::empty({x.size(0), top_k}, x.options().dtype(weights_in_dtype ? x.scalar_type() : at::kFloat));
  if (x.size(0) == 0) return {weights, ids};
  int64_t* id = ids.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* b = bias.numel() ? bias.data_ptr<T>() : nullptr;
    if (weights_in_dtype)
      route_tokens<T, T>(x, router.data_ptr<T>(), b, experts, top_k, mode, renormalize, weights.data_ptr<T>(), id);
    else
      route_tokens<T, float>(x, router.data_ptr<T>(), b, experts, top_k, mode, renormalize, weights.data_ptr<float>(),
                             id);
  };
  if (bf16) run(c10::BFloat16{});
  else run(float{});
  return {weights, ids};
}

// A mixture-of-experts layer's step in one call: `moe_route`'s routing, then `moe_experts_routed` (the arguments as
// those take them) -> [T, H]
torch::Tensor moe_block(torch::Tensor x, torch::Tensor router, torch::Tensor router_bias, int64_t top_k,
                        int64_t mode, bool renormalize, bool weights_in_dtype, torch::Tensor counts,
                        torch::Tensor gate_up, torch::Tensor down, int64_t inter, int64_t packed,
                        torch::Tensor gate_up_bias, torch::Tensor down_bias, bool clamped, double alpha, double limit,
                        torch::Tensor gate_up_scales, torch::Tensor down_scales) {
  const auto [weights, ids] = moe_route(x, router, router_bias, top_k, mode, renormalize, weights_in_dtype);
  return moe_experts_routed(x, weights, ids, counts, gate_up, down, inter, packed, gate_up_bias, down_bias, clamped,
                            alpha, limit, gate_up_scales, down_scales);
}

// gpt-oss's clamped SwiGLU of [N, 2I] rows (gate and up interleaved: gate the even columns), bf16 or fp32,
// contiguous -> [N, I], each step rounded to the rows' dtype as PyTorch's ops round it (the kernel's own activation;
// the exponential is not PyTorch's, so a sigmoid can differ in its last bit)
torch::Tensor clamped_swiglu_rows(torch::Tensor gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() && gate_up.device().is_cpu() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "clamped_swiglu: gate_up must be contiguous [N, 2I] bf16 or fp32 on the CPU");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  Experts ex{};
  ex.inter = inter, ex.clamped = true, ex.alpha = static_cast<float>(alpha), ex.limit = static_cast<float>(limit);
  auto out = torch::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    activation_rows(gate_up.data_ptr<float>(), rows, ex, out.data_ptr<float>(), inter);
  else
    activation_rows(gate_up.data_ptr<c10::BFloat16>(), rows, ex, out.data_ptr<c10::BFloat16>(), inter);
  return out;
}

// MXFP4 rows dequantized: codes [N, K / 2] uint8, exponents [N, K / 32] uint8 (contiguous; K a multiple of 32) ->
// out [N, K] bf16 or fp32, each value FP4_VALUES[code] * 2^(exponent - 127) (exact: the bits of
// `sage_infer.quantization.mxfp4.expert_rows`), rows split over the threads
void mxfp4_rows(torch::Tensor codes, torch::Tensor scales, torch::Tensor out) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kByte && codes.is_contiguous() &&
                  scales.is_contiguous() && out.is_contiguous() && codes.dim() == 2 && scales.dim() == 2 &&
                  out.dim() == 2 && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "mxfp4_rows: codes and scales must be contiguous 2-D uint8, out contiguous 2-D fp32 or bf16");
  const int64_t n = out.size(0), k = out.size(1);
  TORCH_CHECK(k % 32 == 0 && codes.size(0) == n && codes.size(1) == k / 2 && scales.size(0) == n &&
                  scales.size(1) == k / 32,
              "mxfp4_rows: codes [N, K / 2] and scales [N, K / 32] for out [N, K], K a multiple of 32");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint8_t* e = scales.data_ptr<uint8_t>();
  const bool fp32 = out.scalar_type() == at::kFloat;
  void* base = out.data_ptr();
  at::parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / k), [&](int64_t r0, int64_t r1) {
    alignas(64) float row[32];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* codes32 = c + r * (k / 2) + b * 16;
        const float s = kE8m0[e[r * (k / 32) + b]];
#if defined(__AVX512F__)
        _mm512_store_ps(row, fp4x16(codes32, _mm512_set1_ps(s)));
        _mm512_store_ps(row + 16, fp4x16(codes32 + 8, _mm512_set1_ps(s)));
#elif defined(__AVX2__) && defined(__FMA__)
        for (int q = 0; q < 4; ++q) _mm256_store_ps(row + 8 * q, fp4x8(codes32 + 4 * q, _mm256_set1_ps(s)));
#else
        for (int i = 0; i < 32; ++i) row[i] = kFp4Values[i % 2 ? codes32[i / 2] >> 4 : codes32[i / 2] & 15] * s;
#endif
        const int64_t at = r * k + b * 32;
        if (fp32) {
          std::memcpy(static_cast<float*>(base) + at, row, sizeof row);
        } else {
          c10::BFloat16* o = static_cast<c10::BFloat16*>(base) + at;
          for (int i = 0; i < 32; ++i) o[i] = narrow<c10::BFloat16>(row[i]);
        }
      }
    }
  });
}

// The op's namespace names the build (level and key): two levels' builds loaded in one process (tests force
// levels) register apart. Python finds it as torch.ops.sage_moe_<isa>_<build key> (sage_infer/layers/cpu_kernels.py).
#ifndef SAGE_BUILD_KEY
#define SAGE_BUILD_KEY unknown
#endif
#ifndef SAGE_ISA_LEVEL
#define SAGE_ISA_LEVEL unknown
#endif
#define SAGE_MOE_CAT_(level, key) sage_moe_##level##_##key
#define SAGE_MOE_CAT(level, key) SAGE_MOE_CAT_(level, key)
#define SAGE_MOE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

SAGE_MOE_LIBRARY(SAGE_MOE_CAT(SAGE_ISA_LEVEL, SAGE_BUILD_KEY), m) {
  m.def("moe_experts", &moe_experts);
  m.def("moe_experts_routed", &moe_experts_routed);
  m.def("moe_experts_linears", &moe_experts_linears);
  m.def("moe_route", &moe_route);
  m.def("moe_block", &moe_block);
  m.def("mxfp4_rows", &mxfp4_rows);
  m.def("clamped_swiglu", &clamped_swiglu_rows);
}
