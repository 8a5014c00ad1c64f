"""The fleet router's vLLM replicas: their ZMQ KV events into the fleet index, and prompts named as their blocks.

A vLLM replica given with its events endpoint (`router.vllm_events`) is in the routing while its ``/health``
answers; meanwhile a `VllmEventFeed` keeps its blocks in the index under the naming ``vllm/<block size>``, and
its KV pool's size comes from its ``/metrics``.
When ``/health`` stops answering, the replica is out and its blocks are forgotten; when it answers again, a
fresh feed replays what the server kept. For a request, the router hashes the prompt's tokens — the token ids
it was given, or those a vLLM replica's ``POST /tokenize`` returns for text or messages — under each vLLM
naming in the fleet (`vllm_events.prompt_names`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx

from sage_infer.kv_policy.routing import Request as RouteRequest
from sage_infer.router.vllm_events import CLEARED, NAMING, Op, VllmEventFeed, prompt_names

if TYPE_CHECKING:
    from sage_infer.router.fleet import FleetRouter, ReplicaLink

log = logging.getLogger("sage_infer.router")
TOKENIZE_TIMEOUT_S = 2.0
METRICS_TIMEOUT_S = 2.0
RECONNECT_S = 0.5  # between a vLLM replica's /health failing and the next try
# the fields of a client's body that decide its prompt tokens on vLLM (``/tokenize`` takes them as chat
# completions and completions do)
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_generation_prompt", "continue_final_message",
                   "add_special_tokens", "chat_template", "chat_template_kwargs", "tools")


async def follow_vllm(router: FleetRouter, link: ReplicaLink) -> None:
    """Keep a vLLM replica in the routing while its /health answers, its blocks in the index from its events."""
    link.publishes = True
    while True:
        link.replica.capacity_blocks = await device_blocks(router, link)
        feed = VllmEventFeed(link.vllm)  # a fresh sequence and names for each life of the server
        reader = asyncio.create_task(feed.run(lambda ops, feed=feed: apply_ops(router, link, feed, ops)))
        reader.add_done_callback(lambda task: _report(link, task))
        try:
            await router.watch_health(link)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        router.lost(link, "its /health stopped answering")
        await asyncio.sleep(RECONNECT_S)


async def device_blocks(router: FleetRouter, link: ReplicaLink) -> int:
    """The vLLM server's KV pool in blocks (``num_gpu_blocks`` of its ``vllm:cache_config_info`` metric; 0 when it
    does not say): the kv policy charges a recomputation more on a full cache."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        reply = await router.client.get(f"{link.url}/metrics", headers=router.headers, timeout=METRICS_TIMEOUT_S)
        families = list(text_string_to_metric_families(reply.text)) if reply.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return 0
    for family in families:
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info") and sample.labels.get("num_gpu_blocks", "").isdigit():
                return int(sample.labels["num_gpu_blocks"])
    return 0


def _report(link: ReplicaLink, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("vLLM replica %s: its KV events stopped: %s", link.name, task.exception())


def apply_ops(router: FleetRouter, link: ReplicaLink, feed: VllmEventFeed, ops: list[Op]) -> None:
    """One batch's ops, in order, into the index (an AllBlocksCleared forgets the replica's blocks)."""
    if feed.names.block_size:
        link.replica.naming = NAMING.format(block_size=feed.names.block_size)
        link.replica.group_needs = feed.names.group_needs()
    run: list[Op] = []
    for op in ops:
        if op[0] != CLEARED:
            run.append(op)
            continue
        router.on_event(link, {"type": "events", "events": run})
        router.index.drop(link.replica)
        run = []
    router.on_event(link, {"type": "events", "events": run})


def vllm_namings(router: FleetRouter) -> dict[str, int]:
    """The namings of the vLLM replicas in the routing that named blocks: naming -> tokens per block."""
    return {link.replica.naming: int(link.replica.naming.split("/")[1]) for link in router.links.values()
            if link.vllm is not None and link.replica.up and link.replica.naming}


async def describe_for_vllm(router: FleetRouter, body: dict, described: RouteRequest) -> None:
    """The prompt's block names under each vLLM naming in the fleet (none when its tokens are not known)."""
    namings = vllm_namings(router)
    if not namings:
        return
    tokens = await prompt_tokens(router, body)
    if not tokens:
        return
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    for naming, block_size in namings.items():
        described.named[naming] = (prompt_names(tokens, block_size, salt), block_size)
    described.prompt_tokens = described.prompt_tokens or len(tokens)  # a sage replica's count where it answered


async def prompt_tokens(router: FleetRouter, body: dict) -> list[int] | None:
    """The prompt's token ids: as given, or as a vLLM replica in the routing tokenizes its text or messages."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if not isinstance(prompt, str) and not isinstance(body.get("messages"), list):
        return None
    question = {k: body[k] for k in TOKENIZE_FIELDS if k in body}
    vllm = [link for link in router.links.values() if link.vllm is not None and link.replica.up]
    reply = await router.ask_least_busy(vllm, "/tokenize", question, TOKENIZE_TIMEOUT_S)
    if reply is None or reply.status_code != 200:
        return None
    tokens = reply.json().get("tokens")
    return tokens if isinstance(tokens, list) else None
