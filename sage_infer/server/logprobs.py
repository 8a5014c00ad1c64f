"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (per-token objects)."""

from __future__ import annotations


class LogprobFormatter:
    """`entries` are the engine's per-token ``(logprob, [(token_id, logprob), ...])``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, entries: list, token_ids: list[int], offset: int) -> dict:
        tokens = [self.token_text(t) for t in token_ids]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{self.token_text(t): v for t, v in top} for _, top in entries],
            "text_offset": offsets,
        }

    def chat(self, entries: list, token_ids: list[int]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                            for t, (lp, top) in zip(token_ids, entries)]}
