"""Joining the torch.distributed process group the torchdist backend moves KV in.

A prefill/decode deployment over ``kv_transport.backend: torchdist`` is one process group: every
worker joins it at start-up (`join_process_group`), and a decode worker's KV address is its rank
(``torchdist://<rank>``). The group's backend follows the KV pool's device: gloo for a pool on the
CPU, the device's own otherwise (nccl on CUDA; that path is untested here, CI has no GPU). Joining
waits for every rank at most ``process_group.timeout_s``: a rank that never comes (a wrong
address or world size, a worker that failed to start) stops this one with a ConfigError instead
of a hang. A process that joined ends through `exit_process`, which skips the interpreter's teardown.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from sage_infer.config.transport import ProcessGroupConfig
from sage_infer.errors import ConfigError

FIELD = "kv_transport.process_group"
_joined = False  # this process initialised a group (and so must leave through `exit_process`)


@dataclass(frozen=True, slots=True)
class GroupMembership:
    """Where this process stands in the group: what `enable_role` logs."""

    backend: str  # gloo, nccl, ...
    rank: int
    world_size: int
    init_method: str | None  # None: the group was there already (torchrun, a test, the caller)


def group_backend(device: torch.device) -> str:
    """The process-group backend for KV on `device` (gloo on the CPU, nccl on CUDA, ...)."""
    name = dist.Backend.default_device_backend_map.get(device.type)
    if name is None:
        raise ConfigError(f"kv_transport.backend: torchdist has no process-group backend for a {device.type} KV pool")
    return name


def join_process_group(config: ProcessGroupConfig, device: torch.device) -> GroupMembership:
    """Join (or, already initialised, check) this process's group for KV on `device`."""
    global _joined
    if not dist.is_available():
        raise ConfigError("kv_transport.backend: torchdist needs torch.distributed, which this torch build lacks")
    backend = group_backend(device)
    if dist.is_initialized():
        joined = _existing(config)
        _check_any_source(joined.backend, joined.world_size)
        return joined
    for name in ("init_method", "rank", "world_size"):
        if getattr(config, name) is None:
            raise ConfigError(f"{FIELD}.{name}: backend torchdist joins a process group; set init_method "
                              "(tcp://HOST:PORT), rank and world_size (or let --pd assign them)")
    if config.rank >= config.world_size:
        raise ConfigError(f"{FIELD}.rank: {config.rank} is not a rank of a group of world_size {config.world_size}")
    _check_any_source(backend, config.world_size)
    try:
        dist.init_process_group(backend, init_method=config.init_method, rank=config.rank,
                                world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s))
    except (RuntimeError, ValueError) as err:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise ConfigError(f"{FIELD}: rank {config.rank} of {config.world_size} could not join the {backend} group "
                          f"at {config.init_method} within {config.timeout_s:g} s ({_first_line(err)}); does "
                          "every worker have the same init_method and world_size, and did they all start?") from None
    _joined = True
    return GroupMembership(backend, config.rank, config.world_size, config.init_method)


def exit_process(code: int) -> NoReturn:
    """End this process with `code`; once it joined a group, without the interpreter's teardown.

    gloo cannot cancel a posted receive, so after the KV pipe closed, daemon threads may still
    wait on one (a decode worker's next connection request, a channel's next header) and wake when
    the peer sends or goes away. One that wakes while the interpreter finalizes is ended by
    ``pthread_exit`` inside C++, which aborts the whole process ("terminate called without an active
    exception", exit -6). The server has shut down by now: flush what is buffered and leave.
    """
    if not _joined:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say
            pass
    os._exit(code)


def _existing(config: ProcessGroupConfig) -> GroupMembership:
    """The group someone else initialised; the config, where set, must describe it."""
    rank, size, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    for name, have in (("rank", rank), ("world_size", size)):
        want = getattr(config, name)
        if want is not None and want != have:
            raise ConfigError(f"{FIELD}.{name}: this process is already rank {rank} of a group of {size}, "
                              f"not {name} {want}")
    return GroupMembership(backend, rank, size, None)


def _check_any_source(backend: str, world_size: int) -> None:
    """A decode worker takes KV from whichever prefill worker sends it: a receive from any rank, which
    gloo has and NCCL (like the other device libraries) has not. Two ranks need none."""
    if "gloo" not in backend and world_size > 2:
        raise ConfigError(f"{FIELD}.world_size: over {backend} a decode worker cannot receive from any rank, so a "
                          f"torchdist deployment there is one prefill and one decode worker (2), not {world_size}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__
