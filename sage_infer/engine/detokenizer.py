"""Streaming detokenization: token ids in, text deltas out, stop strings applied."""

from __future__ import annotations

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.models.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids into text deltas for streaming, never splitting a UTF-8 character, and
    applies stop strings.

    vLLM's prefix/read offsets: `output_ids[prefix_offset:read_offset]` is the window whose
    text was already emitted; each step decodes the window with and without the tokens after
    `read_offset` and emits the difference. Decoding a short window keeps each step O(1), and
    the tokens before `read_offset` give the decoder the context it needs for word-boundary
    spaces. A text ending in U+FFFD means a multi-byte character is still incomplete, so
    nothing is emitted until a later token completes it (or `flush` gives up on it).

    The output text is `tokenizer.decode(output_ids)` cut at the first stop string: the prompt
    is not part of the decode window, so the first token's leading space is handled exactly as
    a plain decode of the output would handle it. `prompt_token_ids` is accepted so callers
    need not care, and is not used.

    Stop strings: a match is searched in the text each step; until then the longest suffix that
    could still begin a stop string is held back, so a stop string is never partly emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._decoded = ""  # text of output_ids[:read_offset], before any stop-string cut
        self._num_emitted = 0  # chars of the output text already returned to the caller
        self._stop_at: int | None = None  # where the output text ends once a stop string matched
        self._stopped_by: str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    @property
    def stopped_by(self) -> str | None:
        """The stop string that matched, if any."""
        return self._stopped_by

    @property
    def text(self) -> str:
        """The output text so far: complete characters only until `flush`; cut at a matched
        stop string (which is kept only with `include_stop_str_in_output`)."""
        return self._decoded if self._stop_at is None else self._decoded[: self._stop_at]

    def step(self, token_id: int) -> str:
        """Appends one generated token and returns the text that is now safe to emit."""
        if self._stopped_by is not None:
            return ""  # nothing after a stop string ever appears
        self.output_ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._append(new_text[len(prefix_text) :])
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.output_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At finish: emits what was held back (an incomplete character decodes as U+FFFD,
        exactly as a plain decode would), minus anything from a stop string on."""
        if self._stopped_by is None and self.read_offset < len(self.output_ids):
            prefix_text, new_text = self._decode_window()
            self._append(new_text[len(prefix_text) :])
            self.prefix_offset = self.read_offset = len(self.output_ids)
        return self._emit(final=True)

    def _decode_window(self) -> tuple[str, str]:
        skip = self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.output_ids[self.prefix_offset : self.read_offset], skip)
        new_text = self.tokenizer.decode(self.output_ids[self.prefix_offset :], skip)
        return prefix_text, new_text

    def _append(self, delta: str) -> None:
        start = len(self._decoded)
        self._decoded += delta
        if self.params.stop:
            self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        """Looks for the earliest stop string that ends after `start` (earlier text was
        searched on previous steps)."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self._decoded.find(stop, max(0, start - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self._stopped_by = stop
            self._stop_at = at + len(stop) if self.params.include_stop_str_in_output else at

    def _emit(self, final: bool) -> str:
        text = self.text
        end = len(text)
        if not final and self._stopped_by is None:
            end -= self._stop_prefix_len(text)
        delta = text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return n
        return 0
