"""A prompt's token ids computed in the router, as its replicas compute them.

The kv policy needs a request's block hashes before it can route it. Without this a router asks a
replica for them (``POST /v1/kv/hashes``): a round trip to a process that is busy computing, on the
critical path of every request. With the served model's directory the router renders the chat
template and tokenizes itself, with the code a replica's front end runs (`RequestValidator`), and
hashes the ids as the replicas' snapshots say they name blocks. A prompt it cannot take (too large,
a template error) is left to the replica, which answers the client the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from sage_infer.core.messages import ModelInfo
from sage_infer.models.model_dir import read_config, resolve_model_dir
from sage_infer.models.tokenizer import Tokenizer
from sage_infer.router.http import MATCH_FIELDS
from sage_infer.server.openai_errors import APIError
from sage_infer.server.protocol import KVMatchRequest
from sage_infer.server.validation import RequestValidator

log = logging.getLogger("sage_infer.router")


class LocalPrompts:
    """Token ids of requests' prompts, from the model directory the replicas serve."""

    def __init__(self, directory: Path) -> None:
        tokenizer = Tokenizer.from_dir(directory)
        config = read_config(directory)
        config = config.get("text_config", config)  # a multimodal checkpoint's language model
        self.validator = RequestValidator(ModelInfo(
            name=directory.name, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
            vocab_size=int(config["vocab_size"]), max_model_len=int(config.get("max_position_embeddings") or 1 << 20),
            max_bytes_per_token=tokenizer.max_bytes_per_token))

    def token_ids(self, body: dict) -> list[int] | None:
        """The prompt's ids as a replica computes them for `body`; None when this request is the replica's to judge."""
        try:
            question = KVMatchRequest.model_validate({k: body[k] for k in MATCH_FIELDS if k in body})
            return self.validator.match_ids(question)
        except (ValidationError, APIError):
            return None


def local_prompts(model_path: str | None) -> LocalPrompts | None:
    """`LocalPrompts` for the replicas' model (None: the bundled demo); None, logged, when it cannot be read here
    (replicas on other machines): the router then asks a replica for each prompt's hashes."""
    try:
        return LocalPrompts(resolve_model_dir(model_path))
    except Exception as err:  # noqa: BLE001 - any unreadable model: route by asking, as without it
        log.warning("the router asks replicas for prompts' hashes: cannot read the model here (%s)", err)
        return None
