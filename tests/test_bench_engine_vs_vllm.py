"""bench/engine_vs_vllm.py without vLLM: the workloads, the JSON lines spoken with the vLLM
worker, the worker's job loop, and what happens when the vLLM virtualenv is missing."""

from __future__ import annotations

import io
import json

import pytest

from bench import _vllm_worker as wire
from bench.engine_vs_vllm import agreement, build_workloads, main


def test_workloads_are_the_same_token_ids_for_the_same_seed():
    assert build_workloads(4096, 4096, seed=0) == build_workloads(4096, 4096, seed=0)
    assert build_workloads(4096, 4096, seed=0)["W1"] != build_workloads(4096, 4096, seed=1)["W1"]


def test_workloads_have_the_issue_13_shapes():
    w = build_workloads(4096, 4096)
    w1, w2, w3 = w["W1"][0], w["W2"][0], w["W3"][0]
    assert (len(w1), w["W1"][1]) == (64, 128) and all(64 <= len(p) <= 512 for p in w1)
    assert (len(w2), w["W2"][1]) == (64, 32) and all(len(p) == 1024 + 32 for p in w2)
    assert len({tuple(p[:1024]) for p in w2}) == 1 and len({tuple(p[1024:]) for p in w2}) == 64
    assert (len(w3), len(w3[0]), w["W3"][1]) == (1, 128, 256)
    w4 = w["W4"][0]  # long context: the prompts and their output fill the 4,096 positions exactly
    assert (len(w4), w["W4"][1]) == (8, 32) and all(len(p) == 4096 - 32 for p in w4) and len(set(map(tuple, w4))) == 8
    assert all(5 <= t < 4096 for p in w1 + w2 + w3 + w4 for t in p)  # no special token ids


def test_short_context_workloads_fit_the_demo_models_512_positions():
    w = build_workloads(4096, 512)
    assert max(map(len, w["W1"][0])) <= 384
    assert all(len(p) == 256 + 32 for p in w["W2"][0])
    assert all(len(p) + out <= 512 for prompts, out in w.values() for p in prompts)


@pytest.mark.parametrize("message", [
    wire.LoadJob("/models/m", "float32", seed=3, llm_kwargs={"max_model_len": 4096}),
    wire.GenerateJob("W1", [[5, 6, 7], [8]], 128, reset_prefix_cache=False),
    wire.ExitJob(),
])
def test_jobs_round_trip_through_one_json_line(message):
    line = wire.encode(message)
    assert "\n" not in line
    assert wire.decode_job(line) == message


@pytest.mark.parametrize("message", [
    wire.LoadResult(load_s=40.5, vllm_version="0.32.0", torch_version="2.13.0+cpu"),
    wire.GenerateResult("W3", 1.25, [[9, 10, 11]], [0.031], num_cached_tokens=0),
    wire.ErrorResult("ValueError: bad"),
])
def test_results_round_trip_through_one_json_line(message):
    assert wire.decode_result(wire.encode(message)) == message


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op 'pickle'"):
        wire.decode_job(json.dumps({"op": "pickle"}))


def test_the_worker_answers_generate_before_load_with_an_error_and_stops_at_exit():
    jobs = io.StringIO("\n".join([wire.encode(wire.GenerateJob("W3", [[5]], 1)), wire.encode(wire.ExitJob()),
                                  wire.encode(wire.GenerateJob("never", [[5]], 1))]) + "\n")
    results = io.StringIO()
    wire.serve(jobs, results)
    lines = results.getvalue().splitlines()
    assert [wire.decode_result(line) for line in lines] == [wire.ErrorResult("RuntimeError: generate before load")]


def test_agreement_counts_identical_requests_and_the_matching_token_prefix():
    report = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 0, 8]])
    assert report == {"identical_requests": 1, "requests": 2, "token_prefix_fraction": 6 / 8}


def test_a_missing_vllm_venv_says_how_to_make_it_and_exits_2(tmp_path, capsys):
    code = main(["--vllm-venv", str(tmp_path / "no-venv"), "--workloads", "W3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "make vllm-venv" in err and "--sage-only" in err and str(tmp_path / "no-venv") in err


def test_an_unknown_workload_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--sage-only", "--workloads", "W9"])
    assert exit_info.value.code == 2
    assert "unknown workload" in capsys.readouterr().err


def test_sage_only_runs_w3_on_the_demo_model_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    assert main(["--sage-only", "--workloads", "W3", "--repeats", "1", "--kv-gib", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (w3,) = report["workloads"]
    assert w3["workload"] == "W3" and "vllm" not in w3 and "ratio_tok_s" not in w3
    assert w3["sage"]["runs"][0]["generated_tokens"] == 256
