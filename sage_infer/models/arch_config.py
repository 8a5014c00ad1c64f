"""The few numbers a decoder needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sage_infer.core.dtypes import parse_dtype_name
from sage_infer.layers.attention_kinds import AttentionKind
from sage_infer.layers.rotary import inv_frequencies
from sage_infer.models.layer_types import layer_windows, rope_by_layer_type


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts model's routing and expert shapes, as each family's config.json names them."""

    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int
    renormalize: bool  # top-k probabilities divided by their sum (norm_topk_prob; Mixtral always)
    sparse_layers: tuple[int, ...]  # layers whose MLP routes to experts (the others are dense)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one shared expert, scaled by a sigmoid gate
    qk_norm_full: bool = False  # OLMoE: RMSNorm over all heads of q and of k, before the head split
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv
    # gpt-oss: experts with biases and the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
    # g = gate clamped above at `swiglu_limit`; a router with a bias, softmax over the top-k logits
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None


MOE_FAMILIES = ("Qwen2Moe", "Qwen3Moe", "Mixtral", "Olmoe", "GptOss")
# what transformers' GptOssConfig assumes for a field config.json leaves out, where sage's default differs
GPT_OSS_DEFAULTS = {"attention_bias": True, "head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 128,
                    "max_position_embeddings": 131072, "num_key_value_heads": 8, "rope_theta": 150000.0}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def moe_config(config: dict, family: str) -> MoeConfig | None:
    """The MoE fields of a config.json of `family` (None for a dense family). ValueError for a field sage does
    not run (an activation other than silu, no experts)."""
    if family not in MOE_FAMILIES:
        return None
    act = config.get("hidden_act", "silu")
    if act != "silu" and family != "GptOss":  # gpt-oss's experts run their clamped SwiGLU whatever it says
        raise ValueError(f"hidden_act {act!r}: the experts run silu only")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    top_k = int(config["num_experts_per_tok"])
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"num_experts {experts} with num_experts_per_tok {top_k}")
    layers = int(config["num_hidden_layers"])
    sparse = tuple(range(layers))
    if family.startswith("Qwen"):  # dense MLPs in mlp_only_layers and off the decoder_sparse_step grid
        step, dense = int(config.get("decoder_sparse_step", 1)), set(config.get("mlp_only_layers") or ())
        sparse = tuple(i for i in sparse if i not in dense and (i + 1) % step == 0)
    clip = config.get("clip_qkv") if family == "Olmoe" else None
    if clip is not None and not float(clip) > 0:
        raise ValueError(f"clip_qkv {clip}: q, k and v are clamped to +-clip_qkv, which must be above 0")
    gpt_oss = family == "GptOss"
    return MoeConfig(
        num_experts=experts, top_k=top_k,
        expert_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        renormalize=family in ("Mixtral", "GptOss") or bool(config.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        qk_norm_full=family == "Olmoe", clip_qkv=None if clip is None else float(clip),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)) if gpt_oss else None,
        swiglu_limit=float(config.get("swiglu_limit", 7.0)) if gpt_oss else None,
    )


def with_family_defaults(config: dict, family: str) -> dict:
    """`config` with the defaults transformers' config class of `family` gives the fields it leaves out, where they
    differ from sage's (gpt-oss: q/k/v/o biases, a window of 128, yarn rope of theta 150000, ...)."""
    if family != "GptOss":
        return config
    filled = {**GPT_OSS_DEFAULTS, **config}
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        filled["rope_parameters"] = {**GPT_OSS_ROPE, "rope_theta": filled["rope_theta"]}
    return filled


@dataclass(slots=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None
    torch_dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoeConfig | None = None  # mixture-of-experts layers (`moe_config`); None for a dense model
    # attention kinds (`sage_infer.models.layer_types`): each layer's sliding window (None: full attention)
    layer_windows: tuple[int | None, ...] = ()
    attn_softcap: float | None = None  # Gemma 2: attention scores soft-capped at this
    final_softcap: float | None = None  # Gemma 2: logits soft-capped at this
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power (else head_dim's)
    rope_local: dict | None = None  # Gemma 3: the sliding layers' own rope parameters
    hidden_act: str = "silu"  # the MLP's activation (``hidden_activation`` or ``hidden_act``)

    def attention_kind(self, layer: int) -> AttentionKind:
        """Layer `layer`'s sliding window and soft-capping."""
        window = self.layer_windows[layer] if self.layer_windows else None
        return AttentionKind(window=window, softcap=self.attn_softcap)

    @classmethod
    def from_hf(cls, config: dict, architecture: str) -> ArchConfig:
        family = architecture.removesuffix("ForCausalLM")
        config = with_family_defaults(config, family)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // heads
        qkv_bias = bool(config.get("attention_bias", config.get("qkv_bias", family in ("Qwen2", "Qwen2Moe"))))
        num_layers = int(config["num_hidden_layers"])
        windows = layer_windows(config, family, num_layers)
        rope, rope_local = rope_by_layer_type(config)
        for params in (rope, rope_local or rope):  # a rope sage does not build fails here, before any weight loads
            inv_frequencies(int(head_dim), params, int(config.get("max_position_embeddings", 2048)))
        eos = config.get("eos_token_id")
        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope=rope,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", family.startswith("Gemma"))),
            qkv_bias=qkv_bias,
            o_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family in ("Qwen3", "Qwen3Moe"),
            sliding_window=max((w for w in windows if w is not None), default=None),
            torch_dtype=parse_dtype_name(dtype_name, torch.float32),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            moe=moe_config(config, family),
            layer_windows=windows,
            attn_softcap=config.get("attn_logit_softcapping"),
            final_softcap=config.get("final_logit_softcapping"),
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            rope_local=rope_local,
            hidden_act=str(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
        )
