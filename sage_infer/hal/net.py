"""This host's network resources."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now. Whoever binds it later races anyone else asking: a small window."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
