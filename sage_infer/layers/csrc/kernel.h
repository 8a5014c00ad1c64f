// What the kernels need of PyTorch: ATen's tensors and thread pool, not the whole C++ frontend that
// <torch/extension.h> brings (that header alone took ~55 s of a ~60 s compile per file; ATen's ~15 s), since
// every file is compiled once per ISA level (sage_infer/layers/kernel_build.py).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace torch {
using namespace at;  // the kernels are written against torch::Tensor / torch::empty, ATen's names
}

// oneDNN's packed bf16 [N, K] weight (`PackedLinear`), as small_linear.cpp and moe_experts.cpp read it in place:
// [ceil(N/R)][ceil(K/32)*16][R][2], blocks of R output rows and, within a block, each pair of input columns holding
// the R rows' two values side by side, zero padded. R is 64 on CPUs with AVX512-BF16 and 32 where oneDNN packs for
// AMX tiles (`layout_matches` says which). The kernels work in items of 64 rows: `PackedLines` says where an item's
// rows 0-31 and 32-63 of one column pair lie.
struct PackedLines {
  int64_t stride;  // bf16 values from one column pair's line to the next
  int64_t half;    // bf16 values from rows 0-31 of a line to its rows 32-63
};

// the item of `valid` (<= 64) rows in a weight of `pairs` column pairs and blocks of `block_rows`; with 32-row blocks
// an item of up to 32 rows has no second block, and reads the first twice (the extra lanes are dropped)
inline PackedLines packed_lines(int64_t block_rows, int64_t pairs, int64_t valid) {
  return block_rows == 64 ? PackedLines{128, 64} : PackedLines{64, valid > 32 ? pairs * 64 : 0};
}

inline int64_t packed_weight_bytes(int64_t block_rows, int64_t n, int64_t pairs) {
  return (n + block_rows - 1) / block_rows * block_rows * pairs * 4;
}
