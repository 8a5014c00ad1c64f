"""TransportEngine over the shm backend: real processes, real shared memory, real failures."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.config.transport import KVTransportConfig
from sage_infer.transport import KVReceiveBuffers, Priority, base
from sage_infer.transport.backends import shm
from sage_infer.transport.base import before
from sage_infer.transport.format import converter
from sage_infer.transport.planner import TransferPlanner
from sage_infer.transport.transport_errors import (
    BackendUnavailable,
    ChecksumError,
    PeerClosedError,
    TransferTimeout,
    TransportError,
    TruncatedError,
)
from sage_infer.transport.wire import HEADER_BYTES, ChunkHeader, Flag, Kind
from tests.transport_util import SPAWN, digest, engine, kv, receiver_main

SHAPE = dict(layers=3, tokens=700, heads=4, head_dim=64)


def run(coro):
    return asyncio.run(coro)


async def pair(eng, *, max_inflight=None):
    """A connected (Connection, RecvChannel, Listener) over shm inside this process."""
    if max_inflight:
        eng.config = eng.config.model_copy(update={"max_inflight": max_inflight})
    listener = await eng.listen("shm")
    accepting = asyncio.create_task(listener.accept(asyncio.get_running_loop().time() + 10))
    conn = await eng.connect(listener.address)
    return conn, await accepting, listener


# -- across processes -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_arrives_bit_exact_in_another_process(dtype):
    q = SPAWN.Queue()
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    child = SPAWN.Process(target=receiver_main, args=(q, "shm", ["a", "b"], SHAPE, names[dtype]))
    child.start()
    try:
        address = q.get(timeout=60)
        eng = engine(backend="shm", chunk_size="64KiB", max_inflight=4)
        src = {rid: kv(0 if rid == "a" else 0, dtype=dtype, **SHAPE) for rid in "ab"}
        src["b"] = [t.neg().contiguous() for t in src["b"]]  # a different payload for b

        async def send():
            conn = await eng.connect(address)
            sent = []
            for rid in "ab":
                plan, choice = eng.plan(rid, src[rid])
                assert choice.chunk_bytes <= 64 * 1024 and len(plan.chunks) > 3 * SHAPE["layers"]
                sent.append(await eng.stream_pipeline(conn, plan.chunks, plan, src[rid]))
            await conn.aclose()
            return sent

        sent = run(send())
        got = q.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    # b's destination was registered with the zeros of kv(0); it must now hold -kv(0).
    assert got["a"] == (digest(src["a"]), sent[0].chunks, True)
    assert got["b"] == (digest(src["b"]), sent[1].chunks, True)
    assert sent[0].bytes == sum(t.numel() * t.element_size() for t in src["a"]) == sent[0].wire_bytes
    assert len(sent[0].chunk_seconds) == sent[0].chunks


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_converted_kv_crosses_processes_within_the_error_bound(backend):
    q = SPAWN.Queue()
    child = SPAWN.Process(target=receiver_main, args=(q, backend, ["i4", "f8"], SHAPE, "float16", None, True))
    child.start()
    try:
        address = q.get(timeout=60)
        src = kv(0, **SHAPE)

        async def send():
            stats = {}
            eng = engine(backend=backend)
            conn = await eng.connect(address)
            for rid, wire in (("i4", "int4"), ("f8", "fp8_e4m3")):  # the plan carries the wire format
                plan, _ = engine(backend=backend, chunk_size="64KiB", target_dtype=wire).plan(rid, src)
                stats[rid] = (await eng.stream_pipeline(conn, plan.chunks, plan, src), plan)
            await conn.aclose()
            return stats

        stats = run(send())
        summary = q.get(timeout=60)
        received = q.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    for rid, wire in (("i4", "int4"), ("f8", "fp8_e4m3")):
        sent, plan = stats[rid]
        assert summary[rid][1:] == (sent.chunks, True) and sent.wire_bytes < sent.bytes / 1.8
        for chunk in plan.chunks:
            elems = slice(chunk.offset // 2, (chunk.offset + chunk.length) // 2)  # fp16: 2 bytes each
            x = src[chunk.layer].reshape(-1)[elems].view(-1, 64)
            y = torch.from_numpy(received[rid][chunk.layer]).reshape(-1)[elems]
            bound = converter.error_bound(wire, x).float() + y.float().abs().view(-1, 64) * 2**-11 + 1e-6
            assert ((x.float() - y.float().view(-1, 64)).abs() <= bound).all(), (rid, chunk)


def test_killed_receiver_fails_the_sender_promptly():
    q = SPAWN.Queue()
    child = SPAWN.Process(target=receiver_main, args=(q, "shm", ["a"], SHAPE, "float16", 3))
    child.start()
    try:
        address = q.get(timeout=60)
        eng = engine(backend="shm", chunk_size="16KiB", max_inflight=2, timeout_s=20)
        layers = kv(0, **SHAPE)

        async def send():
            conn = await eng.connect(address)
            plan, _ = eng.plan("a", layers)
            try:
                await eng.stream_pipeline(conn, plan.chunks, plan, layers)
            finally:
                await conn.aclose()

        start = time.monotonic()
        with pytest.raises(PeerClosedError, match="receiver went away|send failed"):
            run(send())
        assert time.monotonic() - start < 15  # failed on EOF, not at the 20 s deadline
        assert q.get(timeout=10) == "dying"
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL


# -- in one process (two event-loop tasks, real sockets and shared memory) -------------


def transfer_once(eng, layers, dest, *, return_exceptions=False):
    """One request sent and received over a fresh in-process shm pair: (sent, received
    stats or errors), the buffers, the plan and the receiving channel."""

    async def go():
        conn, channel, listener = await pair(eng)
        buffers = KVReceiveBuffers()
        buffers.register("a", dest)
        plan, _ = eng.plan("a", layers)
        sent, got = await asyncio.gather(
            eng.stream_pipeline(conn, plan.chunks, plan, layers), eng.receive(channel, buffers, ["a"]),
            return_exceptions=return_exceptions,
        )
        await conn.aclose()
        await listener.aclose()
        return sent, got, buffers, plan, channel

    return run(go())


def corrupt_after_checksum(monkeypatch, times: int | None = 1) -> None:
    """Make the shm sender's copy into the ring come out wrong in one byte (`times` chunks, or every
    chunk when None); its CRC is of the sender's own bytes, so the receiver sees a chunk that fails."""
    left = {"n": times}
    real, real_copier = shm.copy_piece, shm.array_copier

    def flip(dest):
        if left["n"] is None or left["n"] > 0:
            if left["n"] is not None:
                left["n"] -= 1
            dest[len(dest) // 2] ^= 0x5A

    def copy_then_flip(dest, src):
        real(dest, src)
        flip(dest)

    def copier_that_flips():  # the one-pass copy + CRC32C, where its kernel loads (the sender takes it at start)
        fused = real_copier()
        if fused is None:
            return None

        def fused_copy_then_flip(dest, src, *args):
            crc = fused(dest, src, *args)
            flip(dest)
            return crc

        return fused_copy_then_flip

    monkeypatch.setattr(shm, "copy_piece", copy_then_flip)
    monkeypatch.setattr(shm, "array_copier", copier_that_flips)


def test_corrupt_chunk_is_resent_and_arrives_exact(monkeypatch):
    corrupt_after_checksum(monkeypatch)
    layers = kv(1, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    sent, _, _, _, channel = transfer_once(engine(backend="shm", chunk_size="32KiB"), layers, dest)
    assert sent.retransmits == 1 and channel.checksum_failures == 1
    assert digest(dest) == digest(layers)


def test_always_corrupt_fails_both_sides_and_marks_nothing(monkeypatch):
    corrupt_after_checksum(monkeypatch, times=None)
    eng = engine(backend="shm", chunk_size="32KiB", timeout_s=5)
    layers = kv(1, **SHAPE)
    sent, got, buffers, _, _ = transfer_once(eng, layers, [torch.zeros_like(t) for t in layers],
                                             return_exceptions=True)
    assert isinstance(got, ChecksumError) and "still corrupt after 2 resends" in str(got)
    assert isinstance(sent, ChecksumError) and "giving up" in str(sent)
    assert buffers.delivered("a") == 0 and not buffers.complete("a")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(eng.telemetry.registry).decode())}
    reasons = {s.labels["reason"]: s.value for s in families["sage:kv_transfer_failures"].samples
               if s.name.endswith("_total")}
    assert reasons.get("checksum", 0) >= 1


def test_truncated_stream_is_a_clear_error():
    eng = engine(backend="shm", chunk_size="32KiB")

    async def go():
        conn, channel, listener = await pair(eng)
        header = ChunkHeader(Kind.DATA, "a", length=16).pack()
        # Write half a header straight onto the control socket, then hang up.
        conn.channel._sock.sendall(header[: HEADER_BYTES // 2])
        conn.channel._sock.shutdown(2)
        buffers = KVReceiveBuffers()
        buffers.register("a", [torch.zeros(64, dtype=torch.float16)])
        with pytest.raises(TruncatedError, match="inside a header"):
            await eng.receive(channel, buffers, ["a"], deadline_s=5)
        await conn.aclose()
        await listener.aclose()

    run(go())


def test_stalled_receiver_hits_the_senders_deadline():
    eng = engine(backend="shm", chunk_size="16KiB", timeout_s=1)
    layers = kv(2, **SHAPE)

    async def go():
        conn, channel, listener = await pair(eng, max_inflight=2)  # the receiver never reads
        plan, _ = eng.plan("a", layers)
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="stalled"):
            await eng.stream_pipeline(conn, plan.chunks, plan, layers, deadline_s=1)
        assert time.monotonic() - start < 10
        with pytest.raises(TransferTimeout):  # the connection is broken now: fail fast, do not stall
            await eng.stream_pipeline(conn, plan.chunks, plan, layers, deadline_s=30)
        assert time.monotonic() - start < 10
        await conn.aclose()
        await channel.aclose()
        await listener.aclose()

    run(go())


def test_stalled_sender_hits_the_receivers_deadline_and_invalidates():
    eng = engine(backend="shm", chunk_size="16KiB")
    layers = kv(3, **SHAPE)

    async def go():
        conn, channel, listener = await pair(eng)
        plan, _ = eng.plan("a", layers)
        loop = asyncio.get_running_loop()
        for chunk in plan.chunks[:3]:  # then the sender goes silent
            await eng.send_kv_chunk(conn, chunk, layers[chunk.layer], plan, deadline=loop.time() + 5,
                                    count=len(plan.chunks))
        buffers = KVReceiveBuffers()
        buffers.register("a", [torch.zeros_like(t) for t in layers])
        with pytest.raises(TransferTimeout):
            await eng.receive(channel, buffers, ["a"], deadline_s=1)
        assert buffers.delivered("a") == 0 and not buffers.complete("a")
        await conn.aclose()
        await channel.aclose()
        await listener.aclose()

    run(go())


@pytest.mark.parametrize("wire", ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "bf16"])
def test_converted_transfer_is_within_the_formats_error_bound(wire):
    eng = engine(backend="shm", chunk_size="32KiB", target_dtype=wire)
    layers = kv(4, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    sent, got, _, plan, _ = transfer_once(eng, layers, dest)
    got = got["a"]
    assert plan.converts
    assert got.bytes == sent.bytes and got.wire_bytes == sent.wire_bytes
    assert sent.wire_bytes < sent.bytes if wire != "bf16" else sent.wire_bytes == sent.bytes
    assert sent.convert_seconds > 0 and got.convert_seconds > 0
    for chunk in plan.chunks:  # the bound holds per chunk (each chunk is quantized on its own)
        src = layers[chunk.layer].reshape(-1).view(torch.uint8)[chunk.offset : chunk.offset + chunk.length]
        out = dest[chunk.layer].reshape(-1).view(torch.uint8)[chunk.offset : chunk.offset + chunk.length]
        x = src.view(torch.float16).view(-1, 64).float()
        y = out.view(torch.float16).view(-1, 64).float()
        bound = converter.error_bound(wire, src.view(torch.float16).view(-1, 64))
        # + one fp16 rounding of the decoded value
        assert ((x - y).abs() <= bound.float() + y.abs() * 2**-11 + 1e-6).all(), chunk


@pytest.mark.parametrize("wire", ["int8", "fp8_e4m3"])
def test_shm_encodes_into_its_ring_and_decodes_from_it_checking_every_chunk(wire, monkeypatch):
    """The sender encodes each chunk into the ring and the receiver decodes it from there, each taking the CRC in
    that pass: a chunk spoiled in the ring after its CRC is NACKed, encoded again, and lands as the codec's."""
    real_write, real_decode = converter.PendingEncode.write, KVReceiveBuffers.decode_from
    left, crcs = {"n": 1}, []

    def write_then_spoil(self, out, crc=True):
        value = real_write(self, out, crc)
        if left["n"]:
            left["n"] -= 1
            out[len(out) // 3] ^= 0x5A
        return value

    def decode_from(self, header, payload):
        crcs.append(real_decode(self, header, payload))
        return crcs[-1]

    monkeypatch.setattr(converter.PendingEncode, "write", write_then_spoil)
    monkeypatch.setattr(KVReceiveBuffers, "decode_from", decode_from)
    layers = kv(2, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    sent, got, _, plan, channel = transfer_once(engine(backend="shm", chunk_size="32KiB", target_dtype=wire),
                                                layers, dest)
    assert left["n"] == 0 and sent.retransmits == 1 and channel.checksum_failures == 1
    assert len(crcs) == len(plan.chunks) + 1 and sent.convert_seconds > 0 and got["a"].convert_seconds > 0
    if converter.kernel_for(torch.device("cpu"), torch.float16, wire, 64, 1) is not None:
        assert all(crc is not None for crc in crcs)  # decoded from the ring, not through a staging copy
    for chunk in plan.chunks:
        src = layers[chunk.layer].reshape(-1).view(torch.uint8)[chunk.offset : chunk.offset + chunk.length]
        out = dest[chunk.layer].reshape(-1).view(torch.uint8)[chunk.offset : chunk.offset + chunk.length]
        x = src.view(torch.float16).view(-1, 64)
        expected = converter.decode(converter.encode(x, wire), wire, *x.shape, torch.float16)
        assert torch.equal(out.view(torch.float16).view(-1, 64), expected), chunk


def test_decode_critical_transfer_overtakes_bulk_prefetch():
    eng = engine(backend="shm", chunk_size="16KiB")
    bulk = kv(5, layers=2, tokens=2048, heads=4, head_dim=64)
    urgent = kv(6, layers=1, tokens=128, heads=4, head_dim=64)
    order: list[str] = []

    async def go():
        conn, channel, listener = await pair(eng, max_inflight=2)
        buffers = KVReceiveBuffers()
        buffers.register("bulk", [torch.zeros_like(t) for t in bulk])
        buffers.register("urgent", [torch.zeros_like(t) for t in urgent])
        real_land = buffers.land

        def land(header):
            order.append(header.request_id)
            return real_land(header)

        buffers.land = land
        bulk_plan, _ = eng.plan("bulk", bulk)
        urgent_plan, _ = eng.plan("urgent", urgent)
        receiving = asyncio.create_task(eng.receive(channel, buffers, ["bulk", "urgent"]))
        bulk_task = asyncio.create_task(
            eng.stream_pipeline(conn, bulk_plan.chunks, bulk_plan, bulk, priority=Priority.PREFETCH)
        )
        while len(order) < 4:  # bulk is streaming
            await asyncio.sleep(0.001)
        landed_before_urgent = len(order)
        await eng.stream_pipeline(conn, urgent_plan.chunks, urgent_plan, urgent, priority=Priority.DECODE)
        bulk_done_when_urgent_done = bulk_task.done()
        await bulk_task
        await receiving
        await conn.aclose()
        await listener.aclose()
        return bulk_plan, urgent_plan, bulk_done_when_urgent_done, landed_before_urgent

    bulk_plan, urgent_plan, bulk_done, n0 = run(go())
    assert not bulk_done and order.count("urgent") == len(urgent_plan.chunks)
    last_urgent = max(i for i, rid in enumerate(order) if rid == "urgent")
    overtaken_by = order[n0 : last_urgent + 1].count("bulk")
    # Only bulk chunks already in flight (2) or being handed to the channel (1) land before
    # the urgent transfer completes; the rest of the bulk transfer waits.
    assert overtaken_by <= 3, order[n0 : last_urgent + 1]
    assert order[last_urgent + 1 :].count("bulk") >= len(bulk_plan.chunks) - n0 - 3


def test_telemetry_counts_bytes_and_transfers():
    eng = engine(backend="shm", chunk_size="32KiB")
    layers = kv(7, **SHAPE)
    transfer_once(eng, layers, [torch.zeros_like(t) for t in layers])
    total = sum(t.numel() * t.element_size() for t in layers)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(eng.telemetry.registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("sage:kv_transfer_bytes_total", (("backend", "shm"), ("direction", "send")))] == total
    assert samples[("sage:kv_transfer_bytes_total", (("backend", "shm"), ("direction", "recv")))] == total
    assert samples[("sage:kv_transfer_seconds_count", (("backend", "shm"), ("direction", "send")))] == 1
    assert samples[("sage:kv_transfer_inflight_chunks", (("backend", "shm"),))] == 0


# -- planner, registry ---------------------------------------------------------------------


def test_planner_sizes_cpu_chunks_from_the_hardware_and_respects_explicit_sizes():
    from sage_infer.config.presets import load_hardware_preset

    cpu = load_hardware_preset("cpu").profile
    choice = TransferPlanner(KVTransportConfig(), cpu).choose(row_bytes=3 * 128 * 2)
    assert choice.backend == "shm" and (1 << 20) <= choice.chunk_bytes <= (4 << 20)
    assert choice.chunk_bytes % (3 * 128 * 2 * 2) == 0
    assert any("1 ms" in r for r in choice.reasons)
    explicit = TransferPlanner(KVTransportConfig(chunk_size="64KiB"), cpu).choose()
    assert explicit.chunk_bytes == 64 * 1024 and any("outside the 1-4 MiB" in r for r in explicit.reasons)
    assert TransferPlanner().choose(same_host=False).backend == "tcp"
    with pytest.raises(NotImplementedError, match="rdma"):
        TransferPlanner(KVTransportConfig(backend="rdma")).choose()


def test_planner_converts_only_for_slow_links_between_hosts():
    from sage_infer.config.presets import load_hardware_preset

    h100 = load_hardware_preset("nvidia-h100").profile
    slow = h100.model_copy(update={"inter_node_nics": [h100.inter_node_nics[0].model_copy(
        update={"count": 1, "gbit_s": 25})]})
    choice = TransferPlanner(KVTransportConfig(), slow).choose(same_host=False)
    assert choice.wire_dtype == "fp8_e4m3" and any("3.125 GB/s" in r for r in choice.reasons)
    assert TransferPlanner(KVTransportConfig(), slow).choose(same_host=True).wire_dtype is None
    assert TransferPlanner(KVTransportConfig(), h100).choose(same_host=False).wire_dtype is None  # 8x400G
    explicit = TransferPlanner(KVTransportConfig(target_dtype="int4"), h100).choose(same_host=True)
    assert explicit.wire_dtype == "int4"


def test_plan_covers_every_byte_once():
    layers = kv(8, layers=2, tokens=333, heads=2, head_dim=64)
    plan, choice = TransferPlanner(KVTransportConfig(chunk_size="4KiB", backend="tcp")).plan("r", layers)
    for layer, t in enumerate(layers):
        chunks = [c for c in plan.chunks if c.layer == layer]
        assert chunks[0].offset == 0 and chunks[-1].is_last
        assert sum(c.length for c in chunks) == t.numel() * t.element_size()
    assert plan.schema.num_layers == 2 and plan.schema.head_dim == 64 and not plan.converts


def test_backend_registry_reports_why_optional_engines_are_missing():
    names = {a.name: a for a in base.backend_availability()}
    assert {"shm", "tcp", "torchdist", "mooncake", "nixl"} <= set(names)
    assert names["shm"].available
    assert not names["mooncake"].available and "mooncake" in names["mooncake"].reason.lower()
    with pytest.raises(BackendUnavailable, match="not installed"):
        base.get_backend("nixl")
    with pytest.raises(BackendUnavailable, match="unknown transport backend 'carrier-pigeon'"):
        base.get_backend("carrier-pigeon")


def test_shm_listener_socket_is_private():
    async def go():
        listener = await engine().listen("shm")
        path = listener.address.removeprefix("shm://")
        mode = os.stat(os.path.dirname(path)).st_mode & 0o777
        await listener.aclose()
        return mode, os.path.exists(path)

    mode, exists = run(go())
    assert mode == 0o700 and not exists


def test_ring_allocator_wraps_and_never_overlaps():
    regions = shm._Regions(100)
    a, b, c = regions.alloc(40), regions.alloc(40), regions.alloc(40)
    assert (a, b, c) == (0, 40, None)
    regions.free(a)
    assert regions.alloc(30) == 0  # wraps to the front
    assert regions.alloc(20) is None  # [30, 40) is too small, [80, 100) is behind the wrap
    assert regions.alloc(10) == 30
    regions.free(b)
    regions.free(0)
    regions.free(30)
    assert regions.alloc(100) == 0


def test_shm_acknowledges_runs_of_chunks_with_one_message_each():
    eng = engine(backend="shm", chunk_size="16KiB")
    layers = kv(5, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    acks = []

    async def go():
        conn, channel, listener = await pair(eng)
        on_control = conn.channel._on_control
        conn.channel._on_control = lambda msg: (acks.append(msg.count), on_control(msg))  # count what arrives
        buffers = KVReceiveBuffers()
        buffers.register("a", dest)
        plan, _ = eng.plan("a", layers)
        sent, _ = await asyncio.gather(eng.stream_pipeline(conn, plan.chunks, plan, layers),
                                       eng.receive(channel, buffers, ["a"]))
        await conn.aclose()
        await channel.aclose()
        await listener.aclose()
        return sent

    sent = run(go())
    assert digest(dest) == digest(layers) and len(sent.chunk_seconds) == sent.chunks > 16
    assert sum(acks) == sent.chunks  # every chunk acknowledged exactly once ...
    assert len(acks) <= sent.chunks // 2  # ... by fewer messages than chunks


def test_an_ack_settles_exactly_the_chunks_in_flight_it_covers():
    async def go():
        conn, channel, listener = await pair(engine(backend="shm"))  # the receiver never reads
        loop = asyncio.get_running_loop()
        payload = memoryview(bytearray(64))
        acked = [await conn.channel.send(ChunkHeader(Kind.DATA, "a", seq=seq, length=64), payload, loop.time() + 5)
                 for seq in range(3)]
        conn.channel._on_control(ChunkHeader.unpack(ChunkHeader.ack(0, 1)))  # chunks 0 and 1
        settled = [f.done() for f in acked]
        conn.channel._on_control(ChunkHeader(Kind.ACK, "", seq=2, count=2**32 - 1))  # a bogus count: only 2 is left
        left = conn.channel.inflight
        await conn.aclose()
        await channel.aclose()
        await listener.aclose()
        return settled, left, acked[2].done()

    settled, left, last = run(go())
    assert settled == [True, True, False] and left == 0 and last


def test_a_chunk_sent_without_ack_now_is_still_acknowledged():
    """The receiver may hold an ACK back for more chunks; when none come, it sends it anyway."""
    eng = engine(backend="shm", chunk_size="16KiB")
    layers = kv(6, **SHAPE)

    async def go():
        conn, channel, listener = await pair(eng)
        plan, _ = eng.plan("a", layers)
        buffers = KVReceiveBuffers()
        buffers.register("a", [torch.zeros_like(t) for t in layers])
        loop = asyncio.get_running_loop()
        acked = await eng.send_kv_chunk(conn, plan.chunks[0], layers[0], plan, deadline=loop.time() + 10,
                                        count=len(plan.chunks), ack_now=False)
        got = await eng.recv_kv_chunk(channel, buffers, deadline=loop.time() + 10)
        seconds = await before(acked, loop.time() + 10, "waiting for the held-back ACK")
        await conn.aclose()
        await channel.aclose()
        await listener.aclose()
        return got, seconds

    got, seconds = run(go())
    assert got[0].seq == 0 and seconds >= 0


def test_shm_control_messages_queue_in_order_when_the_senders_socket_is_full():
    """PLACE messages (up to 64 KiB each) to a sender that is not reading: the receiver never blocks on
    them, and once the sender reads, every message arrives whole and in order."""
    import socket

    from sage_infer.transport.arena import SharedArena

    async def go():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        channel = shm.ShmRecvChannel(ours, SharedArena(4096))
        regions = [[(i * 4096 + layer, 4096) for layer in range(4096)] for i in range(12)]
        for i, places in enumerate(regions):  # ~12 x 64 KiB: far more than a socket buffer holds
            await channel.publish(f"r{i}", places)
        backlog = len(channel._out)
        received = bytearray()
        theirs.setblocking(False)
        give_up = asyncio.get_running_loop().time() + 60  # a hang guard, not a timing check
        while len(received) < 12 * (HEADER_BYTES + 16 * 4096):
            try:
                received += theirs.recv(1 << 20)
            except BlockingIOError:
                await asyncio.sleep(0.01)  # the receiver's loop drains its queue as the socket frees up
            assert asyncio.get_running_loop().time() < give_up, f"{len(received)} bytes arrived, then nothing"
        await channel.aclose()
        theirs.close()
        return backlog, bytes(received), regions

    backlog, received, regions = run(go())
    assert backlog > 0  # the socket did fill up
    offset = 0
    for i, places in enumerate(regions):
        header = ChunkHeader.unpack(received[offset : offset + HEADER_BYTES])
        payload = received[offset + HEADER_BYTES : offset + HEADER_BYTES + header.length]
        assert (header.kind, header.request_id, header.count) == (Kind.PLACE, f"r{i}", 4096)
        assert payload == np.asarray(places, dtype="<u8").tobytes()
        offset += HEADER_BYTES + header.length
    assert offset == len(received)


# -- zero-copy receive into a shared arena -------------------------------------------------


def test_zero_copy_receive_writes_straight_into_the_arena(monkeypatch):
    from sage_infer.transport.arena import SharedArena

    corrupt_after_checksum(monkeypatch)  # in the receiver's arena this time
    eng = engine(backend="shm", chunk_size="32KiB")
    layers = kv(9, **SHAPE)
    arena = SharedArena(8 << 20)
    dest = [arena.tensor(t.shape, t.dtype) for t in layers]
    flags = []

    async def go():
        listener = await eng.listen("shm", arena=arena)
        accepting = asyncio.create_task(listener.accept(asyncio.get_running_loop().time() + 10))
        conn = await eng.connect(listener.address)
        channel = await accepting
        assert conn.channel.peer_arena is not None and channel.arena is arena
        buffers = KVReceiveBuffers()
        buffers.register("a", dest)
        real_land = buffers.land

        def land(header):
            flags.append(header.flags)
            return real_land(header)

        buffers.land = land
        receiving = asyncio.create_task(eng.receive(channel, buffers, ["a"]))
        plan, _ = eng.plan("a", layers)
        sent = await eng.stream_pipeline(conn, plan.chunks, plan, layers, wait_placement=True)
        await receiving
        await conn.aclose()
        await listener.aclose()
        return sent, channel

    sent, channel = run(go())
    assert digest(dest) == digest(layers)
    assert flags and all(f & Flag.DIRECT for f in flags)
    assert sent.retransmits == 1 and channel.checksum_failures == 1
    assert not channel._ring_np.any()  # nothing went through the ring
    arena.close()


def test_zero_copy_needs_the_shm_backend():
    from sage_infer.transport.arena import SharedArena

    arena = SharedArena(1 << 20)
    with pytest.raises(TransportError, match="needs the shm backend"):
        run(engine().listen("tcp", arena=arena))
    arena.close()


def test_receive_buffers_reject_what_does_not_fit_before_allocating():
    from sage_infer.transport.transport_errors import ProtocolError

    buffers = KVReceiveBuffers()
    buffers.register("a", [torch.zeros(2, 16, 4, 64, dtype=torch.float16)])  # 16 KiB
    good = ChunkHeader(Kind.DATA, "a", layer=0, offset=0, length=64 * 64 + 64 * 2, raw_length=8192,
                       flags=Flag.CONVERTED, wire_dtype="int8", src_dtype="fp16", cols=64)
    assert len(buffers.sink(good)) == good.length  # 64 rows of 64 int8 + an fp16 scale per row
    huge = ChunkHeader(Kind.DATA, "a", length=1 << 40, raw_length=8192, flags=Flag.CONVERTED,
                       wire_dtype="int8", src_dtype="fp16", cols=64)
    with pytest.raises(ProtocolError, match="carries 1099511627776 bytes"):
        buffers.sink(huge)
    past_end = ChunkHeader(Kind.DATA, "a", offset=16384 - 100, length=200)
    with pytest.raises(ProtocolError, match="past the 16384-byte destination"):
        buffers.sink(past_end)
    with pytest.raises(ProtocolError, match="no receive buffers registered for request 'b'"):
        buffers.sink(ChunkHeader(Kind.DATA, "b", length=8))


def test_checksum_none_moves_the_bytes_unchecked_when_both_ends_allow_it(monkeypatch):
    corrupt_after_checksum(monkeypatch)  # a bad copy into the ring ...
    layers = kv(1, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    sent, _, _, _, channel = transfer_once(engine(backend="shm", chunk_size="32KiB", checksum="none"), layers, dest)
    assert sent.retransmits == 0 and channel.checksum_failures == 0  # ... goes unnoticed: that is what none means
    assert digest(dest) != digest(layers)


def test_a_receiver_that_requires_checksums_refuses_a_sender_without(monkeypatch):
    layers = kv(1, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    sender, receiver = engine(backend="tcp", checksum="none"), engine(backend="tcp")

    async def go():
        listener = await receiver.listen("tcp")
        accepting = asyncio.create_task(listener.accept(asyncio.get_running_loop().time() + 10))
        conn = await sender.connect(listener.address)
        channel = await accepting
        buffers = KVReceiveBuffers()
        buffers.register("a", dest)
        plan, _ = sender.plan("a", layers)
        got = await asyncio.gather(sender.stream_pipeline(conn, plan.chunks, plan, layers, deadline_s=5),
                                   receiver.receive(channel, buffers, ["a"], deadline_s=5), return_exceptions=True)
        await conn.aclose()
        await listener.aclose()
        return got, buffers

    (_, received), buffers = run(go())
    assert isinstance(received, TransportError) and "requires one" in str(received)
    assert not buffers.complete("a")
