"""Errors of the KV tier stores.

A tier that cannot be reached is not a bug in the caller: it gets a `TierError` quickly and
falls back to recompute (DESIGN: a failed load falls back to the longest verified prefix).
"""

from __future__ import annotations

from sage_infer.errors import SageError


class TierError(SageError):
    """A tier is unreachable or dead (connection refused, timeout, I/O error)."""

    exit_code = 1


class TierConfigError(SageError):
    """A bad tier setting: an unparseable store URL, a capacity smaller than one block."""

    exit_code = 2
