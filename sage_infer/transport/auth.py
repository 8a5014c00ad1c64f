"""Shared-token authentication of a shm or tcp connection (`kv_transport.auth_token`).

Every shm and tcp connection opens with the listener speaking first, before any chunk:

    listener -> connector  AUTH "open"       (no payload)        the listener checks no token, or
    listener -> connector  AUTH "challenge"  nonce_l (32 bytes)  it does:
    connector -> listener  AUTH "answer"     HMAC-SHA256(token, nonce_l || nonce_c || CONTEXT || "connector") || nonce_c
    listener -> connector  AUTH "proof"      HMAC-SHA256(token, nonce_l || nonce_c || CONTEXT || "listener")

The listener compares the answer with `hmac.compare_digest` and, on any failure (wrong or
missing token, garbage, no answer in time), closes the connection without a word; the
connector then reports that the peer refused its token. The proof makes it mutual: a
connector sends no KV to a listener that cannot show it holds the token too. Fresh nonces on
both sides and a different label per direction keep an answer from being replayed or
reflected. A connector with a token meeting a listener without one (or the reverse) fails at
once with a message that says which end lacks it. The token itself never crosses the wire.

torchdist has no handshake: membership of the process group is its boundary.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
from collections.abc import Awaitable, Callable

from sage_infer.transport.transport_errors import AuthError, PeerClosedError, ProtocolError, TransportError
from sage_infer.transport.wire import HEADER_BYTES, ChunkHeader, Kind

CONTEXT = b"sage-kv-transport/auth/v1"
NONCE_BYTES = 32
MAC_BYTES = 32

Recv = Callable[[int], Awaitable[bytes]]  # exactly n bytes, or raise
Send = Callable[[bytes], Awaitable[None]]


def socket_io(sock: socket.socket) -> tuple[Recv, Send]:
    """Exact reads and whole writes on a non-blocking socket, for the handshake."""
    loop = asyncio.get_running_loop()

    async def recv(n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await loop.sock_recv_into(sock, view[got:])
            if k == 0:
                raise PeerClosedError("the peer closed the connection during the handshake")
            got += k
        return bytes(buf)

    async def send(data: bytes) -> None:
        await loop.sock_sendall(sock, data)

    return recv, send


def _mac(token: bytes, role: bytes, listener_nonce: bytes, connector_nonce: bytes) -> bytes:
    return hmac.new(token, listener_nonce + connector_nonce + CONTEXT + role, hashlib.sha256).digest()


async def _read_auth(recv: Recv, what: str) -> tuple[ChunkHeader, bytes]:
    header = ChunkHeader.unpack(await recv(HEADER_BYTES))
    if header.kind is not Kind.AUTH or header.length > NONCE_BYTES + MAC_BYTES:
        raise ProtocolError(f"expected the {what}, got a {header.kind.name} message of {header.length} bytes")
    return header, await recv(header.length) if header.length else b""


async def challenge_peer(recv: Recv, send: Send, token: bytes | None) -> None:
    """Listener side: open the connection; with a `token`, raise `AuthError` unless the peer proves it
    holds the same one, then prove it back."""
    if token is None:
        await send(ChunkHeader(Kind.AUTH, "open").pack())
        return
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        await send(ChunkHeader(Kind.AUTH, "challenge", length=NONCE_BYTES).pack() + nonce)
        header, body = await _read_auth(recv, "answer to the shared-token challenge")
    except (TransportError, OSError) as err:
        raise AuthError(f"no valid answer to the shared-token challenge ({err})") from None
    if len(body) != MAC_BYTES + NONCE_BYTES:
        raise AuthError("the peer did not answer the shared-token challenge (does it have kv_transport.auth_token?)")
    answer, peer_nonce = body[:MAC_BYTES], body[MAC_BYTES:]
    if not hmac.compare_digest(answer, _mac(token, b"connector", nonce, peer_nonce)):
        raise AuthError("the peer's answer does not match the shared token (kv_transport.auth_token differs)")
    proof = _mac(token, b"listener", nonce, peer_nonce)
    await send(ChunkHeader(Kind.AUTH, "proof", length=MAC_BYTES).pack() + proof)


async def answer_challenge(recv: Recv, send: Send, token: bytes | None, address: str) -> None:
    """Connector side: read how the listener at `address` opens; raise `AuthError` when the two ends do
    not hold the same token (or only one holds one)."""
    try:
        header, nonce = await _read_auth(recv, "listener's opening message")
    except (PeerClosedError, OSError) as err:
        raise PeerClosedError(f"{address} closed the connection before it opened it ({err})") from None
    except ProtocolError as err:
        raise ProtocolError(f"{address} is not a sage KV transport listener of this version: {err}") from None
    if not nonce:
        if token is not None:
            raise AuthError(f"{address} does not check a shared token, but kv_transport.auth_token is set here; "
                            "set the same token on both ends")
        return
    if len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"{address} sent a {len(nonce)}-byte challenge, expected {NONCE_BYTES}")
    if token is None:
        raise AuthError(f"{address} requires the deployment's shared token; set kv_transport.auth_token here too")
    mine = secrets.token_bytes(NONCE_BYTES)
    answer = _mac(token, b"connector", nonce, mine)
    try:
        await send(ChunkHeader(Kind.AUTH, "answer", length=MAC_BYTES + NONCE_BYTES).pack() + answer + mine)
        _, proof = await _read_auth(recv, "listener's proof")
    except (TransportError, OSError):
        raise AuthError(f"{address} refused the shared token (kv_transport.auth_token differs between the two "
                        "ends)") from None
    if len(proof) != MAC_BYTES or not hmac.compare_digest(proof, _mac(token, b"listener", nonce, mine)):
        raise AuthError(f"{address} could not prove it holds the shared token; no KV is sent to it")
