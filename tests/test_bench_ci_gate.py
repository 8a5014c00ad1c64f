"""bench/ci_gate.py's verdicts and tolerances, and its deliberate slowdowns (the measuring runs in
`make bench-gate-ci`, never in the tests)."""

from __future__ import annotations

import time

import pytest

from bench.ci_gate import conversation_slice, floors_for, judge, spread
from bench.gate_slowdown import _slower, apply_slowdown
from sage_infer.sim.replay import TraceRequest

CI = {"floors": {"engine.random": 2.0, "tiers.host.get": 0.4, "prefix.hit": 0.75},
      "tolerances": {"engine.random": 0.2, "tiers.host.get": 0.25, "prefix.hit": 0.02}}


def verdicts(measured: dict[str, float]) -> dict[str, str]:
    return {row["ratio"]: row["verdict"] for row in judge(measured, CI)}


def test_a_ratio_more_than_its_tolerance_below_its_floor_fails():
    got = verdicts({"engine.random": 1.59, "tiers.host.get": 0.31, "prefix.hit": 0.7349})
    assert got == {"engine.random": "BELOW", "tiers.host.get": "ok", "prefix.hit": "BELOW"}


def test_a_ratio_within_its_tolerance_passes():
    assert verdicts({"engine.random": 1.61, "tiers.host.get": 0.4, "prefix.hit": 0.736})["engine.random"] == "ok"


def test_on_another_machine_only_a_drop_past_half_the_floor_fails():
    measured = {"engine.random": 1.2, "tiers.host.get": 0.19, "prefix.hit": 0.5}
    got = {row["ratio"]: row["verdict"] for row in judge(measured, CI, same_machine=False)}
    assert got == {"engine.random": "ok", "tiers.host.get": "BELOW", "prefix.hit": "ok"}


def test_each_machine_is_judged_by_its_own_floors_else_by_its_cpu_models_else_the_first():
    xeon = {"cpu": "Intel Xeon", "isa": "avx512_bf16", "cores": 2}
    epyc = {"cpu": "AMD EPYC", "isa": "avx512_bf16", "cores": 2}
    ci = {**CI, "machine": xeon, "machines": [{"machine": epyc, "floors": {"tiers.host.get": 0.15}}]}
    assert floors_for(ci, xeon) == (ci, True)
    assert floors_for(ci, epyc) == (ci["machines"][0], True)
    assert floors_for(ci, {**epyc, "isa": "avx2"}) == (ci["machines"][0], False)  # the same CPU model, another level
    assert floors_for(ci, {**xeon, "cpu": "Ampere Altra"}) == (ci, False)


def test_an_unmeasured_ratio_is_skipped_and_a_new_one_is_not_checked():
    got = verdicts({"engine.random": 2.0, "tiers.host.get": 0.4, "engine.new": 0.01})
    assert got["prefix.hit"] == "skipped (not measured)"
    assert got["engine.new"] == "no floor (not checked)"


def test_the_tolerance_is_one_and_a_half_times_the_worst_drop_below_the_median_with_a_minimum():
    runs = [{"engine.random": v, "prefix.hit": 0.75} for v in (2.0, 1.8, 2.1, 2.2, 2.0)]
    result = spread(runs)
    assert result["engine.random"]["median"] == 2.0
    assert result["engine.random"]["tolerance"] == 0.15  # (2.0 - 1.8) / 2.0 x 1.5
    assert result["prefix.hit"]["tolerance"] == 0.04  # no spread at all: its minimum


def test_the_trace_slice_is_every_turn_of_the_first_conversations_with_enough_turns():
    rows = [[0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 5], [0, 1, 3, 6], [0], [0, 5, 7], [0, 2, 4, 8]]
    requests = [TraceRequest(i, 0, 0, ids) for i, ids in enumerate(rows)]
    picked = conversation_slice(requests, conversations=1, min_turns=3)
    assert [r.hash_ids for r in picked] == [[0, 1], [0, 1, 3], [0, 1, 3, 6]]
    assert len(conversation_slice(requests, conversations=5, min_turns=3)) == 6  # conversations 1 and 2, not 5


def test_a_slowed_path_takes_one_plus_factor_times_as_long():
    def work() -> str:
        time.sleep(0.05)
        return "done"

    start = time.perf_counter()
    assert _slower(work, 1.0)() == "done"
    assert time.perf_counter() - start >= 0.1


@pytest.mark.parametrize("spec", ["kernels", "engine:fast"])
def test_an_unknown_slowdown_is_refused_before_patching_anything(spec):
    with pytest.raises(SystemExit, match="SAGE_GATE_SLOW"):
        apply_slowdown(spec)


def test_the_evict_slowdown_makes_every_eviction_walk_past_the_held_blocks_again(monkeypatch):
    """`SAGE_GATE_SLOW=evict` undoes what `prefix.evict` guards: no policy hears of holds (restored after)."""
    from bench.eviction_cost import KEY, filled
    from sage_infer.kv_policy import POLICIES

    for cls in POLICIES.values():
        monkeypatch.setattr(cls, "on_use", cls.on_use)  # (so the patch below is undone)
    assert apply_slowdown("evict") == "EvictionPolicy.on_use: holds not told"
    manager = filled("lru", 640, 0.1)
    asked = []
    victim = POLICIES["lru"].victim
    monkeypatch.setattr(POLICIES["lru"], "victim",
                        lambda self, evictable: victim(self, lambda key: asked.append(key) or evictable(key)))
    manager.allocate(1, KEY)
    assert len(asked) > 500  # past the nine held chains' 576 blocks
