"""Errors of the KV transport engine. Every failure names the peer, the chunk and why."""

from __future__ import annotations

from sage_infer.errors import SageError


class TransportError(SageError):
    """A transfer failed; nothing it carried is marked delivered. `reason` labels the failure metric."""

    reason = "error"


class ChecksumError(TransportError):
    """A chunk's payload (or header) did not match its CRC after the allowed re-requests."""

    reason = "checksum"


class TruncatedError(TransportError):
    """The stream ended in the middle of a header or payload."""

    reason = "truncated"


class PeerClosedError(TransportError):
    """The peer closed the connection or died before the transfer completed."""

    reason = "peer_closed"


class TransferTimeout(TransportError):
    """The peer stalled: the transfer's deadline passed with chunks still unacknowledged."""

    reason = "timeout"


class ProtocolError(TransportError):
    """A message that does not follow the wire protocol (bad magic, version, kind or size)."""

    reason = "protocol"


class AuthError(TransportError):
    """A connection failed the shared-token handshake (`kv_transport.auth_token`): wrong token,
    a token on one end only, no answer in time, or not a sage peer at all."""

    reason = "auth"


class BackendUnavailable(TransportError):
    """The backend cannot run here (module missing, no device); the message says why."""

    reason = "unavailable"
