"""GPTQ (Frantar et al., 2022): quantize a linear weight column by column, pushing each column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
squared output error on calibration inputs, so ``‖W X − Ŵ X‖²`` stays small where the data is.

    H = 2/n Σ_t x_t x_tᵀ                        [in, in], from calibration inputs x_t of the layer
    H += damp · mean(diag H) · I                 (dampening: H is often near singular)
    U = chol(H⁻¹)ᵀ (upper)                       the rows of U give each step's error propagation
    for each column j (blocks of `block_size`, the lazy batch updates of the paper):
        groups: at the first column of a group, scales from the group's current (updated) weights
        q_j = quantize(w_j);  e_j = (w_j − dequant(q_j)) / U_jj;  w_{j+1:} −= e_j U_{j, j+1:}

Scales are computed exactly as round-to-nearest does (`compute_qparams`, compressed-tensors'
min-max arithmetic) and the error fed back is that of the dequantized value the checkpoint will
hold (the scale's dtype), so the result is an ordinary `QuantizedWeight`. Columns are taken in
their natural order (no act-order, which the pack-quantized format would need `weight_g_idx` for).

Hessians come from the unquantized model (`sage_infer.quantization.calibration.collect_hessians`);
llmcompressor's sequential variant, which feeds each layer the already quantized layers' outputs,
is not implemented.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sage_infer.quantization.weights import QuantizedWeight, WeightScheme, compute_qparams

DAMP = 0.01
BLOCK = 128


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, scheme: WeightScheme, damp: float = DAMP,
                  block_size: int = BLOCK) -> QuantizedWeight:
    """GPTQ-quantize `weight` [out, in] given the layer's input Hessian [in, in] (fp32)."""
    out_f, in_f = weight.shape
    scheme.check_shape(out_f, in_f)
    if hessian.shape != (in_f, in_f):
        raise ValueError(f"hessian shape {tuple(hessian.shape)} does not match in_features {in_f}")
    dtype = weight.dtype
    group = scheme.group_of(in_f)
    if scheme.group_size is not None:  # whole groups per block: a group's scales see its updated weights
        block_size = max(block_size // group, 1) * group
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: their columns cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(in_f)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    num_groups = in_f // group
    scale = torch.empty(out_f, num_groups, dtype=dtype)
    zero_point = None if scheme.symmetric else torch.empty(out_f, num_groups, dtype=torch.int8)
    q = torch.empty(out_f, in_f, dtype=torch.int8)
    if scheme.group_size is None:  # one scale per channel, from the whole original row
        s, z = compute_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), scheme, dtype)
        scale.copy_(s)
        if zero_point is not None:
            zero_point.copy_(z)

    for start in range(0, in_f, block_size):
        end = min(start + block_size, in_f)
        w_block = w[:, start:end].clone()
        u_block = u[start:end, start:end]
        errors = torch.zeros_like(w_block)
        for i in range(end - start):
            col = start + i
            g = col // group
            if scheme.group_size is not None and col % group == 0:
                current = w_block[:, i:i + group].to(dtype)
                s, z = compute_qparams(current.amin(1, keepdim=True), current.amax(1, keepdim=True), scheme, dtype)
                scale[:, g:g + 1] = s
                if zero_point is not None:
                    zero_point[:, g:g + 1] = z
            s = scale[:, g].float()
            z = None if zero_point is None else zero_point[:, g].float()
            column = w_block[:, i]
            values = column / s + (0 if z is None else z)
            q_col = torch.clamp(torch.round(values), scheme.qmin, scheme.qmax)
            q[:, col] = q_col.to(torch.int8)
            # the value the checkpoint will hold: (q - z) * scale in the scale's dtype
            dequant = ((q_col - (0 if z is None else z)).to(dtype) * scale[:, g]).float()
            err = (column - dequant) / u_block[i, i]
            w_block[:, i:] -= err.unsqueeze(1) * u_block[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, end:] -= errors @ u[start:end, end:]
    return QuantizedWeight(q, scale, zero_point, scheme)


def output_error(weight: torch.Tensor, quantized: QuantizedWeight, hessian: torch.Tensor) -> float:
    """``‖(W − Ŵ) X‖²_F / (n / 2) = tr(ΔW H ΔWᵀ)``: the layer's squared output error on the
    calibration inputs the Hessian came from (up to the constant n / 2)."""
    delta = weight.float() - quantized.dequantize().float()
    return float(((delta @ hessian.float()) * delta).sum())


# the linears that read the same input share one Hessian
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def hessian_source(module_name: str) -> str:
    """The module whose input Hessian `module_name` uses (k/v read q's input, up reads gate's)."""
    parent, _, leaf = module_name.rpartition(".")
    return f"{parent}.{SHARED_INPUT[leaf]}" if leaf in SHARED_INPUT else module_name


def gptq_quantizer(model_dir, scheme: WeightScheme, num_samples: int, seq_len: int,
                   texts: list[str] | None = None) -> tuple[Callable[[str, torch.Tensor], QuantizedWeight], int]:
    """A quantizer for `quantize_checkpoint` that runs GPTQ with Hessians from `num_samples` calibration
    windows of `seq_len` tokens (the Shakespeare train split, or `texts`) through the fp32 model.

    Returns (quantizer, calibration tokens). Every layer's Hessian is held at once: about
    4 · layers · (2 · hidden² + intermediate²) bytes.
    """
    import transformers

    from sage_infer.quantization.calibration import calibration_batches, collect_hessians
    from sage_infer.quantization.checkpoint import is_quantized_linear

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batches = calibration_batches(tokenizer, num_samples, seq_len, texts=texts)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = {hessian_source(name) for name, _ in model.named_modules() if is_quantized_linear(f"{name}.weight")}
    hessians = collect_hessians(model, batches, sorted(names))
    del model

    def quantize(module_name: str, weight: torch.Tensor) -> QuantizedWeight:
        return gptq_quantize(weight, hessians[hessian_source(module_name)], scheme)

    return quantize, batches.numel()
