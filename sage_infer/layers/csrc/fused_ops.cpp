// One pass each for the elementwise glue of a decoder layer on CPU: RMSNorm (alone, or after the
// residual add), rotary (after Qwen3's per-head q/k RMSNorm), silu(gate) * up. Built with the paged
// decode kernel by sage_infer/layers/paged_kernel.py; the PyTorch ops they replace
// (sage_infer/layers/norm.py, rotary.py, models/llama.py MLP) stay the reference path
// (`model.elementwise: torch`).
//
// Every value is rounded to the tensor's dtype where the PyTorch reference rounds it (after the
// residual add, the normalised row before the weight, silu before the product, each rotary
// product), so bf16/fp16 results differ from the reference only by fp32 summation order.
// `_Pragma`, not `#pragma`: a directive cannot sit inside the AT_DISPATCH macro argument.
#include "ieee_div.h"
#include "kernel.h"
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "widen.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// the value `f` takes once stored as T
template <typename T>
inline float round_to(float f) { return widen(narrow<T>(f)); }
template <>
inline float round_to<float>(float f) { return f; }

// rows per task: about 16K elements, so a decode step's few rows stay on the calling thread
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// out[i] = w[i] * dtype(x[i] * rsqrt(mean(x^2) + eps)), x read as fp32 (Hugging Face's RMSNorm)
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t h, float eps) {
  float sq = 0.f;
  _Pragma("omp simd reduction(+ : sq)")
  for (int64_t i = 0; i < h; ++i) sq += widen(x[i]) * widen(x[i]);
  const float r = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
  _Pragma("omp simd")
  for (int64_t i = 0; i < h; ++i) out[i] = narrow<T>(widen(w[i]) * round_to<T>(widen(x[i]) * r));
}


void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be [N, H] with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), what, ": weight must be [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": weight and x dtypes differ");
}

}  // namespace

// x: [N, H] (rows may be strided) -> RMSNorm(x) * weight, a new contiguous [N, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t n = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = torch::empty({n, h}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * stride, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x (rounded to the dtype, as a PyTorch add is), then RMSNorm(residual) * weight as a new
// tensor. residual: contiguous [N, H], updated in place; x: [N, H]
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, weight, "add_rms_norm_");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual must be contiguous and shaped and typed like x");
  const int64_t n = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = torch::empty({n, h}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t *rp = residual.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = rp + r * h;
        const scalar_t* add = xp + r * stride;
        _Pragma("omp simd")
        for (int64_t i = 0; i < h; ++i) row[i] = narrow<scalar_t>(widen(row[i]) + widen(add[i]));
        norm_row(row, wp, op + r * h, h, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// gate_up: [N, 2I] (gate then up, rows may be strided) -> silu(gate) * up, [N, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [N, 2I] with contiguous rows");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({n, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t *g = gp + r * stride, *u = g + inter;
        scalar_t* o = op + r * inter;
        _Pragma("omp simd")
        for (int64_t i = 0; i < inter; ++i) {
          const float x = widen(g[i]);
          o[i] = narrow<scalar_t>(round_to<scalar_t>(x / (1.f + std::exp(-x))) * widen(u[i]));
        }
      }
    });
  });
  return out;
}

// In place on x: [T, heads, D] (a view; the last dim contiguous): optionally each head's RMSNorm over
// D (norm_weight [D], Qwen3's q_norm / k_norm), then neox rotary x * cos + roll(x, D/2) * signed_sin
// with cos, signed_sin: [T, D] in x's dtype (RotaryEmbedding.cos_sin)
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor signed_sin, c10::optional<torch::Tensor> norm_weight,
           double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope_: x must be [T, heads, D] with contiguous heads");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && d <= 1024, "rope_: head_dim must be even and at most 1024");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && cos.is_contiguous() &&
                  signed_sin.sizes() == cos.sizes() && signed_sin.is_contiguous(),
              "rope_: cos and signed_sin must be contiguous [T, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(),
              "rope_: cos/sin dtype differs from x");
  const bool norm = norm_weight.has_value() && norm_weight->defined();
  if (norm) {
    TORCH_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == d && norm_weight->is_contiguous() &&
                    norm_weight->scalar_type() == x.scalar_type(), "rope_: norm_weight must be [D] in x's dtype");
  }
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *sp = signed_sin.data_ptr<scalar_t>();
    const scalar_t* wp = norm ? norm_weight->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, t * heads, grain(d), [&](int64_t begin, int64_t end) {
      scalar_t normed[1024];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t tok = task / heads, head = task % heads;
        scalar_t* row = xp + tok * s0 + head * s1;
        const scalar_t *c = cp + tok * d, *s = sp + tok * d;
        const scalar_t* src = row;
        if (norm) {
          norm_row(row, wp, normed, d, static_cast<float>(eps));
          src = normed;
        } else {
          std::memcpy(normed, row, d * sizeof(scalar_t));
          src = normed;
        }
        _Pragma("omp simd")
        for (int64_t i = 0; i < d; ++i) {
          const float rolled = widen(src[i < half ? i + half : i - half]);
          row[i] = narrow<scalar_t>(round_to<scalar_t>(widen(src[i]) * widen(c[i])) +
                                   round_to<scalar_t>(rolled * widen(s[i])));
        }
      }
    });
  });
}

// One token's K (or V) heads into an int8 pool, as `KVCodec.encode` (int8) and `QuantizedKVPool.store` make them,
// to the bit: per head scale = fp16(clamp(amax / 127, 2^-24, fp16 max)), code = floor(x / scale + 127.5) - 127
// with x / scale = x * (1 / scale) clamped to +-127, x read as fp32
template <typename T>
inline void quantize_head(const T* x, int8_t* code, at::Half* scale, int64_t d) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(widen(x[i])));
  const float s = std::min(std::max(ieee_div(amax, 127.f), 0x1p-24f), 65504.f);
  const at::Half half(s);
  const float inv = ieee_div(1.f, static_cast<float>(half));
  *scale = half;
  _Pragma("omp simd")
  for (int64_t i = 0; i < d; ++i) {
    const float w = std::min(std::max(widen(x[i]) * inv, -127.f), 127.f);
    code[i] = static_cast<int8_t>(std::floor(w + 127.5f) - 127.f);
  }
}

// src: [T, KvH, D] (each row's heads contiguous, rows at any stride) in fp32, bf16 or fp16; codes: the pool's
// [slots, KvH, D] int8 rows of one layer's K (or V); scales: its [slots, KvH(, 1)] fp16 scales, contiguous;
// slots: [T] int64 -> token t quantized into slot slots[t] (QuantizedKVPool.store's result, with no temporaries)
void quantize_store_int8_(torch::Tensor src, torch::Tensor codes, torch::Tensor scales, torch::Tensor slots) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && src.stride(1) == src.size(2),
              "quantize_store_int8_: src must be [T, KvH, D] with each row's heads contiguous");
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(1) == src.size(1) && codes.size(2) == src.size(2),
              "quantize_store_int8_: codes must be contiguous int8 [slots, KvH, D]");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.numel() == codes.size(0) * codes.size(1),
              "quantize_store_int8_: scales must be contiguous fp16, one per (slot, KV head)");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == src.size(0),
              "quantize_store_int8_: slots must be [T] int64");
  const int64_t t = src.size(0), heads = src.size(1), d = src.size(2), num_slots = codes.size(0);
  const int64_t stride = src.stride(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "quantize_store_int8_: slot ", slot[i], " is outside the pool");
  int8_t* cp = codes.data_ptr<int8_t>();
  at::Half* sp = scales.data_ptr<at::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "quantize_store_int8_", [&] {
    const scalar_t* xp = src.data_ptr<scalar_t>();
    at::parallel_for(0, t * heads, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t tok = task / heads, head = task % heads, dst = slot[tok] * heads + head;
        quantize_head(xp + tok * stride + head * d, cp + dst * d, sp + dst, d);
      }
    });
  });
}
