"""The native backend: sage_infer's own engine behind the `InferenceBackend` protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from sage_infer.config.serve import ServeConfig
from sage_infer.core.kv_schema import KVDtype
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.engine.build import build_engine
from sage_infer.engine.llm_engine import LLMEngine
from sage_infer.interfaces.backend import GenerateOutput, GenerateRequest, KVStats
from sage_infer.interfaces.capability import AcceleratorDescriptor, CapabilityDescriptor


class NativeBackend:
    """Runs requests on an `LLMEngine`; one engine step per event-loop turn."""

    name = "native"

    def __init__(self, config: ServeConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else build_engine(config or ServeConfig())

    def capabilities(self) -> CapabilityDescriptor:
        device = self.engine.device
        pool = self.engine.runner.pool
        kv_dtype = KVDtype(self.engine.kv_dtype)
        descriptor = AcceleratorDescriptor(
            vendor="cpu" if device.type == "cpu" else "nvidia", device_type=device.type, index=device.index or 0,
            name=str(device), memory_bytes=pool.nbytes, kv_dtypes=(kv_dtype,),
        )
        return CapabilityDescriptor(
            backend=self.name, devices=(descriptor,), kv_dtypes=(kv_dtype,),
            max_model_len=self.engine.max_model_len, supports_prefix_caching=self.engine.kv.index is not None,
            supports_chunked_prefill=self.engine.scheduler.config.enable_chunked_prefill,
        )

    async def generate(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[GenerateOutput]:
        for r in requests:
            params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                    top_k=r.top_k, seed=r.seed, stop_token_ids=list(r.stop_token_ids),
                                    ignore_eos=r.ignore_eos)
            self.engine.add_request(r.request_id, r.prompt_token_ids, params, priority=r.priority,
                                    cache_salt=r.cache_salt)
        pending = {r.request_id for r in requests}
        while pending:
            for out in self.engine.step():
                if out.request_id not in pending:
                    continue
                completion = out.outputs[0]
                yield GenerateOutput(out.request_id, completion.delta_token_ids, out.finished,
                                     completion.finish_reason, out.metrics.num_cached_tokens)
                if out.finished:
                    pending.discard(out.request_id)
            await asyncio.sleep(0)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def kv_stats(self) -> KVStats:
        manager = self.engine.kv.block_manager
        metrics = self.engine.kv.index.metrics if self.engine.kv.index is not None else None
        return KVStats(
            num_blocks=manager.num_blocks, num_free_blocks=manager.num_free_blocks,
            num_cached_blocks=manager.num_cached_blocks, block_size=manager.block_size,
            prefix_queries=metrics.queries if metrics else 0, prefix_hit_blocks=metrics.hit_blocks if metrics else 0,
        )
