"""`sage_infer.LLM`: offline generation in a few lines, on any backend.

    from sage_infer import LLM, SamplingParams
    llm = LLM()                                   # the bundled demo model, on sage's own engine
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].outputs[0].text)

    llm = LLM("path/to/model", backend="vllm", dtype="fp32")

``backend="native"`` (the default) builds sage's `LLMEngine` and steps it in the caller's thread
(no server thread, no event loop: `llm.engine` is there to inspect). Any other backend is started
from the registry and driven through `InferenceBackend`, the same calls the server makes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from itertools import count

from sage_infer.backends.registry import create_backend
from sage_infer.config.serve import (
    KVPoolConfig,
    ModelConfig,
    PolicyConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from sage_infer.core.messages import AddRequest
from sage_infer.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine.build import build_engine
from sage_infer.engine.llm_engine import LLMEngine, RequestError
from sage_infer.interfaces.backend import InferenceBackend, InvalidRequestError

Prompt = str | list[int]


def llm_config(
    model: str | None = None,
    *,
    backend: str = "native",
    dtype: str = "auto",
    max_model_len: int | None = None,
    block_size: int | None = None,
    num_blocks: int | None = None,
    kv_memory: str | int | None = None,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    short_prefill_first: bool = False,
    scheduling: str = "fifo",
    eviction_policy: str = "lru",
    revision: str = "local",
    speculative_config: dict | None = None,
) -> ServeConfig:
    """The `ServeConfig` that `LLM`'s keyword arguments describe. `block_size` None: the
    backend's default (16 natively; vLLM's own on its platform). `speculative_config`: the `speculative`
    section as vLLM's argument of that name, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``."""
    pool = dict(num_blocks=num_blocks, memory_budget=kv_memory, enable_prefix_caching=enable_prefix_caching)
    if block_size is not None:
        pool["block_size"] = block_size
    return ServeConfig(
        backend=backend,
        model=ModelConfig(path=model, dtype=dtype, max_model_len=max_model_len, revision=revision),
        kv_pool=KVPoolConfig(**pool),
        scheduler=SchedulerConfig(strategy=scheduling, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=enable_chunked_prefill,
                                  long_prefill_token_threshold=long_prefill_token_threshold,
                                  short_prefill_first=short_prefill_first),
        policy=PolicyConfig(eviction=eviction_policy),
        speculative=SpeculativeConfig(**(speculative_config or {})),
    )


class LLM:
    """A model and an engine for offline use. Keyword arguments are `llm_config`'s and map onto `ServeConfig`
    sections (``backend=``: a name from `sage infer backends:list`); pass `config=` to use a fully resolved one
    instead. `engine` is the native engine (None on another backend), `backend` the other backend (None
    natively)."""

    def __init__(self, model: str | None = None, *, backend: str = "native", device: str | None = None,
                 config: ServeConfig | None = None, **kwargs) -> None:
        config = config if config is not None else llm_config(model, backend=backend, **kwargs)
        self.config = config
        self.engine: LLMEngine | None = None
        self.backend: InferenceBackend | None = None
        self._ids = count()
        if config.backend == "native":
            self.engine = build_engine(config, device)
            return
        if device is not None:
            raise ValueError(f"device= picks the native engine's device; backend {config.backend} takes it from the "
                             "hardware preset")
        self.backend = create_backend(config)
        self.backend.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else self.backend.model_info().tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.

        A prompt that can never run (empty, longer than the context or the pool) gets an
        output with finish_reason ``error`` and its message; the others are unaffected.
        `progress` (a bar with the token rate) is shown for the native engine only.
        """
        batch = self._normalize(prompts)
        params = self._params(sampling_params, len(batch))
        if self.backend is not None:
            return self._generate_on_backend(batch, params, priority, cache_salt)
        results: dict[str, RequestOutput] = {}
        order = []
        for i, prompt in enumerate(batch):
            request_id = f"gen-{next(self._ids)}"
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, params[i], cache_salt=cache_salt,
                                        priority=priority[i] if priority else 0)
            except RequestError as err:
                results[request_id] = failed_output(request_id, prompt, params[i], str(err))
        self._run(results, len(order), progress)
        return [results[request_id] for request_id in order]

    def _generate_on_backend(self, batch: list[Prompt], params: list[SamplingParams],
                             priority: Sequence[int] | None, cache_salt: str | None) -> list[RequestOutput]:
        jobs = []
        for i, prompt in enumerate(batch):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            jobs.append(AddRequest(f"gen-{next(self._ids)}", ids, params[i],
                                   prompt=prompt if isinstance(prompt, str) else None,
                                   priority=priority[i] if priority else 0, cache_salt=cache_salt))
        return asyncio.run(self._run_all(jobs))

    async def _run_all(self, jobs: list[AddRequest]) -> list[RequestOutput]:
        async def one(job: AddRequest) -> RequestOutput:
            try:
                stream = await self.backend.add_request(job)
            except InvalidRequestError as err:  # like the native engine: this prompt fails, the others run
                return failed_output(job.request_id, job.prompt or job.prompt_token_ids, job.params, str(err))
            final = None
            async for output in stream:
                final = output
            return final

        return list(await asyncio.gather(*(one(job) for job in jobs)))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, cache_salt=cache_salt)

    def close(self) -> None:
        """Call it once, when done generating. The native engine keeps its KV cache in the persistent tier, if one
        is configured, for the next start on it, and stops the tiers' background work (`LLMEngine.shutdown`);
        another backend stops (its engine runs in its own processes until then)."""
        if self.backend is not None:
            self.backend.shutdown()
        else:
            self.engine.shutdown()

    def _run(self, results: dict[str, RequestOutput], total: int, progress: bool) -> None:
        if not progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[tok_s]} tok/s"))
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task("generate", total=total, completed=len(results), tok_s="-")
            start, tokens = time.monotonic(), 0
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    tokens += sum(len(c.delta_token_ids) for c in output.outputs)
                    if output.finished:
                        results[output.request_id] = output
                        bar.advance(task)
                bar.update(task, tok_s=f"{tokens / max(time.monotonic() - start, 1e-9):.1f}")

    def _normalize(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _params(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params


def failed_output(request_id: str, prompt: Prompt, params: SamplingParams, message: str) -> RequestOutput:
    outputs = [CompletionOutput(index=i, finish_reason="error") for i in range(params.n)]
    return RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                         [] if isinstance(prompt, str) else list(prompt), outputs,
                         RequestMetrics(arrival_time=time.monotonic()), finished=True, error=message)
