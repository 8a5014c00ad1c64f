"""`probe_prefill`: time a few prefill steps when an engine with KV tiers starts, before a request needs them.

Load-or-compute (`kv_policy.load_or_compute`) prices a prompt's blocks with a line fitted through the prefill steps
it has seen, ``seconds = fixed + work x marginal``: loading blocks saves their marginal part only, and the fixed part
(the layers' launches, the step's host work) is paid by the loaded prompt's own step too. Fitted from real steps
alone, the first requests find no line (it needs steps of several sizes) or one bent by a cold first step (a kernel
compiled, memory touched for the first time), and price blocks at the average rate: on a GPU running eagerly, where
16 and 1,024 prompt tokens cost about the same step, that loaded short prompts slower than computing them.

So the engine times prefill steps of doubling size once at start: 16 tokens, 32, ... up to one chunked-prefill step's
budget, until a step takes `PROBE_STEP_S` (or the steps `PROBE_TOTAL_S` in all). The prompts are random tokens in
blocks taken from the free list and given back unregistered: nothing is cached, nothing reaches the tiers. A first
step of the smallest size warms up and is not counted; a short step runs three times, the fastest counted. A step
far slower than the one before it for twice the work runs again, the faster counted: a new size can compile a kernel
on first use (a GPU took 713 ms for 32 tokens after 29 ms for 16), and one cold step counted unscreened would set the
line's fixed part. Real steps then move the line as the engine runs.
"""

from __future__ import annotations

import random
import time

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.engine.model_runner import ModelRunner
from sage_infer.kv_policy.load_or_compute import OUTLIER, LoadOrCompute
from sage_infer.kv_runtime.block_manager import BlockManager

FIRST_TOKENS = 16
PROBE_STEP_S = 0.25  # a step this long already shows the slope; longer ones would only delay the start
PROBE_TOTAL_S = 2.0
SHORT_REPEATS = 3  # a step under half `PROBE_STEP_S` runs this many times, the fastest counted
COLD = 2 * OUTLIER  # a step slower than this times the one before it (twice the work) runs again


def probe_prefill(runner: ModelRunner, blocks: BlockManager, rates: LoadOrCompute, max_tokens: int,
                  vocab_size: int) -> list[tuple[int, float]]:
    """Time prefill steps of 16, 32, ... tokens (at most `max_tokens`, and what the free blocks hold) into
    `rates`; returns (tokens, seconds) of the steps counted."""
    draw = random.Random(0)  # (not the process's generator: a seeded request's samples stay its own)

    def prompt(tokens: int) -> list[int]:
        return [draw.randrange(vocab_size) for _ in range(tokens)]

    timed: list[tuple[int, float]] = []
    if FIRST_TOKENS > max_tokens or _step(runner, blocks, prompt(FIRST_TOKENS)) is None:  # warms up, not counted
        return timed
    tokens, spent = FIRST_TOKENS, 0.0
    while tokens <= max_tokens and spent < PROBE_TOTAL_S:
        token_ids = prompt(tokens)
        seconds = _step(runner, blocks, token_ids)
        if seconds is None:
            break  # the free blocks do not hold it
        spent += seconds
        if timed and seconds > COLD * timed[-1][1]:  # cold (a kernel compiled for this size): once more, warm
            again = _step(runner, blocks, token_ids)
            spent += again
            seconds = min(seconds, again)
        for _ in range(SHORT_REPEATS - 1 if seconds < PROBE_STEP_S / 2 else 0):  # one step's noise would tilt the line
            again = _step(runner, blocks, token_ids)
            spent += again
            seconds = min(seconds, again)
        rates.observe_prefill([(tokens, 0)], seconds, screen=False)  # (warm, the fastest of its runs: no outlier)
        timed.append((tokens, seconds))
        if seconds >= PROBE_STEP_S:
            break
        tokens *= 2
    rates.probed = tuple(timed)
    return timed


def _step(runner: ModelRunner, blocks: BlockManager, token_ids: list[int]) -> float | None:
    """One prefill step of `token_ids` in blocks from the free list, timed until its token is on the host."""
    count = -(-len(token_ids) // blocks.block_size)
    if count > blocks.num_free_blocks:
        return None
    seq = Sequence(seq_id=-1, request_id="sage-prefill-probe", index=0, token_ids=token_ids,
                   num_prompt_tokens=len(token_ids), params=SamplingParams(max_tokens=1), extra_key=b"")
    seq.block_table = blocks.allocate(count)
    try:
        started = time.perf_counter()
        logits, _ = runner.run([seq], [len(token_ids)])
        int(logits[-1].argmax())  # on a GPU the forward runs after its launch returns
        return time.perf_counter() - started
    finally:
        blocks.unallocate(seq.block_table)


def describe(rates: LoadOrCompute) -> str:
    """The start-up line: each step the probe timed (`rates.probed`), and the line fitted through them (or why
    none)."""
    timed = rates.probed
    if not timed:
        return (f"prefill steps timed at start: none (the free blocks or the context hold fewer than {FIRST_TOKENS} "
                f"tokens); prices come from the requests' steps")
    steps = ", ".join(f"{tokens} tokens {seconds * 1e3:.1f} ms" for tokens, seconds in timed)
    line = rates.steps.line()
    if line is None:
        return f"prefill steps timed at start: {steps}; too few sizes for a line yet (the requests' steps add more)"
    if not line[1]:
        return f"prefill steps timed at start: {steps}; a step costs {line[0] * 1e3:.2f} ms whatever its size"
    unit = "GFLOP/s" if rates.shape is not None else "G tokens/s"
    return (f"prefill steps timed at start: {steps}; a step costs {line[0] * 1e3:.2f} ms + its work at "
            f"{1 / line[1] / 1e9:.1f} {unit}")
