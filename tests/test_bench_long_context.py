"""bench/long_context.py --vs-vllm: its arguments, the requests it sends both engines, the summary, ratios and memory
its JSON carries, and sage's side of a small run (no vLLM)."""

from __future__ import annotations

import os

import pytest

from bench.long_context import (
    DocQA,
    SageDocQA,
    docqa_ratios,
    docqa_requests,
    docqa_summary,
    kv_bytes_per_token,
    memory_per_token,
    parse_vs_vllm,
    peak_rss_mib,
    print_docqa,
    reset_peak_rss,
)
from tests.tiny_models import make_tiny_model


def test_the_arguments_default_to_8k_and_32k_documents_with_device_kv_holding_one():
    args = parse_vs_vllm(["--vs-vllm", "--lengths", "8192,32768", "--questions", "3"])
    assert args.lengths == [8192, 32768] and args.questions == 3 and args.documents == 2
    q = DocQA(8192)
    assert q.max_len == 8192 + 64 + 16
    assert q.device_tokens % 128 == 0 and q.max_len <= q.device_tokens < 2 * q.length


@pytest.mark.parametrize("argv", [["--lengths", "8k"], ["--documents", "1"], ["--device-frac", "0.5"],
                                  ["--lengths", "100"]])
def test_bad_arguments_exit_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_vs_vllm(["--vs-vllm", *argv])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_documents_take_turns_and_each_question_follows_its_document():
    q = DocQA(300, documents=2, questions=3, question_tokens=8)
    requests = docqa_requests(q, vocab=4096)
    assert [name for name, _ in requests] == ["d0-q0", "d1-q0", "d0-q1", "d1-q1", "d0-q2", "d1-q2"]
    assert all(len(prompt) == 308 for _, prompt in requests)
    assert requests[0][1][:300] == requests[2][1][:300] != requests[1][1][:300]
    assert requests[0][1][300:] != requests[2][1][300:]
    assert docqa_requests(q, vocab=4096) == requests  # the same ids for both engines


def test_the_summary_splits_first_questions_from_later_ones_and_ratios_are_sage_over_vllm():
    def rows(walls, ttfts, cached):
        return [{"wall_s": w, "ttft_s": t, "cached_tokens": c} for w, t, c in zip(walls, ttfts, cached)]

    sage = docqa_summary(rows([2.0, 2.0, 0.5, 0.5], [1.8, 1.8, 0.2, 0.4], [0, 0, 300, 300]), documents=2)
    vllm = docqa_summary(rows([1.0, 1.0, 1.0, 1.0], [0.9, 0.9, 0.9, 0.9], [0, 0, 128, None]), documents=2)
    assert sage["questions_per_s"] == pytest.approx(4 / 5) and vllm["questions_per_s"] == pytest.approx(1.0)
    assert sage["ttft_first_mean_s"] == pytest.approx(1.8) and sage["ttft_later_mean_s"] == pytest.approx(0.3)
    assert sage["cached_tokens_later"] == 600 and vllm["cached_tokens_later"] == 128
    ratio = docqa_ratios(sage, vllm)
    assert ratio["questions_per_s"] == pytest.approx(0.8)
    assert ratio["ttft_later_mean_s"] == pytest.approx(0.3 / 0.9)
    assert set(ratio) == {"questions_per_s", "ttft_mean_s", "ttft_median_s", "ttft_first_mean_s",
                          "ttft_later_mean_s"}


def test_vllm_max_length_defaults_to_every_length():
    assert parse_vs_vllm(["--vs-vllm"]).vllm_max_length is None
    assert parse_vs_vllm(["--vs-vllm", "--vllm-max-length", "65536"]).vllm_max_length == 65536


def test_memory_per_token_counts_the_device_pool_and_the_tiers_over_the_documents():
    q = DocQA(1000, documents=2)
    memory = {"device_kv_bytes": 3000, "tiers": {"host": {"bytes": 5000, "capacity_bytes": 9000, "tokens": 80}},
              "peak_rss_mib": 1.0}
    per_token = memory_per_token(memory, q)
    assert per_token["document_tokens"] == 2000 and per_token["kv_bytes"] == 8000
    assert per_token["kv_bytes_per_token"] == pytest.approx(4.0)
    assert per_token["kv_allocated_bytes"] == 12000 and per_token["kv_allocated_bytes_per_token"] == pytest.approx(6.0)
    assert per_token["peak_rss_bytes_per_token"] == pytest.approx(2**20 / 2000)
    assert memory_per_token({"device_kv_bytes": 3000, "peak_rss_mib": 1.0}, q)["kv_bytes"] == 3000


def test_peak_rss_reads_this_process_and_grows_with_an_allocation():
    import ctypes
    import mmap

    reset_peak_rss()
    before = peak_rss_mib()
    # fresh pages from the kernel, then touched: resident. (A bytearray may reuse freed heap memory that is resident
    # already, after an engine in this process kept its freed buffers: `hal.malloc.keep_freed_buffers`.)
    block = mmap.mmap(-1, 64 << 20)
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(block)), 1, len(block))
    assert peak_rss_mib() >= before + 48 and block[-1] == 1
    assert peak_rss_mib(os.getpid(), tree=True) >= peak_rss_mib()


def test_sage_serves_later_questions_from_its_host_tier_and_reports_its_memory(tmp_path, capsys):
    """A small document QA run of sage alone: each later question loads its document back from the host tier
    (the other document pushed it out of the device pool), the answers match a run without tiers' help
    (the first questions, computed cold), and the memory report counts the host tier's blocks."""
    model_dir = make_tiny_model(tmp_path / "model", "qwen3", vocab_size=512, max_position_embeddings=512)
    q = DocQA(256, questions=2, question_tokens=8, answer_tokens=3, budget=64)
    requests = docqa_requests(q, vocab=512)
    sage = SageDocQA(model_dir, q)
    try:
        rows = [sage.ask(name, prompt) for name, prompt in requests]
        memory = sage.memory()
    finally:
        sage.close()
    assert [r["cached_tokens"] for r in rows[:2]] == [0, 0]
    assert all(r["cached_tokens"] >= 240 for r in rows[2:])  # the whole document's full blocks, from the host
    assert all(len(r["tokens"]) == 3 and r["wall_s"] >= r["ttft_s"] > 0 and r["tier_wait_s"] >= 0 for r in rows)
    per_token = kv_bytes_per_token(model_dir)
    host = memory["tiers"]["host"]
    assert host["tokens"] + memory["device_tokens_held"] >= 2 * 256  # both documents kept, one tier or the other
    assert host["tokens"] > 0 and host["bytes"] == host["tokens"] * per_token
    assert memory["device_kv_bytes"] == q.device_tokens * per_token and memory["peak_rss_mib"] > 0
    result = {"device_kv_bytes": memory["device_kv_bytes"], "kv_bytes_per_token": per_token,
              "sage": {"summary": docqa_summary(rows, q.documents), "memory": memory,
                       "per_token": memory_per_token(memory, q)}}
    print_docqa(q.length, q, result)
    out = capsys.readouterr().out
    assert "vLLM not run" in out and "B per document token" in out
