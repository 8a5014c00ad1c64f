"""bench/long_context.py --vs-vllm without running an engine: its arguments, the requests it sends both engines,
and the summary and ratios its JSON carries."""

from __future__ import annotations

import pytest

from bench.long_context import DocQA, docqa_ratios, docqa_requests, docqa_summary, parse_vs_vllm


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
