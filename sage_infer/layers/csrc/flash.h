// What the flash kernels share (flash_bf16.cpp: AVX-512 and AVX512-BF16; flash_avx2.cpp: AVX2): the
// contract's argument checks, the tile and task sizes, how tasks are handed out, and what a layer's attention
// kind adds (`Kind`: a sliding window, a logit soft-cap, attention sinks).
#pragma once
#include "kernel.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

namespace flash {

constexpr int64_t kTile = 64;         // keys per tile
constexpr int64_t kTaskRows = 192;    // rows a task aims at (query positions x the G query heads of a KV head)
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

// the shape and layout checks of every kernel (their dtype checks are their own); `c`: the keys attended (-1: all
// of k's rows; else a call through `slots`, whose k and v rows are any rows of a pool)
inline void check_shapes(const char* name, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         bool causal, int64_t c = -1) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, ": q [Lq, H, D], k/v [C, KvH, D]");
  const int64_t d = q.size(2), kv_heads = k.size(1);
  if (c < 0) c = k.size(0);
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == kv_heads && k.size(2) == d && v.size(2) == d &&
                  q.size(1) % kv_heads == 0, name, ": shapes disagree");
  TORCH_CHECK(d % 32 == 0 && d <= kMaxHeadDim, name, ": head_dim must be a multiple of 32 up to 256");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, name, ": heads must be contiguous");
  TORCH_CHECK(!causal || c >= q.size(0), name, ": causal needs at least as many keys as queries");
}

// A call whose keys are rows `slots` of k and v (a KV pool's rows of one layer, read in place: no gathered copy):
// key j is row slots[j]. Checks the slots (a contiguous int64 CPU vector, each a row of k) -> their data.
inline const int64_t* check_slots(const char* name, const torch::Tensor& slots, int64_t rows) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.device().is_cpu(),
              name, ": slots must be a contiguous int64 CPU vector");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0, n = slots.numel(); i < n; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < rows, name, ": slot ", s[i], " is outside k and v's ", rows, " rows");
  return s;
}

// key j's row of k and v: slots[j], or j itself without slots
inline int64_t key_row(const int64_t* slots, int64_t key) { return slots ? slots[key] : key; }

// Query positions per task. A task reads each tile of its KV head's keys and values once for all its rows, so
// the more rows the less K/V traffic: about kTaskRows rows (16 to 64 positions, a multiple of 16), fewer where a
// chunk would give under 4 tasks per thread.
inline int64_t task_positions(int64_t lq, int64_t kv_heads, int64_t groups) {
  int64_t positions = std::clamp<int64_t>(kTaskRows / groups / 16 * 16, 16, 64);
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  while (positions > 16 && kv_heads * ((lq + positions - 1) / positions) < wanted) positions -= 16;
  return positions;
}

// the query block of the i-th task handed out (of `blocks`): causal, the last block first (it sees the most keys),
// so the short tasks come last and fill in behind the long ones
inline int64_t task_block(int64_t i, int64_t blocks, bool causal) { return causal ? blocks - 1 - i : i; }

// Runs `body(take)` once on each thread (as many as tasks, at most at::get_num_threads()); `take()` hands out the
// next of tasks 0 .. tasks - 1 from one shared counter, -1 when none is left. A thread that has its core keeps
// taking tasks while one that lost it to another process holds only the task it is in, so a region waits for at
// most one task, not for a fixed half of the work.
template <typename Body>
inline void run_tasks(int64_t tasks, const Body& body) {
  std::atomic<int64_t> next{0};
  const auto take = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < tasks ? i : -1;
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(take); });
}

}  // namespace flash
