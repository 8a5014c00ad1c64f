"""What every proposer shares: the most tokens it proposes, its batch-size cut-off, and the adaptive k of each
sequence (halved after a step that accepted nothing, one more after a step that accepted everything; a step that
accepted nothing also pauses the sequence's proposals for a few steps, twice as many after each refused probe, so a
sequence whose proposals never stand decodes almost as without speculation)."""

from __future__ import annotations

from collections.abc import Sequence

# adaptive: steps a sequence proposes nothing after a step that accepted none of its proposal; doubled after each
# refused probe
PAUSE_STEPS, MAX_PAUSE_STEPS = 4, 64


class Proposer:
    """The scheduler calls `propose` for a decode row and `forget` when the sequence ends; the engine reports each
    verify step's outcome to `observe`."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None,
                 adaptive: bool = False) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size  # the scheduler asks for nothing in bigger steps
        self.adaptive = adaptive  # each sequence's k follows its acceptance (`observe`)
        self._k: dict[int, int] = {}  # adaptive: seq id -> its own limit
        self._pause: dict[int, tuple[int, int]] = {}  # adaptive: seq id -> (steps left proposing nothing, next pause)

    def propose(self, seq_id: int, token_ids: list[int], limit: int, tenant: bytes = b"") -> list[int]:
        """Up to min(k, `limit`) tokens to follow `token_ids` (the sequence's prompt and output). `tenant`: the
        sequence's prefix-cache key (model and tenant salt); what a proposer learns from one tenant's requests it
        never proposes to another's."""
        raise NotImplementedError

    def propose_batch(self, rows: list[tuple[int, list[int], int, bytes]]) -> list[list[int]]:
        """`propose` for each of a step's decode rows, given as (seq id, token ids, limit, tenant), in order. A
        proposer whose work batches across rows (a draft model's forward passes) overrides this."""
        return [self.propose(*row) for row in rows]

    def limit(self, seq_id: int, limit: int) -> int:
        """The most tokens to propose now (called once per step and row): `limit`, the configured k, and with
        `adaptive` the sequence's own k, or 0 while its proposals are paused."""
        if not self.adaptive:
            return min(self.k, limit)
        left, pause = self._pause.get(seq_id, (0, PAUSE_STEPS))
        if left > 0:
            self._pause[seq_id] = (left - 1, pause)
            return 0
        return min(self._k.get(seq_id, self.k), limit)

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verify step's outcome for a sequence: with `adaptive`, nothing accepted halves its k and pauses its
        proposals for PAUSE_STEPS steps (doubled after each refused probe, up to MAX_PAUSE_STEPS), everything
        accepted raises k by one (within [1, num_speculative_tokens]); anything accepted ends the pausing."""
        if not self.adaptive or not proposed:
            return
        k = self._k.get(seq_id, self.k)
        if accepted == 0:
            _, pause = self._pause.get(seq_id, (0, PAUSE_STEPS))
            self._pause[seq_id] = (pause, min(MAX_PAUSE_STEPS, 2 * pause))
            self._k[seq_id] = max(1, k // 2)
            return
        self._pause.pop(seq_id, None)
        if accepted == proposed:
            self._k[seq_id] = min(self.k, k + 1)

    def forget(self, seq_id: int, tenant: bytes = b"", output: Sequence[int] = ()) -> None:
        """A sequence ended (`output`: the tokens it generated): drop what was kept for it."""
        self._k.pop(seq_id, None)
        self._pause.pop(seq_id, None)
