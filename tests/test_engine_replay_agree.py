"""The engine and the trace replay make the same cache decisions for the same accesses.

What `sage kv replay` measures is only worth something if serving behaves the same, so
the same block chains go through both and the per-request prefix hits must agree.

The exact correspondence (block_size 16, `max_num_seqs=1`, `max_tokens=1`):

- A prompt for the chain [b0, .., b(k-1)] is k full 16-token blocks (block b's tokens
  depend only on b) plus ONE extra token: 16k + 1 tokens.
- The engine matches at most (16k + 1 - 1) // 16 = k blocks (it always recomputes at
  least one token), so every full block can hit, as in the replay.
- It allocates ceil((16k + 1) / 16) = k + 1 blocks: the k full ones, registered after
  prefill exactly as the replay registers its k blocks, and one partial block that is
  never registered and goes back on the free list when the request ends.
- `max_tokens=1` ends the request at its first sampled token, so the generated token
  never gets a KV slot: no decode block.

So the engine always holds one free block more than the replay, and a pool of N blocks
evicts exactly when and what a replay capacity of N - 1 evicts: both take free blocks
first and evict max(0, needed - free) cached leaves, through the same index and policy
hook sequence (hit deepest first, insert root first, release leaf first), provided the
policy is sized alike: the engine sizes ARC/S3-FIFO by its pool (N), so the replay's
policy gets N too, not the N - 1 of its block manager. The engine
ticks the policy clock with `time.monotonic()`; the test pins that clock to the trace
timestamps so time-aware policies see the same times as in the replay.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.kv_policy import POLICIES, EvictionPolicy, make_policy
from sage_infer.sim.replay import TraceRequest, replay
from sage_infer.sim.tiered import all_policies
from tests.tiny_models import make_tiny_model

BLOCK = 16
NUM_BLOCKS = 8  # engine pool; the replay gets NUM_BLOCKS - 1
EXTRA_TOKEN = 3


def block_tokens(block_id: int) -> list[int]:
    """16 token ids that only block `block_id` uses (the first token differs per block)."""
    return [5 + block_id] + [5 + (block_id * 7 + j) % 500 for j in range(1, BLOCK)]


def prompt_of(chain: list[int]) -> list[int]:
    return [t for b in chain for t in block_tokens(b)] + [EXTRA_TOKEN]


def chains() -> list[list[int]]:
    """Multi-turn conversations over a shared system block 0, each turn longer than the last.

    Up to 7 blocks per prompt: a prompt of 7 * 16 + 1 tokens needs all 8 engine blocks.
    """
    rng = random.Random(0)
    convs = [[0, *range(1 + 10 * c, 1 + 10 * c + 6)] for c in range(6)]
    turns = [0] * len(convs)
    out = []
    for _ in range(40):
        c = rng.randrange(len(convs))
        turns[c] = turns[c] % 6 + 1
        out.append(convs[c][: turns[c] + 1])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("agree") / "model", "llama")


def run_chains(llm: LLM, sequence: list[list[int]]) -> list[int]:
    """Per-request prefix hits in blocks, one request at a time, the policy clock at trace time."""
    clock = SimpleNamespace(now=0.0)
    llm.engine.kv.clock = lambda: clock.now
    params = SamplingParams(max_tokens=1, temperature=0)
    hits = []
    for i, chain in enumerate(sequence):
        clock.now = float(i)  # request i is stamped i * 1000 ms in the replay
        [out] = llm.generate([prompt_of(chain)], params)
        assert out.outputs[0].finish_reason in ("length", "stop")
        assert out.metrics.num_cached_tokens % BLOCK == 0
        hits.append(out.metrics.num_cached_tokens // BLOCK)
    return hits


def engine_hits(model_dir, policy: str, sequence: list[list[int]]) -> tuple[list[int], int | None]:
    """Per-request prefix hits in blocks, and the capacity the engine sized its policy with."""
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=NUM_BLOCKS, max_num_seqs=1, eviction_policy=policy)
    return run_chains(llm, sequence), getattr(llm.engine.kv.index.policy, "capacity", None)


def replay_hits(policy: str | EvictionPolicy, sequence: list[list[int]], capacity: int) -> list[int]:
    requests = [TraceRequest(i * 1000, BLOCK * len(c) + 1, 1, c) for i, c in enumerate(sequence)]
    return replay(requests, policy, capacity, keep_per_request=True).per_request_prefix_hits


def test_sequence_exercises_hits_and_evictions():
    sequence = chains()
    small = replay_hits("lru", sequence, NUM_BLOCKS - 1)
    unbounded = replay_hits("lru", sequence, 10_000)
    assert sum(small) > 0
    assert small != unbounded  # evictions cost hits, so the comparison below tests eviction order too


@pytest.mark.parametrize("policy", all_policies())
def test_engine_and_replay_hit_the_same_blocks(model_dir, policy):
    sequence = chains()
    hits, sized_for = engine_hits(model_dir, policy, sequence)
    # a capacity-aware policy (ARC, S3-FIFO) is sized as the engine sized its own: by the
    # whole pool, N, though the replay's block manager holds N - 1 (see the module docstring)
    assert hits == replay_hits(make_policy(policy, capacity=sized_for), sequence, NUM_BLOCKS - 1)


CAPACITY_AWARE = [p for p in all_policies() if getattr(POLICIES[p], "uses_capacity", False)]


@pytest.mark.parametrize("policy", CAPACITY_AWARE)
def test_engine_sizes_capacity_aware_policies_by_its_pool(model_dir, policy):
    llm = LLM(str(model_dir), dtype="fp32", num_blocks=NUM_BLOCKS, eviction_policy=policy)
    assert llm.engine.kv.index.policy.capacity == NUM_BLOCKS
