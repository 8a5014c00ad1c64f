// A decode step's decoder layers in one call (`model.decode_step: sage`; every row one new token, read in
// place, with or without a prefix that all rows share): for each layer, the
// stacked q/k/v product, rotary (after Qwen3's q/k norms), the K/V store into the pool, paged
// attention, the o product, the residual add with the next norm, gate/up, silu*mul, down and the
// residual add with the next layer's norm, with no Python between them. The kernels are the ones the
// Python path calls one by one (small_linear.cpp or oneDNN's packed linear, as `PackedLinear` picks;
// fused_ops.cpp; paged_decode.cpp) in the same order on the same values, so the result is the Python
// path's to the bit; what goes is the interpreter's time around ~12 calls per layer (about a fifth of
// a batch-1 step of the 0.5B shape here).
// Over an int8 pool (QuantizedKVPool) the store quantizes as the pool's does, to the bit (fused_ops.cpp
// quantize_store_int8_), attention reads the codes and scales in place (paged_decode_attention_int8), and steps
// with a shared prefix stay in Python.
// The reference is `LlamaForCausalLM.forward`'s fused branch (sage_infer/models/llama.py).
#include "kernel.h"
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cstdint>
#include <cstring>
#include <vector>

// small_linear.cpp, fused_ops.cpp, flash_bf16.cpp, paged_decode.cpp: built into the same module
torch::Tensor small_linear(torch::Tensor x, int64_t address, int64_t nbytes, int64_t n,
                           c10::optional<torch::Tensor> bias);
torch::Tensor bf16_rows_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor signed_sin, c10::optional<torch::Tensor> norm_weight,
           double eps);
std::vector<torch::Tensor> flash_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                           bool causal);
std::vector<torch::Tensor> paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                  torch::Tensor block_tables, torch::Tensor context_lens,
                                                  double scale);
std::vector<torch::Tensor> paged_decode_attention_int8(torch::Tensor q, torch::Tensor k_codes, torch::Tensor v_codes,
                                                       torch::Tensor k_scales, torch::Tensor v_scales,
                                                       torch::Tensor block_tables, torch::Tensor context_lens,
                                                       double scale);
void quantize_store_int8_(torch::Tensor src, torch::Tensor codes, torch::Tensor scales, torch::Tensor slots);

namespace {

// oneDNN's product on a packed weight: torch.ops.mkldnn._linear_pointwise, as `PackedLinear` calls it
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          c10::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// one `PackedLinear`: products of up to `small_rows` bf16 rows on small_linear (its fp32 bias), the
// rest on oneDNN (its bias in the model's dtype), as `PackedLinear.forward` chooses; a bf16 layer that oneDNN
// could not pack (`weight_bf16` set) runs up to `bf16_rows` rows on bf16_rows_linear, the rest in fp32 on its
// packed fp32 copy (fp32 bias), rounded back to bf16
struct Linear {
  int64_t address, nbytes, n, small_rows, bf16_rows;
  torch::Tensor packed;
  c10::optional<torch::Tensor> bias32, bias, weight_bf16, bias_bf16;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (x.size(0) <= small_rows && x.scalar_type() == at::kBFloat16) return small_linear(x, address, nbytes, n, bias32);
    if (weight_bf16.has_value()) {
      if (x.size(0) <= bf16_rows) return bf16_rows_linear(x, *weight_bf16, bias_bf16);
      return onednn_linear(x.to(at::kFloat), packed, bias).to(x.scalar_type());
    }
    return onednn_linear(x, packed, bias);
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  torch::Tensor post_norm, next_norm;         // post-attention norm; the next layer's input norm (or the final)
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3's per-head norms
  torch::Tensor k_rows, v_rows;                // the pool's token rows [slots, KvH, D] (KVPool.token_rows)
  torch::Tensor k_blocks, v_blocks;            // the same memory as [blocks, block_size, KvH, D]
  // an int8 pool: k/v rows and blocks hold its codes (int8), these its fp16 scales, one per (slot, KV head)
  c10::optional<torch::Tensor> k_scales, v_scales;
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

}  // namespace

class DecodeLayers {
 public:
  // per layer, in order: linears (qkv, o, gate_up, down) as (address, nbytes, out_features, small_rows,
  // bf16_rows) x 4 in `shapes` (address and nbytes 0 where small_rows is), their packed weights x 4 in `packed`,
  // biases as (fp32, model dtype) x 4 in `biases` (none where absent), (bf16 weight, bf16 bias) x 4 in `bf16`
  // (none but for bf16 layers on fp32 copies), and in `tensors` post_norm, next_norm, k_rows, v_rows, k_blocks,
  // v_blocks; `qk_norms`: q_norm, k_norm per layer, or empty; `kv_scales`: an int8 pool's k_scales, v_scales
  // per layer (k/v rows and blocks are then its codes: QuantizedKVPool.int8_block_views), or empty
  DecodeLayers(std::vector<int64_t> shapes, std::vector<torch::Tensor> packed,
               std::vector<c10::optional<torch::Tensor>> biases, std::vector<c10::optional<torch::Tensor>> bf16,
               std::vector<torch::Tensor> tensors,
               std::vector<torch::Tensor> qk_norms, std::vector<torch::Tensor> kv_scales, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, double qk_eps, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), qk_eps_(qk_eps), scale_(scale),
        int8_(!kv_scales.empty()) {
    const size_t n = tensors.size() / 6;
    TORCH_CHECK(tensors.size() == n * 6 && shapes.size() == n * 20 && packed.size() == n * 4 &&
                    biases.size() == n * 8 && bf16.size() == n * 8 && (qk_norms.empty() || qk_norms.size() == n * 2) &&
                    (kv_scales.empty() || kv_scales.size() == n * 2),
                "DecodeLayers: per layer 20 linear numbers, 4 packed weights, 8 biases, 8 bf16 weights/biases, 6 "
                "tensors (and 2 q/k norms, 2 int8 scale tensors)");
    for (size_t i = 0; i < n; ++i) {
      auto linear = [&](size_t j) {
        const int64_t* s = shapes.data() + i * 20 + j * 5;
        return Linear{s[0], s[1], s[2], s[3], s[4], packed[i * 4 + j], biases[i * 8 + j * 2],
                      biases[i * 8 + j * 2 + 1], bf16[i * 8 + j * 2], bf16[i * 8 + j * 2 + 1]};
      };
      Layer layer{linear(0), linear(1), linear(2), linear(3), tensors[i * 6], tensors[i * 6 + 1], c10::nullopt,
                  c10::nullopt, tensors[i * 6 + 2], tensors[i * 6 + 3], tensors[i * 6 + 4], tensors[i * 6 + 5]};
      if (!qk_norms.empty()) {
        layer.q_norm = qk_norms[i * 2];
        layer.k_norm = qk_norms[i * 2 + 1];
      }
      if (int8_) {
        layer.k_scales = kv_scales[i * 2];
        layer.v_scales = kv_scales[i * 2 + 1];
      }
      const auto pool_dtype = int8_ ? at::kChar : layer.post_norm.scalar_type();
      TORCH_CHECK(layer.k_rows.scalar_type() == pool_dtype && layer.k_rows.is_contiguous() &&
                      layer.k_rows.dim() == 3 && layer.k_rows.size(1) == num_kv_heads &&
                      layer.k_rows.size(2) == head_dim && layer.v_rows.sizes() == layer.k_rows.sizes(),
                  "DecodeLayers: the pool rows must be contiguous [slots, KvH, D] in the model's dtype (int8 codes "
                  "with scales)");
      layers_.push_back(std::move(layer));
    }
  }

  // h: the first layer's normed input [B, hidden]; residual: its input, updated in place; cos,
  // signed_sin: [B, D] in the model's dtype; slots: [B] long; block_tables: [B, W] long; context_lens: [B]
  // long; shared: the blocks that every row's context starts with ([S] long), attended once by all rows
  // together (cascade attention), block_tables and context_lens then describing what follows them, or
  // none; flash: the shared blocks through sage's flash kernel (bf16 or fp32), else PyTorch's
  // -> the last layer's output normed by the final norm, [B, hidden]
  torch::Tensor run(torch::Tensor h, torch::Tensor residual, torch::Tensor cos, torch::Tensor signed_sin,
                    torch::Tensor slots, torch::Tensor block_tables, torch::Tensor context_lens,
                    c10::optional<torch::Tensor> shared, bool flash) const {
    const int64_t batch = h.size(0), width = (heads_ + 2 * kv_heads_) * head_dim_;
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == batch,
                "decode_step: slots must be [B] int64");
    const int64_t* slot = slots.data_ptr<int64_t>();
    const auto tables = block_tables.contiguous(), lens = context_lens.contiguous();
    TORCH_CHECK(int8_ || layers_.empty() || h.scalar_type() == layers_[0].k_rows.scalar_type(),
                "decode_step: the pool's dtype is not the model's");
    TORCH_CHECK(!int8_ || !shared.has_value(), "decode_step: an int8 pool's steps with a shared prefix run in Python");
    for (const Layer& layer : layers_) {
      auto qkv = layer.qkv(h);
      TORCH_CHECK(qkv.size(1) == width, "decode_step: the qkv product has ", qkv.size(1), " columns, not ", width);
      auto heads = qkv.view({batch, heads_ + 2 * kv_heads_, head_dim_});
      auto q = heads.narrow(1, 0, heads_), k = heads.narrow(1, heads_, kv_heads_);
      auto v = heads.narrow(1, heads_ + kv_heads_, kv_heads_);
      if (layer.q_norm.has_value()) {
        rope_(q, cos, signed_sin, layer.q_norm, qk_eps_);
        rope_(k, cos, signed_sin, layer.k_norm, qk_eps_);
      } else {  // q and k side by side: one pass
        rope_(heads.narrow(1, 0, heads_ + kv_heads_), cos, signed_sin, c10::nullopt, qk_eps_);
      }
      if (int8_) {  // QuantizedKVPool.store's codes and scales
        quantize_store_int8_(k, layer.k_rows, *layer.k_scales, slots);
        quantize_store_int8_(v, layer.v_rows, *layer.v_scales, slots);
      } else {
        store_rows(k, layer.k_rows, slot, batch);
        store_rows(v, layer.v_rows, slot, batch);
      }
      auto attended = attend(layer, q, tables, lens, shared, flash).to(h.scalar_type());
      h = add_rms_norm_(layer.o(attended.view({batch, heads_ * head_dim_})), residual, layer.post_norm, eps_);
      h = add_rms_norm_(layer.down(silu_mul(layer.gate_up(h))), residual, layer.next_norm, eps_);
    }
    return h;
  }

 private:
  // q: [B, H, D] -> attention over each row's context, fp32 [B, H, D]: paged_attention's pure decode step,
  // or with `shared` its cascade step (cascade_attention: the shared prefix, then each row's suffix in
  // place, merged by their log-sum-exp), op for op
  torch::Tensor attend(const Layer& layer, const torch::Tensor& q, const torch::Tensor& tables,
                       const torch::Tensor& lens, const c10::optional<torch::Tensor>& shared, bool flash) const {
    if (int8_)
      return paged_decode_attention_int8(q.to(at::kFloat).contiguous(), layer.k_blocks, layer.v_blocks,
                                         *layer.k_scales, *layer.v_scales, tables, lens, scale_)[0];
    auto suffix = paged_decode_attention(q.to(at::kFloat).contiguous(), layer.k_blocks, layer.v_blocks, tables, lens,
                                         scale_);
    if (!shared.has_value()) return suffix[0];
    const auto rows = q.contiguous();  // cascade_attention's q[shared.rows]: every row, in order
    const auto keys = layer.k_blocks.index_select(0, *shared).view({-1, kv_heads_, head_dim_});
    const auto values = layer.v_blocks.index_select(0, *shared).view({-1, kv_heads_, head_dim_});
    torch::Tensor prefix_out, prefix_lse;
    if (flash) {
      auto prefix = flash_attention(rows, keys, values, scale_, false);
      prefix_out = prefix[0], prefix_lse = prefix[1];
    } else {  // attention._shared_keys_attention_lse: each KV head's query heads folded into its query rows
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
  bool int8_;  // the pool is int8: codes and scales (QuantizedKVPool)
};

void bind_decode_layers(pybind11::module& m) {
  // module-local: each ISA level's build binds its own DecodeLayers, and tests load several in one process
  pybind11::class_<DecodeLayers>(m, "DecodeLayers", pybind11::module_local())
      .def(pybind11::init<std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<c10::optional<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double,
                          double, double>())
      .def("run", &DecodeLayers::run, "the decoder layers of a decode step (CPU)");
}
