"""Which prefill instance a decode worker may pull KV from, when the deployment has an API key.

A decode worker pulls a prompt's KV by calling ``POST {remote_url}/v1/kv/send`` with the deployment's key, and
``remote_url`` arrives in the request body. So that a client who can reach a worker cannot have it send the key
to an address of the client's choosing, the router signs what it names (HMAC-SHA256 under the key, over the
URL and the held request's id) and the worker pulls only a signed ``remote_url``. Without a key there is no
secret to send, and a worker pulls from any http(s) URL it is given. Behind a proxy that does not sign,
``kv_transport.allowed_peers`` lists the prefill instances a worker may pull from unsigned (and, once set, the
only ones it pulls from without a key).
"""

from __future__ import annotations

import hashlib
import hmac

from sage_infer.config.transport import origin


def pull_is_allowed(api_key: str | None, allowed: frozenset[str], remote_url: str, remote_request_id: str,
                    signature: str | None) -> bool:
    """Whether a decode worker may call `remote_url`: it is on the allow-list, or (with a key) the router signed
    it, or (with neither a key nor an allow-list) always."""
    try:
        listed = origin(remote_url) in allowed
    except ValueError:
        listed = False
    if listed:
        return True
    if api_key:
        return pull_is_signed(api_key, remote_url, remote_request_id, signature)
    return not allowed


def sign_pull(api_key: str, remote_url: str, remote_request_id: str) -> str:
    """The signature the router adds as ``kv_transfer_params.signature`` (64 hex digits)."""
    message = f"{remote_url}\n{remote_request_id}".encode()
    return hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()


def pull_is_signed(api_key: str, remote_url: str, remote_request_id: str, signature: str | None) -> bool:
    """Whether `signature` is the router's for this pull (compared in constant time)."""
    return signature is not None and hmac.compare_digest(sign_pull(api_key, remote_url, remote_request_id),
                                                         signature)
