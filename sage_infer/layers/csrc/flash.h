// What the flash kernels share (flash_bf16.cpp: AVX-512 and AVX512-BF16; flash_avx2.cpp: AVX2): the
// contract's argument checks, the tile and task sizes, the order tasks are handed out in, and what a layer's attention
// kind adds (`Kind`: a sliding window, a logit soft-cap, attention sinks).
#pragma once
#include "kernel.h"
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace flash {

constexpr int64_t kTile = 64;         // keys per tile
constexpr int64_t kRowsPerTask = 16;  // query positions per task
constexpr float kNegInf = -1e30f;     // finite: the kernels are built with -ffast-math
constexpr int64_t kMaxHeadDim = 256;  // a multiple of 32 up to this (Gemma's heads are 256 wide)

// A layer's attention beyond plain softmax(q.k * scale) (sage_infer/layers/attention_kinds.py is the oracle):
// `window` > 0: the query at position i sees keys i - window < j <= i (key tiles wholly before a row's window are
// not read); `softcap` > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax; `sinks`
// (one fp32 logit per query head, or null): one more softmax entry, with no value, p_j = exp(s_j) / (exp(sink) +
// sum_k exp(s_k)); the lse returned then counts the sink.
struct Kind {
  int64_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;
};

// the first key a row whose last key is `limit` sees
inline int64_t first_key(int64_t limit, const Kind& kind) {
  return kind.window > 0 ? std::max<int64_t>(0, limit - kind.window + 1) : 0;
}

// a row's end: its running max `m` and softmax denominator `total` (of its keys) -> the factor its unnormalised
// output is multiplied by; with a sink, the sink's term joins `total` and `m` (both updated: lse = m + log(total))
inline float finish(float& m, float& total, const Kind& kind, int64_t head) {
  if (kind.sinks == nullptr) return 1.f / total;
  const float sink = kind.sinks[head], mnew = std::max(m, sink), rescale = std::exp(m - mnew);
  total = total * rescale + std::exp(sink - mnew);
  m = mnew;
  return rescale / total;
}

// a kind's arguments from Python (window <= 0 and softcap <= 0: none; sinks: fp32 [H] or None)
inline Kind make_kind(const char* name, int64_t window, double softcap, const c10::optional<torch::Tensor>& sinks,
                      int64_t heads, bool causal) {
  TORCH_CHECK(window <= 0 || causal, name, ": a window needs causal attention");
  Kind kind{std::max<int64_t>(window, 0), static_cast<float>(std::max(softcap, 0.0)), nullptr};
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == heads, name,
                ": sinks: contiguous fp32, one per query head");
    kind.sinks = sinks->data_ptr<float>();
  }
  return kind;
}

// the shape and layout checks of every kernel (their dtype checks are their own)
inline void check_shapes(const char* name, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, ": q [Lq, H, D], k/v [C, KvH, D]");
  const int64_t d = q.size(2), c = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(v.size(0) == c && v.size(1) == kv_heads && k.size(2) == d && v.size(2) == d &&
                  q.size(1) % kv_heads == 0, name, ": shapes disagree");
  TORCH_CHECK(d % 32 == 0 && d <= kMaxHeadDim, name, ": head_dim must be a multiple of 32 up to 256");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, name, ": heads must be contiguous");
  TORCH_CHECK(!causal || c >= q.size(0), name, ": causal needs at least as many keys as queries");
}

// the query block of task i (of `blocks`): causal tasks grow with the block, so alternate ends to keep each
// thread's share balanced
inline int64_t task_block(int64_t i, int64_t blocks, bool causal) {
  return causal ? (i % 2 == 0 ? i / 2 : blocks - 1 - i / 2) : i;
}

}  // namespace flash
