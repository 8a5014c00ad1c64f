// What the kernels need of PyTorch: ATen's tensors and thread pool, not the whole C++ frontend that
// <torch/extension.h> brings (that header alone took ~55 s of a ~60 s compile per file; ATen's ~15 s), since
// every file is compiled once per ISA level (sage_infer/layers/kernel_build.py).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace torch {
using namespace at;  // the kernels are written against torch::Tensor / torch::empty, ATen's names
}
