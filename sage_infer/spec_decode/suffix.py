"""Suffix decoding (Oliaro et al., SuffixDecoding; vLLM's `suffix` method): propose the continuation that most
often followed the longest match of the sequence's last tokens, in the sequence itself and in the outputs of
the tenant's recent requests.

Two corpora are searched at every proposal:

- the sequence's own prompt and output (as prompt lookup does, but every earlier occurrence of the match votes);
- the outputs of the last `max_cached_requests` finished requests of the same tenant (the prefix-cache key:
  model and `cache_salt`), so an agent that calls the same tool, or a chat that answers a FAQ again, gets its
  earlier answer proposed. One tenant's requests never reach another's proposals.

A match is the longest suffix of the sequence (at most `max_tree_depth` tokens, at least `ANCHOR`) that occurs
in the corpus; its occurrences form the node of a suffix tree, walked without building one: at each step the
next token that most of the node's occurrences agree on is proposed, while its share of them stays at least
`min_token_prob`; the occurrences that disagree leave the node. The proposal is at most
``ceil(max_spec_factor x match length)`` tokens (a short match earns a short guess) and the corpus whose
proposal has the higher expected accepted length (the sum of the running products of those shares) wins.

Each corpus indexes its `ANCHOR`-token windows to the positions after them (one entry per token), and a match
is extended backwards by comparing tokens from the latest `MAX_CANDIDATES` occurrences of its anchor, so the
memory is linear in the tokens kept and a proposal costs at most MAX_CANDIDATES x (depth + k) comparisons.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence

from sage_infer.spec_decode.base import Proposer

ANCHOR = 2  # the shortest match: windows of this many tokens are indexed
MAX_CANDIDATES = 64  # occurrences of the anchor examined per proposal, the latest first
SEPARATOR = -1  # between two requests' outputs in a tenant's corpus: no match or continuation crosses it
COMPACT_AFTER = 1 << 16  # a tenant's corpus drops its evicted tokens once this many have piled up


class _Corpus:
    """Tokens and, for each ANCHOR-token window, the positions right after it (oldest first)."""

    __slots__ = ("tokens", "after", "upto", "base")

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens = tokens if tokens is not None else []
        self.after: dict[tuple[int, ...], list[int]] = {}
        self.upto = ANCHOR  # positions below this are indexed
        self.base = 0  # positions below this belong to evicted requests

    def index(self, end: int) -> None:
        """Index the windows that end before position `end` (each followed by a token in the corpus)."""
        tokens, after = self.tokens, self.after
        for p in range(self.upto, end):
            window = tuple(tokens[p - ANCHOR:p])
            if SEPARATOR in window or tokens[p] == SEPARATOR:
                continue
            after.setdefault(window, []).append(p)
        self.upto = max(self.upto, end)

    def propose(self, context: Sequence[int], limit: int, depth: int, factor: float,
                min_prob: float) -> tuple[list[int], float]:
        """(tokens, expected accepted length) to follow `context` from this corpus; ([], 0) without a match."""
        if len(context) < ANCHOR or limit <= 0:
            return [], 0.0
        positions = self.after.get(tuple(context[-ANCHOR:]))
        if not positions:
            return [], 0.0
        tokens, n = self.tokens, len(context)
        best, node = 0, []
        for p in reversed(positions[-MAX_CANDIDATES:]):
            if p < self.base:
                break
            m = ANCHOR  # extend the match backwards
            while m < depth and m < n and p - m - 1 >= self.base and tokens[p - m - 1] == context[n - m - 1] \
                    and tokens[p - m - 1] != SEPARATOR:
                m += 1
            if m > best:
                best, node = m, [p]
            elif m == best:
                node.append(p)
        limit = min(limit, depth, math.ceil(factor * best))
        out: list[int] = []
        score, share = 0.0, 1.0
        end = len(tokens)
        # the sequence's own corpus: an occurrence that reaches its end goes on reading what was proposed (an
        # overlapping copy), so in a loop of period p the latest occurrence does not cap the proposal at p tokens
        overlap = tokens is context

        def at(p: int) -> int:
            return tokens[p] if p < end else out[p - end] if overlap else SEPARATOR

        while node and len(out) < limit:
            votes = Counter(t for t in map(at, node) if t != SEPARATOR)  # latest first on ties
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            share *= count / len(node)
            if count / len(node) < min_prob:
                break
            out.append(token)
            score += share
            node = [p + 1 for p in node if at(p) == token]
        return out, score


class SuffixProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 disable_by_batch_size: int | None = None, adaptive: bool = False) -> None:
        if max_tree_depth < ANCHOR:
            raise ValueError(f"suffix decoding needs max_tree_depth >= {ANCHOR}, got {max_tree_depth}")
        super().__init__(num_speculative_tokens, disable_by_batch_size, adaptive)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._own: dict[int, _Corpus] = {}  # seq id -> its prompt and output
        self._tenants: dict[bytes, _Corpus] = {}  # tenant -> recent requests' outputs
        self._spans: dict[bytes, deque[tuple[int, int]]] = {}  # tenant -> (start, end) of each kept output

    def propose(self, seq_id: int, token_ids: list[int], limit: int, tenant: bytes = b"") -> list[int]:
        limit = self.limit(seq_id, limit)
        if limit <= 0:
            return []
        own = self._own.get(seq_id)
        if own is None or own.tokens is not token_ids:
            own = self._own[seq_id] = _Corpus(token_ids)
        own.index(len(token_ids))  # (the last window has no token after it yet: it is the one looked up)
        args = (limit, self.max_tree_depth, self.max_spec_factor, self.min_token_prob)
        mine, mine_score = own.propose(token_ids, *args)
        shared = self._tenants.get(tenant)
        if shared is None:
            return mine
        theirs, their_score = shared.propose(token_ids, *args)
        return theirs if their_score > mine_score else mine

    def forget(self, seq_id: int, tenant: bytes = b"", output: Sequence[int] = ()) -> None:
        """Drop the sequence's own corpus; keep its output for the tenant's later requests."""
        super().forget(seq_id)
        self._own.pop(seq_id, None)
        if self.max_cached_requests <= 0 or len(output) < ANCHOR + 1:
            return
        corpus = self._tenants.setdefault(tenant, _Corpus())
        spans = self._spans.setdefault(tenant, deque())
        start = len(corpus.tokens)
        corpus.tokens.extend(output)
        corpus.tokens.append(SEPARATOR)
        corpus.upto = max(corpus.upto, start + ANCHOR)
        corpus.index(len(corpus.tokens))
        spans.append((start, len(corpus.tokens)))
        while len(spans) > self.max_cached_requests:
            corpus.base = spans.popleft()[1]
        if corpus.base >= COMPACT_AFTER and corpus.base * 2 >= len(corpus.tokens):
            self._compact(tenant)

    def _compact(self, tenant: bytes) -> None:
        """Rebuild a tenant's corpus from the outputs it still keeps (their positions shift to the start)."""
        old = self._tenants[tenant]
        corpus = _Corpus(old.tokens[old.base:])
        corpus.index(len(corpus.tokens))
        self._tenants[tenant] = corpus
        self._spans[tenant] = deque((a - old.base, b - old.base) for a, b in self._spans[tenant])
