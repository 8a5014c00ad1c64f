"""Synthetic workloads: token-id prompts of exact length, grouped into conversations.

Prompts are lists of token ids, not text, so the server sees exactly the lengths we
planned and two prompts share a prefix exactly when their id lists do. Ids are drawn
uniformly from ``[FIRST_TOKEN_ID, vocab_size)``, skipping the low ids where tokenizers
keep their special tokens (pad, bos, eos, unk).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

FIRST_TOKEN_ID = 10


@dataclass(slots=True)
class BenchRequest:
    """One completion request.

    The prompt is kept as a list of token segments that several requests may share (a
    common prefix, a trace block), and is only concatenated when sent, so a long trace
    replay does not hold one copy of every shared block per request.
    """

    segments: list[list[int]]
    input_len: int  # prompt length sent: the segments concatenated, cut to this length
    output_len: int  # max_tokens (sent with ignore_eos, so also the expected output length)
    conversation: int = 0
    turn: int = 0

    def prompt_ids(self) -> list[int]:
        ids: list[int] = []
        for segment in self.segments:
            ids.extend(segment)
            if len(ids) >= self.input_len:
                break
        assert len(ids) >= self.input_len, "segments shorter than input_len"
        return ids[: self.input_len]


@dataclass(slots=True)
class Workload:
    """Requests grouped into conversations.

    The turns of one conversation are sent one after another; conversations run
    concurrently. ``arrivals_s`` holds each conversation's start time (seconds from the
    start of the run) when the workload brings its own (a trace), else None and the
    arrival process picked by ``--rate`` decides.
    """

    name: str
    conversations: list[list[BenchRequest]]
    arrivals_s: list[float] | None = None
    info: dict[str, object] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.conversations)


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return rng.choices(range(FIRST_TOKEN_ID, vocab_size), k=n)


def random_workload(num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> Workload:
    """Independent prompts, lengths uniform in ``[input_len // 2, input_len]``."""
    rng = random.Random(seed)
    conversations = []
    for i in range(num_requests):
        n = rng.randint(max(1, input_len // 2), input_len)
        conversations.append([BenchRequest([random_token_ids(rng, n, vocab_size)], n, output_len, conversation=i)])
    return Workload("random", conversations)


def shared_prefix_workload(
    num_requests: int, prefix_len: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> Workload:
    """One ``prefix_len``-token prefix shared by every request, then ``input_len`` tokens of its own.

    Suffix lengths are exact so the reusable fraction is known in advance:
    ``prefix_len / (prefix_len + input_len)`` of every prompt after the first.
    """
    rng = random.Random(seed)
    prefix = random_token_ids(rng, prefix_len, vocab_size)
    conversations = [
        [BenchRequest([prefix, random_token_ids(rng, input_len, vocab_size)], prefix_len + input_len, output_len,
                      conversation=i)]
        for i in range(num_requests)
    ]
    return Workload("shared-prefix", conversations, info={"prefix_len": prefix_len})


def multi_turn_workload(
    num_requests: int, turns: int, input_len: int, output_len: int, vocab_size: int, seed: int,
    system_len: int = 0, context_len: int = 0,
) -> Workload:
    """Conversations of ``turns`` turns (the last one shorter if ``turns`` does not divide the count).

    Turn 0's prompt is a ``system_len``-token system prompt every conversation shares, then
    ``context_len`` tokens of this user's own context (a document, a profile), then ``input_len``
    tokens of question. Turn k's prompt is turn k-1's prompt, then ``output_len`` placeholder
    tokens standing in for the previous answer, then ``input_len`` new user tokens. The server
    generates its own answer, so only the previous *prompt* is reusable, as with a client that
    re-tokenizes the answer text differently.
    """
    rng = random.Random(seed)
    system = random_token_ids(rng, system_len, vocab_size) if system_len else []
    conversations = []
    for c in range(math.ceil(num_requests / turns)):
        segments: list[list[int]] = [part for part in (system, random_token_ids(rng, context_len, vocab_size)) if part]
        conversation = []
        for turn in range(min(turns, num_requests - c * turns)):
            if turn:
                segments = segments + [random_token_ids(rng, output_len, vocab_size)]
            segments = segments + [random_token_ids(rng, input_len, vocab_size)]
            length = sum(len(s) for s in segments)
            conversation.append(BenchRequest(segments, length, output_len, conversation=c, turn=turn))
        conversations.append(conversation)
    return Workload("multi-turn", conversations,
                    info={"turns": turns, "system_len": system_len, "context_len": context_len})


def agent_workload(
    num_requests: int, steps: int, tools_len: int, task_len: int, observation_len: int, output_len: int,
    vocab_size: int, seed: int,
) -> Workload:
    """Agent sessions of ``steps`` steps (the last one shorter if ``steps`` does not divide the count).

    Every session starts with the same ``tools_len``-token prefix (the agent's instructions and tool
    definitions), then ``task_len`` tokens of its own task. Each step sends the whole trajectory so far
    and asks for the next action (``output_len`` tokens); the next step appends that action (as
    placeholder tokens) and the tool's ``observation_len``-token result. So prompts are long and grow
    by short steps, and all but the newest few hundred tokens were seen by the previous step.
    """
    rng = random.Random(seed)
    tools = random_token_ids(rng, tools_len, vocab_size) if tools_len else []
    sessions = []
    for s in range(math.ceil(num_requests / steps)):
        segments = [part for part in (tools, random_token_ids(rng, task_len, vocab_size)) if part]
        session = []
        for step in range(min(steps, num_requests - s * steps)):
            if step:
                segments = segments + [random_token_ids(rng, output_len, vocab_size),
                                       random_token_ids(rng, observation_len, vocab_size)]
            length = sum(len(part) for part in segments)
            session.append(BenchRequest(segments, length, output_len, conversation=s, turn=step))
        sessions.append(session)
    return Workload("agent", sessions, info={"steps": steps, "tools_len": tools_len, "task_len": task_len,
                                              "observation_len": observation_len})


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s) of `n` arrivals: exponential gaps with mean ``1/rate``; all 0 if rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times
