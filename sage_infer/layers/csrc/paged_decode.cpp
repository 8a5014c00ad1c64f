// Decode attention straight from the paged KV pool: no gathered copy of the context.
// Built once per ISA level by sage_infer/layers/kernel_build.py (-O3, that level's -m flags,
// -ffast-math: the dot products and exp vectorize only with reassociation allowed).
//
// One query token per sequence. A task is one sequence (or one of its KV heads when the batch is
// too small to keep every thread busy): its query heads score every context token, read once in
// place from its pool block, softmax in fp32, then the same tokens' values are accumulated (read
// once). Measured 5-7x faster than gather + masked SDPA per layer (bench/paged_decode_kernel.py).
// int8 pools (`paged_decode_attention_int8`) are read the same way, codes in place, each token's fp16 scale
// applied to its score and to its probability (`token_scale`).
// A layer's kind (flash.h's `Kind`, through the `_kind` entry points): a sliding window (each row's table walked from
// the block its window starts in, the keys of that block before the window masked), a logit soft-cap (on the
// scaled scores, before the softmax) and attention sinks (one more logit per query head in the softmax's
// denominator; the lse returned counts it). The oracle is sage_infer/layers/attention_kinds.py.
// Tasks run on ATen's thread pool, so
// torch.set_num_threads applies. The pure-PyTorch oracle is
// sage_infer.layers.attention.decode_attention_batched over KVPool.gather_blocks.
#include "kernel.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash.h"
#include "vec_exp.h"
#include "widen.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// s[0, n) = cap * tanh(s / cap), vectorized (vec_exp.h's tanh: accurate, where libm's is a call per lane)
static inline void soft_cap(float* s, int64_t n, float cap) {
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 in16 = _mm512_set1_ps(1.f / cap), out16 = _mm512_set1_ps(cap);
  for (; t + 16 <= n; t += 16)
    _mm512_storeu_ps(s + t, _mm512_mul_ps(out16, tanh16(_mm512_mul_ps(_mm512_loadu_ps(s + t), in16))));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 in8 = _mm256_set1_ps(1.f / cap), out8 = _mm256_set1_ps(cap);
  for (; t + 8 <= n; t += 8)
    _mm256_storeu_ps(s + t, _mm256_mul_ps(out8, tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + t), in8))));
#endif
  for (; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// one row's softmax over its scores s[0, len) in place, the first `skip` outside its window (probability 0);
// `sink`: the head's sink logit when `has_sink` -> the row's lse
static inline float softmax_row(float* s, int64_t skip, int64_t len, float softcap, bool has_sink, float sink) {
  if (softcap > 0.f) soft_cap(s + skip, len - skip, softcap);
  float m = has_sink ? std::max(s[skip], sink) : s[skip];  // (no -inf: -ffast-math assumes finite floats)
  for (int64_t t = skip + 1; t < len; ++t) m = s[t] > m ? s[t] : m;
  for (int64_t t = 0; t < skip; ++t) s[t] = 0.f;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = skip; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  if (has_sink) sum += std::exp(sink - m);
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = skip; t < len; ++t) s[t] *= inv;
  return m + std::log(sum);
}

// D: head_dim as a compile-time constant for the common sizes (full unrolling), 0 for any other
template <int D, typename kv_t>
static inline float dot(const float* q, const kv_t* k, int64_t d) {
  const int64_t n = D > 0 ? D : d;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += q[i] * widen(k[i]);
  return acc;
}

template <int D, typename kv_t>
static inline void axpy(float* out, float a, const kv_t* v, int64_t d) {
  const int64_t n = D > 0 ? D : d;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += a * widen(v[i]);
}

// The scale of one token and head of an int8 pool ([num_blocks, block_size, KvH] fp16 at `scales`, value = code *
// scale): it multiplies that token's score (q . (c s) = s (q . c)) and its probability in P·V, so codes are widened
// in registers and never dequantized into memory. 1 for a float pool, whose `scales` is null and never read.
template <typename kv_t>
static inline float token_scale(const c10::Half* scales, int64_t index) {
  if constexpr (std::is_same_v<kv_t, int8_t>) {
    return static_cast<float>(scales[index]);
  } else {
    return 1.f;
  }
}

// Ask for the next block's rows of this task's heads while the current block is computed: blocks are
// scattered over the pool and each is one 4 KB page or less (bf16, 16 tokens x 2 KV heads x 64), where
// the hardware prefetcher stops, so without this every block starts with a run of cold misses
template <typename kv_t>
static inline void prefetch_block(const kv_t* first, int64_t tokens, int64_t token_stride, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(first);
  const int64_t stride = token_stride * static_cast<int64_t>(sizeof(kv_t));
  for (int64_t t = 0; t < tokens; ++t, p += stride)
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

#if defined(__AVX512F__)
// one token's D values of one head as D/16 vectors of fp32
template <int D>
static inline void widen_row(const float* p, __m512 (&x)[D / 16]) {
  for (int j = 0; j < D / 16; ++j) x[j] = _mm512_loadu_ps(p + 16 * j);
}
template <int D>
static inline void widen_row(const c10::BFloat16* p, __m512 (&x)[D / 16]) {
  for (int j = 0; j < D / 16; ++j)
    x[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * j))), 16));
}
template <int D>
static inline void widen_row(const c10::Half* p, __m512 (&x)[D / 16]) {
  for (int j = 0; j < D / 16; ++j) x[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * j)));
}
template <int D>
static inline void widen_row(const double*, __m512 (&)[D / 16]) {
  TORCH_CHECK(false, "paged_decode_attention: fp64 pools are not supported");
}

// o[g] = sum_t p[g][t] * v[t] for G query heads of one KV head, the G x D accumulators in registers:
// each token's values are widened once for the G heads, and no partial sum goes through memory
template <int D, int G, typename kv_t>
static void values_in_registers(const kv_t* v_cache, const int64_t* table, int64_t len, int64_t block_size,
                                int64_t block_stride, int64_t token_stride, const float* p, float* o) {
  __m512 acc[G][D / 16];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < D / 16; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t blk = 0, t = 0; t < len; ++blk) {
    const kv_t* v = v_cache + table[blk] * block_stride;
    if (t + block_size < len)
      prefetch_block(v_cache + table[blk + 1] * block_stride, block_size, token_stride, D * sizeof(kv_t));
    for (const int64_t end = std::min(len, t + block_size); t < end; ++t, v += token_stride) {
      __m512 x[D / 16];
      widen_row<D>(v, x);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * len + t]);
        for (int j = 0; j < D / 16; ++j) acc[g][j] = _mm512_fmadd_ps(w, x[j], acc[g][j]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(o + g * D + 16 * j, acc[g][j]);
}

// lane i of the result = the sum of v[i]'s 16 lanes: 16 dot products finished at once, 45 shuffles and
// adds for 16 tokens instead of one horizontal sum (a chain of 8 dependent steps) per token
static inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 s[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] at positions 0 and 2, v[2i+1] at 1 and 3
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i .. 4i+3] at positions 0..3
    const __m512d c = _mm512_castps_pd(s[2 * i]), d = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  // then the four 128-bit lanes of each u[i] summed into lane i (0x88: lanes 0, 2 of a, 0, 2 of b; 0xDD: 1, 3)
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// the scores pass of `attend` for D 64 or 128: 16 tokens at a time, each token's key widened once for
// all G query heads of its KV head; per (head, token) D/16 FMAs into one vector of partial sums, and the
// 16 tokens' vectors summed across lanes together (`sum_lanes16`). qs: [rows, D] scaled queries; scores:
// [rows, len]
template <int D, typename kv_t>
static void scores_pass(const float* qs, const kv_t* k_cache, const int64_t* table, int64_t len, int64_t block_size,
                        int64_t block_stride, int64_t token_stride, int64_t heads, int64_t groups, int64_t row_bytes,
                        const kv_t* next_pass, float* scores, std::vector<float>& partial) {
  partial.resize(static_cast<size_t>(groups * 16 * 16));
  __m512* part = reinterpret_cast<__m512*>(partial.data());  // [groups][16] vectors (loadu/storeu below)
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  for (int64_t blk = 0, t = 0; blk < num_blocks; ++blk) {
    const kv_t* kb = k_cache + table[blk] * block_stride;
    const int64_t end = std::min(len, t + block_size);
    if (blk + 1 < num_blocks)
      prefetch_block(k_cache + table[blk + 1] * block_stride, block_size, token_stride, row_bytes);
    else  // the values come next
      prefetch_block(next_pass, block_size, token_stride, row_bytes);
    for (const kv_t* k = kb; t < end; k += 16 * token_stride) {
      const int64_t n = std::min<int64_t>(16, end - t);
      for (int64_t hh = 0; hh < heads; ++hh) {
        const float* qh = qs + hh * groups * D;
        for (int64_t i = 0; i < n; ++i) {
          __m512 x[D / 16];
          widen_row<D>(k + i * token_stride + hh * D, x);
          for (int64_t g = 0; g < groups; ++g) {
            const float* qg = qh + g * D;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), x[0]);
            for (int j = 1; j < D / 16; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), x[j], acc);
            _mm512_storeu_ps(reinterpret_cast<float*>(part + g * 16 + i), acc);
          }
        }
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
        for (int64_t g = 0; g < groups; ++g) {
          __m512 v[16];
          for (int i = 0; i < 16; ++i)
            v[i] = i < n ? _mm512_loadu_ps(reinterpret_cast<const float*>(part + g * 16 + i)) : _mm512_setzero_ps();
          _mm512_mask_storeu_ps(scores + (hh * groups + g) * len + t, valid, sum_lanes16(v));
        }
      }
      t += n;
    }
  }
}

// the values pass of `attend` for D 64 or 128: query heads of each KV head 4 (D 64) or 2 (D 128) at a time
template <int D, typename kv_t>
static void values_pass(const kv_t* v_cache, const int64_t* table, int64_t len, int64_t block_size,
                        int64_t block_stride, int64_t token_stride, int64_t heads, int64_t groups,
                        const float* scores, float* o) {
  constexpr int kMax = 256 / D;  // 16 accumulators
  for (int64_t hh = 0; hh < heads; ++hh)
    for (int64_t g = 0; g < groups; g += kMax) {
      const int64_t r = hh * groups + g;
      const kv_t* v = v_cache + hh * D;
      const float* p = scores + r * len;
      switch (std::min<int64_t>(kMax, groups - g)) {
        case 4: values_in_registers<D, (kMax >= 4 ? 4 : 1), kv_t>(v, table, len, block_size, block_stride, token_stride, p, o + r * D); break;
        case 3: values_in_registers<D, (kMax >= 3 ? 3 : 1), kv_t>(v, table, len, block_size, block_stride, token_stride, p, o + r * D); break;
        case 2: values_in_registers<D, 2, kv_t>(v, table, len, block_size, block_stride, token_stride, p, o + r * D); break;
        default: values_in_registers<D, 1, kv_t>(v, table, len, block_size, block_stride, token_stride, p, o + r * D);
      }
    }
}
#endif

// One task: `heads` consecutive KV heads of one sequence (all of them when the batch keeps every
// thread busy, so each token's [KvH, D] row is read once, contiguously; one per task otherwise).
// Tokens are walked block by block: no division per token. Under a window the walk starts at the block the
// window starts in (`table` and `len` from there), its `skip` keys before the window scored and masked.
template <int D, typename kv_t>
static void attend(const float* q, const kv_t* k_cache, const kv_t* v_cache, const c10::Half* k_scale,
                   const c10::Half* v_scale, const int64_t* table, int64_t len, float* out, float* lse, int64_t h0,
                   int64_t heads, int64_t groups, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, const flash::Kind& kind, std::vector<float>& scores, std::vector<float>& qs,
                   std::vector<float>& partial) {
  int64_t skip = 0;
  if (kind.window > 0 && len > kind.window) {
    const int64_t start = len - kind.window, first_block = start / block_size;
    table += first_block;
    len -= first_block * block_size;
    skip = start - first_block * block_size;
  }
  const int64_t token_stride = num_kv_heads * head_dim;  // one token of one block: [KvH, D]
  const int64_t block_stride = block_size * token_stride;
  const int64_t rows = heads * groups;  // query heads of this task, [rows, D] from q + h0 * groups * D
  const int64_t num_blocks = (len + block_size - 1) / block_size;
  const float* qh = q + h0 * groups * head_dim;
  qs.resize(rows * head_dim);
  for (int64_t i = 0; i < rows * head_dim; ++i) qs[i] = qh[i] * scale;
  scores.resize(rows * len);
  const int64_t row_bytes = heads * head_dim * static_cast<int64_t>(sizeof(kv_t));
  // int8 pools take the loops below at every level (vectorized by the compiler), the 16-lane passes are float's
  constexpr bool vectorised = (D == 64 || D == 128) && !std::is_same_v<kv_t, int8_t>;
#if defined(__AVX512F__)
  if constexpr (vectorised) {
    scores_pass<D, kv_t>(qs.data(), k_cache + h0 * head_dim, table, len, block_size, block_stride, token_stride,
                         heads, groups, row_bytes, v_cache + table[0] * block_stride + h0 * head_dim, scores.data(),
                         partial);
  } else
#endif
  for (int64_t blk = 0, t = 0; blk < num_blocks; ++blk) {
    const kv_t* k = k_cache + table[blk] * block_stride + h0 * head_dim;
    const int64_t end = std::min(len, t + block_size);
    if (blk + 1 < num_blocks)
      prefetch_block(k_cache + table[blk + 1] * block_stride + h0 * head_dim, block_size, token_stride, row_bytes);
    else  // the values come next
      prefetch_block(v_cache + table[0] * block_stride + h0 * head_dim, block_size, token_stride, row_bytes);
    const int64_t scale_base = (table[blk] - blk) * block_size * num_kv_heads + h0;  // + t * KvH + hh
    for (; t < end; ++t, k += token_stride) {
      for (int64_t hh = 0, r = 0; hh < heads; ++hh) {
        const float ks = token_scale<kv_t>(k_scale, scale_base + t * num_kv_heads + hh);
        for (int64_t g = 0; g < groups; ++g, ++r)
          scores[r * len + t] = dot<D>(qs.data() + r * head_dim, k + hh * head_dim, head_dim) * ks;
      }
    }
  }
  float* o = out + h0 * groups * head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = h0 * groups + r;
    lse[head] = softmax_row(scores.data() + r * len, skip, len, kind.softcap, kind.sinks != nullptr,
                            kind.sinks != nullptr ? kind.sinks[head] : 0.f);
    for (int64_t i = 0; i < head_dim; ++i) o[r * head_dim + i] = 0.f;
  }
#if defined(__AVX512F__)
  if constexpr (vectorised) {
    values_pass<D, kv_t>(v_cache + h0 * head_dim, table, len, block_size, block_stride, token_stride, heads, groups,
                         scores.data(), o);
    return;
  }
#endif
  for (int64_t blk = 0, t = 0; blk < num_blocks; ++blk) {
    const kv_t* v = v_cache + table[blk] * block_stride + h0 * head_dim;
    const int64_t end = std::min(len, t + block_size);
    if (blk + 1 < num_blocks)
      prefetch_block(v_cache + table[blk + 1] * block_stride + h0 * head_dim, block_size, token_stride, row_bytes);
    const int64_t scale_base = (table[blk] - blk) * block_size * num_kv_heads + h0;
    for (; t < end; ++t, v += token_stride) {
      for (int64_t hh = 0, r = 0; hh < heads; ++hh) {
        const float vs = token_scale<kv_t>(v_scale, scale_base + t * num_kv_heads + hh);
        for (int64_t g = 0; g < groups; ++g, ++r)
          axpy<D>(o + r * head_dim, scores[r * len + t] * vs, v + hh * head_dim, head_dim);
      }
    }
  }
}

template <typename kv_t>
static void decode_kernel(const float* q, const kv_t* k_cache, const kv_t* v_cache, const c10::Half* k_scale,
                          const c10::Half* v_scale, const int64_t* block_tables, const int64_t* context_lens,
                          float* out, float* lse, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, int64_t table_width, float scale,
                          const flash::Kind& kind) {
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t heads = batch >= 2 * at::get_num_threads() ? num_kv_heads : 1;  // KV heads per task
  const int64_t per_seq = num_kv_heads / heads;
  at::parallel_for(0, batch * per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs, partial;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per_seq, h0 = (task % per_seq) * heads;
      auto run = head_dim == 64 ? attend<64, kv_t> : head_dim == 128 ? attend<128, kv_t> : attend<0, kv_t>;
      run(q + b * num_heads * head_dim, k_cache, v_cache, k_scale, v_scale, block_tables + b * table_width,
          context_lens[b], out + b * num_heads * head_dim, lse + b * num_heads, h0, heads, groups, num_kv_heads,
          head_dim, block_size, scale, kind, scores, qs, partial);
    }
  });
}

// q: [B, H, D] fp32; k_cache, v_cache: [num_blocks, block_size, KvH, D] (fp32, bf16 or fp16, contiguous);
// block_tables: [B, W] int64; context_lens: [B] int64 (each >= 1) -> out [B, H, D] fp32 and each query's
// log-sum-exp of its scaled scores, lse [B, H] fp32 (for merging with attention over other keys); under a layer's
// kind (`paged_decode_attention_kind`: window <= 0 none, softcap <= 0 none, sinks fp32 [H] or None)
std::vector<torch::Tensor> paged_decode_attention_kind(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       double scale, int64_t window, double softcap,
                                                       c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous() && q.dim() == 3, "q: contiguous fp32 [B, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "k/v cache: contiguous 4-d");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kLong && context_lens.is_contiguous(), "context_lens: int64");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const flash::Kind kind = flash::make_kind("paged_decode_attention", window, softcap, sinks, num_heads, true);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, num_heads}, q.options());
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), nullptr,
                            nullptr, block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                            out.data_ptr<float>(), lse.data_ptr<float>(), batch, num_heads, num_kv_heads, head_dim,
                            block_size, block_tables.size(1), s, kind);
  });
  return {out, lse};
}

std::vector<torch::Tensor> paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return paged_decode_attention_kind(q, k_cache, v_cache, block_tables, context_lens, scale, 0, 0.0, c10::nullopt);
}

// The same over an int8 pool read in place: k_codes, v_codes: [num_blocks, block_size, KvH, D] int8 (contiguous);
// k_scales, v_scales: the fp16 scale of each (block, token, KvH) slot, contiguous (value = code * scale)
std::vector<torch::Tensor> paged_decode_attention_int8_kind(torch::Tensor q, torch::Tensor k_codes,
                                                            torch::Tensor v_codes, torch::Tensor k_scales,
                                                            torch::Tensor v_scales, torch::Tensor block_tables,
                                                            torch::Tensor context_lens, double scale, int64_t window,
                                                            double softcap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous() && q.dim() == 3, "q: contiguous fp32 [B, H, D]");
  TORCH_CHECK(k_codes.scalar_type() == torch::kChar && v_codes.scalar_type() == torch::kChar, "k/v codes: int8");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_codes.dim() == 4 &&
                  k_codes.sizes() == v_codes.sizes(), "k/v codes: contiguous [num_blocks, block_size, KvH, D]");
  const int64_t slots = k_codes.size(0) * k_codes.size(1) * k_codes.size(2);
  TORCH_CHECK(k_scales.scalar_type() == torch::kHalf && v_scales.scalar_type() == torch::kHalf &&
                  k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.numel() == slots &&
                  v_scales.numel() == slots, "k/v scales: contiguous fp16, one per (block, token, KV head)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kLong && context_lens.is_contiguous(), "context_lens: int64");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_codes.size(1), num_kv_heads = k_codes.size(2);
  TORCH_CHECK(k_codes.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const flash::Kind kind = flash::make_kind("paged_decode_attention_int8", window, softcap, sinks, num_heads, true);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, num_heads}, q.options());
  decode_kernel<int8_t>(q.data_ptr<float>(), k_codes.data_ptr<int8_t>(), v_codes.data_ptr<int8_t>(),
                        k_scales.data_ptr<at::Half>(), v_scales.data_ptr<at::Half>(), block_tables.data_ptr<int64_t>(),
                        context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse.data_ptr<float>(), batch,
                        num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1), static_cast<float>(scale),
                        kind);
  return {out, lse};
}

std::vector<torch::Tensor> paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_codes, torch::Tensor v_codes,
                                                       torch::Tensor k_scales, torch::Tensor v_scales,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       double scale) {
  return paged_decode_attention_int8_kind(q, k_codes, v_codes, k_scales, v_scales, block_tables, context_lens, scale,
                                          0, 0.0, c10::nullopt);
}

// fused_ops.cpp, built into the same module
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor signed_sin, c10::optional<torch::Tensor> norm_weight,
           double eps);
void quantize_store_int8_(torch::Tensor src, torch::Tensor codes, torch::Tensor scales, torch::Tensor slots);
// small_linear.cpp
bool small_linear_compiled();
int64_t layout_matches(int64_t address, int64_t nbytes, torch::Tensor weight);
torch::Tensor small_linear(torch::Tensor x, int64_t address, int64_t nbytes, int64_t n,
                           c10::optional<torch::Tensor> bias, int64_t block_rows);
// flash_bf16.cpp (and flash_avx2.cpp)
std::string flash_kernel(bool bf16);
std::vector<torch::Tensor> flash_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                           bool causal);
std::vector<torch::Tensor> flash_attention_kind(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                bool causal, int64_t window, double softcap,
                                                c10::optional<torch::Tensor> sinks);
std::vector<torch::Tensor> flash_attention_slots(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                                 double scale, bool causal, int64_t window, double softcap,
                                                 c10::optional<torch::Tensor> sinks);
// bf16_rows.cpp
torch::Tensor bf16_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
// decode_step.cpp
void bind_decode_layers(pybind11::module& m);
// kv_codec.cpp
void bind_kv_codec(pybind11::module& m);

// the build's identity (sage_infer/layers/kernel_build.py passes both): a build whose key differs from the
// sources on disk is not loaded
#define SAGE_STR_(x) #x
#define SAGE_STR(x) SAGE_STR_(x)
#ifndef SAGE_BUILD_KEY
#define SAGE_BUILD_KEY unknown
#endif
#ifndef SAGE_ISA_LEVEL
#define SAGE_ISA_LEVEL unknown
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_key", [] { return std::string(SAGE_STR(SAGE_BUILD_KEY)); }, "the key of the sources and flags built");
  m.def("isa", [] { return std::string(SAGE_STR(SAGE_ISA_LEVEL)); }, "the ISA level this build was compiled for");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV blocks (CPU)");
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8,
        "decode attention over paged int8 KV blocks and their fp16 scales, read in place (CPU)");
  m.def("paged_decode_attention_kind", &paged_decode_attention_kind,
        "paged_decode_attention under a sliding window, a logit soft-cap and attention sinks");
  m.def("paged_decode_attention_int8_kind", &paged_decode_attention_int8_kind,
        "paged_decode_attention_int8 under a sliding window, a logit soft-cap and attention sinks");
  m.def("rms_norm", &rms_norm, "RMSNorm of [N, H] rows");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x, then RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [N, 2I]");
  m.def("rope_", &rope_, "in place: optional per-head RMSNorm, then neox rotary");
  m.def("quantize_store_int8_", &quantize_store_int8_, "K or V rows quantized into an int8 pool's slots, in place");
  m.def("small_linear_compiled", &small_linear_compiled, "whether small_linear was built (AVX512-BF16)");
  m.def("layout_matches", &layout_matches,
        "the rows per block (64, 32) of small_linear's layout oneDNN's packed bf16 weight is in; 0: neither");
  m.def("flash_kernel", &flash_kernel, "the flash kernel this build runs for bf16 (or fp32) inputs; '' for none");
  m.def("flash_attention", &flash_attention, "bf16 or fp32 attention of many queries, out and lse (CPU)");
  m.def("flash_attention_kind", &flash_attention_kind,
        "flash_attention under a sliding window, a logit soft-cap and attention sinks");
  m.def("flash_attention_slots", &flash_attention_slots,
        "flash_attention_kind over rows `slots` of a KV pool's K and V, read in place (no gathered copy)");
  m.def("small_linear", &small_linear, "x @ W.T + b over oneDNN's packed bf16 weight, for a few rows");
  m.def("bf16_rows_linear", &bf16_rows_linear, "x @ W.T + b for 1-4 bf16 rows on the [N, K] bf16 weight");
  bind_decode_layers(m);
  bind_kv_codec(m);
}
