// What the flash kernels share (flash_bf16.cpp: AVX-512 and AVX512-BF16; flash_avx2.cpp: AVX2): the
// contract's argument checks, the tile and task sizes, and the order tasks are handed out in.
#pragma once
#include "kernel.h"
#include <cstdint>

namespace flash {

constexpr int64_t kTile = 64;         // keys per tile
constexpr int64_t kRowsPerTask = 16;  // query positions per task
constexpr float kNegInf = -1e30f;     // finite: the kernels are built with -ffast-math

// the shape and layout checks of every kernel (their dtype checks are their own)
inline void check_shapes(const char* name, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, name, ": q [Lq, H, D], k/v [C, KvH, D]");
  const int64_t d = q.size(2), c = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(v.size(0) == c && v.size(1) == kv_heads && k.size(2) == d && v.size(2) == d &&
                  q.size(1) % kv_heads == 0, name, ": shapes disagree");
  TORCH_CHECK(d % 32 == 0 && d <= 128, name, ": head_dim must be 32, 64, 96 or 128");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, name, ": heads must be contiguous");
  TORCH_CHECK(!causal || c >= q.size(0), name, ": causal needs at least as many keys as queries");
}

// the query block of task i (of `blocks`): causal tasks grow with the block, so alternate ends to keep each
// thread's share balanced
inline int64_t task_block(int64_t i, int64_t blocks, bool causal) {
  return causal ? (i % 2 == 0 ? i / 2 : blocks - 1 - i / 2) : i;
}

}  // namespace flash
