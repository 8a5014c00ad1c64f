// A decode step's decoder layers in one call (`model.decode_step: sage`; every row one new token, read in
// place, with or without a prefix that all rows share): for each layer, the
// stacked q/k/v product, rotary (after Qwen3's q/k norms), the K/V store into the pool, paged
// attention, the o product, the residual add with the next norm, gate/up, silu*mul, down (a mixture-of-experts
// layer: moe_experts.cpp's moe_block, its routing, grouping and experts) and the residual add with the next layer's
// norm, with no Python between them. The kernels are the ones the
// Python path calls one by one (small_linear.cpp or oneDNN's packed linear, as `PackedLinear` picks;
// fused_ops.cpp; paged_decode.cpp) in the same order on the same values, so the result is the Python
// path's to the bit; what goes is the interpreter's time around ~12 calls per layer (about a fifth of
// a batch-1 step of the 0.5B shape here).
// Over an int8 pool (QuantizedKVPool) the store quantizes as the pool's does, to the bit (fused_ops.cpp
// quantize_store_int8_), attention reads the codes and scales in place (paged_decode_attention_int8), and steps
// with a shared prefix stay in Python.
// Each layer attends under its own kind (a sliding window, a logit soft-cap, attention sinks: paged_decode.cpp's
// `_kind` entry points) through its KV group's slots and block tables (a model with sliding-window layers keeps a
// block table per group), with the rotary tables of its own rope (Gemma 3's sliding layers).
// Gemma 2/3's layers (`gemma`: sage_infer/models/gemma.py) differ in their glue: RMSNorms scaling by fp32 (1 + w),
// in fp32 throughout and rounded once (`gemma_rms_norm` and friends below, also what the Python layer loop runs
// for Gemma); q/k norms (Gemma 3) then rotary; a norm after attention and around the MLP (pre/post feed-forward);
// GELU-tanh(gate) * up as ATen computes it.
// The references are `LlamaForCausalLM.forward`'s fused branch (sage_infer/models/llama.py) and
// `GemmaForCausalLM.forward`'s (sage_infer/models/gemma.py).
#include "ieee_div.h"
#include "kernel.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "widen.h"

// small_linear.cpp, fused_ops.cpp, flash_bf16.cpp, paged_decode.cpp: built into the same module
torch::Tensor small_linear(torch::Tensor x, int64_t address, int64_t nbytes, int64_t n,
                           c10::optional<torch::Tensor> bias, int64_t block_rows);
torch::Tensor bf16_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor signed_sin, c10::optional<torch::Tensor> norm_weight,
           double eps);
std::vector<torch::Tensor> flash_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                           bool causal);
std::vector<torch::Tensor> flash_attention_slots(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                                 double scale, bool causal, int64_t window, double softcap,
                                                 c10::optional<torch::Tensor> sinks);
std::vector<torch::Tensor> paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                  torch::Tensor block_tables, torch::Tensor context_lens,
                                                  double scale);
std::vector<torch::Tensor> paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_codes, torch::Tensor v_codes,
                                                       torch::Tensor k_scales, torch::Tensor v_scales,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       double scale);
void quantize_store_int8_(torch::Tensor src, torch::Tensor codes, torch::Tensor scales, torch::Tensor slots);
// moe_experts.cpp: a mixture-of-experts layer's routing, grouping and experts in one call
torch::Tensor moe_block(torch::Tensor x, torch::Tensor router, torch::Tensor router_bias, int64_t top_k,
                        int64_t mode, bool renormalize, bool weights_in_dtype, torch::Tensor counts,
                        torch::Tensor gate_up, torch::Tensor down, int64_t inter, int64_t packed,
                        torch::Tensor gate_up_bias, torch::Tensor down_bias, bool clamped, double alpha, double limit,
                        torch::Tensor gate_up_scales, torch::Tensor down_scales);
std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor x, torch::Tensor router, torch::Tensor bias,
                                                   int64_t top_k, int64_t mode, bool renormalize,
                                                   bool weights_in_dtype);
torch::Tensor moe_experts_routed(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor counts,
                                 torch::Tensor gate_up, torch::Tensor down, int64_t inter, int64_t packed,
                                 torch::Tensor gate_up_bias, torch::Tensor down_bias, bool clamped, double alpha,
                                 double limit, torch::Tensor gate_up_scales, torch::Tensor down_scales);
torch::Tensor moe_experts_linears(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor counts,
                                  std::vector<at::Tensor> gate_up_linears, std::vector<at::Tensor> down_linears,
                                  int64_t limit, int64_t pass_rows, torch::Tensor gate_up, torch::Tensor down,
                                  int64_t inter, int64_t packed, torch::Tensor gate_up_bias, torch::Tensor down_bias,
                                  bool clamped, double alpha, double limit_swiglu, torch::Tensor gate_up_scales,
                                  torch::Tensor down_scales);
std::vector<torch::Tensor> paged_decode_attention_kind(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       double scale, int64_t window, double softcap,
                                                       c10::optional<torch::Tensor> sinks);
std::vector<torch::Tensor> paged_decode_attention_int8_kind(torch::Tensor q, torch::Tensor k_codes,
                                                            torch::Tensor v_codes, torch::Tensor k_scales,
                                                            torch::Tensor v_scales, torch::Tensor block_tables,
                                                            torch::Tensor context_lens, double scale, int64_t window,
                                                            double softcap, c10::optional<torch::Tensor> sinks);

// Gemma's RMSNorm (Hugging Face's Gemma2RMSNorm / Gemma3RMSNorm): x read as fp32, x * rsqrt(mean(x^2) + eps) * w
// with w the fp32 (1 + weight), rounded to x's dtype once, at the end
namespace gemma {

// rows per task: about 16K elements, so a decode step's few rows stay on the calling thread
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

template <typename T>
inline float inv_rms(const T* x, int64_t h, float eps) {
  float sq = 0.f;
  _Pragma("omp simd reduction(+ : sq)")
  for (int64_t i = 0; i < h; ++i) sq += widen(x[i]) * widen(x[i]);
  return ieee_div(1.f, std::sqrt(sq / static_cast<float>(h) + eps));
}

// out may be x (in place)
template <typename T>
inline void norm_row(const T* x, const float* w, T* out, int64_t h, float eps) {
  const float r = inv_rms(x, h, eps);
  _Pragma("omp simd")
  for (int64_t i = 0; i < h; ++i) out[i] = narrow<T>(widen(x[i]) * r * w[i]);
}

// residual = dtype(residual + dtype(norm(a) * post)); out = norm(residual) * next (Gemma's `x + post_norm(f(..))`
// followed by the next sublayer's input norm)
template <typename T>
inline void add_norms_row(const T* a, T* residual, const float* post, const float* next, T* out, int64_t h,
                          float eps) {
  const float r = inv_rms(a, h, eps);
  _Pragma("omp simd")
  for (int64_t i = 0; i < h; ++i)
    residual[i] = narrow<T>(widen(residual[i]) + widen(narrow<T>(widen(a[i]) * r * post[i])));
  norm_row(residual, next, out, h, eps);
}

void check_weight(const torch::Tensor& w, int64_t h, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == h && w.is_contiguous(), what,
              ": the weight must be the fp32 (1 + w), [", h, "]");
}

}  // namespace gemma

// x: [N, H] (rows may be strided); weight: fp32 (1 + w) [H] -> Gemma's RMSNorm of x, a new contiguous [N, H]
torch::Tensor gemma_rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gemma_rms_norm: x must be [N, H] with contiguous rows");
  gemma::check_weight(weight, x.size(1), "gemma_rms_norm");
  const int64_t n = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = torch::empty({n, h}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemma_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const float* wp = weight.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, gemma::grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        gemma::norm_row(xp + r * stride, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// x: [T, heads, D] (a view; heads contiguous), in place: each head's Gemma RMSNorm over D (Gemma 3's q/k norms)
void gemma_norm_heads_(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "gemma_norm_heads_: x must be [T, heads, D] with contiguous heads");
  gemma::check_weight(weight, x.size(2), "gemma_norm_heads_");
  const int64_t heads = x.size(1), d = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemma_norm_heads_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const float* wp = weight.data_ptr<float>();
    at::parallel_for(0, x.size(0) * heads, gemma::grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        scalar_t* row = xp + (task / heads) * s0 + (task % heads) * s1;
        gemma::norm_row(row, wp, row, d, static_cast<float>(eps));
      }
    });
  });
}

// a: a sublayer's output [N, H] (rows may be strided); residual: the stream, contiguous [N, H], updated in place to
// residual + norm(a) * post; returns norm(residual) * next, a new [N, H] (post, next: fp32 (1 + w) [H])
torch::Tensor gemma_add_rms_norms_(torch::Tensor a, torch::Tensor residual, torch::Tensor post, torch::Tensor next,
                                   double eps) {
  TORCH_CHECK(a.dim() == 2 && a.stride(1) == 1, "gemma_add_rms_norms_: a must be [N, H] with contiguous rows");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == a.sizes() && residual.scalar_type() == a.scalar_type(),
              "gemma_add_rms_norms_: residual must be contiguous and shaped and typed like a");
  gemma::check_weight(post, a.size(1), "gemma_add_rms_norms_");
  gemma::check_weight(next, a.size(1), "gemma_add_rms_norms_");
  const int64_t n = a.size(0), h = a.size(1), stride = a.stride(0);
  auto out = torch::empty({n, h}, a.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "gemma_add_rms_norms_", [&] {
    const scalar_t* ap = a.data_ptr<scalar_t>();
    scalar_t *rp = residual.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    const float *pp = post.data_ptr<float>(), *np = next.data_ptr<float>();
    at::parallel_for(0, n, gemma::grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        gemma::add_norms_row(ap + r * stride, rp + r * h, pp, np, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// gate_up: [N, 2I] (gate then up) -> gelu_tanh(gate) * up, [N, I], by ATen's ops (Gemma's MLP, `F.gelu(gate,
// approximate="tanh") * up`, to the bit)
static torch::Tensor gelu_tanh_mul(const torch::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  return at::gelu(gate_up.narrow(1, 0, inter), "tanh").mul_(gate_up.narrow(1, inter, inter));
}

// oneDNN's product on a packed weight: torch.ops.mkldnn._linear_pointwise, as `PackedLinear` calls it (moe_experts.cpp
// calls it too)
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          c10::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

namespace {

// one `PackedLinear`: products of up to `small_rows` bf16 rows on small_linear (its fp32 bias), the
// rest on oneDNN (its bias in the model's dtype), as `PackedLinear.forward` chooses; a bf16 layer that oneDNN
// could not pack (`weight_bf16` set) runs up to `bf16_rows` rows on bf16_rows_linear, the rest in fp32 on its
// packed fp32 copy (fp32 bias), rounded back to bf16
struct Linear {
  int64_t address, nbytes, n, small_rows, bf16_rows, block_rows;  // block_rows: small_linear's layout (64, 32)
  torch::Tensor packed;
  c10::optional<torch::Tensor> bias32, bias, weight_bf16, bias_bf16;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (x.size(0) <= small_rows && x.scalar_type() == at::kBFloat16)
      return small_linear(x, address, nbytes, n, bias32, block_rows);
    if (weight_bf16.has_value()) {
      if (x.size(0) <= bf16_rows) return bf16_rows_linear(x, *weight_bf16, bias_bf16);
      return onednn_linear(x.to(at::kFloat), packed, bias).to(x.scalar_type());
    }
    return onednn_linear(x, packed, bias);
  }
};

// a mixture-of-experts MLP: moe_block's arguments but x (`SparseMoeBlock.decode_step_args`); with `router_linear`
// (`set_moe_rows`) steps of any rows, each as `moe_step` runs it: past `route_rows` rows the router's product on its
// PackedLinear and PyTorch's softmax and top-k (`route_tokens`), past `pairs_limit` rows (-1: none) the experts past
// that many pairs on their own oneDNN weights (`run_routed`: moe_experts_linears)
struct Moe {
  torch::Tensor router, router_bias, counts, gate_up, down, gate_up_bias, down_bias, gate_up_scales, down_scales;
  int64_t top_k, mode, inter, packed;  // packed: the experts' rows per packed block (64, 32), 0: plain
  bool renormalize, weights_in_dtype, clamped;
  double alpha, limit;
  c10::optional<Linear> router_linear;
  std::vector<torch::Tensor> gate_up_linears, down_linears;  // per expert, where pairs_limit >= 0
  int64_t route_rows = 0, pairs_limit = -1, pass_rows = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const int64_t rows = x.size(0);
    const bool kernel_takes = pairs_limit < 0 || rows <= pairs_limit;
    if (!router_linear.has_value() || (rows <= route_rows && kernel_takes))
      return moe_block(x, router, router_bias, top_k, mode, renormalize, weights_in_dtype, counts, gate_up, down,
                       inter, packed, gate_up_bias, down_bias, clamped, alpha, limit, gate_up_scales, down_scales);
    torch::Tensor weights, ids;
    if (rows <= route_rows) {
      std::tie(weights, ids) = moe_route(x, router, router_bias, top_k, mode, renormalize, weights_in_dtype);
    } else if (mode == 1) {  // route_tokens, TOP_K_SOFTMAX: the top k logits softmaxed in their dtype
      auto [top, top_ids] = at::topk((*router_linear)(x), top_k, -1);
      weights = at::softmax(top, 1, top.scalar_type()), ids = top_ids;
    } else {  // moe.route: the softmax over every expert in fp32, its top k, divided by their sum
      auto [top, top_ids] = at::topk(at::softmax((*router_linear)(x), -1, at::kFloat), top_k, -1);
      if (renormalize) top = top / top.sum(-1, true);
      weights = weights_in_dtype ? top.to(x.scalar_type()) : top, ids = top_ids;
    }
    if (kernel_takes)
      return moe_experts_routed(x, weights, ids, counts, gate_up, down, inter, packed, gate_up_bias, down_bias,
                                clamped, alpha, limit, gate_up_scales, down_scales);
    return moe_experts_linears(x, weights, ids, counts, gate_up_linears, down_linears, pairs_limit, pass_rows, gate_up,
                               down, inter, packed, gate_up_bias, down_bias, clamped, alpha, limit, gate_up_scales,
                               down_scales);
  }
};

struct Layer {
  // where the layer's MLP is a mixture of experts, gate_up and down are its shared expert's (Qwen2-MoE), or unused
  Linear qkv, o, gate_up, down;
  // post-attention norm; the next layer's input norm (or the final); Gemma: fp32 (1 + w)
  torch::Tensor post_norm, next_norm;
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3's / Gemma 3's per-head norms
  // OLMoE's q and k norms over all heads [H * D], [KvH * D] (`set_qk_full`), and its clamp of q, k and v (0: none)
  c10::optional<torch::Tensor> q_norm_full, k_norm_full;
  double clip_qkv = 0.0;
  c10::optional<torch::Tensor> pre_ff, post_ff;  // Gemma's feed-forward norms, fp32 (1 + w)
  torch::Tensor k_rows, v_rows;                // the pool's token rows [slots, KvH, D] (KVPool.token_rows)
  torch::Tensor k_blocks, v_blocks;            // the same memory as [blocks, block_size, KvH, D]
  // an int8 pool: k/v rows and blocks hold its codes (int8), these its fp16 scales, one per (slot, KV head)
  c10::optional<torch::Tensor> k_scales, v_scales;
  int64_t group = 0;        // its KV group: whose slots and block tables it stores and reads through
  int64_t window = 0;       // its kind (flash.h's `Kind`): a sliding window (0: none), a soft-cap (0: none), sinks
  double softcap = 0.0;
  c10::optional<torch::Tensor> sinks;
  bool local_rope = false;  // rotates by the step's second (local) rotary tables
  c10::optional<Moe> moe;   // its MLP as a mixture of experts (`set_moe`), else the dense gate_up and down
  c10::optional<Linear> shared_gate;  // with `moe`: the shared expert's gate [1, hidden] (`set_shared_expert`)

  bool plain() const { return window <= 0 && softcap <= 0.0 && !sinks.has_value(); }
};

// each row's K (or V) [KvH, D] into its slot: what KVPool.store's index_copy_ does
void store_rows(const torch::Tensor& src, const torch::Tensor& rows, const int64_t* slots, int64_t batch) {
  const int64_t width = rows.size(1) * rows.size(2), num_slots = rows.size(0);
  const int64_t bytes = width * static_cast<int64_t>(rows.element_size());
  char* dst = static_cast<char*>(rows.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  const int64_t src_stride = src.stride(0) * static_cast<int64_t>(src.element_size());
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < num_slots, "decode_step: slot ", slots[b], " is outside the pool");
    std::memcpy(dst + slots[b] * bytes, from + b * src_stride, bytes);
  }
}

// a step's per-group metadata: slots [B] long, block_tables [B, W] long, context_lens [B] long of each KV group
struct GroupMeta {
  std::vector<torch::Tensor> slots, tables, lens;
};

}  // namespace

class DecodeLayers {
 public:
  // per layer, in order: linears (qkv, o, gate_up, down) as (address, nbytes, out_features, small_rows,
  // bf16_rows, block_rows) x 4 in `shapes` (address, nbytes and block_rows 0 where small_rows is 0), their packed
  // weights x 4 in `packed`,
  // biases as (fp32, model dtype) x 4 in `biases` (none where absent), (bf16 weight, bf16 bias) x 4 in `bf16`
  // (none but for bf16 layers on fp32 copies), and in `tensors` post_norm, next_norm, k_rows, v_rows, k_blocks,
  // v_blocks; `qk_norms`: q_norm, k_norm per layer, or empty; `kv_scales`: an int8 pool's k_scales, v_scales
  // per layer (k/v rows and blocks are then its codes: QuantizedKVPool.int8_block_views), or empty;
  // `ff_norms`: Gemma's pre_feedforward, post_feedforward norms per layer (the layers are then Gemma's, every norm
  // the fp32 (1 + w)), or empty; `layout`: (KV group, window, local rope 0/1) per layer, or empty (group 0, no
  // window, the one rope); `softcaps`: per layer (0: none), or empty; `sinks`: per layer fp32 [H] or none, or empty
  DecodeLayers(std::vector<int64_t> shapes, std::vector<torch::Tensor> packed,
               std::vector<c10::optional<torch::Tensor>> biases, std::vector<c10::optional<torch::Tensor>> bf16,
               std::vector<torch::Tensor> tensors, std::vector<torch::Tensor> qk_norms,
               std::vector<torch::Tensor> kv_scales, std::vector<torch::Tensor> ff_norms, std::vector<int64_t> layout,
               std::vector<double> softcaps, std::vector<c10::optional<torch::Tensor>> sinks, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, double qk_eps, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), qk_eps_(qk_eps), scale_(scale),
        int8_(!kv_scales.empty()), gemma_(!ff_norms.empty()) {
    const size_t n = tensors.size() / 6;
    TORCH_CHECK(tensors.size() == n * 6 && shapes.size() == n * 24 && packed.size() == n * 4 &&
                    biases.size() == n * 8 && bf16.size() == n * 8 && (qk_norms.empty() || qk_norms.size() == n * 2) &&
                    (kv_scales.empty() || kv_scales.size() == n * 2) && (ff_norms.empty() || ff_norms.size() == n * 2) &&
                    (layout.empty() || layout.size() == n * 3) && (softcaps.empty() || softcaps.size() == n) &&
                    (sinks.empty() || sinks.size() == n),
                "DecodeLayers: per layer 24 linear numbers, 4 packed weights, 8 biases, 8 bf16 weights/biases, 6 "
                "tensors (and 2 q/k norms, 2 int8 scale tensors, 2 feed-forward norms, 3 layout numbers, a soft-cap, "
                "sinks)");
    for (size_t i = 0; i < n; ++i) {
      auto linear = [&](size_t j) {
        const int64_t* s = shapes.data() + i * 24 + j * 6;
        return Linear{s[0], s[1], s[2], s[3], s[4], s[5], packed[i * 4 + j], biases[i * 8 + j * 2],
                      biases[i * 8 + j * 2 + 1], bf16[i * 8 + j * 2], bf16[i * 8 + j * 2 + 1]};
      };
      Layer layer{linear(0), linear(1), linear(2), linear(3), tensors[i * 6], tensors[i * 6 + 1]};
      layer.k_rows = tensors[i * 6 + 2], layer.v_rows = tensors[i * 6 + 3];
      layer.k_blocks = tensors[i * 6 + 4], layer.v_blocks = tensors[i * 6 + 5];
      if (!qk_norms.empty()) layer.q_norm = qk_norms[i * 2], layer.k_norm = qk_norms[i * 2 + 1];
      if (int8_) layer.k_scales = kv_scales[i * 2], layer.v_scales = kv_scales[i * 2 + 1];
      if (gemma_) layer.pre_ff = ff_norms[i * 2], layer.post_ff = ff_norms[i * 2 + 1];
      if (!layout.empty()) {
        layer.group = layout[i * 3], layer.window = layout[i * 3 + 1], layer.local_rope = layout[i * 3 + 2] != 0;
        TORCH_CHECK(layer.group >= 0, "DecodeLayers: a KV group is an index");
        groups_ = std::max(groups_, layer.group + 1);
      }
      if (!softcaps.empty()) layer.softcap = softcaps[i];
      if (!sinks.empty() && sinks[i].has_value()) {
        TORCH_CHECK(sinks[i]->scalar_type() == at::kFloat && sinks[i]->is_contiguous() && sinks[i]->numel() == num_heads,
                    "DecodeLayers: sinks: contiguous fp32, one per query head");
        layer.sinks = sinks[i];
      }
      check_layer(layer);
      layers_.push_back(std::move(layer));
    }
  }

  // layer i's MLP as a mixture of experts: moe_block's arguments but x (the Llama family's layers only)
  void set_moe(int64_t i, torch::Tensor router, torch::Tensor router_bias, int64_t top_k, int64_t mode,
               bool renormalize, bool weights_in_dtype, torch::Tensor counts, torch::Tensor gate_up, torch::Tensor down,
               int64_t inter, int64_t packed, torch::Tensor gate_up_bias, torch::Tensor down_bias, bool clamped,
               double alpha, double limit, torch::Tensor gate_up_scales, torch::Tensor down_scales) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && !gemma_,
                "DecodeLayers.set_moe: a layer of this Llama-family step");
    layers_[i].moe = Moe{router, router_bias, counts, gate_up, down, gate_up_bias, down_bias, gate_up_scales,
                         down_scales, top_k, mode, inter, packed, renormalize, weights_in_dtype, clamped, alpha,
                         limit};
  }

  // layer i's mixture of experts (`set_moe` first) takes steps of any rows: its router as a linear (6 numbers, the
  // packed weight, its biases and bf16 weight and bias, as the constructor takes one) for steps of more than
  // `route_rows`; past `pairs_limit` rows (-1: none) the experts' own packed weights, one gate_up and one down per
  // expert, in passes of `pass_rows` rows (`Moe`)
  void set_moe_rows(int64_t i, std::vector<int64_t> shape, torch::Tensor packed, c10::optional<torch::Tensor> bias32,
                    c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> weight_bf16,
                    c10::optional<torch::Tensor> bias_bf16, int64_t route_rows, int64_t pairs_limit,
                    int64_t pass_rows, std::vector<torch::Tensor> gate_up_linears,
                    std::vector<torch::Tensor> down_linears) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && layers_[i].moe.has_value() && shape.size() == 6,
                "DecodeLayers.set_moe_rows: a mixture-of-experts layer (set_moe), 6 linear numbers");
    auto& moe = *layers_[i].moe;
    const auto experts = static_cast<size_t>(moe.gate_up.size(0));
    TORCH_CHECK(pairs_limit < 0 || (gate_up_linears.size() == experts && down_linears.size() == experts &&
                                    pass_rows > 0),
                "DecodeLayers.set_moe_rows: with a pairs limit, one gate_up and one down weight per expert");
    moe.router_linear = Linear{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], packed, bias32, bias,
                               weight_bf16, bias_bf16};
    moe.route_rows = route_rows, moe.pairs_limit = pairs_limit, moe.pass_rows = pass_rows;
    moe.gate_up_linears = std::move(gate_up_linears), moe.down_linears = std::move(down_linears);
  }

  // layer i's mixture of experts (`set_moe` first) has a shared expert (Qwen2-MoE): the layer's gate_up and down,
  // scaled by the sigmoid of this gate's product; the gate as the constructor takes a linear (6 numbers, the packed
  // weight, its biases and bf16 weight and bias)
  void set_shared_expert(int64_t i, std::vector<int64_t> shape, torch::Tensor packed,
                         c10::optional<torch::Tensor> bias32, c10::optional<torch::Tensor> bias,
                         c10::optional<torch::Tensor> weight_bf16, c10::optional<torch::Tensor> bias_bf16) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && layers_[i].moe.has_value() && shape.size() == 6,
                "DecodeLayers.set_shared_expert: a mixture-of-experts layer (set_moe), 6 linear numbers");
    layers_[i].shared_gate = Linear{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], packed, bias32, bias,
                                    weight_bf16, bias_bf16};
  }

  // layer i's OLMoE attention (`Attention.norm_and_clip`): RMSNorms of q and of k over all heads (weights
  // [H * D] and [KvH * D] in the model's dtype, the layers' epsilon; none: no norm), then q, k and v clamped to
  // +-clip (clip <= 0: no clamp)
  void set_qk_full(int64_t i, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double clip) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && q_norm.has_value() == k_norm.has_value(),
                "DecodeLayers.set_qk_full: a layer, and both norms or neither");
    TORCH_CHECK(!q_norm.has_value() || (q_norm->numel() == heads_ * head_dim_ && k_norm->numel() == kv_heads_ *
                                        head_dim_ && !layers_[i].q_norm.has_value()),
                "DecodeLayers.set_qk_full: norms of [H * D] and [KvH * D], on a layer without per-head norms");
    layers_[i].q_norm_full = q_norm;
    layers_[i].k_norm_full = k_norm;
    layers_[i].clip_qkv = clip;
  }

  // h: the first layer's normed input [B, hidden]; residual: its input, updated in place; cos, signed_sin: [B, D]
  // in the model's dtype (local_cos, local_sin: the same for the layers with their own rope, or none); slots: [B]
  // long, block_tables: [B, W] long, context_lens: [B] long, one of each per KV group; shared: the blocks that
  // every row's context starts with ([S] long), attended once by all rows together (cascade attention; one group,
  // plain layers), block_tables and context_lens then describing what follows them, or none; flash: the shared
  // blocks through sage's flash kernel (bf16 or fp32), else PyTorch's
  // -> the last layer's output normed by the final norm, [B, hidden]
  torch::Tensor run(torch::Tensor h, torch::Tensor residual, torch::Tensor cos, torch::Tensor signed_sin,
                    c10::optional<torch::Tensor> local_cos, c10::optional<torch::Tensor> local_sin,
                    std::vector<torch::Tensor> slots, std::vector<torch::Tensor> block_tables,
                    std::vector<torch::Tensor> context_lens, c10::optional<torch::Tensor> shared, bool flash) const {
    const int64_t batch = h.size(0);
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == groups_ && block_tables.size() == slots.size() &&
                    context_lens.size() == slots.size(), "decode_step: slots, block_tables and context_lens: one "
                    "per KV group (", groups_, ")");
    GroupMeta meta;
    for (int64_t g = 0; g < groups_; ++g) {
      TORCH_CHECK(slots[g].scalar_type() == at::kLong && slots[g].is_contiguous() && slots[g].numel() == batch,
                  "decode_step: slots must be [B] int64");
      meta.slots.push_back(slots[g]);
      meta.tables.push_back(block_tables[g].contiguous());
      meta.lens.push_back(context_lens[g].contiguous());
    }
    TORCH_CHECK(int8_ || layers_.empty() || h.scalar_type() == layers_[0].k_rows.scalar_type(),
                "decode_step: the pool's dtype is not the model's");
    TORCH_CHECK(!int8_ || !shared.has_value(), "decode_step: an int8 pool's steps with a shared prefix run in Python");
    TORCH_CHECK(!shared.has_value() || (groups_ == 1 && all_plain_),
                "decode_step: a shared prefix is attended by plain layers of one KV group only");
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value() && (local_cos.has_value() || !any_local_),
                "decode_step: the layers with their own rope need local_cos and local_sin");
    for (const Layer& layer : layers_) {
      const bool local = layer.local_rope;
      auto attended = attention(layer, h, local ? *local_cos : cos, local ? *local_sin : signed_sin, meta, shared,
                                flash);
      h = gemma_ ? feed_forward_gemma(layer, attended, residual) : feed_forward(layer, attended, residual);
    }
    return h;
  }

 private:
  void check_layer(const Layer& layer) {
    const auto pool_dtype = int8_ ? at::kChar : (gemma_ ? layer.k_rows.scalar_type() : layer.post_norm.scalar_type());
    TORCH_CHECK(layer.k_rows.scalar_type() == pool_dtype && layer.k_rows.is_contiguous() &&
                    layer.k_rows.dim() == 3 && layer.k_rows.size(1) == kv_heads_ &&
                    layer.k_rows.size(2) == head_dim_ && layer.v_rows.sizes() == layer.k_rows.sizes(),
                "DecodeLayers: the pool rows must be contiguous [slots, KvH, D] in the model's dtype (int8 codes "
                "with scales)");
    if (gemma_) {
      for (const auto* w : {&layer.post_norm, &layer.next_norm, &*layer.pre_ff, &*layer.post_ff})
        TORCH_CHECK(w->scalar_type() == at::kFloat, "DecodeLayers: Gemma's norms are the fp32 (1 + w)");
    }
    all_plain_ = all_plain_ && layer.plain();
    any_local_ = any_local_ || layer.local_rope;
  }

  // the attention half of a layer from its normed input h: the q/k/v product, the q/k norms and rotary, the K/V
  // store through its group's slots, attention under its kind -> [B, H * D] in h's dtype (before the o product)
  torch::Tensor attention(const Layer& layer, const torch::Tensor& h, const torch::Tensor& cos,
                          const torch::Tensor& signed_sin, const GroupMeta& meta,
                          const c10::optional<torch::Tensor>& shared, bool flash) const {
    const int64_t batch = h.size(0), width = (heads_ + 2 * kv_heads_) * head_dim_;
    auto qkv = layer.qkv(h);
    TORCH_CHECK(qkv.size(1) == width, "decode_step: the qkv product has ", qkv.size(1), " columns, not ", width);
    auto heads = qkv.view({batch, heads_ + 2 * kv_heads_, head_dim_});
    auto q = heads.narrow(1, 0, heads_), k = heads.narrow(1, heads_, kv_heads_);
    auto v = heads.narrow(1, heads_ + kv_heads_, kv_heads_);
    if (layer.q_norm_full.has_value()) {  // as sage_infer.layers.norm.RMSNorm computes it
      const auto norm = [&](torch::Tensor flat, const torch::Tensor& w) {
        auto x = flat.to(at::kFloat);
        x = x * at::rsqrt(x.pow(2).mean(-1, true) + eps_);
        flat.copy_(w * x.to(flat.scalar_type()));
      };
      norm(qkv.narrow(1, 0, heads_ * head_dim_), *layer.q_norm_full);
      norm(qkv.narrow(1, heads_ * head_dim_, kv_heads_ * head_dim_), *layer.k_norm_full);
    }
    if (layer.clip_qkv > 0.0) qkv.clamp_(-layer.clip_qkv, layer.clip_qkv);
    if (layer.q_norm.has_value() && !gemma_) {
      rope_(q, cos, signed_sin, layer.q_norm, qk_eps_);
      rope_(k, cos, signed_sin, layer.k_norm, qk_eps_);
    } else {  // q and k side by side: one pass (Gemma 3's (1 + w) q/k norms first)
      if (layer.q_norm.has_value()) {
        gemma_norm_heads_(q, *layer.q_norm, qk_eps_);
        gemma_norm_heads_(k, *layer.k_norm, qk_eps_);
      }
      rope_(heads.narrow(1, 0, heads_ + kv_heads_), cos, signed_sin, c10::nullopt, qk_eps_);
    }
    const auto& slots = meta.slots[layer.group];
    if (int8_) {  // QuantizedKVPool.store's codes and scales
      quantize_store_int8_(k, layer.k_rows, *layer.k_scales, slots);
      quantize_store_int8_(v, layer.v_rows, *layer.v_scales, slots);
    } else {
      store_rows(k, layer.k_rows, slots.data_ptr<int64_t>(), batch);
      store_rows(v, layer.v_rows, slots.data_ptr<int64_t>(), batch);
    }
    auto attended = attend(layer, q, meta.tables[layer.group], meta.lens[layer.group], shared, flash);
    return attended.to(h.scalar_type()).view({batch, heads_ * head_dim_});
  }

  // the Llama family's rest of a layer: o, the residual add with the post-attention norm, gate/up, silu*mul, down,
  // the residual add with the next norm
  torch::Tensor feed_forward(const Layer& layer, const torch::Tensor& attended, torch::Tensor& residual) const {
    auto h = add_rms_norm_(layer.o(attended), residual, layer.post_norm, eps_);
    const auto dense = [&] { return layer.down(silu_mul(layer.gate_up(h))); };  // the MLP, or Qwen2-MoE's shared expert
    auto mlp = layer.moe.has_value() ? (*layer.moe)(h) : dense();
    if (layer.shared_gate.has_value())  // SparseMoeBlock.forward: out += sigmoid(gate(x)) * shared_expert(x)
      mlp.add_(at::sigmoid((*layer.shared_gate)(h)) * dense());
    return add_rms_norm_(mlp, residual, layer.next_norm, eps_);
  }

  // Gemma's: o, its post-attention norm added to the residual, the pre-feed-forward norm, gate/up, gelu_tanh*mul,
  // down, its post-feed-forward norm added to the residual, the next norm
  torch::Tensor feed_forward_gemma(const Layer& layer, const torch::Tensor& attended, torch::Tensor& residual) const {
    auto h = gemma_add_rms_norms_(layer.o(attended), residual, layer.post_norm, *layer.pre_ff, eps_);
    return gemma_add_rms_norms_(layer.down(gelu_tanh_mul(layer.gate_up(h))), residual, *layer.post_ff,
                                layer.next_norm, eps_);
  }

  // q: [B, H, D] -> attention over each row's context, fp32 [B, H, D]: paged_attention's pure decode step under the
  // layer's kind, or with `shared` its cascade step (cascade_attention: the shared prefix, then each row's suffix in
  // place, merged by their log-sum-exp), op for op
  torch::Tensor attend(const Layer& layer, const torch::Tensor& q, const torch::Tensor& tables,
                       const torch::Tensor& lens, const c10::optional<torch::Tensor>& shared, bool flash) const {
    const auto q32 = q.to(at::kFloat).contiguous();
    if (int8_)
      return paged_decode_attention_int8_kind(q32, layer.k_blocks, layer.v_blocks, *layer.k_scales, *layer.v_scales,
                                              tables, lens, scale_, layer.window, layer.softcap, layer.sinks)[0];
    auto suffix = paged_decode_attention_kind(q32, layer.k_blocks, layer.v_blocks, tables, lens, scale_, layer.window,
                                              layer.softcap, layer.sinks);
    if (!shared.has_value()) return suffix[0];
    const auto rows = q.contiguous();  // cascade_attention's q[shared.rows]: every row, in order
    torch::Tensor prefix_out, prefix_lse;
    if (flash) {  // the prefix's keys packed straight from the pool's blocks (no gathered copy)
      const int64_t bs = layer.k_blocks.size(1);
      const auto slots = (shared->unsqueeze(1) * bs + at::arange(bs, shared->options())).reshape({-1});
      auto prefix = flash_attention_slots(rows, layer.k_blocks.view({-1, kv_heads_, head_dim_}),
                                          layer.v_blocks.view({-1, kv_heads_, head_dim_}), slots, scale_, false, 0,
                                          0.0, c10::nullopt);
      prefix_out = prefix[0], prefix_lse = prefix[1];
    } else {  // attention._shared_keys_attention_lse: each KV head's query heads folded into its query rows
      const auto keys = layer.k_blocks.index_select(0, *shared).view({-1, kv_heads_, head_dim_});
      const auto values = layer.v_blocks.index_select(0, *shared).view({-1, kv_heads_, head_dim_});
      const int64_t n = rows.size(0), groups = heads_ / kv_heads_;
      auto folded = rows.view({n, kv_heads_, groups, head_dim_}).transpose(0, 1).reshape({1, kv_heads_, n * groups,
                                                                                         head_dim_});
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
          folded, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), 0.0, false, c10::nullopt,
          scale_);
      prefix_out = out.to(at::kFloat).view({kv_heads_, n, groups, head_dim_}).transpose(0, 1).reshape({n, heads_,
                                                                                                     head_dim_});
      prefix_lse = lse.view({kv_heads_, n, groups}).transpose(0, 1).reshape({n, heads_});
    }
    // attention.merge_attention
    const auto weight = at::sigmoid(prefix_lse - suffix[1]).unsqueeze(-1);
    return suffix[0] + (prefix_out - suffix[0]) * weight;
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, qk_eps_, scale_;
  bool int8_;               // the pool is int8: codes and scales (QuantizedKVPool)
  bool gemma_;              // Gemma's layers: (1 + w) norms around attention and the MLP, GELU-tanh
  int64_t groups_ = 1;      // KV groups the layers store and read through
  bool all_plain_ = true;   // no layer has a window, soft-cap or sinks
  bool any_local_ = false;  // some layer rotates by the local tables
};

void bind_decode_layers(pybind11::module& m) {
  // module-local: each ISA level's build binds its own DecodeLayers, and tests load several in one process
  pybind11::class_<DecodeLayers>(m, "DecodeLayers", pybind11::module_local())
      .def(pybind11::init<std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<c10::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<int64_t>, std::vector<double>, std::vector<c10::optional<torch::Tensor>>,
                          int64_t, int64_t, int64_t, double, double, double>())
      .def("set_moe", &DecodeLayers::set_moe, "a layer's MLP as a mixture of experts (moe_block's arguments)")
      .def("set_moe_rows", &DecodeLayers::set_moe_rows,
           "a mixture-of-experts layer's steps of any rows: its router as a linear, its experts' own weights")
      .def("set_shared_expert", &DecodeLayers::set_shared_expert,
           "a mixture-of-experts layer's shared expert: the layer's gate_up and down, and its sigmoid gate")
      .def("set_qk_full", &DecodeLayers::set_qk_full,
           "OLMoE: a layer's q and k norms over all heads, and its clamp of q, k and v")
      .def("run", &DecodeLayers::run, "the decoder layers of a decode step (CPU)");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's RMSNorm of [N, H] rows by the fp32 (1 + w)");
  m.def("gemma_norm_heads_", &gemma_norm_heads_, "in place: Gemma's RMSNorm of each head of [T, heads, D]");
  m.def("gemma_add_rms_norms_", &gemma_add_rms_norms_,
        "residual += gemma_norm(a, post), then gemma_norm(residual, next) (Gemma's sublayer ends)");
}
