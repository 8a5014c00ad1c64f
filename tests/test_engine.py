"""Engine behaviour beyond greedy equivalence: tenants, failures that stay local,
stopping rules, seeds, n>1, priorities, aborts, and clean pools afterwards."""

from __future__ import annotations

import json
import random

import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.engine.llm_engine import RequestError
from sage_infer.models.loader import ModelLoadError, load_model
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("engine") / "model", "llama")


@pytest.fixture
def llm(model_dir):
    engine = LLM(str(model_dir), dtype="fp32", num_blocks=64)
    yield engine
    manager = engine.engine.kv.block_manager
    manager.check_invariants()
    assert manager.get_utilization() == 0.0, "a test leaked in-use blocks"


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_same_salt_shares_blocks_and_other_salts_never_do(llm):
    prompt = ids(40)
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    same = llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    unsalted = llm.generate([prompt], GREEDY)[0]
    assert same.metrics.num_cached_tokens == 32
    assert other.metrics.num_cached_tokens == 0
    assert unsalted.metrics.num_cached_tokens == 0
    assert same.outputs[0].token_ids == other.outputs[0].token_ids == unsalted.outputs[0].token_ids


def test_prompt_longer_than_context_fails_alone(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=64, max_model_len=64)
    outputs = llm.generate([ids(100), ids(10)], GREEDY)
    assert outputs[0].error and "100 tokens" in outputs[0].error and "context" in outputs[0].error
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 8


def test_prompt_longer_than_pool_fails_alone(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=4)  # 64 token slots
    outputs = llm.generate([ids(70), ids(10)], GREEDY)
    assert "KV pool" in outputs[0].error
    assert outputs[1].outputs[0].finish_reason == "length"


def test_generation_stops_at_pool_capacity_with_length(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=2)  # 32 slots
    out = llm.generate([ids(20)], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32


def test_max_tokens_gives_length(llm):
    out = llm.generate([ids(5)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_stop_token_id_ends_generation(llm):
    first = llm.generate([ids(7)], GREEDY)[0].outputs[0].token_ids
    stop_at = first[3]
    out = llm.generate([ids(7)], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == first[: first.index(stop_at) + 1]


def test_eos_stops_unless_ignored(llm, monkeypatch):
    first = llm.generate([ids(9)], GREEDY)[0].outputs[0].token_ids
    # a random model rarely emits the tokenizer's EOS, so declare its 3rd greedy token to be EOS
    monkeypatch.setattr(llm.engine.scheduler, "eos_token_ids", frozenset({first[2]}))
    stopped = llm.generate([ids(9)], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    ignored = llm.generate([ids(9)], GREEDY)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids == first[: first.index(first[2]) + 1]
    assert ignored.token_ids == first and ignored.finish_reason == "length"


def test_stop_string_is_cut_from_the_text(llm):
    prompt = "To be, or not to be"
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    pairs = [free.text[i : i + 2] for i in range(1, len(free.text) - 1)]
    stop = next(p for p in pairs if p.isascii() and p.isalpha())  # StopIteration fails the test

    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == free.text[: free.text.index(stop)]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate([ids(12)], params)[0].outputs[0].token_ids
    b = llm.generate([ids(12), ids(30, seed=9)], [params, GREEDY])[0].outputs[0].token_ids
    c = llm.generate([ids(12)], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True))
    assert a == b
    assert c[0].outputs[0].token_ids != a


def test_n_completions_share_the_prompt_blocks(llm):
    out = llm.generate([ids(40)], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.kv.index.metrics.hit_blocks >= 2  # completions 1 and 2 reuse completion 0's prompt blocks


def test_priority_strategy_serves_urgent_first(model_dir):
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=64, max_num_seqs=1, scheduling="priority")
    outs = llm.generate([ids(8, 1), ids(8, 2), ids(8, 3)], GREEDY, priority=[5, 0, 9])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 0, 2]


def test_abort_frees_blocks_and_spares_others(llm):
    engine = llm.engine
    engine.add_request("keep", ids(20, 1), GREEDY)
    engine.add_request("drop", ids(30, 2), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("drop")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["drop"].outputs[0].finish_reason == "abort"
    assert finished["keep"].outputs[0].token_ids == llm.generate([ids(20, 1)], GREEDY)[0].outputs[0].token_ids


def test_streaming_deltas_add_up_to_the_text(llm):
    engine = llm.engine
    engine.add_request("s", "All the world", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY)[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_duplicate_request_id_is_rejected(llm):
    llm.engine.add_request("x", ids(3), GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        llm.engine.add_request("x", ids(3), GREEDY)
    llm.engine.abort_request("x")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_unsupported_architecture_names_it(tmp_path, model_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        load_model(bad)


def test_missing_weights_name_the_file(tmp_path, model_dir):
    bad = tmp_path / "noweights"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="model.safetensors: not found"):
        load_model(bad)


def test_corrupt_weights_name_the_file(tmp_path, model_dir):
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read safetensors"):
        load_model(bad)


def test_cli_generate_json(sage, model_dir):
    result = sage("llm", "generate", "--model", str(model_dir), "--prompt", "To be", "--max-tokens", "5",
                  "--temperature", "0", "--json", "--set", "kv_pool.num_blocks=32", "--set", "model.dtype=fp32")
    assert result.code == 0, result.err
    line = json.loads(result.out.strip().splitlines()[-1])
    assert line["prompt"] == "To be" and len(line["token_ids"]) <= 5 and line["error"] is None


def test_cli_generate_bad_model_is_one_line_exit_2(sage, tmp_path):
    result = sage("llm", "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert result.code == 2
    assert len(result.err.strip().splitlines()) == 1 and "not found" in result.err


def test_identical_prompts_in_one_step_then_eviction_never_orphans(model_dir):
    """Twins compute the same blocks in one step; the first finishes and its blocks are
    evicted by pressure; the second keeps growing on a chain that must still be valid."""
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=10, max_num_seqs=4)
    prompt = ids(33, seed=11)
    params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)]
    twins = llm.generate([prompt, prompt, ids(40, 12)], [params[0], params[1], params[0]])
    assert [len(t.outputs[0].token_ids) for t in twins] == [2, 40, 2]
    assert twins[1].outputs[0].token_ids[:2] == twins[0].outputs[0].token_ids
    llm.engine.kv.block_manager.check_invariants()
