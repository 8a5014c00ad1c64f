"""Errors a user can cause. The CLI turns each into one line and an exit code."""

from __future__ import annotations


class SageError(Exception):
    """A user-facing error: `str(err)` is the one line shown; `hint` may follow it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class UsageError(SageError):
    """A bad flag or flag value."""

    exit_code = 2


class ConfigError(SageError):
    """A bad preset, config file or env var; the message names file, line and field."""

    exit_code = 2


class NotAvailableError(SageError):
    """A feature that is not installed or not implemented in this build."""

    exit_code = 1


class RequestError(ValueError):
    """A request that can never run (empty, longer than the context or the pool, a KV transfer this engine cannot
    take): the engine queues nothing for it, and a server answers it with a 4xx."""
