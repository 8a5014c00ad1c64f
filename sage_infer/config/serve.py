"""`ServeConfig`: the one resolved configuration of a sage_infer process.

Built once at start-up by `sage_infer.config.resolve.resolve_config` from, highest
first: CLI flags, ``SAGE_*`` env vars (nested with ``__``, e.g.
``SAGE_KV_POOL__BLOCK_SIZE=32``), a ``--config`` YAML file, the hardware and transport
presets, and the defaults below. Constructing it directly reads no env vars.

Every ``auto`` value (model dtype, KV dtype, device, pool size) is decided in
`sage_infer.config.auto`; sections that nothing uses yet are listed in
`sage_infer.config.inactive`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sage_infer.config.hardware import HardwareProfile, Strict
from sage_infer.config.responses import ResponsesConfig
from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.kv_schema import KVDtype

# vLLM's --dtype names and config.json's torch_dtype names, as model.dtype spells them
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


class ModelConfig(Strict):
    path: str | None = Field(None, description="Local HF model directory; None serves the bundled demo model.")
    served_name: str | None = Field(None, description="Model id reported by the API (default: directory name).")
    revision: str = Field("local", description="Part of the prefix-cache key, so caches never mix revisions.")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Weight and compute dtype; auto: the checkpoint's, or what the hardware preset "
        "prefers. vLLM's and config.json's names (bfloat16, float16, half, float32, float) are accepted.")
    max_model_len: int | None = Field(None, ge=16, le=1 << 21)
    linear: Literal["auto", "packed", "torch"] = Field(
        "auto", description="Linear layers: packed (weights prepacked once for oneDNN; CPU only), torch (plain "
        "nn.Linear, the reference path), auto (packed on a CPU whose torch has oneDNN, else torch). Quantized "
        "layers of a quantized checkpoint: the CPU int8/int4 kernels unless torch (dequantize + F.linear).")
    decode_linear: Literal["auto", "sage", "onednn"] = Field(
        "auto", description="bf16 products of up to 32 rows (decode steps) on packed linear layers: sage (a "
        "kernel that reads oneDNN's packed weights in place, near the memory bandwidth; needs AVX512-BF16), "
        "onednn (oneDNN for every product; choose it to compare), auto "
        "(sage where it can run, else onednn). No effect unless model.linear packs the layers.")
    attention: Literal["auto", "paged", "torch"] = Field(
        "auto", description="Decode attention: paged (a kernel reads K/V in place from the pool's blocks, float KV "
        "or, on a CPU, int8 KV: on a CPU in C++, compiled by the install; on an NVIDIA GPU in Triton, needs "
        "triton), torch (gathered copies and PyTorch ops, the reference path), auto (paged where it can run, else "
        "torch).")
    prefill_attention: Literal["auto", "sage", "torch"] = Field(
        "auto", description="Prefill chunks (and, on CPU, prompt prefixes shared by a step's sequences): sage (on "
        "CPU a flash kernel for bf16 or fp32 models, at the ISA level of the CPU kernels in use "
        "(docs/cpu_isa.md); head_dim a multiple of 32 up to 256; a bf16 model on a CPU with AMX tiles runs its plain "
        "layers through PyTorch's CPU flash kernel instead, on AMX, and sage's kernel for windowed, soft-capped and "
        "sink layers. On an NVIDIA GPU a Triton kernel that "
        "attends every prefill span of a step in one launch per layer, reading K/V in place from a float pool; "
        "model.cascade_attention is then off, each row reading its shared prefix in place), torch (PyTorch's flash "
        "kernel per span, the reference path), auto (sage where it can run, else torch).")
    elementwise: Literal["auto", "fused", "torch"] = Field(
        "auto", description="A decoder layer's elementwise glue: fused (the residual add with the RMSNorm after it, "
        "Qwen3's q/k norm with rotary, silu(gate)*up: one C++ pass each, built with the paged kernel; a mixture-of-"
        "experts layer's experts, and a decode step's routing, in C++; CPU), torch "
        "(PyTorch ops, the reference path), auto (fused where it can run, else torch).")
    decode_step: Literal["auto", "sage", "python"] = Field(
        "auto", description="A pure decode step (every row one new token, no shared prefix) of an fp32 or bf16 model "
        "on CPU: sage (all decoder layers in one C++ call chaining the kernels the Python path calls one by one, "
        "the same values to the bit, without the interpreter between them; needs model.linear packed, "
        "model.elementwise fused, model.attention paged and a KV pool in the model's dtype or int8), python (layer by "
        "layer from Python, the reference path), auto (sage where it can run, else python).")
    host_malloc: Literal["keep", "system"] = Field(
        "keep", description="CPU device: keep (raise glibc's mmap and trim thresholds so the buffers a step frees "
        "are reused by the next, not mapped again and zero-filled by the kernel: long prefill steps gain most), "
        "system (glibc's defaults; choose it when the process shares its heap with allocation-sensitive code). "
        "Applies to the whole process; no effect on other devices.")
    huge_pages: bool = Field(
        True, description="CPU: back the packed weights with 2 MiB transparent huge pages, collapsed at start-up "
        "(MADV_COLLAPSE, Linux 6.1+, THP not 'never'; fewer TLB misses when decode reads the weights, for about "
        "2 s of start-up per GB of weights), and the KV pool, asked for huge pages before it is zeroed. false: 4 KiB "
        "pages (choose it where start-up time matters more than decode speed).")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="NVIDIA GPU: replay each pure decode step as a CUDA graph (one per batch-size bucket, "
        "captured on first use; the whole step launched at once instead of op by op from Python; needs "
        "model.attention paged, the Triton kernel), off (launch op by op, the reference path), auto (on where it "
        "can run, else off).")
    cascade_attention: bool = Field(
        True, description="Sequences of a step that share leading KV blocks (one prompt prefix from the prefix "
        "cache) attend to them once, together; false: each reads its whole context (the reference path).")
    deterministic: bool = Field(
        False, description="Batch-invariant output: a request gets the same tokens and logprobs whatever else is "
        "batched with it (every linear product on fixed tiles of rows, every query row through the paged decode "
        "kernel, model.cascade_attention and the C++ decode step off). Slower; without it greedy output under load "
        "can differ from a solo run in near-tie tokens. CPU with the paged kernel (model.attention paged).")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3"] = Field(
        "auto", description="How tool calls are read from the model's text when a chat request gives tools "
        "(tool_choice auto): hermes (Qwen / Hermes <tool_call>{json}</tool_call>), llama3_json (Llama 3 JSON), "
        "mistral ([TOOL_CALLS]), pythonic ([f(a=1), g()], Llama 3.2 / 4 pythonic), deepseek_v3 (DeepSeek V3 / "
        "V3.1 <｜tool▁calls▁begin｜>), auto (the format the chat template's text shows; none found: calls stay "
        "content), none (never parsed). See docs/tools.md.")
    reasoning_parser: Literal["none", "qwen3", "deepseek_r1"] = Field(
        "none", description="Split a reasoning model's <think>...</think> section off as reasoning_content: qwen3, "
        "deepseek_r1 (whose answers start inside the section), none (all of the text is content).")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: object) -> object:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


class KVPoolConfig(Strict):
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block (a power of two).")
    num_blocks: int | None = Field(None, ge=1, description="Blocks to preallocate; None: from memory_budget. A "
                                   "draft model's pool (speculative.model) holds as many blocks, beyond this count.")
    memory_budget: ByteSize | None = Field(None, description="Bytes for the KV cache, e.g. 2GiB; with a draft model "
                                           "(speculative.model) its pool and the target's share them, as many "
                                           "blocks each.")
    memory_utilization: float = Field(0.9, gt=0, le=1, description="Device memory share when no budget is set "
                                      "(with a draft model: of the free memory less its weights, for both pools).")
    kv_dtype: KVDtype | Literal["auto"] = Field(
        "auto", description="auto: the hardware preset's default unless the model or device cannot hold it."
    )
    enable_prefix_caching: bool = True
    layer_loads: Literal["auto", "on", "off"] = Field(
        "auto", description="How KV loaded at admission (a lower-tier hit, a received prefill/decode transfer) reaches "
        "the pool. on: layer by layer, each layer's attention waiting only for its own layer: on a CUDA GPU the "
        "copies run on a copy stream while earlier layers compute (a Triton kernel reading the page-locked rows); "
        "on a CPU each layer's copy is made right before its attention. off: all of it before the step. auto: on "
        "for a CUDA pool of a float KV dtype with Triton, off otherwise. A quantized KV dtype or a model with KV "
        "groups (sliding-window layers) loads whole.")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two, got {value}")
        return value


class TierConfig(Strict):
    host_bytes: ByteSize | Literal["auto"] = Field(
        "auto", description="Host (DDR) KV tier size; 0 disables it. auto: on an accelerator, a share of the "
        "preset's host DDR per device (memory.host_ddr_gb), capped by what the OS has available; none on a CPU, "
        "whose device pool is host DDR already.")
    disk_path: str | None = Field(None, description="Directory of the SSD KV tier; None disables it.")
    disk_bytes: ByteSize = Field(ByteSize(0))
    remote_url: str | None = Field(None, description="Remote KV tier, e.g. redis://127.0.0.1:6379/0 "
                                      "or mooncake://127.0.0.1:50051 (a Mooncake Store master).")
    remote_bytes: ByteSize = Field(ByteSize(1 << 30), description="Bytes of KV this server keeps in the remote tier.")
    load_timeout_s: float = Field(5.0, gt=0, le=600, description="Deadline of one lower-tier load; past it the "
                                  "request recomputes those blocks. Loads run off the engine thread.")
    hot_promote_after: int = Field(2, ge=0, le=1000, description="A block loaded back from a lower tier this many "
                                   "times is hot: while the engine has free blocks and no queue, hot blocks are "
                                   "promoted to the device ahead of need. 0: off.")
    write_policy: Literal["write_back", "write_through", "write_through_selective"] = Field(
        "write_back", description="When the disk tier gets a block: write_back (when the device and the faster tiers "
        "evict it; the least disk traffic), write_through (also as soon as the device computes it, in the "
        "background: a crash or SIGKILL loses at most the writes in flight), write_through_selective (also once "
        "the device's prefix cache has hit it twice: only reused blocks cost a write). Needs tiers.disk_path "
        "unless write_back.")
    remote_write_policy: Literal["write_back", "write_through"] = Field(
        "write_back", description="When the remote tier gets a block: write_back (when the faster tiers evict it) or "
        "write_through (also as soon as the device computes it): every server sharing the remote tier can load a "
        "prefix one of them computed without waiting for its eviction (a fleet's shared cache; a KV-aware router "
        "counts those blocks for every replica). Needs tiers.remote_url unless write_back.")
    flush_on_shutdown_s: float = Field(30.0, ge=0, le=3600, description="At a graceful end, how long the device's "
                                       "cached blocks and the host tier's may take to be copied into the disk tier "
                                       "for the next start on it (the rest is left out, and the log says so). 0: none.")

    @model_validator(mode="after")
    def _write_policy_needs_disk(self) -> TierConfig:
        if self.write_policy != "write_back" and self.disk_path is None:
            raise ValueError(f"write_policy {self.write_policy} writes blocks to the disk tier: set disk_path (and "
                             f"disk_bytes), or use write_back")
        if self.remote_write_policy != "write_back" and self.remote_url is None:
            raise ValueError("remote_write_policy write_through writes blocks to the remote tier: set remote_url, or "
                             "use write_back")
        return self

    @field_validator("remote_url")
    @classmethod
    def _redis_only(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://", "mooncake://")):
            raise ValueError(f"remote_url must be a redis://, rediss://, unix:// or mooncake:// URL, got {value!r}")
        return value


class TenantQuotaConfig(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Label in metrics and logs (the salt itself is never shown).")
    cache_salt: SecretStr = Field(description="Requests whose cache_salt is this belong to the tenant.")
    min_share: float = Field(0.0, ge=0, le=1, description="Fraction of each KV tier others cannot evict it below.")
    max_share: float = Field(1.0, ge=0, le=1, description="Fraction of each KV tier past which it evicts its own "
                             "blocks first.")

    @model_validator(mode="after")
    def _ordered(self) -> TenantQuotaConfig:
        if self.min_share > self.max_share:
            raise ValueError(f"tenant {self.name}: min_share {self.min_share} > max_share {self.max_share}")
        return self


class QuotaConfig(Strict):
    """Per-tenant shares of every KV tier (device, host, disk, remote); off when no tenant is listed."""

    tenants: list[TenantQuotaConfig] = Field(default_factory=list)
    default_min_share: float = Field(0.0, ge=0, le=1, description="Share of a tenant not listed (or no salt).")
    default_max_share: float = Field(1.0, ge=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> QuotaConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names repeat: {names}")
        salts = [t.cache_salt.get_secret_value() for t in self.tenants]
        if len(set(salts)) != len(salts):
            raise ValueError("two tenants have the same cache_salt")
        if self.default_min_share > self.default_max_share:
            raise ValueError("default_min_share > default_max_share")
        if sum(t.min_share for t in self.tenants) > 1.0:
            raise ValueError("the tenants' min_share values add up to more than the whole tier")
        return self


class PolicyConfig(Strict):
    eviction: Literal["lru", "lfu", "arc", "s3fifo", "cost", "sage"] = "lru"


class KVEventsConfig(Strict):
    """KV block events in vLLM's ZMQ format, for routers built for vLLM (llm-d, Dynamo). sage's own fleet router
    reads the authenticated HTTP stream (GET /v1/kv/events/stream) instead and needs none of this."""

    publisher: Literal["null", "zmq"] = Field(
        "null", description="zmq: publish every block stored or removed (device, host, disk, remote) as vLLM's "
        "KVEventBatch (msgpack) on a ZMQ PUB socket; null: do not. Needs pip install 'sage-infer[events]'.")
    endpoint: str = Field("tcp://127.0.0.1:5557", pattern=r"^(tcp|ipc)://", description="The PUB socket's address "
                          "(bound). Loopback unless told otherwise: the ZMQ channel, like vLLM's, carries no key.")
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://", description="A ROUTER socket where a "
                                        "subscriber that missed batches asks for them again from a sequence number.")
    buffer_steps: int = Field(10_000, ge=1, le=1_000_000, description="Batches kept for replay.")
    topic: str = Field("", max_length=256, description="The topic every message is published under.")


class RouterConfig(Strict):
    """The prefill/decode router `--pd xPyD` starts (not used by a single server)."""

    strategy: Literal["fifo", "priority", "slo"] = Field(
        "fifo", description="Order of requests waiting for a free worker slot: fifo (arrival), priority (the "
        "request's priority, lower first), slo (earliest TTFT deadline: arrival + slo_ttft_ms, or the default; "
        "and the decode worker is one whose measured TPOT meets the request's slo_tpot_ms, if any does).")
    max_outstanding_per_worker: int = Field(8, ge=1, le=4096, description="Requests in flight at one decode "
                                            "worker; more wait in the router, ordered by the strategy.")
    default_slo_ttft_ms: float = Field(1000.0, gt=0, le=3_600_000, description="TTFT target of a request that "
                                       "names none (strategy slo).")
    default_slo_tpot_ms: float = Field(200.0, gt=0, le=3_600_000, description="TPOT target of a request that "
                                       "names none (strategy slo): decode workers measured slower are avoided.")


class SchedulerConfig(Strict):
    strategy: Literal["fifo", "priority", "lpm"] = Field(
        "fifo", description="Order in which waiting requests are admitted: fifo (arrival); priority (the request's "
        "priority, lower first, then arrival); lpm (longest prefix match, SGLang's: the most prompt tokens already "
        "cached, on the device or in a lower tier, first; arrival among equals; a queue of more than 128 is "
        "admitted in arrival order; a request waiting longer than lpm_max_wait_s goes first). Under load past the "
        "pool's capacity lpm lets a conversation's next turn in before new conversations evict its prefix.")
    lpm_max_wait_s: float = Field(1.0, ge=0, le=3600, description="strategy lpm: a request that has waited this "
                                  "long is admitted before the longest-prefix order (the longest waiting first), so "
                                  "prompts with little cached are not starved while cached ones keep coming; 0: "
                                  "arrival order.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Requests running at once.")
    max_num_batched_tokens: int = Field(2048, ge=16, le=1 << 20, description="Token budget of one step.")
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0, le=1 << 20, description="With chunked prefill, a request "
                                              "computes at most this many prompt tokens per step while another "
                                              "request runs or waits (vLLM's option of the same name), so a long "
                                              "prompt's chunks share steps with short prompts and decodes instead "
                                              "of filling them: a short prompt's first token need not wait for a "
                                              "long one's prefill. 0: up to the step's budget.")
    short_prefill_first: bool = Field(False, description="With chunked prefill and a long_prefill_token_threshold: "
                                      "in a step where a prompt with at most that many tokens left to compute (its "
                                      "cached prefix not counted) can run, prompts with more left compute nothing, "
                                      "so a short prompt (a conversation's next turn over its cached history) gets "
                                      "its first token after its own prefill, not after a step shared with a long "
                                      "one: on a CPU a step takes as long as all its prompt tokens. A long prompt is "
                                      "held back at most one step in a row. Decodes always run. vLLM and SGLang have "
                                      "no such option.")
    max_waiting: int = Field(1024, ge=1, description="Queue length before new requests get 429.")


class SpeculativeConfig(Strict):
    """Speculative decoding: a proposer guesses a running sequence's next tokens, one forward pass of the model
    checks them all, and every guess that matches what the model would have produced is kept. The output is the
    same as without it (greedy: the same tokens; sampling: the same distribution, and a seeded request the same
    tokens); a step that accepts guesses makes several tokens for about the weight reads of one."""

    method: Literal["off", "ngram", "suffix", "draft_model"] = Field(
        "off", description="off; ngram: look the sequence's last tokens up earlier in its prompt and output and "
        "propose what followed them (prompt lookup); suffix: propose the continuation most earlier occurrences of "
        "the longest match agree on, in the sequence and in the outputs of the tenant's recent requests (suffix "
        "decoding); draft_model: a small model sharing the target's tokenizer (speculative.model) proposes greedily "
        "from its own paged KV.")
    model: str | None = Field(None, description="draft_model: the draft model's local HF directory (vLLM's "
                              "speculative_config.model); its tokenizer must be the target's. Its KV pool holds as "
                              "many blocks as the target's, out of the same kv_pool budget (an explicit "
                              "kv_pool.num_blocks: beyond it).")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Most tokens proposed per sequence and step.")
    prompt_lookup_min: int = Field(2, ge=1, le=64, description="ngram: the shortest suffix of the sequence that "
                                   "is looked up.")
    prompt_lookup_max: int = Field(5, ge=1, le=64, description="ngram: the longest suffix looked up (the longest "
                                   "one found wins; among its occurrences, the latest).")
    suffix_decoding_max_tree_depth: int = Field(24, ge=2, le=256, description="suffix: the longest match (and "
                                                "proposal) in tokens.")
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0, le=1_000_000, description="suffix: finished "
                                                     "requests per tenant whose outputs are searched too (the "
                                                     "oldest dropped first); 0: the sequence's own tokens only.")
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0, le=64, description="suffix: propose at most this "
                                                   "many tokens per matched token (a short match, a short guess).")
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1, description="suffix: stop proposing when the "
                                                  "share of the match's occurrences agreeing on the next token "
                                                  "falls below this.")
    adaptive: bool = Field(False, description="Each sequence proposes up to its own k: halved after a step that "
                           "accepted nothing, one more after a step that accepted everything (between 1 and "
                           "num_speculative_tokens); a step that accepted nothing also pauses its proposals for 4 "
                           "steps, twice as many after each refused probe (up to 64), until a proposal stands.")
    disable_by_batch_size: int | None = Field(None, ge=1, le=4096, description="No proposals in a step that runs "
                                              "at least this many sequences (a big batch is no longer bound by "
                                              "weight reads, so verify rows cost compute); None: always propose.")

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("model: the draft model's directory is needed by method draft_model, and only by it")
        return self


class ServeConfig(BaseSettings):
    """Everything one serve process needs; frozen after resolution."""

    model_config = SettingsConfigDict(
        env_prefix="SAGE_", env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # Only the values passed in: `resolve_config` reads the env itself (from the dict it
        # is given, recording each variable as an origin), so a ServeConfig built in code
        # or from `resolve_config(env={})` never picks up SAGE_* behind the caller's back.
        return (init_settings,)

    preset: str = Field("auto", description="Hardware preset name or YAML path; auto: detect this machine.")
    backend: str = Field("native", description="Inference backend (sage infer backends:list); native: our engine.")
    pd: str | None = Field(None, pattern=r"^\d+[pP]\d+[dD]$", description="Run xPyD here (e.g. 1P1D): a router "
                           "and x prefill + y decode workers behind one URL (`--pd`).")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="Prefill/decode separation: prefill computes prompts and sends their KV, decode "
        "receives it and generates; both (default) does everything here. kv_transport.* configures the transfers.")
    host: str = Field("127.0.0.1", description="Bind address; loopback unless told otherwise.")
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = Field(None, description="Required bearer token when set.")
    drain_timeout_s: int = Field(30, ge=0, le=3600, description="At SIGTERM/SIGINT, how long running requests get "
                                 "to finish; just before it ends, what still runs gets an error (a stream's error "
                                 "event and [DONE], a 503) and its KV freed.")
    model: ModelConfig = ModelConfig()
    kv_pool: KVPoolConfig = KVPoolConfig()
    tiers: TierConfig = TierConfig()
    policy: PolicyConfig = PolicyConfig()
    quota: QuotaConfig = QuotaConfig()
    router: RouterConfig = RouterConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    kv_transport: KVTransportConfig = KVTransportConfig()
    responses: ResponsesConfig = ResponsesConfig()
    hardware: HardwareProfile | None = Field(None, description="The resolved hardware preset.")

    def preset_kv_dtype(self) -> KVDtype | None:
        """The hardware preset's default KV dtype (what ``kv_dtype: auto`` starts from)."""
        return self.hardware.kv.default_dtype if self.hardware else None
