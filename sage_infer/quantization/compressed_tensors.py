"""The compressed-tensors checkpoint format for weight-only int4 / int8 linears: what llmcompressor
writes and vLLM loads (``quant_method: compressed-tensors``), read and written without the library.

config.json ``quantization_config``:
    quant_method "compressed-tensors", format "pack-quantized" (or "int-quantized" /
    "naive-quantized" for 8 bits), quantization_status "compressed", ignore ["lm_head"],
    config_groups {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4|8, "type": "int",
    "symmetric": bool, "strategy": "channel"|"group", "group_size": G|null, ...}, "input_activations": null}}

Tensors of one quantized linear ``<prefix>`` (N out, K in, S = K // group, one group for "channel"):
    pack-quantized:  <prefix>.weight_packed      int32 [N, ceil(K / f)], f = 32 // num_bits values per int32,
                                                 value j of a row in bits [j*b, (j+1)*b) of int32 j // f,
                                                 stored as q + 2**(b-1) (unsigned)
                     <prefix>.weight_shape       int64 [2] = (N, K)
                     <prefix>.weight_scale       [N, S] in the model dtype
                     <prefix>.weight_zero_point  int32 [ceil(N / f), S], packed the same way along dim 0
                                                 (asymmetric only)
    int-quantized:   <prefix>.weight int8 [N, K], <prefix>.weight_scale [N, S],
                     <prefix>.weight_zero_point int8 [N, S] (asymmetric only)

Weight-only int8 is written as pack-quantized with num_bits 8 (4 values per int32): that is what
compressed-tensors infers for a weight-only int8 scheme and the only weight-only int layout vLLM's
WNA16 path loads; int-quantized / naive-quantized int8 checkpoints are read too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from sage_infer.quantization.weights import QuantizedWeight, WeightScheme

QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = ("int-quantized", "naive-quantized")
FORMAT_VERSION = "0.17.0"  # the compressed-tensors release whose layout this mirrors
SUFFIXES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight")


class FormatError(ValueError):
    """A quantization_config or tensor sage cannot load: the message starts with the field's path."""


# -- int32 packing -----------------------------------------------------------------------------


def pack_int32(values: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """int8 [R, C] signed values -> int32, 32 // num_bits per int32 along `packed_dim` (zero-padded)."""
    per_int = 32 // num_bits
    unsigned = (values.to(torch.int32) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    if packed_dim == 0:
        unsigned = unsigned.t()
    rows, cols = unsigned.shape
    padded = math.ceil(cols / per_int) * per_int
    unsigned = torch.nn.functional.pad(unsigned, (0, padded - cols)).view(rows, padded // per_int, per_int)
    shifts = torch.arange(per_int, dtype=torch.int32) * num_bits
    packed = (unsigned << shifts).sum(dim=2, dtype=torch.int32)  # bits never overlap: sum == or
    return packed.t().contiguous() if packed_dim == 0 else packed


def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int], packed_dim: int = 1) -> torch.Tensor:
    """The inverse of `pack_int32`: int8 signed values of `shape` [R, C]."""
    per_int = 32 // num_bits
    if packed_dim == 0:
        packed = packed.t().contiguous()
    shifts = torch.arange(per_int, dtype=torch.int32) * num_bits
    unsigned = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    rows = packed.shape[0]
    values = (unsigned.view(rows, -1) - (1 << (num_bits - 1))).to(torch.int8)
    if packed_dim == 0:
        return values[:, : shape[0]].t().contiguous()
    return values[:, : shape[1]].contiguous()


# -- quantization_config -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigGroup:
    name: str
    targets: tuple[str, ...]
    scheme: WeightScheme
    format: str


@dataclass(frozen=True, slots=True)
class CompressedTensorsConfig:
    """The parts of a compressed-tensors quantization_config sage acts on."""

    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...] = field(default=())

    def scheme_for(self, module_name: str) -> ConfigGroup | None:
        """The config group quantizing linear `module_name`, or None when it stays unquantized."""
        if any(_matches(pattern, module_name) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(target == "Linear" or _matches(target, module_name) for target in group.targets):
                return group
        return None


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def parse_config(qc: object) -> CompressedTensorsConfig:
    """Check a config.json ``quantization_config`` and return the weight schemes sage will run.

    FormatError naming ``quantization_config.<field>`` for anything sage cannot run exactly (another
    quant_method, activation or KV cache quantization, fp8, 2-bit, per-tensor scales, sparsity, ...):
    a checkpoint is never run with parts of its quantization silently dropped.
    """
    where = "quantization_config"
    if not isinstance(qc, dict):
        raise FormatError(f"{where}: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise FormatError(f"{where}.quant_method: {method!r} is not supported (sage loads {QUANT_METHOD!r} "
                          f"weight-only int4/int8 checkpoints)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise FormatError(f"{where}.quantization_status: {status!r}; sage loads compressed checkpoints only")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise FormatError(f"{where}.{key}: not supported (sage runs weight-only quantized linears)")
    global_format = qc.get("format")
    groups_raw = qc.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise FormatError(f"{where}.config_groups: expected a non-empty object")
    groups = []
    for name, raw in groups_raw.items():
        gwhere = f"{where}.config_groups.{name}"
        if not isinstance(raw, dict):
            raise FormatError(f"{gwhere}: expected an object")
        for key in ("input_activations", "output_activations"):
            if raw.get(key) is not None:
                raise FormatError(f"{gwhere}.{key}: activation quantization is not supported (weight-only only)")
        fmt = raw.get("format") or global_format
        if fmt != PACK_QUANTIZED and fmt not in INT_QUANTIZED:
            field_path = f"{gwhere}.format" if raw.get("format") else f"{where}.format"
            raise FormatError(f"{field_path}: {fmt!r} is not supported (pack-quantized, int-quantized, "
                              f"naive-quantized)")
        targets = raw.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise FormatError(f"{gwhere}.targets: expected a list of module names, 're:' patterns or 'Linear'")
        for target in targets:
            if target != "Linear" and target[:1].isupper():  # a class name: Embedding, LlamaDecoderLayer, ...
                raise FormatError(f"{gwhere}.targets: {target!r} is not supported ('Linear', 're:<pattern>' "
                                  f"or a module name)")
        scheme = _weight_scheme(raw.get("weights"), f"{gwhere}.weights")
        if fmt in INT_QUANTIZED and scheme.num_bits != 8:
            raise FormatError(f"{gwhere}.weights.num_bits: {fmt} stores int8 values; {scheme.num_bits} bits "
                              f"need pack-quantized")
        groups.append(ConfigGroup(name, tuple(targets), scheme, fmt))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise FormatError(f"{where}.ignore: expected a list of module names or 're:' patterns")
    return CompressedTensorsConfig(tuple(groups), tuple(ignore))


def _weight_scheme(raw: object, where: str) -> WeightScheme:
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: expected an object (sage runs weight-quantized linears only)")
    if raw.get("type", "int") != "int":
        raise FormatError(f"{where}.type: {raw.get('type')!r} is not supported (int only; no fp8 / fp4)")
    bits = raw.get("num_bits")
    if bits not in (4, 8):
        raise FormatError(f"{where}.num_bits: {bits!r} is not supported (4 or 8)")
    if raw.get("dynamic"):
        raise FormatError(f"{where}.dynamic: dynamic weight scales are not supported")
    if raw.get("actorder") not in (None, "static", "weight", False):
        raise FormatError(f"{where}.actorder: {raw.get('actorder')!r} (permuted groups, weight_g_idx) is not "
                          f"supported; use static or none")
    strategy, group_size = raw.get("strategy"), raw.get("group_size")
    if strategy is None:  # compressed-tensors infers it: -1 channel, > 0 group
        strategy = "channel" if group_size == -1 else "group" if isinstance(group_size, int) else None
    if strategy == "channel":
        group_size = None
    elif strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise FormatError(f"{where}.group_size: {group_size!r}; group strategy needs a positive group size")
    else:
        raise FormatError(f"{where}.strategy: {strategy!r} is not supported (channel or group)")
    symmetric = raw.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise FormatError(f"{where}.symmetric: expected true or false, got {symmetric!r}")
    return WeightScheme(bits, group_size, symmetric)


def quantization_config(scheme: WeightScheme, ignore: list[str] | None = None) -> dict:
    """The config.json ``quantization_config`` for a checkpoint whose Linear layers use `scheme`
    (the fields compressed-tensors 0.17 writes, weight args spelled out as its serializer does)."""
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False,
        "group_size": scheme.group_size, "num_bits": scheme.num_bits, "observer": "memoryless_minmax",
        "observer_kwargs": {}, "scale_dtype": None, "strategy": "channel" if scheme.group_size is None else "group",
        "symmetric": scheme.symmetric, "type": "int",
        "zp_dtype": None if scheme.symmetric else "torch.int8",
    }
    return {
        "config_groups": {"group_0": {"format": PACK_QUANTIZED, "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": PACK_QUANTIZED,
        "global_compression_ratio": None,
        "ignore": list(ignore if ignore is not None else ["lm_head"]),
        "kv_cache_scheme": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": FORMAT_VERSION,
    }


# -- tensors of one linear ---------------------------------------------------------------------


def encode_weight(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """pack-quantized tensors of one linear, keyed by suffix (``weight_packed``, ...)."""
    bits = qw.scheme.num_bits
    out = {
        "weight_packed": pack_int32(qw.qweight, bits),
        "weight_scale": qw.scale.contiguous(),
        "weight_shape": torch.tensor(qw.shape, dtype=torch.int64),
    }
    if qw.zero_point is not None:
        out["weight_zero_point"] = pack_int32(qw.zero_point, bits, packed_dim=0)
    return out


def decode_weight(tensors: dict[str, torch.Tensor], group: ConfigGroup, shape: tuple[int, int],
                  prefix: str) -> QuantizedWeight:
    """The QuantizedWeight of linear `prefix` [out, in] = `shape` from its checkpoint tensors (keyed by suffix).

    FormatError naming the tensor when one is missing, of the wrong dtype or shape.
    """
    scheme = group.scheme
    out_f, in_f = shape
    group_len = scheme.group_of(in_f)
    if in_f % group_len:
        raise FormatError(f"{prefix}: in_features {in_f} is not a multiple of group_size {group_len} "
                          f"(quantization_config.config_groups.{group.name}.weights.group_size)")
    groups = in_f // group_len

    def need(suffix: str, dtype: torch.dtype | None, want: tuple[int, ...]) -> torch.Tensor:
        if suffix not in tensors:
            raise FormatError(f"{prefix}.{suffix}: missing from the checkpoint ({group.format}, {scheme.name})")
        tensor = tensors[suffix]
        if dtype is not None and tensor.dtype != dtype:
            raise FormatError(f"{prefix}.{suffix}: dtype {tensor.dtype}, expected {dtype}")
        if tuple(tensor.shape) != want:
            raise FormatError(f"{prefix}.{suffix}: shape {tuple(tensor.shape)}, expected {want}")
        return tensor

    scale = need("weight_scale", None, (out_f, groups))
    if not scale.dtype.is_floating_point:
        raise FormatError(f"{prefix}.weight_scale: dtype {scale.dtype}, expected a float dtype")
    zero_point = None
    if group.format == PACK_QUANTIZED:
        per_int = 32 // scheme.num_bits
        stored_shape = tuple(int(v) for v in need("weight_shape", None, (2,)).tolist())
        if stored_shape != (out_f, in_f):
            raise FormatError(f"{prefix}.weight_shape: {stored_shape}, expected {(out_f, in_f)}")
        packed = need("weight_packed", torch.int32, (out_f, math.ceil(in_f / per_int)))
        qweight = unpack_int32(packed, scheme.num_bits, (out_f, in_f))
        if not scheme.symmetric:
            zp = need("weight_zero_point", torch.int32, (math.ceil(out_f / per_int), groups))
            zero_point = unpack_int32(zp, scheme.num_bits, (out_f, groups), packed_dim=0)
    else:
        qweight = need("weight", torch.int8, (out_f, in_f))
        if not scheme.symmetric:
            zero_point = need("weight_zero_point", torch.int8, (out_f, groups))
    if scheme.symmetric and "weight_zero_point" in tensors and bool(tensors["weight_zero_point"].any()):
        raise FormatError(f"{prefix}.weight_zero_point: non-zero zero points in a symmetric scheme "
                          f"(quantization_config.config_groups.{group.name}.weights.symmetric)")
    extra = set(tensors) - set(SUFFIXES)
    if extra:
        raise FormatError(f"{prefix}.{sorted(extra)[0]}: not supported ({group.format}, {scheme.name})")
    return QuantizedWeight(qweight, scale, zero_point, scheme)
