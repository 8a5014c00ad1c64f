"""KV groups of models with sliding-window layers: a block table per group, a sliding group freeing the blocks that
fall out of its window (pool counters bound a long decode), prefix hits per group (all full blocks, only the window's
sliding ones), against transformers' greedy tokens (eager attention, which applies the window), with speculative
rollback and preemption. (Tiers: tests/test_kv_groups_tiers.py; P/D transfers: tests/test_pd_kv_groups.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import ServeConfig
from sage_infer.core.sampling_params import SamplingParams as Params
from sage_infer.core.sequence import Sequence
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.kv_groups import kv_groups
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from tests.test_engine_vs_transformers import random_prompts
from tests.tiny_models import make_tiny_model, save_tokenizer

WINDOW = 16
BS = 16
WANT: dict[tuple, list[int]] = {}  # transformers' tokens, once per module and prompt


pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(hf, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from transformers with its own KV cache (sliding layers keep their window)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def llm(directory, num_blocks: int = 64, **sections) -> LLM:
    config = {"model": {"path": str(directory), "dtype": "fp32"}, "kv_pool": {"num_blocks": num_blocks}}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return LLM(config=ServeConfig.model_validate(config))


def outputs(engine: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("kvg-mistral") / "model", "mistral", sliding_window=WINDOW,
                                head_dim=32)
    return directory, transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                       sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0)
    directory = tmp_path_factory.mktemp("kvg-gemma2") / "model"
    transformers.Gemma2ForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, 512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return directory, hf


def test_groups_follow_the_layer_kinds_with_equal_layer_counts():
    gemma3 = kv_groups([512] * 5 + [None] + [512] * 5 + [None])  # 5:1: groups of the full layers' count
    assert [(g.window, g.layers) for g in gemma3.groups] == [(None, (5, 11)), *[(512, (i, i + 6)) for i in range(5)]]
    assert gemma3.layers_per_block == 2 and gemma3.per_group
    assert gemma3.layer_map[11] == (0, 1) and gemma3.layer_map[6] == (1, 1)
    gemma2 = kv_groups([16, None] * 3)
    assert [(g.window, g.layers) for g in gemma2.groups] == [(None, (1, 3, 5)), (16, (0, 2, 4))]
    padded = kv_groups([None] * 3 + [8] * 4)  # 4 < 1.5 x 3: one group each, the full one a layer short
    assert [len(g.layers) for g in padded.groups] == [3, 4] and padded.layers_per_block == 4
    assert not kv_groups([None] * 4).per_group and len(kv_groups([None] * 4).groups) == 1
    row = gemma2.describe(bytes_per_block=3 * 2 * BS * 2 * 32 * 2, block_size=BS)[1]
    assert row["kind"] == "sliding 16" and row["max_tokens_per_sequence"] == 2 * BS
    assert row["tokens_per_gib"] == (1 << 30) // (3 * 2 * BS * 2 * 32 * 2) * BS


def evict(manager: BlockManager, block: int) -> None:
    """What eviction does to one cached block (the policy would choose which)."""
    manager.index.remove(block)
    manager.num_tokens[block] = 0
    manager.free_block_ids.append(block)


def test_a_prefix_hit_needs_every_full_block_but_only_the_windows_sliding_blocks():
    manager = BlockManager(64, BS, PrefixReuseIndex(BS))
    kv = GroupKVCacheManager(manager, kv_groups([WINDOW, None]))
    prompt = list(range(100, 100 + 6 * BS + 3))  # 6 full blocks and 3 tokens
    first = Sequence(0, "a", 0, list(prompt), len(prompt), Params(), b"key")
    assert kv.admit(first, kv.match(first), len(prompt))
    sliding = list(kv.tables(first)[1])
    first.num_computed_tokens = len(prompt)
    kv.commit(first)
    assert kv.held_blocks(first) == [7, 2]  # the full group every block; the sliding one the window's (84..98)
    assert manager.num_used_blocks == 1 + 7 + 2  # with the null block; the 5 others cached, evictable
    kv.free(first)
    manager.check_invariants()
    again = Sequence(1, "b", 0, prompt + [7, 8], len(prompt) + 2, Params(), b"key")
    match = kv.match(again)
    assert match.num_tokens == 6 * BS and match.group_block_ids[1] == [kv.null_block] * 5 + sliding[5:6]
    for block in sliding[4:6]:  # evicted: a prefix of 5 or 6 blocks lacks its window, one of 4 has it
        evict(manager, block)
    match = kv.match(again)
    assert match.num_tokens == 4 * BS and match.group_block_ids[1] == [kv.null_block] * 3 + sliding[3:4]
    assert match.group_block_ids[0] == kv.match(again).block_ids[:4]
    assert kv.admit(again, match, again.num_tokens - match.num_tokens)
    assert again.block_table[:4] == match.group_block_ids[0] and again.num_computed_tokens == 4 * BS
    manager.check_invariants()
    kv.free(again)
    for block in sliding[:4]:
        evict(manager, block)
    assert kv.match(again).num_tokens == 0  # the full group still holds all 6: the sliding one serves none
    manager.check_invariants()


@pytest.mark.parametrize("windows", [(9, None, 9), (9, 9)], ids=["full-and-sliding", "sliding-only"])
def test_random_admissions_steps_and_evictions_keep_every_hit_on_the_right_blocks(windows):
    """Random prompts sharing prefixes, admitted in random chunks through a small pool (a full group and two sliding
    ones; one sliding group): what every block holds is tracked as the steps write it, and every prefix hit must name
    blocks holding its own group's tokens at their positions; the pool's invariants hold throughout."""
    import random

    rng = random.Random(5)
    bs = 4
    groups = kv_groups(windows)
    manager = BlockManager(16 * len(groups.groups), bs, PrefixReuseIndex(bs))
    kv = GroupKVCacheManager(manager, groups)
    evicted: list = []
    manager.on_evict = evicted.extend
    held: dict[int, tuple] = {}  # block -> (group, position in the sequence, token) of each slot written
    stems = [[rng.randrange(50) for _ in range(30)] for _ in range(3)]
    running: list[Sequence] = []
    for step in range(300):
        if len(running) < 3 and rng.random() < 0.4:
            tokens = rng.choice(stems)[: rng.randrange(5, 30)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            seq = Sequence(step, str(step), 0, tokens, len(tokens), Params(), b"k")
            match = kv.match(seq)
            for group, ids in enumerate(match.group_block_ids if match.num_tokens else ()):
                need = groups.window_blocks(group, bs)  # every block a query after the hit reads is there
                assert kv.null_block not in ids[max(0, len(ids) - need) if need >= 0 else 0:]
                for i, block in enumerate(ids):
                    if block != kv.null_block:
                        assert [held.get((block, j)) for j in range(bs)] == \
                            [(group, i * bs + j, tokens[i * bs + j]) for j in range(bs)]
            if kv.admit(seq, match, rng.randrange(1, len(tokens) - match.num_tokens + 1)):
                running.append(seq)
            continue
        if not running:
            continue
        seq = rng.choice(running)
        if seq.num_computed_tokens >= seq.num_tokens or rng.random() < 0.1:
            kv.free(seq)
            running.remove(seq)
            continue
        tables = kv.tables(seq)
        end = min(seq.num_tokens, len(tables[0]) * bs)
        for group, table in enumerate(tables):  # the step writes its tokens' KV
            for pos in range(seq.num_computed_tokens, end):
                held[(table[pos // bs], pos % bs)] = (group, pos, seq.token_ids[pos])
        seq.num_computed_tokens = end
        kv.commit(seq)
        for group, window in enumerate(kv.windows):
            if window is not None:
                gone = max(0, seq.num_computed_tokens - window + 1) // bs
                assert tables[group][:gone] == [kv.null_block] * gone and kv.null_block not in tables[group][gone:]
        if end < seq.num_tokens and not kv.allocate(seq, min(bs, seq.num_tokens - end)):
            kv.free(seq)
            running.remove(seq)
        manager.check_invariants()
    assert manager.index.metrics.hit_tokens >= 100 and len(evicted) >= 20  # hits, under eviction


def test_a_sliding_groups_blocks_stay_bounded_while_a_long_sequence_decodes(mistral, cpu_isa):
    """A pool of 5 blocks (80 tokens) holds a 40-token prompt, prefilled in chunks of 16, decoding 64 tokens: the
    window's blocks only (pool counters); the pool does not bound the sequence's length. At every CPU ISA level (the
    paged kernel reads the window's blocks, the flash kernel the prompt's chunks)."""
    directory, hf = mistral
    engine = llm(directory, num_blocks=5, scheduler={"max_num_batched_tokens": 16}).engine
    kv = engine.kv
    assert isinstance(kv, GroupKVCacheManager) and engine.max_total_tokens == 1024
    prompt = random_prompts([40], seed=7)[0]
    engine.add_request("long", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    peak_held = peak_used = 0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        for seq in engine.scheduler.running:
            peak_held = max(peak_held, *kv.held_blocks(seq))
        peak_used = max(peak_used, kv.block_manager.num_used_blocks)
    assert peak_held == -(-(WINDOW - 1) // BS) + 1  # the window's blocks and the one being written
    assert peak_used <= 1 + 2 + 1  # the null block, the window's, a chunk's before its commit
    assert engine.stats().num_preemptions == 0
    assert tokens == WANT.setdefault(tuple(prompt), greedy(hf, prompt, 64))


def test_gemma2_prefix_hits_chunked_prefill_and_mixed_lengths_match_transformers(gemma2):
    """Prompts sharing a 70-token prefix (over 4 windows) with their own tails, mixed lengths, chunks of 24 tokens: the
    second round hits the full group's whole prefix and the sliding group's window of it."""
    directory, hf = gemma2
    shared = random_prompts([70], seed=11)[0]
    prompts = [shared + tail for tail in random_prompts([9, 30, 1], seed=12)] + random_prompts([5, 21], seed=13)
    want = [greedy(hf, prompt, 8) for prompt in prompts]
    engine = llm(directory, num_blocks=96, scheduler={"max_num_batched_tokens": 24})
    kv = engine.engine.kv
    assert [g.kind for g in kv.groups.groups] == ["full", "sliding 16"] and kv.groups.layers_per_block == 2
    assert outputs(engine, prompts, 8) == want
    hits = kv.index.metrics.hit_tokens
    assert outputs(engine, prompts, 8) == want
    assert kv.index.metrics.hit_tokens - hits >= 3 * 64  # each shared prompt's 4 blocks at least
    kv.block_manager.check_invariants()
    assert kv.block_manager.num_used_blocks == 1  # every sequence freed its blocks: only the null block is held
    # a router's overlap and a session's retention count every group: 6 full blocks, the sliding group's last one
    assert engine.engine.prefix.overlap(prompts[1]) == 6 * BS
    assert engine.engine.sessions.enable(0.5) and engine.engine.sessions.retain("turn", prompts[1], None, 60) == 7


def test_speculative_rollback_and_preemption_per_group_match_transformers(mistral):
    """ngram proposals (their rejected rows trimmed from every group) and a pool too small for three sequences at
    once (one preempted, recomputed later)."""
    directory, hf = mistral
    prompts = [[7, 8, 9, 10] * 10 + p for p in random_prompts([6, 20, 3], seed=21)]
    want = [greedy(hf, prompt, 40) for prompt in prompts]
    spec = llm(directory, num_blocks=64, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1})
    assert outputs(spec, prompts, 40) == want
    assert spec.engine.spec_stats.num_draft_tokens > 0
    tight = llm(directory, num_blocks=5, scheduler={"max_num_batched_tokens": 16})
    assert outputs(tight, prompts, 40) == want
    assert tight.engine.stats().num_preemptions > 0


def test_config_show_reports_tokens_per_gib_per_group(gemma2, sage):
    directory, _ = gemma2
    result = sage("config", "show", "--json", "--model", str(directory), "--set", "kv_pool.kv_dtype=bf16")
    assert result.code == 0
    shown = json.loads(result.out)
    per_token = 2 * 2 * 32 * 2 * 2  # K and V, 2 KV heads of 32, bf16, the 2 layers of a group
    assert shown["kv_dtype_counted"] == "bf16"
    assert shown["kv_groups"] == [
        {"group": 0, "kind": "full", "layers": [1, 3], "bytes_per_token": per_token,
         "tokens_per_gib": (1 << 30) // (per_token * BS) * BS, "max_tokens_per_sequence": None},
        {"group": 1, "kind": "sliding 16", "layers": [0, 2], "bytes_per_token": per_token,
         "tokens_per_gib": (1 << 30) // (per_token * BS) * BS, "max_tokens_per_sequence": 2 * BS}]
    # at 1024 tokens: 64 full blocks, the sliding group's last one (tokens 1009..1023); every layer: 2 x 64
    assert shown["kv_sequence"] == {"tokens": 1024, "bytes": 65 * per_token * BS,
                                    "full_attention_bytes": 128 * per_token * BS}


@pytest.mark.parametrize("model", ["mistral", "gemma2"])
def test_a_burst_behind_one_new_prefix_computes_it_once_in_one_step_with_kv_groups(model, request):
    """Requests arriving together behind one uncached prefix, with KV groups (Mistral: every layer sliding; Gemma 2:
    a full and a sliding group): the first computes the prefix and the others take its blocks of every group in
    that same step (none waits); the full group's prefix blocks are shared, each sliding group's blocks out of the
    window are freed at the first commit, and the tokens equal transformers'."""
    directory, hf = request.getfixturevalue(model)
    shared = random_prompts([64], seed=21)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 3], seed=22)]
    engine = llm(directory, num_blocks=96)
    for i, prompt in enumerate(prompts):
        engine.engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.engine.step()
    kv = engine.engine.kv
    assert engine.engine.scheduler.deferred == 0 and kv.in_step_tokens == 2 * 64
    seqs = [engine.engine.requests[f"r{i}"].seqs[0] for i in range(3)]
    assert all(seq.num_computed_tokens == len(prompt) for seq, prompt in zip(seqs, prompts))
    tables = [kv.tables(seq) for seq in seqs]
    for group, window in enumerate(kv.windows):
        if window is None:  # a full group: the 4 prefix blocks are the first sequence's, in every table
            assert tables[1][group][:4] == tables[2][group][:4] == tables[0][group][:4]
        else:  # only the window's last prefix block is held (the first three freed by the commit)
            assert all(t[group][:3] == [kv.null_block] * 3 for t in tables)
            assert tables[1][group][3] == tables[2][group][3] == tables[0][group][3] != kv.null_block
    done = {}
    while engine.engine.has_unfinished_requests():
        for out in engine.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(3)] == [greedy(hf, prompt, 6) for prompt in prompts]
    kv.block_manager.check_invariants()
