"""The vLLM side of bench/engine_vs_vllm.py: runs in the vLLM virtualenv, one process per model.

    .vllm-venv/bin/python bench/_vllm_worker.py < jobs.jsonl > results.jsonl

Reads one JSON job per line on stdin and answers each with one JSON line on stdout (the
worker moves its own and vLLM's prints to stderr first, so stdout carries only results).
Jobs, in order: one `load`, any number of `generate`, then `exit` (or end of input).
Standard library only at import time (it is imported by the bench and its tests without vLLM);
no pickle crosses the pipe.

Timing: `wall_s` is `LLM.generate`'s wall time; a request's TTFT is its first token's time
from the `generate` call's start (vLLM's `metrics.arrival_time + first_token_latency`, both
wall clock, which needs `disable_log_stats=False`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class LoadJob:
    """Build `vllm.LLM(model, dtype=..., seed=..., enable_prefix_caching=True, **llm_kwargs)`."""

    model: str
    dtype: str  # vLLM spelling: float32, bfloat16, float16
    seed: int = 0
    llm_kwargs: dict = field(default_factory=dict)
    op: str = "load"


@dataclass(slots=True)
class GenerateJob:
    """Greedy, ignore_eos generation of `max_tokens` for each token-id prompt."""

    workload: str
    prompts: list[list[int]]
    max_tokens: int
    reset_prefix_cache: bool = True  # start from an empty prefix cache, as each sage run does
    cache_salt: str | None = None  # vLLM's per-request prefix-cache salt (tenant isolation)
    kv_transfer_params: list[dict] | None = None  # per prompt: vLLM's kv_transfer_params (P/D through a connector)
    op: str = "generate"


@dataclass(slots=True)
class ExitJob:
    op: str = "exit"


@dataclass(slots=True)
class LoadResult:
    load_s: float
    vllm_version: str
    torch_version: str
    isa: str = ""  # the kernel build vLLM's CPU platform imports on this CPU (`vllm_cpu_isa`)
    op: str = "load"


@dataclass(slots=True)
class GenerateResult:
    """output_token_ids and ttft_s are in prompt order; ttft_s from the generate call's start."""

    workload: str
    wall_s: float
    output_token_ids: list[list[int]]
    ttft_s: list[float]
    num_cached_tokens: int | None = None
    cached_tokens: list[int] | None = None  # per prompt, in prompt order (None when vLLM did not say)
    kv_transfer_params: list[dict | None] | None = None  # per prompt, what the KV connector answered
    op: str = "generate"


@dataclass(slots=True)
class ErrorResult:
    error: str
    op: str = "error"


JOBS = {"load": LoadJob, "generate": GenerateJob, "exit": ExitJob}
RESULTS = {"load": LoadResult, "generate": GenerateResult, "error": ErrorResult}


def encode(message) -> str:
    """One JSON line (no newline) for a job or result dataclass."""
    return json.dumps(asdict(message), separators=(",", ":"))


def _decode(line: str, kinds: dict[str, type]):
    data = json.loads(line)
    op = data.get("op") if isinstance(data, dict) else None
    if op not in kinds:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(kinds)}")
    return kinds[op](**data)


def decode_job(line: str) -> LoadJob | GenerateJob | ExitJob:
    return _decode(line, JOBS)


def decode_result(line: str) -> LoadResult | GenerateResult | ErrorResult:
    return _decode(line, RESULTS)


# -- the vLLM side (imports vLLM) -----------------------------------------------------------


def load(job: LoadJob):
    import torch
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(job.model, dtype=job.dtype, seed=job.seed, enable_prefix_caching=True,
                   disable_log_stats=False, **job.llm_kwargs)
    return llm, LoadResult(load_s=time.perf_counter() - start, vllm_version=vllm.__version__,
                           torch_version=torch.__version__, isa=vllm_cpu_isa())


def vllm_cpu_isa() -> str:
    """Which of its x86 kernel builds vLLM's CPU platform imports here (`CpuPlatform.import_kernels` decides by
    the same two torch checks, in its engine process): _C (AVX512-BF16), _C_AVX512 or _C_AVX2. Its choice
    cannot be forced lower."""
    import platform

    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine()
    if torch.cpu._is_avx512_supported():
        return "avx512_bf16 (vllm._C)" if torch.cpu._is_avx512_bf16_supported() else "avx512 (vllm._C_AVX512)"
    return "avx2 (vllm._C_AVX2)"


def generate(llm, job: GenerateJob) -> GenerateResult:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if job.reset_prefix_cache and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
    if job.kv_transfer_params is not None:
        params = [SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True,
                                 extra_args={"kv_transfer_params": dict(kv)}) for kv in job.kv_transfer_params]
    salt = {} if job.cache_salt is None else {"cache_salt": job.cache_salt}
    prompts = [TokensPrompt(prompt_token_ids=p, **salt) for p in job.prompts]
    start_wall, start = time.time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttfts = [o.metrics.arrival_time + o.metrics.first_token_latency - start_wall for o in outs]
    cached = [o.num_cached_tokens for o in outs]
    return GenerateResult(workload=job.workload, wall_s=wall,
                          output_token_ids=[list(o.outputs[0].token_ids) for o in outs], ttft_s=ttfts,
                          num_cached_tokens=None if None in cached else sum(cached),
                          cached_tokens=None if None in cached else cached,
                          kv_transfer_params=[o.kv_transfer_params for o in outs])


def serve(jobs, results) -> None:
    """Answer each job line from `jobs` with one result line on `results`."""
    llm = None
    for line in jobs:
        if not line.strip():
            continue
        try:
            job = decode_job(line)
            if isinstance(job, ExitJob):
                return
            if isinstance(job, LoadJob):
                llm, result = load(job)
            elif llm is None:
                raise RuntimeError("generate before load")
            else:
                result = generate(llm, job)
        except Exception as err:  # noqa: BLE001 - reported to the bench, which decides
            result = ErrorResult(f"{type(err).__name__}: {err}")
        results.write(encode(result) + "\n")
        results.flush()


def main() -> None:
    # keep fd 1 for results only: everything vLLM (and its engine-core process) prints goes to stderr
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, results)


if __name__ == "__main__":
    main()
