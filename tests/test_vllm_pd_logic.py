"""Prefill/decode between vLLM instances (integrations/vllm/pd_transfer.py) without vLLM: the planner, the held
blocks, and pulls over a real shm transport between a pull server and a receiving KVPipe.

The same path inside two real vLLM instances is tests/test_vllm_pd.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from sage_infer.config.transport import KVTransportConfig
from sage_infer.errors import ConfigError
from sage_infer.integrations.vllm import kv_transfer_config
from sage_infer.integrations.vllm.blocks import block_schema
from sage_infer.integrations.vllm.config import SageConnectorConfig
from sage_infer.integrations.vllm.keys import KeySpace, vllm_layout
from sage_infer.integrations.vllm.pd_transfer import HeldBlocks, HeldTransfer, PDPlanner, PullClient, PullServer
from sage_infer.kv_runtime.kv_pipe import KVPipe
from sage_infer.prefix_reuse.hashing import hash_token_blocks

BS = 4
SPACE = KeySpace("org/model", "main|none|float32", "fp32", vllm_layout(BS))
SCHEMA = block_schema(2, 2, 8, BS, torch.float32)  # 2 layers x 2 heads x 4 slots x 16 floats = 1 KiB a block
TOKEN = b"a-shared-deployment-token"


def keys_of(tokens, salt=None):
    return hash_token_blocks(tokens, BS, SPACE.extra_key(salt))


# -- the planner ----------------------------------------------------------------------------------


def test_a_producer_holds_each_full_prompt_block_once_as_prefill_computes_it():
    pd = PDPlanner(BS, SPACE, "10.0.0.1:7500")
    prompt = list(range(11))  # 2 full blocks and 3 tokens
    pd.hold("r", prompt, None)
    first = pd.plan_holds("r", prompt, 6, [7, 8, 9])  # chunked prefill: 6 tokens computed
    assert first.block_ids == [7] and first.keys == keys_of(prompt)[:1]
    assert pd.plan_holds("r", prompt, 6, [7, 8, 9]) is None  # nothing new
    second = pd.plan_holds("r", prompt + [99], 12, [7, 8, 9])  # the prompt done (+ its first token)
    assert second.block_ids == [8] and second.keys == keys_of(prompt)[1:2]  # never past the prompt
    assert second.transfer == first.transfer
    assert pd.finished_hold("r") == HeldTransfer("10.0.0.1:7500", first.transfer, 2).params()
    assert pd.finished_hold("r") is None  # answered once


def test_a_prompt_shorter_than_a_block_holds_nothing_and_says_so():
    pd = PDPlanner(BS, SPACE, "h:1")
    pd.hold("r", [1, 2, 3], None)
    assert pd.plan_holds("r", [1, 2, 3], 3, [5]) is None
    assert pd.finished_hold("r") == {"do_remote_prefill": False}
    assert HeldTransfer.of({"do_remote_prefill": False}) is None


def test_a_consumer_pulls_whole_blocks_past_its_own_hit_never_the_last_token():
    pd = PDPlanner(BS, SPACE)
    held = HeldTransfer("h:1", "t1", 3)
    prompt = list(range(12))  # 3 full blocks; the third holds the last token
    assert pd.match("r", held, prompt, None, 4) == 4  # block 0 cached here, block 1 pulled, block 2 computed
    pd.allocated("r", [20, 21, 22], 4)
    (pull,) = pd.take_pulls()
    assert (pull.first, pull.block_ids, pull.keys) == (1, [21], keys_of(prompt)[1:2])
    assert pd.take_pulls() == []
    assert pd.match("r", held, prompt, None, 0) == 0  # in flight: never twice
    assert pd.finished_pull("r") is True  # vLLM keeps the blocks it is written into
    pd.received(["r"])
    assert pd.finished_pull("r") is False


def test_a_consumer_whose_own_cache_covers_the_held_blocks_pulls_nothing():
    pd = PDPlanner(BS, SPACE)
    assert pd.match("r", HeldTransfer("h:1", "t", 2), list(range(10)), None, 8) == 0
    assert not pd.pulling("r")


@pytest.mark.parametrize("params", [
    None, {}, {"do_remote_prefill": True}, {"do_remote_prefill": True, "sage_pd": "x"},
    {"do_remote_prefill": True, "sage_pd": {"address": "h:1", "transfer": "t", "num_blocks": 0}},
    {"do_remote_prefill": True, "sage_pd": {"address": "h:1", "transfer": "t" * 65, "num_blocks": 1}},
    {"do_remote_prefill": True, "sage_pd": {"address": 1, "transfer": "t", "num_blocks": 1}},
])
def test_params_that_name_no_valid_held_transfer_mean_compute_it_here(params):
    assert HeldTransfer.of(params) is None


# -- held blocks ----------------------------------------------------------------------------------


def rows(n: int, fill: int) -> torch.Tensor:
    return torch.full((n, 16), fill, dtype=torch.uint8)


def test_held_blocks_are_taken_once_and_in_the_range_asked():
    held = HeldBlocks(1 << 20, 60)
    held.add("t", rows(1, 1), [b"a" * 32])
    held.add("t", rows(2, 2), [b"b" * 32, b"c" * 32])
    got, keys = held.take("t", 1, 2)
    assert got.tolist() == rows(2, 2).tolist() and keys == [b"b" * 32, b"c" * 32]
    with pytest.raises(KeyError, match="not held"):
        held.take("t", 0, 1)
    held.add("u", rows(1, 1), [b"a" * 32])
    with pytest.raises(KeyError, match="holds 1 blocks"):
        held.take("u", 0, 2)
    assert held.nbytes == 0


def test_held_blocks_drop_the_oldest_past_their_bytes_and_age():
    now = [0.0]
    held = HeldBlocks(40, ttl_s=10, clock=lambda: now[0])
    held.add("old", rows(2, 1), [b"a" * 32] * 2)  # 32 bytes
    held.add("new", rows(1, 2), [b"b" * 32])  # 48 > 40: "old" goes
    assert len(held) == 1 and held.dropped == 1
    now[0] = 11.0
    with pytest.raises(KeyError):
        held.take("new", 0, 1)  # expired
    assert held.dropped == 2 and held.nbytes == 0


# -- pulls over a real transport ------------------------------------------------------------------


@pytest.fixture
def pd_pair():
    """A producer (held blocks, pull server, sending connector) and a consumer (receiving connector)."""
    config = KVTransportConfig(timeout_s=10, auth_token=TOKEN.decode())
    sender = KVPipe(SCHEMA, config, backend="shm")
    receiver = KVPipe(SCHEMA, config, backend="shm", listen=True)
    held = HeldBlocks(1 << 20, 60)
    server = PullServer("127.0.0.1", 0, held, sender.start_send, token=TOKEN)
    failures: list[tuple[str, str]] = []
    done = threading.Event()
    client = PullClient(lambda wire_id, why: (failures.append((wire_id, why)), done.set()), token=TOKEN)
    yield held, server, receiver, client, failures, done
    client.close()
    server.close()
    sender.close()
    receiver.close()


def wait_received(receiver: KVPipe, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = receiver.poll_received()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("nothing arrived")


def test_a_pull_brings_the_held_rows_bit_exact_with_their_hashes(pd_pair):
    held, server, receiver, client, failures, _ = pd_pair
    data = torch.randint(0, 256, (3, SCHEMA.bytes_per_block), dtype=torch.uint8)
    keys = keys_of(list(range(12)))
    held.add("t1", data, keys)
    receiver.expect("w1", 2, 10)
    client.pull(server.address, "t1", 1, 2, receiver.address, "w1")
    (result,) = wait_received(receiver)
    assert result.ok and result.transfer_id == "w1"
    assert torch.equal(result.rows, data[1:3])
    assert list(result.block_hashes) == keys[1:3]
    assert failures == [] and server.pulls == 1 and len(held) == 0


def test_a_pull_for_something_not_held_is_refused_at_once(pd_pair):
    _, server, receiver, client, failures, done = pd_pair
    client.pull(server.address, "nope", 0, 1, receiver.address, "w2")
    assert done.wait(10)
    assert failures[0][0] == "w2" and "not held here" in failures[0][1]


def test_an_unsigned_pull_is_refused_and_sends_nothing(pd_pair):
    held, server, receiver, _, _, _ = pd_pair
    held.add("t1", torch.zeros((1, SCHEMA.bytes_per_block), dtype=torch.uint8), keys_of(list(range(4))))
    failures = []
    done = threading.Event()
    stranger = PullClient(lambda wire_id, why: (failures.append(why), done.set()), token=b"another-token-of-16+")
    stranger.pull(server.address, "t1", 0, 1, receiver.address, "w3")
    assert done.wait(10)
    stranger.close()
    assert "refused" in failures[0] and server.refused == 1 and len(held) == 1


def test_an_unreachable_producer_fails_the_pull_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens once closed
    failures = []
    done = threading.Event()
    client = PullClient(lambda wire_id, why: (failures.append(why), done.set()))
    client.pull(f"127.0.0.1:{port}", "t", 0, 1, "shm:///nowhere", "w")
    assert done.wait(10)
    client.close()
    assert "did not answer" in failures[0]


# -- configuration --------------------------------------------------------------------------------


def test_a_producer_needs_its_pull_port_and_a_pd_role_needs_no_store():
    with pytest.raises(ConfigError, match="pd_port"):
        SageConnectorConfig.parse({}, "kv_producer")
    assert SageConnectorConfig.parse({"pd_port": 7500}, "kv_producer").has_store is False
    assert SageConnectorConfig.parse({}, "kv_consumer").role == "kv_consumer"
    assert kv_transfer_config(role="kv_consumer")["kv_role"] == "kv_consumer"
    with pytest.raises(ConfigError, match="kv_role 'kv_sideways'"):
        SageConnectorConfig.parse({"disk_path": "/tmp/x"}, "kv_sideways")
    with pytest.raises(ConfigError, match="pd_backend"):
        SageConnectorConfig.parse({"pd_backend": "carrier-pigeon"}, "kv_consumer")
