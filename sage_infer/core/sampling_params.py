"""How one request wants its tokens chosen and when it wants generation to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

from sage_infer.core.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction (a bad value raises
    `ValueError` naming the field and its allowed range).

    `temperature == 0` or `top_k == 1` means greedy. `top_k` of 0 is normalised to -1 (off).
    `repetition_penalty` follows HF/vLLM (divides positive logits, multiplies negative ones,
    over prompt + output tokens); `presence_penalty`/`frequency_penalty` follow OpenAI
    (subtracted from the logits of tokens already in the output). `logprobs=N` returns the
    sampled token's logprob plus the top-N alternatives (N in 0..20). `structured_outputs` constrains every
    sequence of the request to a grammar (each its own matcher; the logprobs are those of the masked logits).
    """

    n: int = 1
    max_tokens: int | None = 16  # None: until the context window ends
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 (or None: until the context ends), got {self.max_tokens}")
        if not self.temperature >= 0.0:  # `not >=` also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _check_int("top_k", self.top_k)
        if not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1 or 0 (off) or in [1, 2**31), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 means off), got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                raise ValueError(f"seed must be a 64-bit integer (in [-2**63, 2**64)), got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
                raise ValueError(f"stop_token_ids must be token ids (integers in [0, 2**31)), got {t!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
