"""The scheduler on its own: admission order, token budget, chunking, preemption, post-step bookkeeping.

No model runs here: a step is `schedule()`, then `postprocess()` with the token each
sequence whose chunk reached its end would have sampled.
"""

from __future__ import annotations

import time
from itertools import count

import pytest

from sage_infer.config.serve import SchedulerConfig
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence, SequenceStatus
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from sage_infer.scheduler import scheduler as scheduler_module
from sage_infer.scheduler.scheduler import ScheduledBatch, Scheduler

BS = 4
EOS = 2
KEY = b"test"
_ids = count()


def make_scheduler(num_blocks: int = 64, max_model_len: int = 1024, **config) -> Scheduler:
    manager = BlockManager(num_blocks, BS, PrefixReuseIndex(BS))
    return Scheduler(SchedulerConfig(**config), KVCacheManager(manager), max_model_len, eos_token_ids=[EOS])


def make_seq(prompt: list[int], *, priority: int = 0, arrival: float | None = None, request_id: str | None = None,
             index: int = 0, **params) -> Sequence:
    seq_id = next(_ids)
    params.setdefault("max_tokens", 4)
    return Sequence(seq_id, request_id or f"r{seq_id}", index, list(prompt), len(prompt), SamplingParams(**params),
                    KEY, priority=priority, arrival_time=float(seq_id) if arrival is None else arrival)


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def step(scheduler: Scheduler, token: int = 7) -> ScheduledBatch:
    """Schedule, then sample `token` for every sequence whose chunk reached its last token."""
    batch = scheduler.schedule()
    sampled = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    scheduler.postprocess(batch)
    for seq in sampled:
        scheduler.append_token(seq, token)
    scheduler.end_step()
    return batch


def test_fifo_admits_in_arrival_order():
    scheduler = make_scheduler(max_num_seqs=2)
    late, early, middle = make_seq(prompt(3), arrival=3.0), make_seq(prompt(3), arrival=1.0), make_seq(prompt(3),
                                                                                                      arrival=2.0)
    for seq in (late, early, middle):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == [early, middle]


def test_priority_strategy_serves_lower_values_first_then_arrival():
    scheduler = make_scheduler(strategy="priority", max_num_seqs=2)
    first = make_seq(prompt(3), priority=5, arrival=1.0)
    urgent = make_seq(prompt(3), priority=0, arrival=3.0)
    second = make_seq(prompt(3), priority=5, arrival=2.0)
    for seq in (first, urgent, second):
        scheduler.add(seq)
    assert scheduler.schedule().seqs == [urgent, first]


def _cache(scheduler: Scheduler, tokens: list[int]) -> None:
    """Run `tokens` as a prompt to the end (one sampled token): its full blocks stay in the prefix cache."""
    seq = make_seq(tokens, max_tokens=1)
    scheduler.add(seq)
    while not seq.is_finished:
        step(scheduler)


@pytest.mark.parametrize("strategy", ["fifo", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first_and_fifo_the_earliest(strategy):
    scheduler = make_scheduler(strategy=strategy, max_num_seqs=1, lpm_max_wait_s=600)
    history = prompt(13, start=100)  # a conversation's previous turn: 3 full blocks cached
    _cache(scheduler, history)
    now = time.monotonic()
    new = make_seq(prompt(9, start=300), arrival=now)  # a new conversation, nothing cached, came first
    short = make_seq(history[:5] + prompt(4, start=400), arrival=now + 1)  # one block cached
    turn = make_seq(history + prompt(4, start=200), arrival=now + 2)  # the next turn: 12 tokens cached
    for seq in (new, short, turn):
        scheduler.add(seq)
    order = []
    while scheduler.waiting:
        batch = step(scheduler)
        order += [s for s, n in zip(batch.seqs, batch.num_new_tokens) if n > 1]
        for seq in list(scheduler.running):
            scheduler.finish(seq, "stop")
    assert order == ([new, short, turn] if strategy == "fifo" else [turn, short, new])
    assert turn.num_cached_tokens == 12
    scheduler.kv.block_manager.check_invariants()


def test_lpm_keeps_arrival_order_among_equal_matches_and_in_a_long_queue(monkeypatch):
    scheduler = make_scheduler(strategy="lpm", max_num_seqs=1, lpm_max_wait_s=600)
    _cache(scheduler, prompt(9, start=100))
    now = time.monotonic()
    first, second = make_seq(prompt(6, start=300), arrival=now), make_seq(prompt(6, start=500), arrival=now + 1)
    hit = make_seq(prompt(9, start=100) + [5], arrival=now + 2)
    for seq in (first, second, hit):
        scheduler.add(seq)
    assert scheduler._admission_order() == [hit, first, second]
    monkeypatch.setattr(scheduler_module, "LPM_MAX_QUEUE", 2)  # past the cut-off: arrival order
    assert scheduler._admission_order() == [first, second, hit]


def test_lpm_admits_a_request_that_waited_lpm_max_wait_s_before_the_longest_prefix():
    scheduler = make_scheduler(strategy="lpm", max_num_seqs=1, lpm_max_wait_s=5.0)
    _cache(scheduler, prompt(9, start=100))
    now = time.monotonic()
    old = make_seq(prompt(6, start=300), arrival=now - 6)  # waited past the bound
    older = make_seq(prompt(6, start=500), arrival=now - 7)
    fresh = make_seq(prompt(6, start=700), arrival=now)
    hit = make_seq(prompt(9, start=100) + [5], arrival=now)
    for seq in (old, older, fresh, hit):
        scheduler.add(seq)
    assert scheduler._admission_order() == [older, old, hit, fresh]
    scheduler.config = scheduler.config.model_copy(update={"lpm_max_wait_s": 0.0})  # 0: arrival order
    assert scheduler._admission_order() == [older, old, fresh, hit]


def test_fifo_ignores_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    first, urgent = make_seq(prompt(3), priority=9, arrival=1.0), make_seq(prompt(3), priority=0, arrival=2.0)
    scheduler.add(first)
    scheduler.add(urgent)
    assert scheduler.schedule().seqs == [first]


def test_chunked_prefill_splits_a_long_prompt_across_steps_under_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(prompt(40))
    scheduler.add(seq)
    chunks = [step(scheduler).num_new_tokens for _ in range(3)]
    assert chunks == [[16], [16], [8]]
    assert seq.num_computed_tokens == 40 and seq.num_output_tokens == 1


def test_long_prefill_token_threshold_lets_a_short_prompt_share_the_long_ones_steps():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=12)
    long, long2, short = make_seq(prompt(40)), make_seq(prompt(40, start=200)), make_seq(prompt(8, start=100))
    scheduler.add(long)
    first = step(scheduler)
    assert first.num_new_tokens == [40]  # alone: nobody to leave room for, the whole budget (vLLM's rule)
    scheduler.add(long2)
    scheduler.add(short)
    second = step(scheduler)
    # the running decode, then the long prompt cut to 12 and the short one whole in the same step
    assert second.seqs == [long, long2, short] and second.num_new_tokens == [1, 12, 8]
    assert short.num_output_tokens == 1 and long2.num_output_tokens == 0
    batches = [step(scheduler) for _ in range(3)]
    assert [b.num_new_tokens[b.seqs.index(long2)] for b in batches] == [12, 12, 4]
    assert long2.num_computed_tokens == 40 and long2.num_output_tokens == 1


def test_short_prefill_first_holds_a_long_prompt_back_for_a_step_with_a_short_one():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=12, short_prefill_first=True)
    decode, long = make_seq(prompt(8, start=300), max_tokens=8), make_seq(prompt(40))
    scheduler.add(decode)
    step(scheduler)
    scheduler.add(long)
    assert step(scheduler).num_new_tokens == [1, 12]  # no short prompt: the long one's chunk, cut to the threshold
    short = make_seq(prompt(8, start=100))
    scheduler.add(short)
    held = step(scheduler)
    # the decode and the short prompt whole; the long one's prefill waits a step
    assert held.seqs == [decode, short] and held.num_new_tokens == [1, 8] and long.num_computed_tokens == 12
    assert short.num_output_tokens == 1
    again = make_seq(prompt(8, start=200))
    scheduler.add(again)
    # held back at most one step in a row: now it shares the step with the next short prompt
    assert step(scheduler).num_new_tokens == [1, 12, 1, 8] and long.num_computed_tokens == 24


def test_short_prefill_first_counts_a_cached_prefix_and_holds_long_admissions_too():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=12, short_prefill_first=True)
    history = prompt(32)
    first = make_seq(history + [5])
    scheduler.add(first)
    step(scheduler)
    scheduler.finish(first, "stop")
    new, turn = make_seq(prompt(40, start=200)), make_seq(history + prompt(8, start=400))
    scheduler.add(new)
    scheduler.add(turn)  # 40 tokens, 32 of them cached: 8 to compute, short
    batch = step(scheduler)
    assert batch.seqs == [turn] and batch.num_new_tokens == [8] and scheduler.waiting == [new]
    assert step(scheduler).seqs == [turn, new]


def test_short_prefill_first_needs_the_threshold():
    scheduler = make_scheduler(max_num_batched_tokens=64, short_prefill_first=True)
    long, short = make_seq(prompt(40)), make_seq(prompt(8, start=100))
    scheduler.add(long)
    scheduler.add(short)
    assert scheduler.schedule().num_new_tokens == [40, 8]


def test_without_chunked_prefill_the_long_prefill_threshold_cuts_nothing():
    scheduler = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False, long_prefill_token_threshold=8)
    first, second = make_seq(prompt(20)), make_seq(prompt(20, start=100))
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.schedule().num_new_tokens == [20, 20]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_the_rest_of_the_budget_waits():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    short, long = make_seq(prompt(10)), make_seq(prompt(12, start=100))
    scheduler.add(short)
    scheduler.add(long)
    first = scheduler.schedule()
    assert first.seqs == [short] and first.num_new_tokens == [10]  # 12 more would exceed 16
    assert scheduler.waiting == [long] and long.block_table == []


def test_without_chunked_prefill_a_prompt_longer_than_the_budget_runs_alone_whole():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    seq = make_seq(prompt(40))
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [40]


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(prompt(3, start=10 * i)) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule().seqs == seqs[:2]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2


def test_a_short_pool_preempts_the_last_running_sequence_by_recompute():
    # 4 blocks of 4 tokens: two 7-token prompts take 2 blocks each; the first decode step needs a third
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    first, second = make_seq(prompt(7), max_tokens=8), make_seq(prompt(7, start=50), max_tokens=8)
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)  # both prefill 7 tokens and sample one
    step(scheduler)  # both decode token 8: 2 full blocks each, the pool is full
    batch = step(scheduler)  # token 9 needs a 3rd block each: only one can have it
    assert batch.preempted == [second]
    assert batch.seqs == [first]
    assert second.status is SequenceStatus.WAITING and second.block_table == []
    assert second.num_computed_tokens == 0 and second.num_preemptions == 1
    scheduler.kv.block_manager.check_invariants()


def test_a_request_that_must_wait_is_not_counted_or_touched_again_each_step():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    runner, blocked = make_seq(prompt(12), max_tokens=3), make_seq(prompt(12, start=50))
    scheduler.add(runner)
    step(scheduler)  # runner holds 3 of the 4 blocks, then a 4th for its decode
    scheduler.add(blocked)  # needs 3 blocks: waits until runner finishes
    metrics = scheduler.kv.index.metrics
    waited = 0
    while not blocked.admitted_once:
        step(scheduler)
        waited += not blocked.admitted_once
    assert waited >= 1
    # each prompt counted once (2 full blocks each may be looked up), however many steps it waited
    assert (metrics.queries, metrics.query_tokens) == (2, 16)


def test_postprocess_registers_full_blocks_so_the_next_request_hits_them():
    scheduler = make_scheduler()
    first = make_seq(prompt(9), max_tokens=1)
    scheduler.add(first)
    step(scheduler)
    assert first.is_finished and first.finish_reason == "length"
    again = make_seq(prompt(9))
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached_tokens == 8  # two full blocks of 4, one token left to compute


def test_stop_token_finishes_and_frees_the_sequence():
    scheduler = make_scheduler()
    seq = make_seq(prompt(5), stop_token_ids=[7], max_tokens=10)
    scheduler.add(seq)
    step(scheduler, token=7)
    assert seq.finish_reason == "stop" and seq.stop_reason == 7
    assert seq.block_table == [] and scheduler.kv.block_manager.num_used_blocks == 0


def test_eos_finishes_unless_ignored():
    scheduler = make_scheduler()
    stops, ignores = make_seq(prompt(5), max_tokens=3), make_seq(prompt(5, start=40), max_tokens=3, ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(ignores)
    step(scheduler, token=EOS)
    assert stops.finish_reason == "stop" and stops.stop_reason is None
    assert not ignores.is_finished


def test_max_tokens_ends_with_length():
    scheduler = make_scheduler()
    seq = make_seq(prompt(5), max_tokens=2)
    scheduler.add(seq)
    step(scheduler)
    assert not seq.is_finished
    step(scheduler)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 2


def test_a_sequence_ends_with_length_at_the_context_limit():
    scheduler = make_scheduler(max_model_len=16)
    seq = make_seq(prompt(14), max_tokens=None)
    scheduler.add(seq)
    for _ in range(4):
        step(scheduler)
    assert seq.finish_reason == "length" and seq.num_tokens == 16


def test_siblings_of_an_n_request_start_after_the_first_sampled_and_reuse_its_prompt_blocks():
    scheduler = make_scheduler()
    seqs = [make_seq(prompt(9), request_id="req", index=i, n=3, max_tokens=2) for i in range(3)]
    scheduler.add_request(seqs)
    first = scheduler.schedule()
    assert first.seqs == [seqs[0]]
    scheduler.postprocess(first)
    scheduler.append_token(seqs[0], 7)
    batch = scheduler.schedule()
    assert batch.seqs[1:] == seqs[1:]
    assert [s.num_cached_tokens for s in seqs[1:]] == [8, 8]


def test_finishing_a_waiting_sibling_removes_it():
    scheduler = make_scheduler()
    seqs = [make_seq(prompt(9), request_id="req", index=i, n=2) for i in range(2)]
    scheduler.add_request(seqs)
    for seq in seqs:
        scheduler.finish(seq, "abort")
    assert not scheduler.has_unfinished()
    step(scheduler)
    assert all(s.finish_reason == "abort" for s in seqs)
    assert scheduler.kv.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_keeps_block_invariants(chunked):
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=16, enable_chunked_prefill=chunked)
    for i in range(12):
        scheduler.add(make_seq(prompt(3 + (i * 5) % 13, start=(i % 3) * 20), max_tokens=1 + i % 4))
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
        scheduler.kv.block_manager.check_invariants()
    assert not scheduler.has_unfinished()
    assert scheduler.kv.block_manager.num_used_blocks == 0
