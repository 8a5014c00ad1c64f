"""`AcceptingListener`: the listening side shm and tcp share.

Connections are accepted in the background. Each one is opened (the shared-token challenge of
auth.py, when the listener has a token) and set up by the backend in a task of its own, under
one set-up deadline, so a slow or hostile peer holds up nobody else. A connection that fails
is closed, logged in one line and reported to `on_refused` (the engine counts it by reason);
`accept()` hands out only the channels that made it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from abc import abstractmethod
from collections.abc import Callable

from sage_infer.transport.auth import challenge_peer, socket_io
from sage_infer.transport.base import Listener, RecvChannel, before
from sage_infer.transport.transport_errors import AuthError, PeerClosedError, TransferTimeout, TransportError

log = logging.getLogger("sage_infer.transport")
OnRefused = Callable[[TransportError], None]


class AcceptingListener(Listener):
    def __init__(self, server: socket.socket, address: str, *, token: bytes | None, setup_timeout_s: float,
                 on_refused: OnRefused | None) -> None:
        self.address = address
        self._server = server
        self._token = token
        self._setup_timeout_s = setup_timeout_s
        self._on_refused = on_refused
        self._ready: asyncio.Queue[RecvChannel] = asyncio.Queue()
        self._openings: set[asyncio.Task] = set()
        self._acceptor = asyncio.get_running_loop().create_task(self._accept_loop())

    async def accept(self, deadline: float) -> RecvChannel:
        return await before(self._ready.get(), deadline, f"waiting for a sender to connect to {self.address}")

    async def aclose(self) -> None:
        self._acceptor.cancel()
        for task in list(self._openings):
            task.cancel()
        await asyncio.gather(self._acceptor, *self._openings, return_exceptions=True)
        self._server.close()
        while not self._ready.empty():
            await self._ready.get_nowait().aclose()

    # -- for subclasses ------------------------------------------------------------

    @abstractmethod
    async def _set_up(self, sock: socket.socket, deadline: float) -> RecvChannel:
        """Turn an opened (authenticated) connection into a channel; raise to refuse it."""

    @abstractmethod
    def _peer_of(self, sock: socket.socket) -> str:
        """Who is on the other end, for the log line."""

    # -- internals -------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._server)
            except OSError as err:  # out of file descriptors, say: wait for some to be freed
                log.warning("%s: accept failed: %s", self.address, err)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._open(sock))
            self._openings.add(task)
            task.add_done_callback(self._openings.discard)

    async def _open(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._setup_timeout_s
        peer = self._peer_of(sock)
        try:
            try:
                await before(challenge_peer(*socket_io(sock), self._token), deadline, "opening the connection")
            except TransferTimeout:
                if self._token is None:
                    raise
                raise AuthError(f"no answer to the shared-token challenge within {self._setup_timeout_s:g} s") from None
            channel = await self._set_up(sock, deadline)
        except (TransportError, OSError) as err:
            sock.close()
            if not isinstance(err, TransportError):
                err = PeerClosedError(f"the peer went away during set-up ({err})")
            log.warning("%s: refused a connection from %s: %s", self.address, peer, err)
            if self._on_refused is not None:
                self._on_refused(err)
            return
        except BaseException:
            sock.close()
            raise
        self._ready.put_nowait(channel)
