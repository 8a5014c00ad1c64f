"""Quantized KV in the engine: the demo model (trained, fp32) with fp8 / int8 / int4 KV against fp32 KV,
and quantized blocks through the lower tiers and the prefix-cache key."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sage_infer import LLM, SamplingParams
from sage_infer.cli.main import app, main
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig
from sage_infer.kv_runtime.quantized_pool import QuantizedKVPool

PROMPTS = ["ROMEO: What light through yonder window breaks?", "KING HENRY: Once more unto the breach, dear friends,",
           "HAMLET: To be, or not to be", "First Citizen: Before we proceed any further, hear me speak."]
GREEDY = SamplingParams(max_tokens=24, temperature=0, logprobs=0, ignore_eos=True)
# the largest |logprob difference| of the chosen token against fp32 KV, up to the first differing token
# (measured on this CPU: int8 0.018, fp8_e4m3 0.067, fp8_e5m2 0.18, int4 0.22)
LOGPROB_TOLERANCE = {"int8": 0.05, "fp8_e4m3": 0.15, "fp8_e5m2": 0.4, "int4": 0.5}


def generate(kv_dtype: str, **tiers) -> tuple[LLM, list[tuple[list[int], list[float]]]]:
    config = ServeConfig(model=ModelConfig(dtype="fp32"), kv_pool=KVPoolConfig(kv_dtype=kv_dtype, num_blocks=128),
                         tiers=TierConfig(**tiers))
    llm = LLM(config=config, device="cpu")
    outs = llm.generate(PROMPTS, GREEDY)
    return llm, [(o.outputs[0].token_ids, [lp[0] for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def fp32_kv():
    return generate("fp32")[1]


@pytest.mark.parametrize("kv_dtype", list(LOGPROB_TOLERANCE))
def test_quantized_kv_stays_close_to_fp32_kv(kv_dtype, fp32_kv):
    llm, outs = generate(kv_dtype)
    assert isinstance(llm.engine.runner.pool, QuantizedKVPool)
    assert llm.engine.kv_dtype == kv_dtype  # part of every prefix-cache key
    for (ref_tokens, ref_lps), (tokens, lps) in zip(fp32_kv, outs):
        agree = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(tokens))
        assert agree >= 2  # the first decode steps read the quantized prompt KV and still agree
        worst = max(abs(a - b) for a, b in zip(ref_lps[: agree + 1], lps[: agree + 1]))
        assert worst < LOGPROB_TOLERANCE[kv_dtype]
        if kv_dtype == "int8":
            assert agree >= 16


def test_int8_kv_holds_more_blocks_in_the_same_bytes():
    def blocks(kv_dtype: str) -> int:
        config = ServeConfig(model=ModelConfig(dtype="fp32"), kv_pool=KVPoolConfig(kv_dtype=kv_dtype,
                                                                                   memory_budget="8MiB"))
        return LLM(config=config, device="cpu").engine.runner.pool.num_blocks

    # demo model (4 layers, 4 KV heads, head_dim 32), blocks of 16 tokens, K and V: bf16 64 bytes per token
    # and head, int8 32 + 2 (the fp16 scale)
    assert blocks("bf16") == (8 << 20) // (4 * 2 * 16 * 4 * 64)
    assert blocks("int8") == (8 << 20) // (4 * 2 * 16 * 4 * 34)


def test_quantized_blocks_come_back_from_the_disk_tier_bit_exact(tmp_path):
    def make(disk: str) -> LLM:
        config = ServeConfig(model=ModelConfig(dtype="fp32"), scheduler=SchedulerConfig(max_num_seqs=1),
                             kv_pool=KVPoolConfig(kv_dtype="int4", num_blocks=12),
                             tiers=TierConfig(disk_path=disk, disk_bytes=16 << 20))
        return LLM(config=config, device="cpu")

    long_prompt = PROMPTS[0] * 6  # > 4 blocks of 16 tokens
    first = make(str(tmp_path))
    [hot] = first.generate([long_prompt], GREEDY)
    for other in PROMPTS[1:]:  # evict it from the 12-block pool into the disk tier
        first.generate([other * 6], GREEDY)
    assert first.engine.kv.source("tiers").hierarchy.stats.tiers["disk"].demoted_blocks >= 4
    first.engine.kv.source("tiers").hierarchy.close()
    [again] = make(str(tmp_path)).generate([long_prompt], GREEDY)
    assert again.metrics.num_cached_tokens >= 4 * 16
    assert again.outputs[0].token_ids == hot.outputs[0].token_ids


def test_blocks_written_in_one_kv_dtype_are_never_read_in_another(tmp_path):
    def make(kv_dtype: str) -> LLM:
        config = ServeConfig(model=ModelConfig(dtype="fp32"), scheduler=SchedulerConfig(max_num_seqs=1),
                             kv_pool=KVPoolConfig(kv_dtype=kv_dtype, num_blocks=12),
                             tiers=TierConfig(disk_path=str(tmp_path), disk_bytes=16 << 20))
        return LLM(config=config, device="cpu")

    int8 = make("int8")
    for prompt in PROMPTS:
        int8.generate([prompt * 6], GREEDY)
    assert int8.engine.kv.source("tiers").hierarchy.stats.tiers["disk"].demoted_blocks >= 4
    int8.engine.kv.source("tiers").hierarchy.close()
    [out] = make("fp8_e4m3").generate([PROMPTS[0] * 6], GREEDY)  # same bytes per block, same disk directory
    assert out.metrics.num_cached_tokens == 0


def test_the_kv_cache_dtype_flag_sets_the_pool():
    result = CliRunner().invoke(app, ["llm", "generate", "--prompt", "ROMEO:", "--max-tokens", "4",
                                      "--temperature", "0", "--kv-cache-dtype", "int4", "--json"])
    assert result.exit_code == 0, result.output
    assert "kv_pool.kv_dtype = int4 (set explicitly)" in result.output


def test_a_bad_kv_cache_dtype_is_one_line_and_exit_2(capsys):
    assert main(["llm", "generate", "--prompt", "x", "--kv-cache-dtype", "int3"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--kv-cache-dtype: kv_pool.kv_dtype" in line and "'int3'" in line
