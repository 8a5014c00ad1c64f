"""This host's network resources."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now. Whoever binds it later races anyone else asking: a small window."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP `port` of this host (IPv4; from /proc/net/tcp and the sockets in
    /proc/*/fd), None when none is, or /proc does not say (another OS, another user's process)."""
    import os

    inodes = set()
    try:
        lines = open("/proc/net/tcp").read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if any(os.readlink(f"/proc/{entry}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{entry}/fd")):
                    return int(entry)
            except OSError:
                continue
    return None
