"""`sage_infer.LLM`: offline generation on any backend.

    llm = LLM("path/to/model", backend="vllm", dtype="fp32")
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=32, temperature=0))

``backend="native"`` (the default) is the engine's own `LLM`, stepped in this thread.
Any other backend is started from the registry and driven through `InferenceBackend`,
the same calls the server makes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import count

from sage_infer.backends.registry import create_backend
from sage_infer.config.serve import ServeConfig
from sage_infer.core.messages import AddRequest
from sage_infer.core.outputs import RequestOutput
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine import llm as native
from sage_infer.interfaces.backend import InferenceBackend, InvalidRequestError


class LLM(native.LLM):
    """`engine.llm.LLM` plus ``backend=`` (a name from `sage infer backends:list`)."""

    backend: InferenceBackend | None = None

    def __init__(self, model: str | None = None, *, backend: str = "native", device: str | None = None,
                 config: ServeConfig | None = None, **kwargs) -> None:
        config = config if config is not None else native.llm_config(model, backend=backend, **kwargs)
        if config.backend == "native":
            super().__init__(config=config, device=device)
            return
        if device is not None:
            raise ValueError(f"device= picks the native engine's device; backend {config.backend} takes it from the "
                             "hardware preset")
        self.config = config
        self.backend = create_backend(config)
        self.backend.start()
        self._ids = count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.backend is None else self.backend.model_info().tokenizer

    def generate(self, prompts: native.Prompt | Sequence[native.Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """As `engine.llm.LLM.generate`; on another backend `progress` is ignored."""
        if self.backend is None:
            return super().generate(prompts, sampling_params, priority=priority, cache_salt=cache_salt,
                                    progress=progress)
        batch = self._normalize(prompts)
        params = self._params(sampling_params, len(batch))
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
                return native.failed_output(job.request_id, job.prompt or job.prompt_token_ids, job.params, str(err))
            final = None
            async for output in stream:
                final = output
            return final

        return list(await asyncio.gather(*(one(job) for job in jobs)))

    def close(self) -> None:
        """Stop the backend (another backend's engine runs in its own processes until then); the native engine
        keeps its KV cache in the persistent tier, if one is configured (`LLMEngine.shutdown`)."""
        if self.backend is not None:
            self.backend.shutdown()
        else:
            super().close()
