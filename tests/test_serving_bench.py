"""`sage llm bench`: workloads, trace replay, statistics, SSE parsing, and runs against the real server."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest

from sage_infer.errors import UsageError
from sage_infer.serving_bench.client import RequestResult, _ChunkTimer, normalize_url, scrape_prefix_counters
from sage_infer.serving_bench.sse import SSEDecoder
from sage_infer.serving_bench.stats import (
    PREFIX_HITS,
    PREFIX_LOWER_HITS,
    PREFIX_QUERIES,
    percentile,
    prefix_hit_rate,
    summarize,
)
from sage_infer.serving_bench.trace import block_tokens, load_mooncake_trace
from sage_infer.serving_bench.workloads import (
    FIRST_TOKEN_ID,
    agent_workload,
    multi_turn_workload,
    poisson_arrivals,
    random_workload,
    shared_prefix_workload,
)
from tests.server_fixture import running_server
from tests.tiny_models import make_tiny_model

MOONCAKE = Path("/work/shared/traces/mooncake/conversation_trace.jsonl")


def prompts(workload):
    return [r.prompt_ids() for turns in workload.conversations for r in turns]


# -- workloads ---------------------------------------------------------------------------


def test_random_prompts_have_planned_lengths_and_ids_in_vocab():
    load = random_workload(50, input_len=40, output_len=7, vocab_size=64, seed=1)
    requests = [r for turns in load.conversations for r in turns]
    assert len(requests) == 50
    for request, ids in zip(requests, prompts(load)):
        assert 20 <= request.input_len <= 40 and len(ids) == request.input_len
        assert all(FIRST_TOKEN_ID <= i < 64 for i in ids)
        assert request.output_len == 7
    assert len({r.input_len for r in requests}) > 1


def test_workloads_are_deterministic_per_seed():
    assert prompts(random_workload(5, 30, 4, 512, seed=3)) == prompts(random_workload(5, 30, 4, 512, seed=3))
    assert prompts(random_workload(5, 30, 4, 512, seed=3)) != prompts(random_workload(5, 30, 4, 512, seed=4))
    assert prompts(multi_turn_workload(6, 3, 8, 4, 512, seed=3)) == prompts(multi_turn_workload(6, 3, 8, 4, 512, 3))


def test_shared_prefix_prompts_share_exactly_the_prefix():
    ids = prompts(shared_prefix_workload(6, prefix_len=32, input_len=10, output_len=4, vocab_size=512, seed=0))
    assert all(len(p) == 42 for p in ids)
    assert len({tuple(p[:32]) for p in ids}) == 1
    assert len({tuple(p[32:]) for p in ids}) == 6


def test_multi_turn_prompts_extend_the_previous_turn():
    load = multi_turn_workload(7, turns=3, input_len=8, output_len=5, vocab_size=512, seed=0)
    assert [len(turns) for turns in load.conversations] == [3, 3, 1]
    for turns in load.conversations:
        ids = [r.prompt_ids() for r in turns]
        for k, prompt in enumerate(ids):
            assert len(prompt) == (k + 1) * 8 + k * 5
            if k:
                assert prompt[: len(ids[k - 1])] == ids[k - 1]
    first_turns = [turns[0].prompt_ids() for turns in load.conversations]
    assert len({tuple(p) for p in first_turns}) == 3


def test_multi_turn_conversations_share_the_system_prompt_and_keep_their_own_context():
    load = multi_turn_workload(6, turns=2, input_len=8, output_len=5, vocab_size=512, seed=0, system_len=32,
                               context_len=20)
    firsts = [turns[0].prompt_ids() for turns in load.conversations]
    assert all(len(p) == 32 + 20 + 8 for p in firsts)
    assert len({tuple(p[:32]) for p in firsts}) == 1  # the system prompt: shared
    assert len({tuple(p[32:52]) for p in firsts}) == 3  # the user context: each its own
    second = load.conversations[0][1].prompt_ids()
    assert len(second) == 60 + 5 + 8 and second[:60] == firsts[0]
    assert load.info == {"turns": 2, "system_len": 32, "context_len": 20}


def test_agent_sessions_share_the_tools_and_grow_by_short_steps():
    load = agent_workload(10, steps=4, tools_len=64, task_len=16, observation_len=6, output_len=3, vocab_size=512,
                          seed=1)
    assert [len(steps) for steps in load.conversations] == [4, 4, 2]
    for steps in load.conversations:
        ids = [r.prompt_ids() for r in steps]
        assert [len(p) for p in ids] == [80 + k * (3 + 6) for k in range(len(ids))]
        for previous, current in zip(ids, ids[1:]):
            assert current[: len(previous)] == previous
    assert len({tuple(steps[0].prompt_ids()[:64]) for steps in load.conversations}) == 1
    assert len({tuple(steps[0].prompt_ids()[64:]) for steps in load.conversations}) == 3


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    times = poisson_arrivals(4000, rate=20.0, seed=7)
    assert times == poisson_arrivals(4000, rate=20.0, seed=7)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 20.0, rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    assert poisson_arrivals(5, rate=float("inf"), seed=0) == [0.0] * 5


# -- Mooncake trace ----------------------------------------------------------------------

SAMPLE_ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 700, "output_length": 40, "hash_ids": [0, 3]},
    {"timestamp": 1000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 2, 4]},
]


@pytest.fixture
def trace_path(tmp_path) -> Path:
    """The real Mooncake conversation trace when it is on this machine, else a 3-row sample."""
    if MOONCAKE.exists():
        return MOONCAKE
    path = tmp_path / "sample.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in SAMPLE_ROWS))
    return path


def _rows(path: Path, n: int) -> list[dict]:
    with path.open() as handle:
        return [json.loads(next(handle)) for _ in range(n)]


def test_trace_requests_sharing_a_hash_id_share_that_blocks_tokens(trace_path):
    n = 3 if trace_path != MOONCAKE else 300
    load = load_mooncake_trace(trace_path, n, length_scale=1 / 32)  # 16-token blocks
    rows, ids = _rows(trace_path, n), prompts(load)
    tokens_of: dict[int, list[int]] = {}
    shared = 0
    for row, prompt in zip(rows, ids):
        for k, hash_id in enumerate(row["hash_ids"]):
            block = prompt[16 * k: 16 * (k + 1)]
            if len(block) < 16:  # the last, partial block
                continue
            if hash_id in tokens_of:
                assert block == tokens_of[hash_id]
                shared += 1
            tokens_of[hash_id] = block
    assert shared > 0
    distinct = {tuple(b) for b in tokens_of.values()}
    assert len(distinct) == len(tokens_of)


def test_trace_lengths_scale_with_block_size_and_clip(trace_path):
    rows = _rows(trace_path, 3)
    load = load_mooncake_trace(trace_path, 3, length_scale=0.25, max_input_len=1000)
    assert block_tokens(0.25) == 128
    for row, turns in zip(rows, load.conversations):
        request = turns[0]
        assert request.input_len == min(1000, round(row["input_length"] * 0.25))
        assert len(request.prompt_ids()) == request.input_len
        assert request.output_len == round(row["output_length"] * 0.25)


def test_trace_arrivals_are_timestamps_times_time_scale(trace_path):
    rows = _rows(trace_path, 3)
    load = load_mooncake_trace(trace_path, 3, time_scale=0.5)
    assert load.arrivals_s == [(r["timestamp"] - rows[0]["timestamp"]) / 1000 * 0.5 for r in rows]


def test_trace_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SAMPLE_ROWS[0]) + "\n\n" + '{"timestamp": 5, "input_length": 10\n')
    with pytest.raises(UsageError, match=rf"{path}:3: not valid JSON"):
        load_mooncake_trace(path, 10)


def test_trace_row_whose_hash_ids_do_not_cover_the_prompt_is_rejected(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}))
    with pytest.raises(UsageError, match=rf"{path}:1: 2 hash_ids cover 1024 tokens"):
        load_mooncake_trace(path, 1)


def test_missing_trace_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="--trace-file .*nope.jsonl"):
        load_mooncake_trace(tmp_path / "nope.jsonl", 1)


# -- statistics --------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    values = list(range(10, 0, -1))  # 1..10, unsorted
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([4.0], 99) == 4.0
    assert percentile([], 50) is None


def test_prefix_hit_rate_is_delta_hits_over_delta_queries():
    before = {PREFIX_QUERIES: 100.0, PREFIX_HITS: 10.0}
    assert prefix_hit_rate(before, {PREFIX_QUERIES: 300.0, PREFIX_HITS: 110.0}) == 0.5
    assert prefix_hit_rate(before, before) is None
    assert prefix_hit_rate({}, {PREFIX_QUERIES: 1.0, PREFIX_HITS: 1.0}) is None
    lower = {PREFIX_QUERIES: 300.0, PREFIX_HITS: 110.0, PREFIX_LOWER_HITS: 50.0}
    assert prefix_hit_rate({**before, PREFIX_LOWER_HITS: 0.0}, lower, PREFIX_LOWER_HITS) == 0.25


def test_the_chunk_timer_keeps_the_streamed_text():
    result = RequestResult(0, 0, 0, 4, 3)
    timer = _ChunkTimer(result, 0.0)
    assert not timer.take(['{"choices": [{"text": "he"}]}', '{"choices": [{"text": ""}]}'], 0.25)
    assert timer.take(['{"choices": [{"text": "llo"}]}', "[DONE]"], 0.5)
    assert result.text == "hello" and result.ttft_s == 0.25 and result.itl_s == [0.25]


def test_tpot_excludes_the_first_token():
    result = RequestResult(0, 0, 0, 8, 10, ttft_s=0.1, e2e_s=1.0, output_tokens=10)
    assert result.tpot_s == pytest.approx(0.1)
    assert RequestResult(0, 0, 0, 8, 1, ttft_s=0.1, e2e_s=0.1, output_tokens=1).tpot_s is None


def test_summary_counts_errors_but_measures_only_successes():
    ok = [RequestResult(i, i, 0, 10, 5, ttft_s=0.01 * (i + 1), e2e_s=0.5, itl_s=[0.1, 0.2], output_tokens=5,
                        prompt_tokens=10, cached_tokens=4 * i) for i in range(3)]
    failed = RequestResult(3, 3, 0, 10, 5, ttft_s=9.0, e2e_s=9.0, output_tokens=0, status=400, error="HTTP 400: no")
    summary = summarize([*ok, failed], duration_s=2.0, before={}, after={})
    assert (summary["requests"], summary["ok"], summary["errors"]) == (4, 3, 1)
    assert summary["request_throughput"] == 1.5
    assert summary["output_throughput"] == 7.5
    assert summary["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(150.0)
    assert summary["mean_cached_tokens"] == 4.0
    assert summary["prefix_hit_rate"] is None


# -- SSE parsing -------------------------------------------------------------------------

STREAM = (
    'data: {"choices": [{"text": "Hel"}]}\n\n'
    'data: {"choices": [{"text": "lo \u00e9"}]}\r\n\r\n'
    ": keep-alive comment\n\n"
    'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    "data: [DONE]\n\n"
).encode()


def test_sse_decoder_yields_each_event_data():
    events = SSEDecoder().feed(STREAM)
    assert [json.loads(e) for e in events[:3]] == [
        {"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo \u00e9"}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    ]
    assert events[3] == "[DONE]"


@pytest.mark.parametrize("size", [1, 3, 7, 40])
def test_sse_decoder_reassembles_events_split_mid_line(size):
    decoder = SSEDecoder()
    events = []
    for start in range(0, len(STREAM), size):  # size 1 also splits the two-byte "\u00e9"
        events.extend(decoder.feed(STREAM[start: start + size]))
    assert events == SSEDecoder().feed(STREAM)


def test_sse_decoder_flushes_a_final_event_without_blank_line():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DO") == []
    assert decoder.close() == ["[DO"]


def test_url_is_normalized_to_the_server_root():
    assert normalize_url("http://h:8000/v1/") == "http://h:8000"
    with pytest.raises(UsageError, match="http://HOST:PORT"):
        normalize_url("h:8000")


def test_scraped_metrics_without_prefix_counters_give_no_hit_rate():
    """A server that exports other metrics but no sage:prefix_cache_* counters (vLLM, say):
    the scrape finds nothing and the hit rate is null rather than a made-up 0."""
    text = ("# HELP vllm:num_requests_running Running requests.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 0.0\n')

    async def scrape(status: int, body: str) -> dict[str, float]:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://metrics.invalid") as client:
            return await scrape_prefix_counters(client)

    assert asyncio.run(scrape(200, text)) == {}
    assert asyncio.run(scrape(404, "not found")) == {}
    assert asyncio.run(scrape(200, "not { prometheus")) == {}
    assert summarize([], 1.0, before={}, after={})["prefix_hit_rate"] is None


# -- end to end against the real server ---------------------------------------------------

API_KEY = "bench-secret"
BLOCK = 16  # the server's KV block size (KVPoolConfig default)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    with running_server(model_dir, api_key=API_KEY) as running:
        yield running


def expected_cached(prompt_ids: list[list[int]]) -> list[int]:
    """Cached tokens the server reports when these prompts are sent one after another: the
    full blocks shared with an earlier prompt, leaving at least one token to compute."""
    out = []
    for k, ids in enumerate(prompt_ids):
        best = 0
        for earlier in prompt_ids[:k]:
            common = next((i for i, (a, b) in enumerate(zip(ids, earlier)) if a != b), min(len(ids), len(earlier)))
            best = max(best, common)
        out.append(min(best // BLOCK, (len(ids) - 1) // BLOCK) * BLOCK)
    return out


def bench_json(sage, *argv: str) -> dict:
    result = sage("llm", "bench", *argv, "--json", "-")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_shared_prefix_reports_counts_tokens_and_the_servers_hit_rate(server, sage, tmp_path):
    # traffic before the run, hits included, must not count towards the run's hit rate
    for _ in range(2):
        httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": list(range(300, 340)),
                                                         "max_tokens": 1}).raise_for_status()
    out = tmp_path / "run.json"
    result = sage("llm", "bench", "--url", server.url + "/v1", "--workload", "shared-prefix", "--seed", "11",
                  "--num-requests", "8", "--prefix-len", "64", "--input-len", "16", "--output-len", "5",
                  "--concurrency", "1", "--json", str(out))
    assert result.code == 0, result.err
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert data["config"]["model"] == server.model == "tiny-llama"
    assert (summary["requests"], summary["ok"], summary["errors"]) == (8, 8, 0)
    assert summary["total_output_tokens"] == 8 * 5 and summary["total_input_tokens"] == 8 * 80
    # the server looks up the 4 full blocks of each 80-token prompt; all but the first find the 64-token prefix
    assert (summary["prefix_cache_queries"], summary["prefix_cache_hits"]) == (8 * 64, 7 * 64)
    assert summary["prefix_hit_rate"] == pytest.approx(7 / 8)
    assert summary["mean_cached_tokens"] == pytest.approx(7 * 64 / 8)
    records = sorted(data["requests"], key=lambda r: r["start_ms"])
    assert [r["cached_tokens"] for r in records] == [0] + [64] * 7
    for record in records:
        assert (record["status"], record["error"]) == (200, None)
        assert record["prompt_tokens"] == 80 and record["output_tokens"] == 5
        assert record["ttft_ms"] > 0 and record["e2e_ms"] >= record["ttft_ms"] and record["tpot_ms"] >= 0
        assert 1 <= len(record["itl_ms"]) <= 4
    assert "prefix hit rate (server)" in result.out and "87.5 %" in result.out and "TTFT" in result.out


def test_multi_turn_sends_each_conversations_turns_one_after_another(server, sage):
    data = bench_json(sage, "--url", server.url, "--workload", "multi-turn", "--seed", "12", "--num-requests", "9",
                      "--turns", "3", "--input-len", "16", "--output-len", "3", "--concurrency", "4")
    assert data["summary"]["ok"] == 9 and data["summary"]["prefix_hit_rate"] > 0
    by_conversation: dict[int, list[dict]] = {}
    for record in data["requests"]:
        by_conversation.setdefault(record["conversation"], []).append(record)
    assert sorted(by_conversation) == [0, 1, 2]
    for records in by_conversation.values():
        records.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in records] == [0, 1, 2]
        assert [r["prompt_tokens"] for r in records] == [16, 35, 54]
        assert records[0]["cached_tokens"] == 0
        for previous, current in zip(records, records[1:]):
            assert current["start_ms"] >= previous["start_ms"] + previous["e2e_ms"]
            # the previous prompt's full blocks; its answer was generated, not the placeholder tokens
            assert current["cached_tokens"] == previous["prompt_tokens"] // BLOCK * BLOCK
    starts = sorted(r["start_ms"] for records in by_conversation.values() for r in records if r["turn"] == 0)
    assert starts[-1] < min(r["start_ms"] + r["e2e_ms"] for r in data["requests"])  # conversations overlap


def test_agent_sessions_against_the_server_report_ttft_and_reuse_by_step(server, sage):
    data = bench_json(sage, "--url", server.url, "--workload", "agent", "--seed", "5", "--num-requests", "8",
                      "--turns", "4", "--prefix-len", "64", "--context-len", "16", "--input-len", "8",
                      "--output-len", "3", "--concurrency", "2")
    summary = data["summary"]
    assert summary["ok"] == 8 and [t["turn"] for t in summary["by_turn"]] == [0, 1, 2, 3]
    assert [t["requests"] for t in summary["by_turn"]] == [2, 2, 2, 2]
    assert [t["mean_prompt_tokens"] for t in summary["by_turn"]] == [80, 91, 102, 113]
    later = summary["by_turn"][1:]
    assert all(t["cached_token_fraction"] > 0.5 for t in later)  # each step finds the trajectory before it
    assert all(t["ttft_ms"]["p50"] is not None for t in summary["by_turn"])
    assert data["config"]["workload"] == "agent" and data["config"]["prefix_len"] == 64


def test_finite_rate_sends_no_request_before_its_poisson_arrival(server, sage):
    data = bench_json(sage, "--url", server.url, "-n", "8", "--rate", "50", "--seed", "3", "--input-len", "8",
                      "--output-len", "2")
    assert data["config"]["rate"] == 50.0 and data["summary"]["ok"] == 8
    starts = [r["start_ms"] for r in sorted(data["requests"], key=lambda r: r["index"])]
    arrivals = poisson_arrivals(8, 50.0, seed=3)
    assert arrivals[-1] > 0.05  # the arrivals really are spread out
    for start, arrival in zip(starts, arrivals):
        assert start >= arrival * 1000 - 1.0


TRACE_ROWS = [  # Mooncake format; hash id 0 is the system prompt every request starts with
    {"timestamp": 0, "input_length": 1500, "output_length": 64, "hash_ids": [0, 1, 2]},
    {"timestamp": 40, "input_length": 700, "output_length": 48, "hash_ids": [0, 3]},
    {"timestamp": 90, "input_length": 2000, "output_length": 32, "hash_ids": [0, 1, 2, 4]},
    {"timestamp": 150, "input_length": 900, "output_length": 64, "hash_ids": [0, 5]},
    {"timestamp": 210, "input_length": 1200, "output_length": 16, "hash_ids": [0, 6, 7]},
    {"timestamp": 260, "input_length": 600, "output_length": 48, "hash_ids": [0, 3]},
    {"timestamp": 330, "input_length": 1800, "output_length": 64, "hash_ids": [0, 8, 9, 10]},
    {"timestamp": 400, "input_length": 1024, "output_length": 32, "hash_ids": [0, 1]},
]


def test_trace_replay_reuses_the_shared_system_block(server, sage, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TRACE_ROWS))
    data = bench_json(sage, "--url", server.url, "--workload", "trace", "--trace-file", str(path), "-n", "8",
                      "--length-scale", "0.0625", "--time-scale", "0.1", "--max-input-len", "100",
                      "--concurrency", "1")
    assert data["config"]["block_tokens"] == 32 and data["config"]["rate"] == "trace"
    records = sorted(data["requests"], key=lambda r: r["index"])
    assert data["summary"]["ok"] == 8
    ids = prompts(load_mooncake_trace(path, 8, length_scale=0.0625, max_input_len=100))
    assert [r["prompt_tokens"] for r in records] == [len(p) for p in ids] == [94, 44, 100, 56, 75, 38, 100, 64]
    cached = [r["cached_tokens"] for r in records]
    assert cached == expected_cached(ids)
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:])  # every later request finds the system block
    queried = sum((len(p) - 1) // BLOCK * BLOCK for p in ids)
    assert data["summary"]["prefix_hit_rate"] == pytest.approx(sum(cached) / queried)
    assert data["summary"]["prefix_hit_rate"] > 0


def test_openai_error_is_recorded_per_request_and_all_failing_exits_1(server, sage, tmp_path):
    out = tmp_path / "err.json"
    result = sage("llm", "bench", "--url", server.url, "--model", "no-such-model", "-n", "8", "--input-len", "8",
                  "--output-len", "2", "--json", str(out))
    message = "The model `no-such-model` does not exist (this server serves `tiny-llama`)."
    assert result.code == 1
    assert result.err.count("\n") == 1 and "all 8 requests failed" in result.err and message in result.err
    data = json.loads(out.read_text())
    assert (data["summary"]["ok"], data["summary"]["errors"]) == (0, 8)
    assert {r["status"] for r in data["requests"]} == {404}
    assert data["errors"] == {f"HTTP 404: {message}": 8}


def test_missing_api_key_is_one_line_with_a_hint(keyed_server, sage):
    result = sage("llm", "bench", "--url", keyed_server.url, "-n", "1")
    assert result.code == 1
    assert result.err.count("\n") == 1 and "Traceback" not in result.err
    assert "HTTP 401: missing or invalid API key" in result.err and "--api-key" in result.err


def test_wrong_api_key_fails_every_request(keyed_server, sage):
    result = sage("llm", "bench", "--url", keyed_server.url, "--api-key", "wrong", "--model", keyed_server.model,
                  "-n", "2", "--input-len", "8", "--output-len", "2")
    assert result.code == 1 and "all 2 requests failed" in result.err and "HTTP 401" in result.err


def test_api_key_comes_from_sage_api_key_env(keyed_server, sage, monkeypatch):
    monkeypatch.setenv("SAGE_API_KEY", API_KEY)
    data = bench_json(sage, "--url", keyed_server.url, "-n", "8", "--input-len", "40", "--output-len", "2")
    assert data["config"]["model"] == keyed_server.model and data["summary"]["ok"] == 8
    assert data["summary"]["prefix_hit_rate"] == 0.0  # independent random prompts share no block


def test_plot_writes_a_png(server, sage, tmp_path):
    png = tmp_path / "lat.png"
    result = sage("llm", "bench", "--url", server.url, "-n", "8", "--input-len", "8", "--output-len", "4",
                  "--plot", str(png))
    assert result.code == 0, result.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_url_is_one_line_exit_1(sage):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    result = sage("llm", "bench", "--url", f"http://127.0.0.1:{port}", "--model", "m", "-n", "1")
    assert result.code == 1
    assert result.err.count("\n") == 1 and "cannot reach" in result.err and "Traceback" not in result.err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--workload", "zipf"], "'zipf' is not one of"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--rate", "fast"], "Invalid value for '--rate'"),
        (["--concurrency", "0"], "Invalid value for '--concurrency'"),
        (["--workload", "trace"], "--workload trace needs --trace-file"),
        (["--prefix-len", "8"], "--prefix-len does not apply to --workload random"),
        (["--context-len", "8", "--workload", "shared-prefix"], "--context-len does not apply"),
        (["--workload", "trace", "--trace-file", "t.jsonl", "--rate", "2"], "--rate does not apply"),
        (["--length-scale", "0.5"], "--length-scale does not apply"),
        (["--json", "/nonexistent/dir/run.json"], "--json /nonexistent/dir/run.json: directory"),
    ],
    ids=["unknown-workload", "zero-rate", "rate-not-number", "zero-concurrency", "trace-without-file",
         "prefix-len-on-random", "context-len-on-shared-prefix", "rate-on-trace", "length-scale-on-random",
         "json-dir-missing"],
)
def test_bad_flag_is_one_line_exit_2(sage, argv, fragment):
    result = sage("llm", "bench", "--url", "http://127.0.0.1:9", *argv)
    assert result.code == 2
    assert result.err.count("\n") == 1 and fragment in result.err and "Traceback" not in result.err


def test_url_without_scheme_is_exit_2(sage):
    result = sage("llm", "bench", "--url", "localhost:8000")
    assert result.code == 2 and "http://HOST:PORT" in result.err
