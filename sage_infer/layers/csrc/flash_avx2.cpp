// Attention of many queries (a prefill chunk, or decode rows that all read one shared prefix) on AVX2 + FMA:
// the flash kernel of the builds without AVX-512 (the avx2 level), fp32 or bf16 q, k, v. bf16 is widened to fp32
// as it is read (a 16-bit shift: exact), and from there both are one fp32
// kernel: exact fp32 products, fp32 sums, so only the summation order differs from the reference
// (sage_infer.layers.attention.attention_with_lse_reference).
//
// The contract of csrc/flash_bf16.cpp: q: [Lq, H, D]; k, v: [C, KvH, D] (strided views with contiguous
// heads); causal aligned to the lower right; a layer's kind (flash.h's `Kind`) -> out [Lq, H, D] and lse [Lq, H],
// fp32. Its fp32 kernel's walk too: a task is one KV head and 16-64 query positions (`flash::task_positions`; the
// G query heads of the KV head share its keys), handed out from a shared counter (`flash::run_tasks`), and each
// 64-key tile of the head's keys is read once per task and applied to every group of 6 rows, whose softmax state
// lives in `RowState`s between tiles. With 16 ymm registers a pass holds 6 rows x 16 keys of scores (12
// accumulators; K packed [C/8][D][8], 8 keys side by side per dimension, one query element broadcast per row), and
// P·V 6 rows x 16 dimensions (p broadcast, V read by key).
#include "flash.h"
#include "kernel.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_exp.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)  // AVX-512 builds run their own kernels
#define FLASH_AVX2 1
#endif

#if defined(FLASH_AVX2)
namespace {

using flash::Kind;
using flash::kNegInf;
using flash::kTile;

constexpr int kRows = 6;  // rows per pass

struct RowState {
  float m;  // running max of the scaled scores
  float l;  // softmax denominator
  alignas(32) float o[flash::kMaxHeadDim];  // unnormalised output
};

inline float max_lanes(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum_lanes(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// s[r][off, off + 16) = unscaled scores of R rows against 16 keys, packed as two blocks [D][8] at kt
template <int R>
inline void scores16(const float* const* qr, const float* kt, int64_t d, float (*s)[kTile], int64_t off) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m256 k0 = _mm256_load_ps(kt + i * 8), k1 = _mm256_load_ps(kt + (d + i) * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(qr[r] + i);
      acc[r][0] = _mm256_fmadd_ps(k0, qb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(k1, qb, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(s[r] + off, acc[r][0]);
    _mm256_store_ps(s[r] + off + 8, acc[r][1]);
  }
}

// one row's online-softmax step over a tile: s, its 64 unscaled scores (soft-capped first when `softcap` > 0;
// keys before `first` or past `limit` masked here), become p = exp(score * scale - max) (masked keys 0); m and l
// are updated -> alpha, the factor the row's output is rescaled by (1, p all 0, state kept for a tile the row
// sees none of)
inline float softmax_tile(float* s, int64_t k0, int64_t first, int64_t limit, float scale, float softcap,
                          RowState& st) {
  if (k0 > limit || k0 + kTile <= first) {
    std::fill(s, s + kTile, 0.f);
    return 1.f;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 in = _mm256_set1_ps(softcap > 0.f ? scale / softcap : 1.f), out = _mm256_set1_ps(softcap);
  if (softcap > 0.f) scale = 1.f;  // cap * tanh(score * scale / cap): the scores are scaled from here on
  __m256 v[kTile / 8];
  __m256 tmax = _mm256_set1_ps(kNegInf);  // of the unscaled scores (scale > 0 keeps the order)
  for (int j = 0; j < kTile / 8; ++j) {
    v[j] = _mm256_load_ps(s + 8 * j);
    if (softcap > 0.f) v[j] = _mm256_mul_ps(out, tanh8(_mm256_mul_ps(v[j], in)));
    if (k0 + 8 * j + 7 > limit || k0 + 8 * j < first) {  // keys outside the row's [first, limit]: masked
      const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(k0 + 8 * j)));
      const __m256i past = _mm256_or_si256(_mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(limit))),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(first)), key));
      v[j] = _mm256_blendv_ps(v[j], _mm256_set1_ps(kNegInf), _mm256_castsi256_ps(past));
    }
    tmax = _mm256_max_ps(tmax, v[j]);
  }
  const float mnew = std::max(st.m, max_lanes(tmax) * scale);
  const float alpha = _mm256_cvtss_f32(exp8(_mm256_set1_ps(st.m - mnew)));
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < kTile / 8; ++j) {
    const __m256 p = exp8(_mm256_fmsub_ps(v[j], _mm256_set1_ps(scale), _mm256_set1_ps(mnew)));
    _mm256_store_ps(s + 8 * j, p);
    sum = _mm256_add_ps(sum, p);
  }
  st.m = mnew;
  st.l = st.l * alpha + sum_lanes(sum);
  return alpha;
}

// o[r][off, off + 16) = o * alpha[r] + P[r] . V over the tile's first nkeys keys; v: the first key's values
// at `off`, vs floats apart
template <int R>
inline void values16(const float* v, int64_t vs, int64_t nkeys, const float (*p)[kTile], const float* alpha,
                     RowState* const* st, int64_t off) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    acc[r][0] = _mm256_mul_ps(_mm256_load_ps(st[r]->o + off), a);
    acc[r][1] = _mm256_mul_ps(_mm256_load_ps(st[r]->o + off + 8), a);
  }
  for (int64_t t = 0; t < nkeys; ++t, v += vs) {
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 pp = _mm256_broadcast_ss(p[r] + t);
      acc[r][0] = _mm256_fmadd_ps(v0, pp, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(v1, pp, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(st[r]->o + off, acc[r][0]);
    _mm256_store_ps(st[r]->o + off + 8, acc[r][1]);
  }
}

// one 64-key tile for R rows (R <= kRows); kt: the tile's packed keys, 8 blocks [D][8]; vt: its first key's
// values, `vs` floats apart; nkeys: keys of the tile any row sees (16-key groups past it are not scored)
template <int R>
void tile_pass(const float* const* qr, const int64_t* first, const int64_t* limit, const float* kt, const float* vt,
               int64_t vs, int64_t nkeys, int64_t k0, int64_t d, float scale, float softcap, RowState* const* st) {
  alignas(32) float s[R][kTile];
  for (int64_t j = 0; j < kTile; j += 16) {
    if (j < nkeys) {
      scores16<R>(qr, kt + j * d, d, s, j);
    } else {
      for (int r = 0; r < R; ++r) std::fill(s[r] + j, s[r] + j + 16, kNegInf);
    }
  }
  float alpha[R];
  for (int r = 0; r < R; ++r) alpha[r] = softmax_tile(s[r], k0, first[r], limit[r], scale, softcap, *st[r]);
  for (int64_t off = 0; off < d; off += 16) values16<R>(vt + off, vs, nkeys, s, alpha, st, off);
}

// d values of one row as fp32
inline void widen_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, sizeof(float) * d); }
inline void widen_row(const c10::BFloat16* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
}

// `slots` (or null): key j is row slots[j] of k and v, `c` keys (flash.h's `check_slots`)
template <typename T>
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, float scale, bool causal,
            const Kind& kind, float* ob, float* lb, const int64_t* slots, int64_t c) {
  const int64_t lq = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  const int64_t groups = heads / kv_heads, cp = (c + kTile - 1) / kTile * kTile;
  const T* kb = k.data_ptr<T>();
  const T* vb = v.data_ptr<T>();
  const int64_t ks = k.stride(0), kh = k.stride(1);
  // packed K: [KvH][cp/8][D][8], zero padded past C (torch's allocator aligns it to 64 bytes); V: read in place
  // when fp32 and its rows are consecutive (no slots), else copied (widened) once to [KvH][C][D]
  auto kpack = torch::empty({kv_heads * cp * d}, q.options().dtype(at::kFloat));
  float* kpb = kpack.data_ptr<float>();
  constexpr bool in_place = std::is_same_v<T, float>;  // (q's rows read in place)
  const bool v_in_place = in_place && slots == nullptr;
  torch::Tensor vwide = v_in_place ? torch::Tensor() : torch::empty({kv_heads, c, d}, kpack.options());
  float* vw = v_in_place ? nullptr : vwide.data_ptr<float>();
  const float* vf = v_in_place ? reinterpret_cast<const float*>(vb) : vw;
  const int64_t vs = v_in_place ? v.stride(0) : d, vh = v_in_place ? v.stride(1) : c * d;
  at::parallel_for(0, kv_heads * (cp / 8), 1, [&](int64_t b0, int64_t b1) {
    alignas(32) float row[flash::kMaxHeadDim];
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t h = task / (cp / 8), blk = task % (cp / 8);
      float* kdst = kpb + (h * cp + blk * 8) * d;  // [D][8]
      for (int64_t t = 0; t < 8; ++t) {
        const int64_t key = blk * 8 + t;
        if (key < c) {
          const int64_t at = flash::key_row(slots, key);
          widen_row(kb + at * ks + h * kh, row, d);
          if (!v_in_place) widen_row(vb + at * v.stride(0) + h * v.stride(1), vw + (h * c + key) * d, d);
        } else {
          std::fill(row, row + d, 0.f);
        }
        for (int64_t i = 0; i < d; ++i) kdst[i * 8 + t] = row[i];
      }
    }
  });
  const int64_t positions = flash::task_positions(lq, kv_heads, groups);
  const int64_t qblocks = (lq + positions - 1) / positions;
  const T* qb = q.data_ptr<T>();
  const int64_t qs = q.stride(0), qh = q.stride(1);
  flash::run_tasks(kv_heads * qblocks, [&](const auto& take) {
    std::vector<RowState> state(positions * groups);
    std::vector<RowState*> st(state.size());
    std::vector<float> qwide(in_place ? 0 : state.size() * d);
    std::vector<const float*> qp(state.size());
    std::vector<int64_t> first(state.size()), limit(state.size());
    for (int64_t task = take(); task >= 0; task = take()) {
      const int64_t h = task % kv_heads, qblk = flash::task_block(task / kv_heads, qblocks, causal);
      const int64_t p0 = qblk * positions, rows = (std::min(lq, p0 + positions) - p0) * groups;
      int64_t last = 0, begin = c;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = p0 + r / groups, head = h * groups + r % groups;
        const T* src = qb + pos * qs + head * qh;
        if constexpr (in_place) {
          qp[r] = src;
        } else {
          widen_row(src, qwide.data() + r * d, d);
          qp[r] = qwide.data() + r * d;
        }
        limit[r] = causal ? pos + c - lq : c - 1;
        first[r] = flash::first_key(limit[r], kind);
        last = std::max(last, limit[r]);
        begin = std::min(begin, first[r]);
        st[r] = &state[r];
        state[r].m = kNegInf;
        state[r].l = 0.f;
        std::fill(state[r].o, state[r].o + d, 0.f);
      }
      const float* kph = kpb + h * cp * d;
      // each tile once per task, for every row; tiles before every row's window are not read
      for (int64_t k0 = begin / kTile * kTile; k0 <= last; k0 += kTile) {
        const float* kt = kph + k0 * d;
        const float* vt = vf + k0 * vs + h * vh;
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          const int64_t glast = *std::max_element(limit.begin() + r0, limit.begin() + r0 + n);
          const int64_t gfirst = *std::min_element(first.begin() + r0, first.begin() + r0 + n);
          if (k0 > glast || k0 + kTile <= gfirst) continue;
          const int64_t nkeys = std::min<int64_t>(kTile, glast + 1 - k0);
          const float* const* q6 = qp.data() + r0;
          const int64_t* f6 = first.data() + r0;
          const int64_t* l6 = limit.data() + r0;
          RowState* const* s6 = st.data() + r0;
          switch (n) {
            case 6: tile_pass<6>(q6, f6, l6, kt, vt, vs, nkeys, k0, d, scale, kind.softcap, s6); break;
            case 5: tile_pass<5>(q6, f6, l6, kt, vt, vs, nkeys, k0, d, scale, kind.softcap, s6); break;
            case 4: tile_pass<4>(q6, f6, l6, kt, vt, vs, nkeys, k0, d, scale, kind.softcap, s6); break;
            case 3: tile_pass<3>(q6, f6, l6, kt, vt, vs, nkeys, k0, d, scale, kind.softcap, s6); break;
            case 2: tile_pass<2>(q6, f6, l6, kt, vt, vs, nkeys, k0, d, scale, kind.softcap, s6); break;
            default: tile_pass<1>(q6, f6, l6, kt, vt, vs, nkeys, k0, d, scale, kind.softcap, s6);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = p0 + r / groups, head = h * groups + r % groups;
        const float inv = flash::finish(state[r].m, state[r].l, kind, head);
        float* orow = ob + (pos * heads + head) * d;
        for (int64_t j = 0; j < d; ++j) orow[j] = state[r].o[j] * inv;
        lb[pos * heads + head] = state[r].m + std::log(state[r].l);
      }
    }
  });
}

}  // namespace
#endif

bool flash_avx2_compiled() {
#if defined(FLASH_AVX2)
  return true;
#else
  return false;
#endif
}

std::vector<torch::Tensor> flash_attention_avx2(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                bool causal, const flash::Kind& kind, const int64_t* slots,
                                                int64_t c) {
  const bool fp32 = q.scalar_type() == at::kFloat;
  const auto dtype = fp32 ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype,
              fp32 ? "flash_attention_avx2: float32 q, k and v" : "flash_attention_avx2: bf16 q, k and v");
  flash::check_shapes("flash_attention_avx2", q, k, v, causal, c);
  if (c < 0) c = k.size(0);
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
#if defined(FLASH_AVX2)
  const float s = static_cast<float>(scale);
  if (fp32) {
    attend<float>(q, k, v, s, causal, kind, out.data_ptr<float>(), lse.data_ptr<float>(), slots, c);
  } else {
    attend<c10::BFloat16>(q, k, v, s, causal, kind, out.data_ptr<float>(), lse.data_ptr<float>(), slots, c);
  }
#else
  TORCH_CHECK(false, "flash_attention_avx2: built without AVX2 and FMA, or with AVX-512");
#endif
  return {out, lse};
}
