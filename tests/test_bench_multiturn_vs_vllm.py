"""bench/multiturn_vs_vllm.py without running a server: configurations with settings after `+`, the command
lines they start, goodput over loads, and the errors for a bad --configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.multiturn_vs_vllm import agreement, goodput, parse_args, ratios, search_goodput, server_for, split_config


def test_a_configs_settings_after_plus_become_sages_set_flags(tmp_path):
    assert split_config("sage-host") == ("sage-host", [])
    assert split_config("sage-host+policy.eviction=sage+tiers.write_policy=write_back") == (
        "sage-host", ["policy.eviction=sage", "tiers.write_policy=write_back"])
    args = parse_args(["--configs", "sage-host+policy.eviction=sage", "--dtype", "fp32"])
    server = server_for(args.configs[0], args, Path("/models/m"), 1 << 20, 1 << 24, 1024, tmp_path)
    command = server.command
    assert command[command.index("--kv-tiers") + 1] == "host=1GiB"
    assert command[command.index("--set") + 1] == "policy.eviction=sage"
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(1 << 20)
    assert server.name == "sage-host+policy.eviction=sage"


@pytest.mark.parametrize(("configs", "message"), [
    ("sage-hots", "unknown"),
    ("vllm+policy.eviction=sage", "vLLM takes none"),
    ("sage+policy.eviction", "KEY=VALUE"),
])
def test_a_bad_configs_list_is_refused_with_exit_2(configs, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--configs", configs])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_goodput_is_the_highest_load_below_the_first_that_missed_the_slo():
    def row(rate, p90, errors=0):
        return {"rate": rate, "errors": errors, "ttft_ms": {"p90": p90}}

    assert goodput([row(2, 2500), row(0.5, 300), row(1, 1900)], 2000) == 1
    assert goodput([row(0.5, 300), row(1, 100, errors=1), row(2, 100)], 2000) == 0.5  # a failed request ends it
    assert goodput([row(0.5, 2100)], 2000) is None


def _row(rate, p90, errors=0):
    return {"rate": rate, "errors": errors, "ttft_ms": {"p90": p90}, "request_throughput": 1.0}


def test_the_goodput_search_bisects_the_bracket_the_listed_loads_leave():
    def measure(rate):  # a server whose p90 crosses 2 s at 1.3 sessions/s
        return _row(rate, 1000 + 1000 * rate / 1.3 - 1e-9 if rate <= 1.3 else 2500)

    found, tried = search_goodput(measure, [_row(0.5, 900), _row(1, 1700), _row(2, 2600)], 2000, 4)
    assert [r["rate"] for r in tried] == [1.5, 1.25, 1.38, 1.31]
    assert found == 1.25
    # every listed load met it: double until one fails, then bisect
    found, tried = search_goodput(measure, [_row(0.25, 500), _row(0.5, 900)], 2000, 3)
    assert [r["rate"] for r in tried] == [1.0, 2.0, 1.5] and found == 1.0
    # none met it: halve the lowest
    found, tried = search_goodput(measure, [_row(2, 2600)], 2000, 2)
    assert [r["rate"] for r in tried] == [1.0, 1.5] and found == 1.0
    assert search_goodput(measure, [_row(2, 2600)], 2000, 0) == (None, [])


def test_ttft_ratios_are_taken_at_vllms_highest_sustainable_load_or_say_it_had_none():
    def config(goodput_, *rows):
        loads = [{"rate": rate, "ttft_ms": {"p50": p50, "p90": p90}} for rate, p50, p90 in rows]
        return {"goodput": goodput_, "loads": loads}

    sage = config(0.2, (0.05, 500, 1000), (0.1, 600, 1500), (0.2, 900, 2000))
    out = ratios({"configs": {"vllm": config(0.05, (0.05, 1000, 4000), (0.1, 3000, 12000)), "sage-host": sage}})
    assert out["goodput sage-host / vllm"] == 4.0
    assert out["TTFT p50 sage-host / vllm at 0.05/s"] == 0.5 and out["TTFT p90 sage-host / vllm at 0.05/s"] == 0.25
    out = ratios({"configs": {"vllm": config(None, (0.05, 3000, 12000), (0.1, 5000, 20000)), "sage-host": sage}})
    assert out["TTFT p50 sage-host / vllm at 0.05/s (vLLM missed the SLO there)"] == pytest.approx(1 / 6)
    assert not any(key.startswith("goodput") for key in out)


def test_greedy_agreement_counts_equal_texts_of_requests_both_finished_on_the_same_seed():
    def run(seed, digests):
        return {"seed": seed, "text_digests": digests}

    runs = {"sage": {1.0: [run(1, ["a", "b", "c"])], 2.0: [run(2, ["d", "e"])]},
            "sage-host": {1.0: [run(1, ["a", "x", None])], 2.0: [run(2, ["d", "e"])]},
            "vllm": {1.0: [run(1, ["a", "b", "c"])], 2.0: [run(3, ["d", "e"])]}}  # another seed: not compared
    assert agreement(runs, "sage") == {"sage-host": [3, 4], "vllm": [3, 3]}
