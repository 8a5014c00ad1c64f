"""Counters of speculative decoding, as vLLM's `vllm:spec_decode_*` metrics count them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # verify rows groups: a sequence's proposals checked in one step
    num_draft_tokens: int = 0  # tokens proposed and checked
    num_accepted_tokens: int = 0  # proposed tokens the target agreed with
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts whose proposal j+1 stood

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.extend([0] * (num_proposed - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per draft (accepted proposals + the target's own token): 1.0 means no gain."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
