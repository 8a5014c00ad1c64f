// bf16 products of a few rows on the bf16 weight as it is ([N, K] row-major), for CPUs where oneDNN cannot
// pack bf16 (no AVX512-BW/VL/DQ): `PackedLinear` computes larger products in fp32 copies there, and these
// rows, which are bound by reading the weight, read its bf16 bytes once. Each bf16 is widened to fp32 by a
// 16-bit shift (exact), multiplied and summed in fp32 with FMA, and the sum rounded to bf16 once (to nearest
// even), so results differ from torch's bf16 product only by fp32 summation order.
// Up to 16 rows: each weight row is read from memory once and multiplied with the rows in as few passes of at most
// 6 rows as there can be, of even sizes (a pass of 1 row is bound by its FMAs' latency, nearly as slow as one of 4;
// later passes find the weight row in L1), and every row's sum is computed the same way whatever the row count.
// The weight is prefetched PREFETCH_AHEAD elements ahead of the product (one hint per 64-byte line): the rows of a
// thread's chunk lie one after another, so the hints run on into its next rows. Over weights read from DRAM they
// cut ~10 % of a 1-row product and ~15 % of a 5-row one (bench/packed_linear.py --cold-layers; docs/cpu_isa.md).
// The reference is torch.nn.functional.linear on the same bf16 tensors (tests/test_packed_linear.py).
#include "kernel.h"

#include <cstdint>
#include <cstring>

#include "widen.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_ROWS = 16;
constexpr int64_t PREFETCH_AHEAD = 2048;  // bf16 elements: 4 KiB
constexpr int64_t PASS_ROWS = 6;  // rows per pass over a weight row: 2 accumulators each, with the weight's 2: 14 of 16 ymm

#if defined(__AVX2__) && defined(__FMA__)
// 8 bf16 at p as 8 fp32
inline __m256 widen8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// out[m] = x[m, :] . w_row for the M rows of x (fp32, [M, K]); the weight row is read once for all M
template <int M>
inline void dot_rows(const float* x, const uint16_t* w_row, int64_t k_len, float* out) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
  for (; k + 16 <= k_len; k += 16) {
    if ((k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(w_row + k + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m256 w0 = widen8(w_row + k), w1 = widen8(w_row + k + 8);
    for (int m = 0; m < M; ++m) {
      acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * k_len + k), acc0[m]);
      acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * k_len + k + 8), acc1[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(_mm256_add_ps(acc0[m], acc1[m]));
#else
  for (int m = 0; m < M; ++m) out[m] = 0.f;
#endif
  for (; k < k_len; ++k) {
    uint32_t bits = static_cast<uint32_t>(w_row[k]) << 16;
    float wk;
    std::memcpy(&wk, &bits, sizeof wk);
    for (int m = 0; m < M; ++m) out[m] += wk * x[m * k_len + k];
  }
}

// out[m] for all m_len rows: ceil(m_len / PASS_ROWS) passes whose sizes differ by at most one
inline void dot_all_rows(const float* x, int64_t m_len, const uint16_t* w_row, int64_t k_len, float* out) {
  const int64_t passes = (m_len + PASS_ROWS - 1) / PASS_ROWS, base = m_len / passes, extra = m_len % passes;
  int64_t m = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t rows = base + (p < extra ? 1 : 0);
    const float* xm = x + m * k_len;
    switch (rows) {
      case 1: dot_rows<1>(xm, w_row, k_len, out + m); break;
      case 2: dot_rows<2>(xm, w_row, k_len, out + m); break;
      case 3: dot_rows<3>(xm, w_row, k_len, out + m); break;
      case 4: dot_rows<4>(xm, w_row, k_len, out + m); break;
      case 5: dot_rows<5>(xm, w_row, k_len, out + m); break;
      default: dot_rows<6>(xm, w_row, k_len, out + m); break;
    }
    m += rows;
  }
}

void rows_linear(const float* x, int64_t m_len, const uint16_t* w, const float* bias, c10::BFloat16* y,
                 int64_t n_len, int64_t k_len) {
  at::parallel_for(0, n_len, 16, [&](int64_t begin, int64_t end) {
    float sums[MAX_ROWS];
    for (int64_t n = begin; n < end; ++n) {
      dot_all_rows(x, m_len, w + n * k_len, k_len, sums);
      const float b = bias != nullptr ? bias[n] : 0.f;
      for (int64_t m = 0; m < m_len; ++m) y[m * n_len + n] = narrow<c10::BFloat16>(sums[m] + b);
    }
  });
}

}  // namespace

// x: [M, K] bf16 with M <= 16; weight: [N, K] bf16 contiguous; bias: [N] or none -> [M, N] bf16
torch::Tensor bf16_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x and weight: bf16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.is_contiguous(), "x: [M, K]; weight: contiguous [N, K]");
  const int64_t m_len = x.size(0), k_len = x.size(1), n_len = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_len, "x and weight disagree on K");
  TORCH_CHECK(m_len >= 1 && m_len <= MAX_ROWS, "bf16_rows_linear takes 1 to 16 rows");
  const auto xf = x.to(at::kFloat).contiguous();
  c10::optional<torch::Tensor> bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_len, "bias: [N]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  auto y = torch::empty({m_len, n_len}, x.options());
  const float* xp = xf.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bp = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  rows_linear(xp, m_len, wp, bp, yp, n_len, k_len);
  return y;
}
