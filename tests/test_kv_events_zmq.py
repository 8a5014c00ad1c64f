"""KV events in vLLM's ZMQ format (`kv_events.publisher: zmq`): what a router built for vLLM (llm-d, Dynamo) reads
from a sage replica, decoded with structs laid out as vLLM 0.32's and, in the vLLM venv, with vLLM's own classes."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import openai
import pytest

from tests.redis_fixture import free_port
from tests.server_fixture import running_server
from tests.test_vllm_connector import PYTHON, VENV
from tests.tiny_models import make_tiny_model

zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'sage-infer[events]')")
msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'sage-infer[events]')")

BLOCK = 16
PROMPT = [5 + (13 * j) % 400 for j in range(3 * BLOCK + 2)]  # 3 full blocks, then 2 tokens


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):  # laid out as vLLM 0.32's
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("zmq-events") / "tiny", "llama")


def received(sub, until, timeout: float = 20.0) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message until `until(decoded events so far)` holds."""
    got, events = [], []
    deadline = time.monotonic() + timeout
    while not until(events):
        assert time.monotonic() < deadline, f"timed out; events so far: {events}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), payload))
            events += msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events
    return got


def test_a_replica_publishes_its_blocks_as_vllm_kv_events_and_replays_them(model_dir):
    port, replay = free_port(), free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv"}
    context = zmq.Context()
    with running_server(model_dir, kv_events=config) as server:
        sub = context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # a SUB socket misses what is sent before it joined (what replay is for)
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0).completions.create(
            model=server.model, prompt=PROMPT, max_tokens=1, temperature=0)
        messages = received(sub, lambda events: sum(isinstance(e, BlockStored) for e in events) >= 3)
        stored = [e for seq, payload in messages
                  for e in msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored[:3]] == [PROMPT[i * BLOCK:(i + 1) * BLOCK] for i in range(3)]
        assert stored[0].parent_block_hash is None
        assert [e.parent_block_hash for e in stored[1:3]] == [stored[0].block_hashes[0], stored[1].block_hashes[0]]
        assert {e.medium for e in stored} == {"GPU"} and {e.block_size for e in stored} == {BLOCK}
        dealer = context.socket(zmq.DEALER)  # a late subscriber asks for what it missed
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()  # as vLLM 0.32's replay socket sends
            assert topic == b"kv" or seq == (-1).to_bytes(8, "big", signed=True)
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed[:len(messages)] == messages
        if PYTHON.exists():  # vLLM's own classes read the same bytes
            decoded = _decode_with_vllm(messages[0][1])
            assert decoded[0]["type"] == "BlockStored" and decoded[0]["token_ids"] == PROMPT[:BLOCK]
        sub.close(0)
        dealer.close(0)
    context.term()


def _decode_with_vllm(payload: bytes) -> list[dict]:
    script = ("import sys, json, msgspec; from vllm.distributed.kv_events import KVEventBatch; "
              "batch = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read()); "
              "print(json.dumps([{'type': type(e).__name__, **{k: getattr(e, k) for k in ('token_ids', 'medium') "
              "if hasattr(e, k)}} for e in batch.events]))")
    out = subprocess.run([str(PYTHON), "-c", script], input=payload, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV} (make vllm-venv, or set VLLM_VENV)")
def test_vllms_own_kv_event_classes_decode_a_sage_batch(model_dir):
    port = free_port()
    context = zmq.Context()
    with running_server(model_dir, kv_events={"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}) as server:
        sub = context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0).completions.create(
            model=server.model, prompt=PROMPT, max_tokens=1, temperature=0)
        [(_, payload), *_] = received(sub, lambda events: len(events) >= 1)
        sub.close(0)
    context.term()
    events = _decode_with_vllm(payload)
    assert events[0] == {"type": "BlockStored", "token_ids": PROMPT[:BLOCK], "medium": "GPU"}


def test_a_decode_worker_cannot_publish_events(model_dir):
    from sage_infer.errors import ConfigError

    with pytest.raises(ConfigError, match="logs no KV events"):
        with running_server(model_dir, role="decode", kv_events={"publisher": "zmq",
                                                                  "endpoint": f"tcp://127.0.0.1:{free_port()}"}):
            pass
