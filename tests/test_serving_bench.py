"""`sage llm bench`: workloads, trace replay, statistics, SSE parsing, and runs against a live HTTP server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path

import pytest
import typer

from sage_infer.cli.errors import invoke
from sage_infer.cli.llm_bench import bench
from sage_infer.errors import UsageError
from sage_infer.serving_bench.client import RequestResult, normalize_url
from sage_infer.serving_bench.sse import SSEDecoder
from sage_infer.serving_bench.stats import PREFIX_HITS, PREFIX_QUERIES, percentile, prefix_hit_rate, summarize
from sage_infer.serving_bench.trace import block_tokens, load_mooncake_trace
from sage_infer.serving_bench.workloads import (
    FIRST_TOKEN_ID,
    multi_turn_workload,
    poisson_arrivals,
    random_workload,
    shared_prefix_workload,
)

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


# -- end to end against a stand-in server ------------------------------------------------


class StandInServer:
    """Stand-in for `sage llm serve` until it lands: streams OpenAI completions in the exact
    SSE format (text chunks, usage chunk, [DONE]), keeps a 16-token-block prefix cache and
    exports its prefix-cache counters on /metrics with prometheus_client."""

    BLOCK = 16

    def __init__(self, api_key: str = "secret") -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.api_key = api_key
        self.export_metrics = True
        self.blocks: set[tuple[int, ...]] = set()
        self.registry = CollectorRegistry()
        self.queries = Counter("sage:prefix_cache_queries", "prompt tokens looked up", registry=self.registry)
        self.hits = Counter("sage:prefix_cache_hits", "prompt tokens found", registry=self.registry)

    def lookup_and_insert(self, prompt: list[int]) -> int:
        cached, hit = 0, True
        for end in range(self.BLOCK, len(prompt) + 1, self.BLOCK):
            key = tuple(prompt[:end])
            hit = hit and key in self.blocks
            cached += self.BLOCK if hit else 0
            self.blocks.add(key)
        self.queries.inc(len(prompt))
        self.hits.inc(cached)
        return cached

    def app(self):
        from prometheus_client import generate_latest
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                                status_code=status)

        def authorized(request) -> bool:
            return request.headers.get("authorization") == f"Bearer {self.api_key}"

        async def models(request):
            if not authorized(request):
                return error(401, "invalid api key")
            return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

        async def metrics(request):
            if not self.export_metrics:
                return Response("not found", status_code=404)
            return Response(generate_latest(self.registry), media_type="text/plain")

        async def completions(request):
            if not authorized(request):
                return error(401, "invalid api key")
            body = await request.json()
            if body["model"] != "stand-in":
                return error(404, f"The model `{body['model']}` does not exist.")
            prompt, n = body["prompt"], body["max_tokens"]
            cached = self.lookup_and_insert(prompt)

            async def stream():
                for _ in range(n):
                    await asyncio.sleep(0.001)
                    yield "data: " + json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]})
                    yield "\n\n"  # a separate write, so events arrive split across chunks
                usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics),
                                 Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def stand_in():
    import uvicorn

    fake = StandInServer()
    sock = socket.socket()
    # uvicorn leaves Nagle on for sockets it is handed: without this, small SSE writes wait
    # ~40 ms for the client's delayed ACK and arrive in one burst.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("stand-in server did not start")
        threading.Event().wait(0.01)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    server.should_exit = True
    thread.join(5)


@pytest.fixture
def run_bench(capsys, monkeypatch):
    """Run the `bench` command the way `sage llm bench` will, through the CLI error handler."""
    monkeypatch.setenv("COLUMNS", "200")
    app = typer.Typer()
    app.command()(bench)
    command = typer.main.get_command(app)

    def run(*argv: str):
        capsys.readouterr()
        code = invoke(command, list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_bench_against_stand_in_server_reports_counts_tokens_and_hit_rate(stand_in, run_bench, tmp_path):
    stand_in.blocks.clear()
    stand_in.queries.inc(1000)  # traffic before the run must not count
    out = tmp_path / "run.json"
    code, stdout, _ = run_bench("--url", stand_in.url + "/v1", "--api-key", "secret", "--workload", "shared-prefix",
                                "--num-requests", "8", "--prefix-len", "64", "--input-len", "16",
                                "--output-len", "5", "--concurrency", "4", "--json", str(out))
    assert code == 0, stdout
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert data["config"]["model"] == "stand-in"
    assert (summary["requests"], summary["ok"], summary["errors"]) == (8, 8, 0)
    assert summary["total_output_tokens"] == 40 and summary["total_input_tokens"] == 8 * 80
    # one cold request, then seven that find the 64-token prefix: 7 * 64 of 8 * 80 tokens
    assert summary["prefix_hit_rate"] == pytest.approx(7 * 64 / (8 * 80))
    assert summary["mean_cached_tokens"] == pytest.approx(7 * 64 / 8)
    for record in data["requests"]:
        assert record["ttft_ms"] > 0 and len(record["itl_ms"]) == 4 and record["tpot_ms"] >= 0
        assert record["e2e_ms"] >= record["ttft_ms"]
    assert "prefix hit rate (server)" in stdout and "70.0 %" in stdout and "TTFT" in stdout


def test_multi_turn_sends_each_conversations_turns_one_after_another(stand_in, run_bench):
    stand_in.blocks.clear()
    code, stdout, _ = run_bench("--url", stand_in.url, "--api-key", "secret", "--workload", "multi-turn",
                                "--num-requests", "6", "--turns", "3", "--input-len", "16", "--output-len", "3",
                                "--concurrency", "4", "--json", "-")
    assert code == 0
    data = json.loads(stdout)
    assert data["summary"]["ok"] == 6 and data["summary"]["prefix_hit_rate"] > 0
    by_conversation: dict[int, list[dict]] = {}
    for record in data["requests"]:
        by_conversation.setdefault(record["conversation"], []).append(record)
    assert sorted(by_conversation) == [0, 1]
    for records in by_conversation.values():
        records.sort(key=lambda r: r["turn"])
        for previous, current in zip(records, records[1:]):
            assert current["start_ms"] >= previous["start_ms"] + previous["e2e_ms"]
            assert current["cached_tokens"] >= previous["prompt_tokens"] // 16 * 16


def test_finite_rate_sends_no_request_before_its_poisson_arrival(stand_in, run_bench):
    code, stdout, _ = run_bench("--url", stand_in.url, "--api-key", "secret", "-n", "5", "--rate", "50",
                                "--seed", "3", "--input-len", "8", "--output-len", "2", "--json", "-")
    assert code == 0
    starts = [r["start_ms"] for r in json.loads(stdout)["requests"]]
    for start, arrival in zip(starts, poisson_arrivals(5, 50.0, seed=3)):
        assert start >= arrival * 1000 - 1.0


def test_trace_replay_reuses_the_shared_system_block(stand_in, run_bench, trace_path):
    stand_in.blocks.clear()
    code, stdout, _ = run_bench("--url", stand_in.url, "--api-key", "secret", "--workload", "trace",
                                "--trace-file", str(trace_path), "-n", "3", "--length-scale", "0.0625",
                                "--time-scale", "0.001", "--max-input-len", "200", "--concurrency", "1",
                                "--json", "-")
    assert code == 0
    data = json.loads(stdout)
    assert data["config"]["block_tokens"] == 32 and data["config"]["rate"] == "trace"
    assert all(r["prompt_tokens"] <= 200 for r in data["requests"])
    assert [r["cached_tokens"] >= 32 for r in data["requests"]] == [False, True, True]


def test_server_without_metrics_reports_null_hit_rate(stand_in, run_bench):
    stand_in.export_metrics = False
    try:
        code, stdout, _ = run_bench("--url", stand_in.url, "--api-key", "secret", "-n", "2", "--input-len", "8",
                                    "--output-len", "2", "--json", "-")
    finally:
        stand_in.export_metrics = True
    assert code == 0
    assert json.loads(stdout)["summary"]["prefix_hit_rate"] is None


def test_openai_error_is_recorded_per_request_and_all_failing_exits_1(stand_in, run_bench, tmp_path):
    out = tmp_path / "err.json"
    code, _, err = run_bench("--url", stand_in.url, "--api-key", "secret", "--model", "nope", "-n", "3",
                             "--input-len", "8", "--output-len", "2", "--json", str(out))
    assert code == 1
    assert "all 3 requests failed" in err and "The model `nope` does not exist." in err
    data = json.loads(out.read_text())
    assert data["summary"]["errors"] == 3
    assert {r["status"] for r in data["requests"]} == {404}
    assert data["errors"] == {"HTTP 404: The model `nope` does not exist.": 3}


def test_missing_api_key_is_one_line_with_a_hint(stand_in, run_bench):
    code, _, err = run_bench("--url", stand_in.url, "-n", "1")
    assert code == 1
    assert err.count("\n") == 1 and "HTTP 401: invalid api key" in err and "--api-key" in err


def test_api_key_comes_from_sage_api_key_env(stand_in, run_bench, monkeypatch):
    monkeypatch.setenv("SAGE_API_KEY", "secret")
    code, stdout, _ = run_bench("--url", stand_in.url, "-n", "1", "--input-len", "8", "--output-len", "2",
                                "--json", "-")
    assert code == 0 and json.loads(stdout)["summary"]["ok"] == 1


def test_plot_writes_a_png(stand_in, run_bench, tmp_path):
    png = tmp_path / "lat.png"
    code, _, _ = run_bench("--url", stand_in.url, "--api-key", "secret", "-n", "4", "--input-len", "8",
                           "--output-len", "4", "--plot", str(png))
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_url_is_one_line_exit_1(run_bench):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    code, _, err = run_bench("--url", f"http://127.0.0.1:{port}", "--model", "m", "-n", "1")
    assert code == 1
    assert err.count("\n") == 1 and "cannot reach" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--workload", "zipf"], "'zipf' is not one of"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--rate", "fast"], "Invalid value for '--rate'"),
        (["--concurrency", "0"], "Invalid value for '--concurrency'"),
        (["--workload", "trace"], "--workload trace needs --trace-file"),
        (["--prefix-len", "8"], "--prefix-len does not apply to --workload random"),
        (["--workload", "trace", "--trace-file", "t.jsonl", "--rate", "2"], "--rate does not apply"),
        (["--length-scale", "0.5"], "--length-scale does not apply"),
        (["--json", "/nonexistent/dir/run.json"], "--json /nonexistent/dir/run.json: directory"),
    ],
    ids=["unknown-workload", "zero-rate", "rate-not-number", "zero-concurrency", "trace-without-file",
         "prefix-len-on-random", "rate-on-trace", "length-scale-on-random", "json-dir-missing"],
)
def test_bad_flag_is_one_line_exit_2(run_bench, argv, fragment):
    code, _, err = run_bench("--url", "http://127.0.0.1:9", *argv)
    assert code == 2
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


def test_url_without_scheme_is_exit_2(run_bench):
    code, _, err = run_bench("--url", "localhost:8000")
    assert code == 2 and "http://HOST:PORT" in err
