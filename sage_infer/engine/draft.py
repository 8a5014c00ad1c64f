"""`DraftModelProposer` (``speculative.method: draft_model``): a small model that shares the target's tokenizer
proposes the next tokens greedily, from its own paged KV.

Each target sequence has a draft sequence here: the same tokens, its KV in the draft's own pool. When the
scheduler asks for proposals, the draft first drops the KV of tokens the target did not keep (the proposals it
rejected last step: the draft's computed tokens are cut back to the longest common prefix with the target's
tokens, and the blocks past them go back to the draft pool), computes what it has not seen (the prompt the first
time, then the tokens the target accepted and its own next token), and decodes up to k tokens greedily, one
forward pass each. Greedy proposals are a deterministic function of the context, so the verifier's rejection
sampling with a one-hot draft distribution keeps the target's distribution exactly (`spec_decode.accept`).

The draft runs on the target's device with the target's attention backend choices. The scheduler asks for all of a
step's decode rows at once (`propose_batch`), so a step costs the draft k forward passes whatever the batch size,
each over every row still proposing; it pays where a step is bound by the target's weight reads, batch 1 above all.
A draft pool too full for a sequence proposes nothing for it (the target decodes alone) rather than wait.
"""

from __future__ import annotations

import torch

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.spec_decode.base import Proposer

GREEDY = SamplingParams(temperature=0)


class DraftModelProposer(Proposer):
    """Up to `num_speculative_tokens` greedy tokens of the draft model behind `runner` (its pool managed by
    `blocks`, which has no prefix index: a draft sequence's blocks are its own)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, num_speculative_tokens: int,
                 disable_by_batch_size: int | None = None, adaptive: bool = False) -> None:
        super().__init__(num_speculative_tokens, disable_by_batch_size, adaptive)
        self.runner = runner
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.seqs: dict[int, Sequence] = {}  # target seq id -> its draft sequence

    def propose(self, seq_id: int, token_ids: list[int], limit: int, tenant: bytes = b"") -> list[int]:
        return self.propose_batch([(seq_id, token_ids, limit, tenant)])[0]

    def propose_batch(self, rows: list[tuple[int, list[int], int, bytes]]) -> list[list[int]]:
        """Greedy proposals for a step's decode rows, (seq id, token ids, limit, tenant) each: every draft step is
        one forward pass over all rows still proposing (the first also computes what each draft has not seen)."""
        proposed: list[list[int]] = [[] for _ in rows]
        active: list[tuple[int, Sequence, int]] = []  # (row, its draft sequence, how many to propose)
        for row, (seq_id, token_ids, limit, _) in enumerate(rows):
            n = self.limit(seq_id, limit)
            if n <= 0:
                continue
            draft = self.seqs.get(seq_id)
            if draft is None:
                draft = self.seqs[seq_id] = Sequence(seq_id, "draft", 0, [], len(token_ids), GREEDY, b"")
            self._keep_common_prefix(draft, token_ids)
            active.append((row, draft, n))
        with torch.inference_mode():
            while active:
                # a draft whose pool is full proposes what it has
                active = [a for a in active if self._room(a[1], a[1].num_tokens - a[1].num_computed_tokens)]
                if not active:
                    break
                drafts = [draft for _, draft, _ in active]
                new = [draft.num_tokens - draft.num_computed_tokens for draft in drafts]
                logits, owners = self.runner.run(drafts, new)
                assert owners == list(range(len(drafts))), "every draft row ends its chunk: one logits row each"
                for (row, draft, _), n_new, token in zip(active, new, logits.argmax(dim=-1).tolist()):
                    draft.num_computed_tokens += n_new
                    draft.token_ids.append(token)
                    proposed[row].append(token)
                active = [a for a in active if len(proposed[a[0]]) < a[2]]
        return proposed

    def _keep_common_prefix(self, draft: Sequence, token_ids: list[int]) -> None:
        """Make `draft` hold `token_ids`, keeping the KV of the longest prefix it computed that they share."""
        old = draft.token_ids
        common = 0
        limit = min(draft.num_computed_tokens, len(token_ids))
        while common < limit and old[common] == token_ids[common]:
            common += 1
        draft.token_ids = list(token_ids)
        del draft.hash_chain[common // self.block_size :]  # (unused: the draft pool has no prefix index)
        draft.num_computed_tokens = min(common, len(token_ids) - 1)  # the last token is fed: its logits propose
        keep = -(-draft.num_computed_tokens // self.block_size)
        if len(draft.block_table) > keep:
            self.blocks.free(list(reversed(draft.block_table[keep:])))
            del draft.block_table[keep:]

    def _room(self, draft: Sequence, new: int) -> bool:
        """Blocks for `new` more tokens of `draft`, allocated; False (nothing taken) when the draft pool is short."""
        needed = -(-(draft.num_computed_tokens + new) // self.block_size) - len(draft.block_table)
        if needed <= 0:
            return True
        if not self.blocks.can_allocate(needed):
            return False
        draft.block_table.extend(self.blocks.allocate(needed))
        return True

    def forget(self, seq_id: int, tenant: bytes = b"", output=()) -> None:
        super().forget(seq_id, tenant, output)
        draft = self.seqs.pop(seq_id, None)
        if draft is not None and draft.block_table:
            self.blocks.free(list(reversed(draft.block_table)))
