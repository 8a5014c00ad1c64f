"""The shared token on the inter-instance channel (`kv_transport.auth_token`): over real shm and tcp
connections only a peer holding the listener's token gets a channel; anyone else — wrong token, no
token, garbage, silence — is refused, logged and counted, and the listener goes on serving good peers.
The connecting side checks the listener too, and the KV connector reports a refused transfer."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.config.transport import KVTransportConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.kv_runtime.kv_pipe import KVPipe
from sage_infer.transport import KVReceiveBuffers
from sage_infer.transport.backends.shm import _path_of
from sage_infer.transport.backends.tcp import parse_address
from sage_infer.transport.transport_errors import AuthError
from sage_infer.transport.wire import HEADER_BYTES, ChunkHeader, Kind
from tests.transport_util import digest, engine, kv

TOKEN = "deployment-token-0123456789"
OTHER = "some-other-token-0123456789"
SHAPE = dict(layers=2, tokens=300, heads=4, head_dim=64)
BACKENDS = ["shm", "tcp"]


def run(coro):
    return asyncio.run(coro)


def failures(eng, reason: str) -> float:
    for family in text_string_to_metric_families(generate_latest(eng.telemetry.registry).decode()):
        for s in family.samples:
            if s.name == "sage:kv_transfer_failures_total" and s.labels == {"reason": reason}:
                return s.value
    return 0.0


async def until(condition, what: str, timeout_s: float = 20.0) -> None:
    """Poll `condition` (the listener refuses in the background) up to a generous bound."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        assert loop.time() < end, f"still waiting for {what}"
        await asyncio.sleep(0.02)


async def transfer(sender, listener, rid: str = "a") -> bool:
    """Send one request's KV from `sender` to `listener`'s next channel; True when it arrived bit-exact."""
    layers = kv(3, **SHAPE)
    dest = [torch.zeros_like(t) for t in layers]
    accepting = asyncio.create_task(listener.accept(asyncio.get_running_loop().time() + 20))
    conn = await sender.connect(listener.address)
    channel = await accepting
    buffers = KVReceiveBuffers()
    buffers.register(rid, dest)
    plan, _ = sender.plan(rid, layers)
    try:
        await asyncio.gather(sender.stream_pipeline(conn, plan.chunks, plan, layers, deadline_s=20),
                             sender.receive(channel, buffers, [rid], deadline_s=20))
    finally:
        await conn.aclose()
        await channel.aclose()
    return buffers.complete(rid) and digest(dest) == digest(layers)


def open_raw(backend: str, address: str) -> socket.socket:
    if backend == "tcp":
        return socket.create_connection(parse_address(address), timeout=10)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(_path_of(address))
    return sock


# -- the handshake --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_peers_holding_the_same_token_move_kv_bit_exact(backend):
    async def go():
        receiver = engine(backend=backend, auth_token=TOKEN)
        listener = await receiver.listen(backend)
        try:
            return await transfer(engine(backend=backend, auth_token=TOKEN, chunk_size="16KiB"), listener), receiver
        finally:
            await listener.aclose()

    ok, receiver = run(go())
    assert ok and failures(receiver, "auth") == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_or_missing_token_is_refused_and_the_listener_keeps_serving(backend, caplog):
    caplog.set_level(logging.WARNING, logger="sage_infer.transport")

    async def go():
        receiver = engine(backend=backend, auth_token=TOKEN)
        listener = await receiver.listen(backend)
        wrong, missing = engine(backend=backend, auth_token=OTHER), engine(backend=backend)
        try:
            with pytest.raises(AuthError, match="refused the shared token") as refused:
                await wrong.connect(listener.address)
            with pytest.raises(AuthError, match="requires the deployment's shared token") as unasked:
                await missing.connect(listener.address)
            await until(lambda: failures(receiver, "auth") == 2, "both refusals to be counted")
            good = await transfer(engine(backend=backend, auth_token=TOKEN), listener)
        finally:
            await listener.aclose()
        return refused.value, unasked.value, good, receiver, wrong

    refused, unasked, good, receiver, wrong = run(go())
    assert good, "the listener stopped serving good peers after refusing bad ones"
    assert failures(receiver, "auth") == 2 and failures(wrong, "auth") == 1
    assert TOKEN not in str(refused) and OTHER not in str(refused) and TOKEN not in str(unasked)
    lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(lines) == 2 and all("token" in line for line in lines), lines
    assert not any(TOKEN in r.getMessage() or OTHER in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_and_silence_are_refused_as_auth_failures(backend):
    async def go():
        receiver = engine(backend=backend, auth_token=TOKEN, timeout_s=1)  # also the set-up deadline
        listener = await receiver.listen(backend)
        loop = asyncio.get_running_loop()
        try:
            silent = await loop.run_in_executor(None, open_raw, backend, listener.address)
            noisy = await loop.run_in_executor(None, open_raw, backend, listener.address)
            noisy.sendall(os.urandom(HEADER_BYTES + 64))  # an "answer" that is not one
            await until(lambda: failures(receiver, "auth") == 2, "the garbage and the silent peer to be refused")
            challenge = ChunkHeader.unpack(silent.recv(HEADER_BYTES, socket.MSG_WAITALL))
            assert (challenge.kind, challenge.length) == (Kind.AUTH, 32)
            assert silent.recv(64 + HEADER_BYTES, socket.MSG_WAITALL)[32:] == b""  # the nonce, then closed
            noisy.close()
            silent.close()
            good = await transfer(engine(backend=backend, auth_token=TOKEN), listener)
        finally:
            await listener.aclose()
        return good, receiver

    good, receiver = run(go())
    assert good and failures(receiver, "auth") == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_on_the_connecting_side_only_fails_clearly(backend):
    async def go():
        listener = await engine(backend=backend).listen(backend)
        try:
            with pytest.raises(AuthError, match="does not check a shared token"):
                await engine(backend=backend, auth_token=TOKEN).connect(listener.address)
            if backend == "tcp":  # tcp has no set-up after the opening: that channel was handed out, and ends
                gone = await listener.accept(asyncio.get_running_loop().time() + 20)
                assert await gone.recv(lambda h: memoryview(bytearray(h.length)),
                                       asyncio.get_running_loop().time() + 20) is None
                await gone.aclose()
            return await transfer(engine(backend=backend), listener)  # no token on either end: as before
        finally:
            await listener.aclose()

    assert run(go())


def test_a_listener_that_cannot_prove_the_token_gets_no_kv():
    """Mutual: a listener that does not hold the token (here: one that answers with random bytes)
    is found out before the connecting side sends anything."""

    async def go():
        loop = asyncio.get_running_loop()
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        received = bytearray()

        async def impostor():
            sock, _ = await loop.sock_accept(server)
            await loop.sock_sendall(sock, ChunkHeader(Kind.AUTH, "challenge", length=32).pack() + os.urandom(32))
            received.extend(await loop.sock_recv(sock, HEADER_BYTES + 64))
            await loop.sock_sendall(sock, ChunkHeader(Kind.AUTH, "proof", length=32).pack() + os.urandom(32))
            await asyncio.sleep(0.5)
            while chunk := await loop.sock_recv(sock, 1 << 16):  # whatever comes after the proof
                received.extend(chunk)
            sock.close()

        task = asyncio.create_task(impostor())
        try:
            with pytest.raises(AuthError, match="could not prove it holds the shared token"):
                await engine(backend="tcp", auth_token=TOKEN).connect(address)
            await task
        finally:
            server.close()
        return bytes(received)

    received = run(go())
    assert len(received) == HEADER_BYTES + 64  # the answer, and nothing after it
    assert TOKEN.encode() not in received


# -- config ----------------------------------------------------------------------------------


def test_the_token_is_never_printed(sage, monkeypatch):
    monkeypatch.setenv("SAGE_KV_TRANSPORT__AUTH_TOKEN", "env-token-0123456789abc")
    result = sage("config", "show", "--preset", "cpu", "--kv-transport", f"auth-token={TOKEN}", "--json")
    assert result.code == 0, result.err
    assert TOKEN not in result.out and "env-token" not in result.out
    rows = {r["field"]: r for r in json.loads(result.out)["fields"]}
    assert rows["kv_transport.auth_token"]["source"] == "cli"
    table = sage("config", "show", "--preset", "cpu", "--set", f"kv_transport.auth_token={TOKEN}")
    assert table.code == 0 and TOKEN not in table.out


def test_a_short_token_is_a_config_error_naming_the_field_not_the_value(sage):
    result = sage("config", "show", "--preset", "cpu", "--kv-transport", "auth-token=hunter2")
    assert result.code == 2
    assert "kv_transport.auth_token" in result.err and "at least 16 characters" in result.err
    assert "hunter2" not in result.err


def test_the_default_is_no_token():
    assert KVTransportConfig().auth_token is None


# -- the KV connector ----------------------------------------------------------------------------


SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=KVDtype.FP16)


def wait_for(poll, timeout_s: float = 30.0) -> list:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = poll()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("the connector reported nothing (hung?)")


@pytest.mark.parametrize("sender_token", [TOKEN, OTHER])
def test_kv_connectors_transfer_with_the_same_token_and_fail_with_another(sender_token):
    config = dict(backend="shm", chunk_size="16KiB", timeout_s=3)
    receiver = KVPipe(SCHEMA, KVTransportConfig(auth_token=TOKEN, **config), backend="shm", listen=True)
    sender = KVPipe(SCHEMA, KVTransportConfig(auth_token=sender_token, **config), backend="shm")
    try:
        rows = torch.randint(0, 256, (5, SCHEMA.bytes_per_block), dtype=torch.uint8)
        receiver.expect("t-1", 5)
        hashes = [bytes([i]) * 32 for i in range(5)]
        sender.start_send("t-1", receiver.address, rows, hashes)
        [sent] = wait_for(sender.poll_sent)
        [received] = wait_for(receiver.poll_received)
    finally:
        sender.close()
        receiver.close()
    if sender_token == TOKEN:
        assert sent.ok and received.ok and torch.equal(received.rows, rows)
        assert list(received.block_hashes) == hashes
    else:
        assert not sent.ok and "refused the shared token" in sent.error
        assert not received.ok and received.rows is None  # its deadline passed: the request recomputes
        assert failures(receiver.transport, "auth") == 1
