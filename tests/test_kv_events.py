"""Block events a prefill worker publishes for a router (GET /v1/kv/events)."""

from __future__ import annotations

from sage_infer.kv_policy import make_policy
from sage_infer.prefix_reuse.events import BlockEvents, short
from sage_infer.prefix_reuse.index import PrefixReuseIndex


def test_the_index_logs_stored_and_removed_blocks_in_order():
    index = PrefixReuseIndex(2, make_policy("lru", capacity=8))
    events = index.enable_events()
    h0, _ = index.insert(0, None, [1, 2], b"k")
    h1, _ = index.insert(1, h0, [3, 4], b"k")
    index.remove(1)
    batch = events.since(0)
    assert (batch.next, batch.reset) == (3, False)
    assert batch.events == [f"+{short(h0)}", f"+{short(h1)}", f"-{short(h1)}"]
    assert events.since(3).events == [] and events.since(2).events == [f"-{short(h1)}"]


def test_a_reader_too_far_behind_gets_the_whole_current_set():
    held = {b"a" * 32, b"b" * 32}
    events = BlockEvents(lambda: held, capacity=2)
    for key in (b"x" * 32, b"y" * 32, b"z" * 32):
        events.stored(key)
    batch = events.since(0)  # event 0 fell out of the 2-event log
    assert batch.reset and sorted(batch.events) == sorted(f"+{short(k)}" for k in held) and batch.next == 3
    assert events.since(-1).reset and events.since(99).reset
