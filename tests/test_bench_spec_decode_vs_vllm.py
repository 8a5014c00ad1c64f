"""bench/spec_decode_vs_vllm.py without vLLM: its prompts, the config it gives both engines, the sage side on the
bundled demo model, and the error without a vLLM virtualenv (the side-by-side run itself needs `make vllm-venv`)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.spec_decode_vs_vllm import COPY_TOKENS, main, ngram, run_sage, workloads
from bench.vllm_models import MODELS, prepare_model


def test_copy_prompts_repeat_the_free_prompts_first_tokens_and_are_seeded():
    every = workloads(3, 500, 100, seed=1)
    assert len(every["free"]) == 3 and all(len(p) == 100 for p in every["free"])
    assert every["copy"] == [p + p[:COPY_TOKENS] for p in every["free"]]
    assert workloads(3, 500, 100, seed=1) == every and workloads(3, 500, 100, seed=2) != every
    assert all(10 <= t < 500 for p in every["free"] for t in p)


def test_both_engines_get_vllms_ngram_config():
    assert ngram(4) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 5}


def test_the_sage_side_keeps_greedy_tokens_with_prompt_lookup(tmp_path):
    args = SimpleNamespace(dtype="fp32", kv_gib=1, max_tokens=12, repeats=1)
    model_dir = prepare_model(MODELS["demo"], tmp_path)
    jobs = [("copy b=2", workloads(2, 400, 40, seed=0)["copy"])]
    off, spec = run_sage(args, model_dir, None, jobs), run_sage(args, model_dir, ngram(2), jobs)
    assert off["copy b=2"]["tokens"] == spec["copy b=2"]["tokens"]
    assert all(len(t) == 12 for t in off["copy b=2"]["tokens"]) and off["copy b=2"]["tok_s"] > 0


def test_without_a_vllm_venv_it_says_how_to_make_one_and_exits_2(tmp_path, capsys):
    assert main(["--vllm-venv", str(tmp_path / "none")]) == 2
    assert "make vllm-venv" in capsys.readouterr().err
