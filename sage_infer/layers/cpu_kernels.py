"""The CPU kernels (csrc/): paged decode attention, the fused elementwise ops, flash attention, the small-row
bf16 product and the C++ decode step, as one module per ISA level (`sage_infer.hal.kernel_build`).

The install compiles them for every x86-64 level (avx2, avx512, avx512_bf16); `_module()` loads the highest build
this CPU can run, or the one ``SAGE_CPU_ISA`` forces (`sage_infer.hal.isa`). Each function below reports what its
level cannot run (`small_linear_unavailable`, `flash_unavailable`), and `kernel_unavailable()` why no build can
be used at all; the engine then takes the PyTorch path.

`decode_attention_paged` reads each decode row's keys and values in place from the pool's
blocks: no gathered, padded copy of the context per layer and step (what the pure-PyTorch path,
`gather_blocks` + `decode_attention_batched`, does and stays the oracle of); `decode_attention_paged_int8` the
same from an int8 pool's codes and scales.

The same module carries a decoder layer's elementwise glue as one pass each (csrc/fused_ops.cpp;
`model.elementwise`): `rms_norm`, `add_rms_norm_` (the residual add, then the norm), `rope_` (Qwen3's
per-head q/k norm, then rotary) and `silu_mul`. Their references are `RMSNorm`, `apply_rotary` and
``F.silu(gate) * up``; values are rounded to the model dtype where those round, so only fp32
summation order differs.

`flash_attention`: attention of many bf16 or fp32 queries (a prefill chunk, or the decode rows that share a
prefix; `model.prefill_attention`), against PyTorch's CPU flash kernel as the reference: on AVX512-BF16 dot
products for bf16 and AVX-512 FMA for fp32 (csrc/flash_bf16.cpp); without AVX-512 on AVX2 FMA in fp32, bf16
widened as it is read (csrc/flash_avx2.cpp). `flash_kernel` names the one in use.

And `small_linear`: the bf16 products of a decode step's few rows, on the weights oneDNN packed for
`PackedLinear`, read in place (csrc/small_linear.cpp; `model.decode_linear`). `moe_experts`: all active experts
of a mixture-of-experts step in one call (csrc/moe_experts.cpp). `decode_layers`: those
kernels, the fused ops and the paged kernel chained over all decoder layers of a decode step in one
call (csrc/decode_step.cpp; `model.decode_step`).
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from sage_infer.hal import kernel_build
from sage_infer.hal.isa import ENV, selected_level

log = logging.getLogger(__name__)


_load = kernel_build.load_selected  # (module, why not, how it was found) per SAGE_CPU_ISA value


def _current() -> tuple[ModuleType | None, str | None, str]:
    return _load(os.environ.get(ENV, ""))


def kernel_level() -> str | None:
    """The ISA level of the kernels in use, with how it was chosen and found (for the start-up lines); None
    when none can be used (`kernel_unavailable` says why)."""
    module, _, how = _current()
    return how if module is not None else None


def check_forced_level() -> None:
    """ConfigError when ``SAGE_CPU_ISA`` names a level that is unknown or above this CPU's."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        selected_level()


def kernel_unavailable() -> str | None:
    """None when a build of the kernels is loadable here, else why not (compiles it on the first call when the
    install did not)."""
    return _current()[1]


def decode_attention_paged(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over pool blocks in place. q: [B, H, D] (any float dtype); k_blocks,
    v_blocks: [num_blocks, block_size, KvH, D] contiguous fp32/bf16/fp16 (`KVPool.block_views`);
    block_tables: [B, W] long (padding entries are never read); context_lens: [B] long, each >= 1
    -> out [B, H, D] and lse [B, H], both float32 (lse: log-sum-exp of the scaled scores).
    On a CUDA device the Triton kernel (`sage_infer.layers.triton_paged`) runs instead, same contract.
    """
    if q.device.type != "cpu":
        from sage_infer.layers.triton_paged import decode_attention

        return decode_attention(q, k_blocks, v_blocks, block_tables, context_lens, scale)
    return _module().paged_decode_attention(q.float().contiguous(), k_blocks, v_blocks, block_tables.contiguous(),
                                         context_lens.contiguous(), scale)


def decode_attention_paged_int8(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention_paged` over an int8 pool's blocks in place (CPU): k_codes, v_codes: [num_blocks,
    block_size, KvH, D] int8, contiguous; k_scales, v_scales: [num_blocks, block_size, KvH] (or with a trailing 1)
    fp16, contiguous; a value is code * scale (`QuantizedKVPool`'s int8 layout). Each token's key scale multiplies
    its score and its value scale its probability, so the codes are widened in registers, never dequantized into
    memory. The oracle is `decode_attention_scaled` over `QuantizedKVPool.gather_block_levels`."""
    return _module().paged_decode_attention_int8(q.float().contiguous(), k_codes, v_codes, k_scales, v_scales,
                                                 block_tables.contiguous(), context_lens.contiguous(), scale)


def _module() -> ModuleType:
    module, why, _ = _current()
    if module is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {why}")
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` of x: [N, H] (rows may be strided) -> a new [N, H] in x's dtype."""
    return _module().rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place (contiguous [N, H]), then `RMSNorm(residual)` as a new [N, H]."""
    return _module().add_rms_norm_(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] -> ``silu(gate) * up``, [N, I]."""
    return _module().silu_mul(gate_up)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, norm_weight: torch.Tensor | None = None,
          eps: float = 1e-6) -> None:
    """In place on x: [T, heads, D] (a view with contiguous heads): each head's RMSNorm over D when
    `norm_weight` is given, then `apply_rotary` with cos, signed_sin: [T, D] in x's dtype."""
    _module().rope_(x, cos, signed_sin, norm_weight, eps)


BF16_ROWS_KERNEL_MAX = 16  # the most rows `bf16_rows_linear` takes (csrc/bf16_rows.cpp MAX_ROWS)


def bf16_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] bf16 (1 to 16 rows) times the [N, K] bf16 `weight` (as stored: no packing), plus `bias` -> [M, N]
    bf16; fp32 sums rounded once, against `F.linear` as the reference (csrc/bf16_rows.cpp)."""
    return _module().bf16_rows_linear(x, weight, bias)


def small_linear_unavailable() -> str | None:
    """None when `small_linear` can run here, else why not."""
    why = kernel_unavailable()
    if why is None and not _module().small_linear_compiled():
        why = f"it needs AVX512-BF16 (the kernels in use are the {_module().isa()} build)"
    return why


def packed_layout_matches(address: int, nbytes: int, weight: torch.Tensor) -> int:
    """The rows per block of `small_linear`'s layout ([N/R][K/32*16][R][2], zero padded; R = 64, or 32 where oneDNN
    packs for AMX tiles) in which oneDNN's packed buffer at `address` (`nbytes` long) holds the bf16 [N, K]
    `weight`; 0 when neither."""
    return _module().layout_matches(address, nbytes, weight)


def small_linear(x: torch.Tensor, address: int, nbytes: int, out_features: int,
                 bias: torch.Tensor | None = None, block_rows: int = 64) -> torch.Tensor:
    """x: [M, K] bf16 (a few rows) times the packed weight that `packed_layout_matches` accepted (in its blocks of
    `block_rows`), plus the fp32 `bias` -> [M, N] bf16. The caller keeps the packed weight alive."""
    return _module().small_linear(x, address, nbytes, out_features, bias, block_rows)


def flash_unavailable(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when `flash_attention` can run here for heads of `head_dim` in `dtype`, else why not."""
    why = kernel_unavailable()
    if why is None and dtype not in (torch.bfloat16, torch.float32):
        why = f"the kernel is bf16 or fp32 only (not {dtype})"
    elif why is None and not flash_kernel(dtype):
        isa = _module().isa()
        why = (f"the bf16 kernel needs AVX512-BF16 (the kernels in use are the {isa} build)" if isa == "avx512"
               else f"the flash kernels need AVX2 and FMA (the kernels in use are the {isa} build)")
    if why is None and (head_dim % 32 or head_dim > 256):
        why = f"head_dim {head_dim} is not a multiple of 32 up to 256"
    return why


def amx_flash_attention(dtype: torch.dtype) -> bool:
    """Whether bf16 prefill attention here runs PyTorch's CPU flash kernel instead of sage's: a bf16 model on a
    CPU with AMX tiles that this process may use (PyTorch's own check), whose tiles that kernel runs on oneDNN's
    AMX micro-kernels (`bench/flash_attention.py --heads 32,4 --head-dim 128` on a 2-vCPU Xeon with AMX: 3-5x sage's
    AVX512-BF16 kernel from 100 to 2,048 rows). Not under a forced ``SAGE_CPU_ISA`` level: those runs test sage's
    kernels as a CPU of that level runs them."""
    if dtype != torch.bfloat16 or os.environ.get(ENV, "").strip():
        return False
    return _amx_tiles()


@functools.cache
def _amx_tiles() -> bool:
    supported, init = getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_init_amx", None)
    return bool(supported is not None and init is not None and supported() and init())


def flash_kernel(dtype: torch.dtype) -> str:
    """Which kernel `flash_attention` runs for `dtype` (bf16 or fp32) in the build in use, in words, for the
    start-up lines: ``bf16 flash kernel on AVX512-BF16``, ``fp32 flash kernel on AVX-512``, ``fp32 flash kernel on
    AVX2`` (for bf16: ``..., bf16 widened``); '' where none runs (bf16 in the avx512 build)."""
    return _module().flash_kernel(dtype == torch.bfloat16)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Lq, H, D], k, v: [C, KvH, D], all bf16 or all float32 (views with contiguous heads) -> out
    [Lq, H, D] and lse [Lq, H], float32. Causal is aligned to the lower right (the queries are the last Lq of C
    positions)."""
    if q.dtype == torch.bfloat16 and (q.stride(0) % 2 or q.stride(1) % 2):
        q = q.contiguous()
    out, lse = _module().flash_attention(q, k, v, scale, causal)
    return out, lse


def flash_attention_slots(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, slots: torch.Tensor,
                          scale: float, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                          causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention` over keys read in place from a KV pool's rows: k_rows, v_rows ``[S, KvH, D]``
    (`KVPool.token_rows`), key j being row ``slots[j]`` (``[C]`` int64) -- the result over ``k_rows[slots]``
    without gathering that copy first; under a layer's kind (`attention_kinds.kernel_kind_args`)."""
    if q.dtype == torch.bfloat16 and (q.stride(0) % 2 or q.stride(1) % 2):
        q = q.contiguous()
    out, lse = _module().flash_attention_slots(q, k_rows, v_rows, slots.contiguous(), scale, causal, window,
                                               softcap, sinks)
    return out, lse


def decode_layers(shapes: list[int], packed: list[torch.Tensor], biases: list[torch.Tensor | None],
                  bf16: list[torch.Tensor | None], tensors: list[torch.Tensor], qk_norms: list[torch.Tensor],
                  kv_scales: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                  qk_eps: float, scale: float, ff_norms: list[torch.Tensor] = (), layout: list[int] = (),
                  softcaps: list[float] = (), sinks: list[torch.Tensor | None] = ()):
    """The C++ decode step over a model's layers (csrc/decode_step.cpp; built by
    `LlamaForCausalLM.prepare_decode_step` and `GemmaForCausalLM.prepare_decode_step`, which say what goes in the
    lists; `ff_norms` non-empty: Gemma's layers, every norm its fp32 (1 + w); `layout`: (KV group, window, local
    rope) per layer; `softcaps`, `sinks`: per layer, each layer's attention kind). Its ``run(h, residual, cos,
    signed_sin, local_cos or None, local_sin or None, slots, block_tables, context_lens, shared_block_ids or None,
    flash)``, with slots, block_tables and context_lens lists of one tensor per KV group, returns the
    final-normed hidden states (`sage_infer.engine.steps.cpp_decode` calls it)."""
    return _module().DecodeLayers(shapes, packed, biases, bf16, tensors, qk_norms, kv_scales, list(ff_norms),
                                  list(layout), list(softcaps), list(sinks), num_heads, num_kv_heads, head_dim, eps,
                                  qk_eps, scale)


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of x: [N, H] (rows may be strided) by `scale`, the fp32 ``1 + weight`` [H], in fp32 and
    rounded once to x's dtype -> a new [N, H] (csrc/decode_step.cpp; the reference is `GemmaRMSNorm`)."""
    return _module().gemma_rms_norm(x, scale, eps)


def gemma_norm_heads_(x: torch.Tensor, scale: torch.Tensor, eps: float) -> None:
    """In place on x: [T, heads, D] (a view with contiguous heads): each head's `gemma_rms_norm` over D (Gemma 3's
    q/k norms)."""
    _module().gemma_norm_heads_(x, scale, eps)


def gemma_add_rms_norms_(a: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, after: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """A Gemma sublayer's end: ``residual += gemma_rms_norm(a, post)`` in place (contiguous [N, H], the sum rounded
    to its dtype as PyTorch's add), then ``gemma_rms_norm(residual, after)`` as a new [N, H]."""
    return _module().gemma_add_rms_norms_(a, residual, post, after, eps)


def quantize_store_int8_(src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """src: [T, KvH, D] K (or V) rows (fp32/bf16/fp16, each row's heads contiguous) quantized into an int8 pool's
    codes [slots, KvH, D] int8 and fp16 scales (one per slot and KV head) at `slots` ([T] int64), in place: the
    codes and scales `QuantizedKVPool.store` writes (`KVCodec.encode`), to the bit. What the C++ decode step
    stores into an int8 pool."""
    _module().quantize_store_int8_(src, codes, scales, slots)


def moe_experts_unavailable() -> str | None:
    """None when `moe_experts` can run here, else why not."""
    return kernel_unavailable()


def moe_experts_native_bf16() -> bool:
    """Whether `moe_experts` sums packed bf16 with bf16 dot products (the AVX512-BF16 build), as oneDNN's own
    products do; the other builds widen each pair to fp32 first (half the rate of multiply-adds)."""
    return _module().isa() == "avx512_bf16"


def mxfp4_rows(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """MXFP4 rows dequantized into `out` [N, K] (fp32 or bf16, contiguous): codes [N, K / 2] and exponents
    [N, K / 32] uint8, each value its FP4 value times 2^(exponent - 127), exact (csrc/moe_experts.cpp)."""
    _moe_op(_module(), "mxfp4_rows")(codes, scales, out)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of gate_up [N, 2I] (bf16 or fp32, contiguous; gate the even columns, up the odd)
    -> [N, I]: ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = gate.clamp(max=limit)``, each
    step rounded as PyTorch's ops round it, in one pass (csrc/moe_experts.cpp)."""
    return _moe_op(_module(), "clamped_swiglu")(gate_up, alpha, limit)


def moe_experts_wide_fma() -> bool:
    """Whether `moe_experts` multiplies plain weights with 16-lane FMA (the AVX-512 builds) rather than 8-lane."""
    return _module().isa() in ("avx512", "avx512_bf16")


def moe_experts(rows: torch.Tensor, spans: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                intermediate: int, packed: int, options: tuple) -> torch.Tensor:
    """rows: [P, H] bf16 or fp32 (contiguous), a step's (token, expert) rows sorted by expert; spans: [A, 3] int64,
    (expert, start, end) of each active expert's rows; gate_up, down: [E] int64, the address of each expert's
    [2I, H] and [H, I] weight, in small_linear's packed bf16 layout (`packed`: its rows per block, 64 or 32) or
    plain row-major in the rows' dtype (`packed` 0); `options`: `moe_options` of the experts -> [P, H]:
    ``down(act(gate_up))`` of each row by its expert (csrc/moe_experts.cpp). The caller keeps the weights alive
    (`sage_infer.layers.moe_grouped`)."""
    return _moe_op(_module())(rows, spans, gate_up, down, intermediate, packed, *options)


def moe_options(dtype: torch.dtype, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                clamped: tuple[float, float] | None, mxfp4_scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The experts ops' trailing arguments (empty tensors for none): gate_up_bias [E, 2I] and down_bias [E, H] in
    the rows' dtype where the experts have biases; `clamped`: (alpha, limit) of gpt-oss's clamped SwiGLU (gate and
    up interleaved) in place of SiLU(gate) * up; `mxfp4_scales`: for MXFP4 experts ([E] int64 each) the address of
    each expert's exponent bytes ([2I, H / 32], [H, I / 32]), gate_up and down then addressing its FP4 codes
    ([2I, H / 2], [H, I / 2] bytes)."""
    none, no_scales = torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.long)
    alpha, limit = clamped if clamped is not None else (0.0, 0.0)
    gate_up_scales, down_scales = mxfp4_scales if mxfp4_scales is not None else (no_scales, no_scales)
    return (none if gate_up_bias is None else gate_up_bias, none if down_bias is None else down_bias,
            clamped is not None, alpha, limit, gate_up_scales, down_scales)


def moe_route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, top_k: int, mode: int,
              renormalize: bool, weights_in_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's routing: x [T, H] (bf16 or fp32, contiguous), the router's weight [E, H] and bias ([E] or None) in
    x's dtype -> (weights [T, K]: fp32, or x's dtype where `weights_in_dtype`; expert ids [T, K] int64). The logits
    are the router's product rounded to x's dtype, each summed in one order whatever the step's other rows; mode 0:
    the softmax over every expert in fp32, its top k, divided by their sum where `renormalize`; mode 1: the top k
    logits softmaxed among themselves. Of equal values the lower expert id ranks first (csrc/moe_experts.cpp)."""
    return _moe_op(_module(), "moe_route")(x, router, torch.empty(0, dtype=x.dtype) if bias is None else bias,
                                           top_k, mode, renormalize, weights_in_dtype)


def moe_block(x: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor | None, routing: tuple,
              counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, intermediate: int, packed: int,
              options: tuple) -> torch.Tensor:
    """A mixture-of-experts layer's step in one call: `moe_route` (`routing`: its top_k, mode, renormalize and
    weights_in_dtype), then `moe_experts_routed` (`options`: `moe_options` of the experts) -> [T, H]."""
    return _moe_op(_module(), "moe_block")(
        x, router, torch.empty(0, dtype=x.dtype) if router_bias is None else router_bias, *routing, counts, gate_up,
        down, intermediate, packed, *options)


def moe_experts_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor | None,
                       gate_up: torch.Tensor, down: torch.Tensor, intermediate: int, packed: int,
                       options: tuple) -> torch.Tensor:
    """A step from its routing: x [T, H] (bf16 or fp32, contiguous), the routing weights [T, K] (fp32 or x's
    dtype) and expert ids [T, K] int64 -> [T, H], each token's expert outputs times their weights, added in expert
    order: the bits of `sage_infer.layers.moe.run_grouped` over `moe_experts` (the other arguments as it takes
    them), the pairs grouped by expert in C++ rather than in Python. `counts` ([E] int64), where given, grows by the
    pairs routed to each expert."""
    return _moe_op(_module(), "moe_experts_routed")(
        x, weights, ids, torch.empty(0, dtype=torch.long) if counts is None else counts, gate_up, down, intermediate,
        packed, *options)


def moe_experts_linears(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor | None,
                        linears: tuple[list[torch.Tensor], list[torch.Tensor]], limit: int, pass_rows: int,
                        gate_up: torch.Tensor, down: torch.Tensor, intermediate: int, packed: int,
                        options: tuple) -> torch.Tensor:
    """`moe_experts_routed` of packed bf16 experts (bf16 x, no biases) with each expert's own oneDNN weights
    (`linears`: every expert's `PackedLinear.packed` of gate_up, then of down): an expert with more than `limit`
    pairs in the step is multiplied by those (in passes of `pass_rows` rows, as `FusedOps.gated_mlp` runs it, each
    pass's rows rounded up to a multiple of 32 so that oneDNN meets few row counts), the others by the kernel in one
    call; grouped and combined in C++ as `sage_infer.layers.moe.run_grouped` does it."""
    return _moe_op(_module(), "moe_experts_linears")(
        x, weights, ids, torch.empty(0, dtype=torch.long) if counts is None else counts, linears[0], linears[1],
        limit, pass_rows, gate_up, down, intermediate, packed, *options)


_MOE_OPS: dict[tuple[str, str], object] = {}


def _moe_op(module: ModuleType, name: str = "moe_experts"):
    """One of the build's grouped-experts ops: csrc/moe_experts.cpp registers them as torch ops in a namespace
    named after the build (two levels' builds can be loaded in one process)."""
    op = _MOE_OPS.get((module.__name__, name))
    if op is None:
        namespace = getattr(torch.ops, f"sage_moe_{module.isa()}_{module.build_key()}")
        op = _MOE_OPS[module.__name__, name] = getattr(namespace, name)
    return op
