// Attention of many bf16 queries over bf16 keys and values (a prefill chunk, or decode rows that
// all read one shared prefix) on CPU with AVX512-BF16: both products on `vdpbf16ps`; and of fp32 ones with
// AVX-512 (below). Builds without AVX-512 run csrc/flash_avx2.cpp instead (`flash_attention`, at the end).
//
// q: [Lq, H, D]; k, v: [C, KvH, D] (each may be a strided view with contiguous heads); causal or not. Causal is aligned to the
// lower right: query i sees keys j <= i + C - Lq (the queries are the last Lq of C positions); a layer's kind
// (flash.h's `Kind`: a sliding window, a soft-cap, sinks) through `flash_attention_kind`.
// -> out [Lq, H, D] fp32 and lse [Lq, H] fp32 (log-sum-exp of the scaled scores).
//
// Per KV head, K is packed once as [C/16][D/2][16][2] (16 keys side by side per column pair) and V
// as [C/2][D][2] (2 keys side by side per dimension); a task is one KV head and 16-64 query positions
// (`attend_tasks`: the G query heads of the KV head share its keys), walked tile by tile of 64 keys, each tile
// applied to every group of 6 rows: scores (24 accumulators of 16 keys), online softmax in fp32, then P·V with P
// rounded to bf16 (as PyTorch's CPU flash kernel rounds it for bf16 inputs). Scores are exact bf16
// products summed in fp32, so only the summation order and that rounding differ from the reference
// (sage_infer.layers.attention.attention_with_lse_reference).
#include "flash.h"
#include "kernel.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "vec_exp.h"

namespace {

using flash::Kind;
using flash::kNegInf;
using flash::kTile;

#if defined(__AVX512F__)
// one row's online-softmax step over a 64-key tile, both kernels: s, its 4 x 16 unscaled scores (keys before
// `first` or past `limit` masked here; soft-capped first when `softcap` > 0); m, l: the running max of the scaled
// scores and the per-lane denominators, updated; p: exp(score * scale - max) of the tile (masked keys 0) ->
// alpha, the factor the row's output is rescaled by (1, p all 0, m and l kept for a tile the row sees none of)
inline float softmax_tile(__m512 (&s)[4], int64_t k0, int64_t first, int64_t limit, float scale, float softcap,
                          float& m, __m512& l, __m512 (&p)[4]) {
  if (k0 > limit || k0 + kTile <= first) {
    for (int j = 0; j < 4; ++j) p[j] = _mm512_setzero_ps();
    return 1.f;
  }
  if (softcap > 0.f) {  // cap * tanh(score * scale / cap): the scores from here on are scaled
    const __m512 in = _mm512_set1_ps(scale / softcap), out = _mm512_set1_ps(softcap);
    for (int j = 0; j < 4; ++j) s[j] = _mm512_mul_ps(out, tanh16(_mm512_mul_ps(s[j], in)));
    scale = 1.f;
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 tmax = _mm512_set1_ps(kNegInf);  // of the unscaled scores (scale > 0 keeps the order)
  for (int j = 0; j < 4; ++j) {
    if (k0 + 16 * j + 15 > limit || k0 + 16 * j < first) {  // keys outside the row's [first, limit]: masked
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(k0 + 16 * j)));
      const __mmask16 keep = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(limit))) &
                             _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(first)));
      s[j] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(kNegInf), s[j]);
    }
    tmax = _mm512_max_ps(tmax, s[j]);
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(tmax) * scale);
  const float alpha = _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - mnew)));  // no libm call: it would spill s
  m = mnew;
  __m512 sum = _mm512_mul_ps(l, _mm512_set1_ps(alpha));
  for (int j = 0; j < 4; ++j) {  // masked keys: exp(-1e30) = 0
    p[j] = exp16(_mm512_fmsub_ps(s[j], _mm512_set1_ps(scale), _mm512_set1_ps(mnew)));
    sum = _mm512_add_ps(sum, p[j]);
  }
  l = sum;
  return alpha;
}
#endif

#if defined(__AVX512F__)
// a row's softmax state between tiles, both kernels
struct F32Row {
  __m512 l;  // softmax denominator, per lane: summed across lanes once, at the end
  float m;   // running max of the scaled scores
  alignas(64) float o[flash::kMaxHeadDim];  // unnormalised output
};

// What both AVX-512 kernels' task loop needs to know of a call.
struct Call {
  int64_t lq, heads, kv_heads, c, d;
  bool causal;
  int64_t qs, qh;  // q's row and head strides, in the kernel's q elements
  float* out;      // [Lq, H, D]
  float* lse;      // [Lq, H]
};

// The task loop of both AVX-512 kernels. A task is one KV head and `flash::task_positions` query positions, i.e.
// positions x G rows (the G query heads of the KV head share its keys), handed out by `flash::run_tasks`; it walks
// its head's keys tile-major: each 64-key tile is read once per task and applied to every group of up to 6 rows
// (`tile(n, q, first, limit, head, k0, nkeys, state)`, n rows), whose softmax state lives in `F32Row`s between
// tiles. `Q`: q's element type (float, or uint32_t: a bf16 pair).
template <typename Q, typename Tile>
void attend_tasks(const Q* qb, const Call& call, const Kind& kind, const Tile& tile) {
  const int64_t groups = call.heads / call.kv_heads, lq = call.lq, c = call.c, d = call.d;
  const int64_t positions = flash::task_positions(lq, call.kv_heads, groups);
  const int64_t qblocks = (lq + positions - 1) / positions;
  flash::run_tasks(call.kv_heads * qblocks, [&](const auto& take) {
    std::vector<F32Row> state(positions * groups);
    std::vector<F32Row*> st(state.size());
    std::vector<const Q*> qp(state.size());
    std::vector<int64_t> first(state.size()), limit(state.size());
    for (int64_t task = take(); task >= 0; task = take()) {
      const int64_t h = task % call.kv_heads, qblk = flash::task_block(task / call.kv_heads, qblocks, call.causal);
      const int64_t p0 = qblk * positions, rows = (std::min(lq, p0 + positions) - p0) * groups;
      int64_t last = 0, begin = c;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = p0 + r / groups, head = h * groups + r % groups;
        qp[r] = qb + pos * call.qs + head * call.qh;
        limit[r] = call.causal ? pos + c - lq : c - 1;
        first[r] = flash::first_key(limit[r], kind);
        last = std::max(last, limit[r]);
        begin = std::min(begin, first[r]);
        st[r] = &state[r];
        state[r].m = kNegInf;
        state[r].l = _mm512_setzero_ps();
        std::memset(state[r].o, 0, sizeof(float) * d);
      }
      // each tile once per task, for every row; tiles before every row's window are not read
      for (int64_t k0 = begin / kTile * kTile; k0 <= last; k0 += kTile) {
        for (int64_t r0 = 0; r0 < rows; r0 += 6) {
          const int n = static_cast<int>(std::min<int64_t>(6, rows - r0));
          const int64_t glast = *std::max_element(limit.begin() + r0, limit.begin() + r0 + n);
          const int64_t gfirst = *std::min_element(first.begin() + r0, first.begin() + r0 + n);
          if (k0 > glast || k0 + kTile <= gfirst) continue;
          const int64_t nkeys = std::min<int64_t>(kTile, glast + 1 - k0);
          tile(n, qp.data() + r0, first.data() + r0, limit.data() + r0, h, k0, nkeys, st.data() + r0);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = p0 + r / groups, head = h * groups + r % groups;
        float total = _mm512_reduce_add_ps(state[r].l);
        const float inv = flash::finish(state[r].m, total, kind, head);
        float* orow = call.out + (pos * call.heads + head) * d;
        for (int64_t j = 0; j < d; ++j) orow[j] = state[r].o[j] * inv;
        call.lse[pos * call.heads + head] = state[r].m + std::log(total);
      }
    }
  });
}

// fn(std::integral_constant<int, n>) for n = 1 .. 6: a tile function's row count as a constant
template <typename Fn>
inline void with_rows(int n, const Fn& fn) {
  switch (n) {
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    default: fn(std::integral_constant<int, 1>());
  }
}
#endif

#if defined(__AVX512BF16__)
// one 64-key tile for R rows (R <= 6): scores (R x 4 accumulators of 16 keys, 4 keys' vectors) on `vdpbf16ps`,
// the online softmax in fp32, then o = o * alpha + P . V with P rounded to bf16; qp: R rows of D/2 bf16 pairs; kt:
// the tile's packed keys, 4 blocks [D/2][16][2]; vt: its values, 32 key pairs [D][2]
template <int R>
void bf16_tile(const uint32_t* const* qp, const int64_t* first, const int64_t* limit, const uint16_t* kt,
               const uint16_t* vt, int64_t k0, int64_t d, float scale, float softcap, F32Row* const* st) {
  const int64_t pairs = d / 2, chunks = d / 16;
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh kk[4];
    for (int j = 0; j < 4; ++j) kk[j] = (__m512bh)_mm512_loadu_si512(kt + j * 16 * d + p * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r][p]));
      for (int j = 0; j < 4; ++j) s[r][j] = _mm512_dpbf16_ps(s[r][j], kk[j], qb);
    }
  }
  alignas(64) uint16_t pb[R][kTile];  // P of the tile, bf16
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    __m512 pv[4];
    alpha[r] = softmax_tile(s[r], k0, first[r], limit[r], scale, softcap, st[r]->m, st[r]->l, pv);
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb[r] + 16 * j), (__m256i)_mm512_cvtneps_pbh(pv[j]));
  }
  // o[r] = o[r] * alpha[r] + P[r] (64 keys, bf16) . V (64 keys): per key pair, 2 keys' values side by side
  for (int64_t c = 0; c < chunks; c += 4) {
    const int64_t n = std::min<int64_t>(4, chunks - c);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < n; ++j)
        acc[r][j] = _mm512_mul_ps(_mm512_load_ps(st[r]->o + 16 * (c + j)), _mm512_set1_ps(alpha[r]));
    for (int64_t kp2 = 0; kp2 < kTile / 2; ++kp2) {
      __m512bh vv[4];
      for (int j = 0; j < n; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vt + (kp2 * d + 16 * (c + j)) * 2);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, pb[r] + 2 * kp2, sizeof pair);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int j = 0; j < n; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], vv[j], pp);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < n; ++j) _mm512_store_ps(st[r]->o + 16 * (c + j), acc[r][j]);
  }
}
#endif

// ---- fp32: q, k, v all float32 (an fp32 model's prefill chunks and shared prefixes) ----
//
// The same tasks and walk as the bf16 kernel (`attend_tasks`). Scores by fp32 FMA (K packed [C/16][D][16]: 16 keys
// side by side per dimension, one query element broadcast per row), P·V by key (p broadcast, V rows read in place).
// Exact fp32 products; only the summation order differs from the reference.
#if defined(__AVX512F__)
// o[r][off, off + 16 N) = o * alpha[r] + P[r] . V over the tile's first nkeys keys; N is a constant so
// the R x N accumulators stay in registers
template <int R, int N>
inline void f32_values(const float* v, int64_t vs, int64_t nkeys, const float (*pb)[kTile], const float* alpha,
                       F32Row* const* st, int64_t off) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j)
      acc[r][j] = _mm512_mul_ps(_mm512_load_ps(st[r]->o + off + 16 * j), _mm512_set1_ps(alpha[r]));
  for (int64_t t = 0; t < nkeys; ++t, v += vs) {
    __m512 vv[N];
    for (int j = 0; j < N; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 pp = _mm512_set1_ps(pb[r][t]);
      for (int j = 0; j < N; ++j) acc[r][j] = _mm512_fmadd_ps(vv[j], pp, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) _mm512_store_ps(st[r]->o + off + 16 * j, acc[r][j]);
}

// one 64-key tile for R rows (R <= 6: 6 x 4 score accumulators, 4 keys' vectors); kt: the tile's packed keys, 4
// blocks [D][16]; vt: its first key's value row, `vs` floats apart; nkeys: keys of the tile any row sees
template <int R>
void f32_tile(const float* const* qr, const int64_t* first, const int64_t* limit, const float* kt, const float* vt,
              int64_t vs, int64_t nkeys, int64_t k0, int64_t d, float scale, float softcap, F32Row* const* st) {
  __m512 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m512 kk[4];
    for (int j = 0; j < 4; ++j) kk[j] = _mm512_load_ps(kt + (j * d + i) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qb = _mm512_set1_ps(qr[r][i]);
      for (int j = 0; j < 4; ++j) s[r][j] = _mm512_fmadd_ps(kk[j], qb, s[r][j]);
    }
  }
  alignas(64) float pb[R][kTile];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    __m512 pv[4];
    alpha[r] = softmax_tile(s[r], k0, first[r], limit[r], scale, softcap, st[r]->m, st[r]->l, pv);
    for (int j = 0; j < 4; ++j) _mm512_store_ps(pb[r] + 16 * j, pv[j]);
  }
  for (int64_t c = 0, chunks = d / 16; c < chunks;) {  // chunks is even (D % 32 == 0)
    if (chunks - c >= 4) {
      f32_values<R, 4>(vt + 16 * c, vs, nkeys, pb, alpha, st, 16 * c);
      c += 4;
    } else {
      f32_values<R, 2>(vt + 16 * c, vs, nkeys, pb, alpha, st, 16 * c);
      c += 2;
    }
  }
}
#endif

}  // namespace

// `slots` (or null): key j is row slots[j] of k and v, `c` keys (flash.h's `check_slots`); both packs read them
std::vector<torch::Tensor> flash_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                bool causal, const flash::Kind& kind, const int64_t* slots = nullptr,
                                                int64_t c = -1) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "flash_attention_bf16: bf16 q, k and v");
  flash::check_shapes("flash_attention_bf16", q, k, v, causal, c);
  TORCH_CHECK(q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0, "flash_attention_bf16: q's row and head strides must be even");
  if (c < 0) c = k.size(0);
  const int64_t lq = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  auto out = torch::empty({lq, heads, d}, q.options().dtype(at::kFloat));
  auto lse = torch::empty({lq, heads}, q.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const int64_t cp = (c + kTile - 1) / kTile * kTile;
  // packed K: [KvH][cp/16][D/2][16][2]; packed V: [KvH][cp/2][D][2] (zero padded past C)
  std::vector<uint16_t> kpack(kv_heads * cp * d), vpack(kv_heads * cp * d);
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);
  at::parallel_for(0, kv_heads * (cp / 16), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t h = task / (cp / 16), blk = task % (cp / 16);
      uint16_t* kdst = kpack.data() + (h * cp + blk * 16) * d;  // [D/2][16][2]
      uint16_t* vdst = vpack.data() + (h * cp + blk * 16) * d;  // 8 key pairs of [D][2]
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t key = blk * 16 + t;
        const int64_t row = key < c ? flash::key_row(slots, key) : 0;
        const uint16_t* krow = key < c ? kb + row * ks + h * kh : nullptr;
        const uint16_t* vrow = key < c ? vb + row * vs + h * vh : nullptr;
        for (int64_t i = 0; i < d; ++i) {
          kdst[((i / 2) * 16 + t) * 2 + (i & 1)] = krow ? krow[i] : 0;
          vdst[((t / 2) * d + i) * 2 + (t & 1)] = vrow ? vrow[i] : 0;
        }
      }
    }
  });
  const float s = static_cast<float>(scale);
  const Call call{lq, heads, kv_heads, c, d, causal, q.stride(0) / 2, q.stride(1) / 2, out.data_ptr<float>(),
                  lse.data_ptr<float>()};
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());  // bf16 pairs
  attend_tasks(qw, call, kind, [&](int n, const uint32_t* const* qr, const int64_t* first, const int64_t* limit,
                                   int64_t h, int64_t k0, int64_t, F32Row* const* st) {
    const uint16_t* kt = kpack.data() + (h * cp + k0) * d;
    const uint16_t* vt = vpack.data() + (h * cp + k0) * d;
    with_rows(n, [&](auto rows) {
      bf16_tile<decltype(rows)::value>(qr, first, limit, kt, vt, k0, d, s, kind.softcap, st);
    });
  });
#else
  TORCH_CHECK(false, "flash_attention_bf16: built without AVX512-BF16 (this CPU or compiler lacks it)");
#endif
  return {out, lse};
}

// `slots`, `c`: as `flash_attention_bf16`'s; with slots, V is packed too ([KvH][cp][D]: its rows are anywhere)
std::vector<torch::Tensor> flash_attention_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                               bool causal, const flash::Kind& kind, const int64_t* slots = nullptr,
                                               int64_t c = -1) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "flash_attention_f32: float32 q, k and v");
  flash::check_shapes("flash_attention_f32", q, k, v, causal, c);
  if (c < 0) c = k.size(0);
  const int64_t lq = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  auto out = torch::empty({lq, heads, d}, q.options());
  auto lse = torch::empty({lq, heads}, q.options());
#if defined(__AVX512F__)
  const int64_t cp = (c + kTile - 1) / kTile * kTile;
  // packed K: [KvH][cp/16][D][16], zero padded past C (torch's allocator aligns it to 64 bytes)
  auto kpack = torch::empty({kv_heads * cp * d}, q.options());
  float* kpb = kpack.data_ptr<float>();
  const float* kb = k.data_ptr<float>();
  const float* vsrc = v.data_ptr<float>();
  const int64_t ks = k.stride(0), kh = k.stride(1);
  torch::Tensor vpack = slots ? torch::empty({kv_heads * cp * d}, q.options()) : torch::Tensor();
  float* vpb = slots ? vpack.data_ptr<float>() : nullptr;
  at::parallel_for(0, kv_heads * (cp / 16), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t task = b0; task < b1; ++task) {
      const int64_t h = task / (cp / 16), blk = task % (cp / 16);
      float* kdst = kpb + (h * cp + blk * 16) * d;  // [D][16]
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t key = blk * 16 + t;
        const float* krow = kb + (key < c ? flash::key_row(slots, key) : 0) * ks + h * kh;
        for (int64_t i = 0; i < d; ++i) kdst[i * 16 + t] = key < c ? krow[i] : 0.f;
        if (vpb != nullptr && key < c)  // (keys past c are never read from V)
          std::memcpy(vpb + (h * cp + key) * d, vsrc + flash::key_row(slots, key) * v.stride(0) + h * v.stride(1),
                      sizeof(float) * d);
      }
    }
  });
  const float* vb = slots ? vpb : vsrc;
  const int64_t vs = slots ? d : v.stride(0), vh = slots ? cp * d : v.stride(1);
  const float s = static_cast<float>(scale);
  const Call call{lq, heads, kv_heads, c, d, causal, q.stride(0), q.stride(1), out.data_ptr<float>(),
                  lse.data_ptr<float>()};
  attend_tasks(q.data_ptr<float>(), call, kind, [&](int n, const float* const* qr, const int64_t* first,
                                                    const int64_t* limit, int64_t h, int64_t k0, int64_t nkeys,
                                                    F32Row* const* st) {
    const float* kt = kpb + (h * cp + k0) * d;
    const float* vt = vb + k0 * vs + h * vh;
    with_rows(n, [&](auto rows) {
      f32_tile<decltype(rows)::value>(qr, first, limit, kt, vt, vs, nkeys, k0, d, s, kind.softcap, st);
    });
  });
#else
  TORCH_CHECK(false, "flash_attention_f32: built without AVX-512 (this CPU or compiler lacks it)");
#endif
  return {out, lse};
}

// flash_avx2.cpp: the kernel of builds without AVX-512, both dtypes
bool flash_avx2_compiled();
std::vector<torch::Tensor> flash_attention_avx2(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                bool causal, const flash::Kind& kind, const int64_t* slots,
                                                int64_t c);

// the kernel `flash_attention` runs for bf16 (or fp32) q, k and v in this build, in words; "" where none can (bf16
// on AVX-512 without AVX512-BF16: that build keeps PyTorch's flash kernel, having no measured kernel of its own)
std::string flash_kernel(bool bf16) {
#if defined(__AVX512BF16__)
  return bf16 ? "bf16 flash kernel on AVX512-BF16" : "fp32 flash kernel on AVX-512";
#elif defined(__AVX512F__)
  return bf16 ? "" : "fp32 flash kernel on AVX-512";
#else
  if (!flash_avx2_compiled()) return "";
  return bf16 ? "fp32 flash kernel on AVX2, bf16 widened" : "fp32 flash kernel on AVX2";
#endif
}

// the kernel of q's dtype in this build (`flash_kernel`), under a layer's kind
static std::vector<torch::Tensor> flash_dispatch(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                 bool causal, const flash::Kind& kind, const int64_t* slots = nullptr,
                                                 int64_t c = -1) {
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat) return flash_attention_f32(q, k, v, scale, causal, kind, slots, c);
  return flash_attention_bf16(q, k, v, scale, causal, kind, slots, c);
#else
  return flash_attention_avx2(q, k, v, scale, causal, kind, slots, c);
#endif
}

// plain attention (causal or not)
std::vector<torch::Tensor> flash_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                           bool causal) {
  return flash_dispatch(q, k, v, scale, causal, flash::Kind{});
}

// attention under a layer's kind (flash.h's `Kind`): window <= 0 none (else causal only), softcap <= 0 none,
// sinks: fp32 [H] or None
std::vector<torch::Tensor> flash_attention_kind(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                                bool causal, int64_t window, double softcap,
                                                c10::optional<torch::Tensor> sinks) {
  const flash::Kind kind = flash::make_kind("flash_attention_kind", window, softcap, sinks, q.size(1), causal);
  return flash_dispatch(q, k, v, scale, causal, kind);
}

// attention over keys read in place from a KV pool's rows: k, v [S, KvH, D] (one layer's slots), key j being row
// slots[j] ([C] int64) -- what flash_attention_kind computes over k[slots], v[slots], without that gathered copy
// (the kernels pack K, and V, straight from the rows)
std::vector<torch::Tensor> flash_attention_slots(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                                 double scale, bool causal, int64_t window, double softcap,
                                                 c10::optional<torch::Tensor> sinks) {
  const flash::Kind kind = flash::make_kind("flash_attention_slots", window, softcap, sinks, q.size(1), causal);
  const int64_t* rows = flash::check_slots("flash_attention_slots", slots, k.size(0));
  return flash_dispatch(q, k, v, scale, causal, kind, rows, slots.numel());
}
