"""Speculative decoding: a proposer guesses a running sequence's next tokens, the target model checks them in
one forward pass (the verify rows of a step), and the verifier keeps the guesses the target agrees with.

- `base.Proposer`: what the scheduler and engine use of a proposer (and each sequence's adaptive k).
- `ngram.NgramProposer`: prompt lookup, the sequence's last tokens found earlier in its own prompt and output.
- `suffix.SuffixProposer`: suffix decoding, the continuation most occurrences of the longest match agree on, in
  the sequence and in the tenant's recent outputs.
- `verifier.accept`: how many proposed tokens stand, given the target's own choice at each verify row.
- `stats.SpecDecodeStats`: proposals, proposed and accepted tokens, acceptance by position (`/metrics`).

The scheduler asks the proposer when it schedules a decode row (so the step's token budget and the KV blocks
count the proposed tokens); the engine samples every verify row and keeps what `accept` says, then rolls the KV
of the rejected rows back (`Scheduler.postprocess`).
"""

from __future__ import annotations

from sage_infer.config.serve import SpeculativeConfig
from sage_infer.errors import ConfigError
from sage_infer.spec_decode.base import Proposer
from sage_infer.spec_decode.ngram import NgramProposer
from sage_infer.spec_decode.stats import SpecDecodeStats
from sage_infer.spec_decode.suffix import SuffixProposer
from sage_infer.spec_decode.verifier import accept

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "SuffixProposer", "accept", "build_proposer"]


def build_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer `config` asks for; None when speculation is off or a draft model proposes (the engine builds
    that one: it is a model). A method not built yet is a ConfigError."""
    if config.method == "off":
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                             config.disable_by_batch_size, config.adaptive)
    if config.method == "suffix":
        return SuffixProposer(config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob, config.disable_by_batch_size, config.adaptive)
    if config.method == "draft_model":
        return None  # a model: built with the engine (`engine.build`, `engine.draft.DraftModelProposer`)
    raise ConfigError(f"speculative.method: {config.method} is not implemented yet; use ngram, suffix or "
                      "draft_model (or off)")
