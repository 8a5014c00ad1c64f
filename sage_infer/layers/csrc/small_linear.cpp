// y = x @ W.T + b for the few rows of a decode step (bf16), reading the weights oneDNN packed for
// `PackedLinear` in place: no second copy of any weight.
//
// On a CPU with AVX512-BF16, oneDNN packs a bf16 [N, K] weight as [ceil(N/64)][ceil(K/32)*16][64][2]:
// blocks of 64 output rows, and within a block each pair of input columns holds the 64 rows' two
// values side by side, zero padded; where it packs for AMX tiles, the same with blocks of 32 rows (kernel.h).
// `layout_matches` checks which layout holds against the weight itself (sage_infer/layers/linear.py calls it once
// per layer, and uses this kernel only where one does). A block is one contiguous stretch of memory, so a row walks
// the weights in order: per column pair, one broadcast of x's two values and four `vdpbf16ps` over 64 rows (one
// 256-byte line, or two 128-byte lines of two 32-row blocks). oneDNN's own kernel reads the same bytes at ~70 % of
// the streaming bandwidth for 1-4 rows; this one at ~100 %.
//
// Accumulation is fp32 (vdpbf16ps: products of bf16 values summed in fp32), the bias is added in
// fp32 and the result rounded once to bf16, as oneDNN does; only the summation order differs.
#include "kernel.h"
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "widen.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 64;       // output rows per work item (one block, or two 32-row blocks)
constexpr int64_t kPairStep = 16;   // column pairs are padded to a multiple of 16 (32 columns)
constexpr int kGroup = 6;           // x rows per pass over a block (24 accumulators + 4 weight lines + x)

inline int64_t padded_pairs(int64_t k) { return (k + 2 * kPairStep - 1) / (2 * kPairStep) * kPairStep; }
inline int64_t num_blocks(int64_t n) { return (n + kRows - 1) / kRows; }

#if defined(__AVX512BF16__)
// rows [0, G) of x (as bf16 pairs, `xs` pairs apart) times one block -> acc, then bias, rounding, store
template <int G>
void block_pass(const uint16_t* w, PackedLines lines, const uint32_t* x, int64_t xs, int64_t pairs, const float* bias,
                int64_t valid, c10::BFloat16* out, int64_t os) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* line = w + p * lines.stride;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line), w1 = (__m512bh)_mm512_loadu_si512(line + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(line + lines.half),
                   w3 = (__m512bh)_mm512_loadu_si512(line + lines.half + 32);
    for (int g = 0; g < G; ++g) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[g * xs + p]));
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], w0, xb);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], w1, xb);
      acc[g][2] = _mm512_dpbf16_ps(acc[g][2], w2, xb);
      acc[g][3] = _mm512_dpbf16_ps(acc[g][3], w3, xb);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[kRows];
    for (int j = 0; j < 4; ++j) _mm512_store_ps(row + 16 * j, acc[g][j]);
    c10::BFloat16* o = out + g * os;
    for (int64_t i = 0; i < valid; ++i) o[i] = narrow<c10::BFloat16>(bias ? row[i] + bias[i] : row[i]);
  }
}
#endif

}  // namespace

bool small_linear_compiled() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// the rows per block (64 or 32) of the layout above in which the packed buffer (address, bytes) holds `weight` [N, K]
// bf16; 0: neither
int64_t layout_matches(int64_t address, int64_t nbytes, torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "layout_matches: weight must be [N, K] bf16");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), pairs = padded_pairs(k);
  const uint16_t* packed = reinterpret_cast<const uint16_t*>(address);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  for (const int64_t rows : {int64_t{64}, int64_t{32}}) {
    if (nbytes != packed_weight_bytes(rows, n, pairs)) continue;
    std::atomic<bool> same{true};
    at::parallel_for(0, (n + rows - 1) / rows, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1 && same.load(std::memory_order_relaxed); ++b)
        for (int64_t p = 0; p < pairs; ++p)
          for (int64_t lane = 0; lane < rows; ++lane)
            for (int64_t half = 0; half < 2; ++half) {
              const int64_t row = b * rows + lane, col = 2 * p + half;
              const uint16_t want = row < n && col < k ? src[row * k + col] : 0;
              if (packed[((b * pairs + p) * rows + lane) * 2 + half] != want) same = false;
            }
    });
    if (same.load()) return rows;
  }
  return 0;
}

// x: [M, K] bf16 (contiguous rows); the packed weight of `layout_matches` at (address, bytes), in blocks of
// `block_rows` rows (its answer); bias: [N] float or none -> [M, N] bf16
torch::Tensor small_linear(torch::Tensor x, int64_t address, int64_t nbytes, int64_t n,
                           c10::optional<torch::Tensor> bias, int64_t block_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "small_linear: x must be [M, K] bf16 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), pairs = padded_pairs(k), blocks = num_blocks(n);
  TORCH_CHECK((block_rows == 64 || block_rows == 32) && nbytes == packed_weight_bytes(block_rows, n, pairs),
              "small_linear: the packed weight has ", nbytes, " bytes, not the [", (n + block_rows - 1) / block_rows,
              "][", pairs, "][", block_rows, "][2] bf16 of a [", n, ", ", k, "] weight");
  const float* b = nullptr;
  torch::Tensor bias32;
  if (bias.has_value()) {
    bias32 = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias32.numel() == n, "small_linear: bias must have ", n, " values");
    b = bias32.data_ptr<float>();
  }
  auto out = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  // x as column pairs, zero padded like the weight
  std::vector<uint32_t> xp(static_cast<size_t>(m * pairs), 0u);
  const int64_t xstride = x.stride(0);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r) std::memcpy(xp.data() + r * pairs, xs + r * xstride, k * sizeof(uint16_t));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(address);
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const uint16_t* wb = w + blk * pairs * kRows * 2;  // the same offset in either layout: two 32-row blocks
      const int64_t valid = std::min(kRows, n - blk * kRows);
      const PackedLines lines = packed_lines(block_rows, pairs, valid);
      const float* bb = b ? b + blk * kRows : nullptr;
      for (int64_t r = 0; r < m; r += kGroup) {  // after the first group the block is in cache
        const uint32_t* xr = xp.data() + r * pairs;
        c10::BFloat16* orow = o + r * n + blk * kRows;
        switch (std::min<int64_t>(kGroup, m - r)) {
          case 6: block_pass<6>(wb, lines, xr, pairs, pairs, bb, valid, orow, n); break;
          case 5: block_pass<5>(wb, lines, xr, pairs, pairs, bb, valid, orow, n); break;
          case 4: block_pass<4>(wb, lines, xr, pairs, pairs, bb, valid, orow, n); break;
          case 3: block_pass<3>(wb, lines, xr, pairs, pairs, bb, valid, orow, n); break;
          case 2: block_pass<2>(wb, lines, xr, pairs, pairs, bb, valid, orow, n); break;
          default: block_pass<1>(wb, lines, xr, pairs, pairs, bb, valid, orow, n);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "small_linear: built without AVX512-BF16 (this CPU or compiler lacks it)");
#endif
  return out;
}
